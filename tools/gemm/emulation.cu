// Does cuBLAS's BF16x9 emulation of FP32 products run on this GPU, and is it faster and as
// accurate as FP32 for a small transformer's products? nvcc -O2 -arch=sm_90 emulation.cu -lcublas
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cmath>
#include <vector>
#include <algorithm>
__global__ void fill(float* p, size_t n, unsigned seed) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) { unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; p[i] = (h >> 8) * (2.0f / 16777216.0f) - 1.0f; }
}
__global__ void ref(const float* A, const float* B, double* C, int M, int N, int K) {
    int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
    if (n >= N) return;
    double s = 0;
    for (int k = 0; k < K; k++) s += (double)A[(size_t)m * K + k] * (double)B[(size_t)n * K + k];
    C[(size_t)m * N + n] = s;
}
int main() {
    cublasHandle_t h; cublasCreate(&h);
    int shapes[][3] = {{320, 512, 512}, {320, 2048, 512}, {320, 512, 2048}, {320, 6144, 512}, {4096, 4096, 4096}};
    struct V { const char* name; cublasComputeType_t ct; int strategy; } vs[] = {
        {"fp32", CUBLAS_COMPUTE_32F, -1},
        {"bf16x9 compute type", CUBLAS_COMPUTE_32F_EMULATED_16BFX9, -1},
        {"fp32 + eager emulation", CUBLAS_COMPUTE_32F, (int)CUBLAS_EMULATION_STRATEGY_EAGER},
    };
    for (auto& sh : shapes) {
        int M = sh[0], N = sh[1], K = sh[2];
        float *A, *B, *C; double* R;
        cudaMalloc(&A, (size_t)M * K * 4); cudaMalloc(&B, (size_t)N * K * 4); cudaMalloc(&C, (size_t)M * N * 4); cudaMalloc(&R, (size_t)M * N * 8);
        fill<<<(M * K + 255) / 256, 256>>>(A, (size_t)M * K, 3); fill<<<(N * K + 255) / 256, 256>>>(B, (size_t)N * K, 5);
        ref<<<dim3((N + 127) / 128, M), 128>>>(A, B, R, M, N, K);
        std::vector<double> r((size_t)M * N); std::vector<float> o((size_t)M * N);
        cudaMemcpy(r.data(), R, r.size() * 8, cudaMemcpyDeviceToHost);
        for (auto& v : vs) {
            if (v.strategy >= 0) cublasSetEmulationStrategy(h, (cublasEmulationStrategy_t)v.strategy); else cublasSetEmulationStrategy(h, CUBLAS_EMULATION_STRATEGY_DEFAULT);
            const float one = 1, zero = 0;
            auto run = [&] { return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &one, B, CUDA_R_32F, K, A, CUDA_R_32F, K, &zero, C, CUDA_R_32F, N, v.ct, CUBLAS_GEMM_DEFAULT); };
            cudaMemset(C, 0xff, (size_t)M * N * 4);
            cublasStatus_t st = run(); cudaDeviceSynchronize();
            if (st != CUBLAS_STATUS_SUCCESS) { printf("%5dx%5dx%5d %-24s status %d\n", M, N, K, v.name, (int)st); continue; }
            cudaMemcpy(o.data(), C, o.size() * 4, cudaMemcpyDeviceToHost);
            double num = 0, den = 0; for (size_t i = 0; i < o.size(); i++) { double d = o[i] - r[i]; num += d * d; den += r[i] * r[i]; }
            cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
            std::vector<float> ts;
            for (int i = 0; i < 30; i++) { cudaEventRecord(s); for (int j = 0; j < 10; j++) run(); cudaEventRecord(e); cudaEventSynchronize(e); float ms; cudaEventElapsedTime(&ms, s, e); ts.push_back(ms * 100); }
            std::sort(ts.begin(), ts.end());
            printf("%5dx%5dx%5d %-24s %9.2f us  err %.2e\n", M, N, K, v.name, ts[15], sqrt(num / den));
        }
        cudaFree(A); cudaFree(B); cudaFree(C); cudaFree(R);
    }
}
