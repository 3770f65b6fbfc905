// Host time of one cuLaunchKernel on an idle device (after a synchronize, as the bench's
// one-call timing sees it), by stream kind and argument size:
//   nvcc -O2 -arch=sm_90 tools/launch/streams.cu -o /tmp/streams -lcuda && /tmp/streams
#include <cuda.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <algorithm>
#include <vector>

struct Big { unsigned long long w[64]; };
struct Small { unsigned long long w[8]; };
__global__ void k_big(Big a) { if (a.w[0] == 1234567 && threadIdx.x == 0) ((float*)a.w[1])[blockIdx.x] = 1.f; }
__global__ void k_small(Small a) { if (a.w[0] == 1234567 && threadIdx.x == 0) ((float*)a.w[1])[blockIdx.x] = 1.f; }

template <class A>
double launch_us(CUfunction f, CUstream s, int blocks, int threads, bool sync_before) {
  A a = {};
  void* params[] = {&a};
  std::vector<double> t;
  for (int i = 0; i < 40; i++) {
    if (sync_before) cuCtxSynchronize();
    auto t0 = std::chrono::steady_clock::now();
    cuLaunchKernel(f, blocks, 1, 1, threads, 1, 1, 0, s, params, nullptr);
    auto t1 = std::chrono::steady_clock::now();
    t.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  cuCtxSynchronize();
  std::sort(t.begin() + 5, t.end());
  return t[5 + (t.size() - 5) / 2];
}

int main() {
  cudaFree(0);
  CUfunction big, small;
  cudaGetFuncBySymbol(&big, (const void*)k_big);
  cudaGetFuncBySymbol(&small, (const void*)k_small);
  CUstream nb, blocking;
  cuStreamCreate(&nb, CU_STREAM_NON_BLOCKING);
  cuStreamCreate(&blocking, CU_STREAM_DEFAULT);
  struct { const char* name; CUstream s; } streams[] = {{"legacy default", nullptr}, {"per-thread default", CU_STREAM_PER_THREAD}, {"non-blocking", nb}, {"blocking (created)", blocking}};
  for (auto& st : streams) {
    for (int blocks : {1, 8192}) {
      printf("%-20s %5d blocks: 512 B args %.2f us, 64 B args %.2f us (after a sync); back to back %.2f us\n", st.name, blocks,
             launch_us<Big>(big, st.s, blocks, 512, true), launch_us<Small>(small, st.s, blocks, 512, true), launch_us<Big>(big, st.s, blocks, 512, false));
    }
  }
}
