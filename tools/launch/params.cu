// Host cost and idle-device latency of one launch against the size of its argument block:
// generated kernels take a 512-byte block today. nvcc -O2 -arch=sm_90 params.cu -lcuda
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <vector>
template <int N> struct Args { unsigned long long w[N]; };
template <int N> __global__ void k(Args<N> a) {
    size_t n = a.w[0]; const float4* x = (const float4*)a.w[1]; float4* y = (float4*)a.w[2];
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) y[i] = x[i];
}
template <int N> void run(const char* what, float* x, float* y, size_t n4, int grid) {
    Args<N> a = {}; a.w[0] = n4; a.w[1] = (unsigned long long)x; a.w[2] = (unsigned long long)y;
    cudaEvent_t s, e; cudaEventCreate(&s); cudaEventCreate(&e);
    std::vector<double> host, ev;
    for (int i = 0; i < 200; i++) {
        cudaDeviceSynchronize();
        cudaEventRecord(s);
        auto t = std::chrono::steady_clock::now();
        k<N><<<grid, 256>>>(a);
        host.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t).count());
        cudaEventRecord(e); cudaEventSynchronize(e);
        float ms; cudaEventElapsedTime(&ms, s, e); ev.push_back(ms * 1e3);
    }
    std::sort(host.begin(), host.end()); std::sort(ev.begin(), ev.end());
    printf("%-28s args %4d B: launch host %.2f us, event %.2f us\n", what, N * 8, host[100], ev[100]);
}
int main() {
    float *x, *y; size_t n = 134217728; cudaMalloc(&x, n * 4); cudaMalloc(&y, n * 4); cudaMemset(x, 1, n * 4);
    for (int rep = 0; rep < 2; rep++) {
        run<64>("empty", x, y, 0, 1); run<8>("empty", x, y, 0, 1); run<16>("empty", x, y, 0, 1);
        run<64>("copy 1 GB", x, y, n / 4, 132 * 16); run<8>("copy 1 GB", x, y, n / 4, 132 * 16);
    }
    printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
