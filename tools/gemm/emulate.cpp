// CPU emulation of gemm_f32.cu, to check its indexing without a GPU: one
// std::thread per CUDA thread, a barrier for __syncthreads, blocks one after another. Checks
// every output against a float64 product and that the split counters are left at zero.
//   g++ -std=c++20 -O1 -pthread -DBM=64 -DBN=64 -DBK=16 -DTM=8 -DTN=4 -DTA=0 -DTB=1 -DVA=1 \
//       -DVB=1 -DEPI=2 tools/gemm/emulate.cpp -o /tmp/e && /tmp/e BATCH M N K SPLITS
#include <barrier>
#include <thread>
#include <vector>
#include <cstdio>
#include <cmath>
#include <cstdlib>
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(x)
#define __launch_bounds__(x)
#define __restrict__
struct float4 { float x, y, z, w; };
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
struct dim3 { unsigned x, y, z; };
thread_local dim3 threadIdx; dim3 blockIdx, gridDim;
std::barrier<>* bar;
inline void __syncthreads() { bar->arrive_and_wait(); }
inline void __threadfence() {}
inline unsigned atomicAdd(unsigned* p, unsigned v) { unsigned o = *p; *p += v; return o; }
inline float __ldcg(const float* p) { return *p; }
using std::min;
typedef unsigned long long u64;
struct KArgs { u64 w[64]; };
#define KNAME kern
#include "gemm_f32.cu"
int main(int argc, char** argv) {
  int batch = atoi(argv[1]), M = atoi(argv[2]), N = atoi(argv[3]), K = atoi(argv[4]), splits = atoi(argv[5]);
  std::vector<float> A(batch * M * K), B(batch * K * N), bias(N), C(batch * M * N, -7.f);
  unsigned s = 1; auto r = [&] { s = s * 1664525u + 1013904223u; return (s >> 8) / 16777216.f * 4.f - 2.f; };
  for (auto& x : A) x = r(); for (auto& x : B) x = r(); for (auto& x : bias) x = r();
  int per = ((K + splits - 1) / splits + BK - 1) / BK * BK; if (per < BK) per = BK;
  std::vector<float> ws(splits * batch * M * N); std::vector<unsigned> ctr(100000);
  KArgs a{}; a.w[0] = (u64)A.data(); a.w[1] = (u64)B.data(); a.w[2] = (u64)C.data(); a.w[3] = (u64)bias.data();
  a.w[4] = (u64)ws.data(); a.w[5] = (u64)ctr.data(); a.w[6] = M; a.w[7] = N; a.w[8] = K;
  a.w[9] = TA ? M : K; a.w[10] = TB ? K : N; a.w[11] = M * K; a.w[12] = K * N; a.w[13] = per; a.w[14] = splits;
  gridDim = {(unsigned)((N + BN - 1) / BN), (unsigned)((M + BM - 1) / BM), (unsigned)(batch * splits)};
  std::barrier<> b(NT); bar = &b;
  for (unsigned z = 0; z < gridDim.z; z++) for (unsigned y = 0; y < gridDim.y; y++) for (unsigned x = 0; x < gridDim.x; x++) {
    blockIdx = {x, y, z};
    std::vector<std::thread> ts;
    for (int t = 0; t < NT; t++) ts.emplace_back([&, t] { threadIdx = {(unsigned)t, 0, 0}; kern(a); });
    for (auto& t : ts) t.join();
  }
  double worst = 0;
  for (int bz = 0; bz < batch; bz++) for (int i = 0; i < M; i++) for (int j = 0; j < N; j++) {
    double w = 0, mag = 0;
    for (int p = 0; p < K; p++) {
      double av = TA ? A[bz * M * K + p * M + i] : A[bz * M * K + i * K + p];
      double bv = TB ? B[bz * K * N + j * K + p] : B[bz * K * N + p * N + j];
      w += av * bv; mag += fabs(av * bv);
    }
    if (EPI >= 1) w += bias[j];
    if (EPI == 2) w = w > 0 ? w : 0;
    double e = fabs(C[(bz * M + i) * N + j] - w) / (mag * K * 1.2e-7 + 1e-6);
    if (e > worst) worst = e;
    if (e > 1) { printf("FAIL at %d %d %d: %f vs %f\n", bz, i, j, C[(bz * M + i) * N + j], w); return 1; }
  }
  for (auto c : ctr) if (c) { printf("FAIL: counter left nonzero\n"); return 1; }
  printf("ok (worst %.3f of bound)\n", worst);
}
