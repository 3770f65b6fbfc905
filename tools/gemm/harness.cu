// Checks and times FP32 products (the kernels of tools/gemm) against cuBLAS's
// FP32 (CUDA-core) product and a float64 reference. Built by tools/gemm/run.sh on the GPU machine.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <algorithm>
#include <string>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); exit(1); } } while (0)

typedef void (*Launch)(const float*, const float*, float*, const float*, int, int, int, int, int, int, cudaStream_t);
struct Cfg { const char* name; int bm, bn, nk, epi; Launch f; };
#include "configs.inc"

__global__ void fill(float* p, size_t n, unsigned seed) {
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n) { unsigned h = (unsigned)i * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16; p[i] = (h >> 8) * (2.0f / 16777216.0f) - 1.0f; }
}
__global__ void ref(const float* A, const float* B, const float* bias, double* C, int M, int N, int K, int nk, int epi) {
    int n = blockIdx.x * blockDim.x + threadIdx.x, m = blockIdx.y;
    if (n >= N) return;
    double s = 0;
    for (int k = 0; k < K; k++) s += (double)A[(size_t)m * K + k] * (double)(nk ? B[(size_t)n * K + k] : B[(size_t)k * N + n]);
    if (epi >= 1) s += bias[n];
    if (epi == 2 && s < 0) s = 0;
    C[(size_t)m * N + n] = s;
}

static double rel_err(const std::vector<float>& o, const std::vector<double>& r, int* unwritten) {
    double num = 0, den = 0; *unwritten = 0;
    for (size_t i = 0; i < o.size(); i++) { if (std::isnan(o[i])) { (*unwritten)++; continue; } double d = o[i] - r[i]; num += d * d; den += r[i] * r[i]; }
    return std::sqrt(num / den);
}

template <class F> static float time_us(F f, cudaStream_t s) {
    // 20 launches in one graph, replayed; median of 15 replays.
    cudaGraph_t g; cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int i = 0; i < 20; i++) f();
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
    for (int i = 0; i < 3; i++) CK(cudaGraphLaunch(ge, s));
    std::vector<float> ts;
    for (int r = 0; r < 15; r++) { cudaEventRecord(a, s); CK(cudaGraphLaunch(ge, s)); cudaEventRecord(b, s); cudaEventSynchronize(b); float ms; cudaEventElapsedTime(&ms, a, b); ts.push_back(ms * 1000 / 20); }
    std::sort(ts.begin(), ts.end());
    cudaGraphExecDestroy(ge); cudaGraphDestroy(g);
    return ts[ts.size() / 2];
}

int main() {
    cudaStream_t s; CK(cudaStreamCreate(&s));
    cublasHandle_t h; cublasCreate(&h); cublasSetStream(h, s);
    struct Shape { int m, n, k; };
    std::vector<Shape> shapes = {{320, 512, 512}, {320, 1536, 512}, {320, 2048, 512}, {320, 512, 2048}, {320, 6144, 512}, {77, 100, 36}, {33, 36, 68}, {4096, 4096, 4096}};
    printf("%-34s %18s %9s %9s %9s %9s %9s\n", "config", "shape", "us", "cublas", "tf32", "err", "cublas_err");
    for (auto sh : shapes) {
        int M = sh.m, N = sh.n, K = sh.k;
        float *A, *B, *C, *bias; double* R;
        CK(cudaMalloc(&A, (size_t)M * K * 4)); CK(cudaMalloc(&B, (size_t)N * K * 4)); CK(cudaMalloc(&C, (size_t)M * N * 4)); CK(cudaMalloc(&bias, N * 4)); CK(cudaMalloc(&R, (size_t)M * N * 8));
        fill<<<(M * K + 255) / 256, 256, 0, s>>>(A, (size_t)M * K, 1 + M + N + K);
        fill<<<(N * K + 255) / 256, 256, 0, s>>>(B, (size_t)N * K, 7 + M * 3 + K);
        fill<<<(N + 255) / 256, 256, 0, s>>>(bias, N, 99);
        std::vector<float> out((size_t)M * N); std::vector<double> rf((size_t)M * N);
        for (int nk = 1; nk >= 0; nk--) {
            // cuBLAS FP32 reference timing and error (no epilogue).
            ref<<<dim3((N + 127) / 128, M), 128, 0, s>>>(A, B, bias, R, M, N, K, nk, 0);
            CK(cudaMemcpy(rf.data(), R, rf.size() * 8, cudaMemcpyDeviceToHost));
            const float one = 1, zero = 0;
            auto cub = [&] { cublasSgemm(h, nk ? CUBLAS_OP_T : CUBLAS_OP_N, CUBLAS_OP_N, N, M, K, &one, B, nk ? K : N, A, K, &zero, C, N); };
            CK(cudaMemset(C, 0xff, (size_t)M * N * 4)); cub(); CK(cudaStreamSynchronize(s));
            CK(cudaMemcpy(out.data(), C, out.size() * 4, cudaMemcpyDeviceToHost));
            int unw; double cerr = rel_err(out, rf, &unw);
            float cus = time_us(cub, s);
            // cuBLAS's TF32 product (one TF32 pass, not FP32-accurate): what the tensor cores give.
            cublasSetMathMode(h, CUBLAS_TF32_TENSOR_OP_MATH);
            float tus = time_us(cub, s);
            cublasSetMathMode(h, CUBLAS_DEFAULT_MATH);
            for (int epi = 0; epi <= 2; epi++) {
                if (epi) { ref<<<dim3((N + 127) / 128, M), 128, 0, s>>>(A, B, bias, R, M, N, K, nk, epi); CK(cudaMemcpy(rf.data(), R, rf.size() * 8, cudaMemcpyDeviceToHost)); }
                for (int c = 0; c < NCFG; c++) {
                    const Cfg& cf = cfgs[c];
                    if (cf.nk != nk || cf.epi != epi) continue;
                    auto run = [&] { cf.f(A, B, C, bias, M, N, K, K, nk ? K : N, N, s); };
                    CK(cudaMemset(C, 0xff, (size_t)M * N * 4)); run(); CK(cudaGetLastError()); CK(cudaStreamSynchronize(s));
                    CK(cudaMemcpy(out.data(), C, out.size() * 4, cudaMemcpyDeviceToHost));
                    double err = rel_err(out, rf, &unw);
                    float us = time_us(run, s);
                    char shape[64]; snprintf(shape, 64, "%dx%dx%d", M, N, K);
                    printf("%-34s %18s %9.2f %9.2f %9.2f %9.2e %9.2e%s\n", cf.name, shape, us, cus, tus, err, cerr, unw ? "  UNWRITTEN" : (err > 4 * cerr + 1e-7 ? "  ERR" : ""));
                }
            }
        }
        cudaFree(A); cudaFree(B); cudaFree(C); cudaFree(bias); cudaFree(R);
    }
    return 0;
}
