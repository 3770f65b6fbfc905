// The compiled bias + GELU map kernel over 8192 x 8192 f32 (as kiln generates it: one thread per
// vector of VEC floats, the bias's offset by magic division) against variants, timed back to
// back and one call at a time on an idle device (as the bench does), beside cudaMemcpy of the
// same bytes. nvcc -O3 -arch=sm_90 bias_gelu.cu -o bias_gelu && ./bias_gelu
#include <cuda_runtime.h>
#include <cstdio>
#include <vector>
#include <algorithm>
typedef unsigned long long u64;
struct KArgs { u64 w[64]; };
typedef int IDX;
template <int V> struct __align__(4 * V) Vec { float v[V]; };

// GELU: 0 none (bias add only), 1 exact (erff, as generated), 2 a plain copy of x (no bias).
template <int V, int GELU, int MINB, bool STRIDE, int T = 256>
__global__ void __launch_bounds__(T, MINB) bias_gelu(const KArgs a) {
  const IDX n = (IDX)a.w[0];
  float* __restrict__ out0 = (float*)a.w[1];
  const float* __restrict__ p0 = (const float*)a.w[2];
  const float* __restrict__ p1 = (const float*)a.w[3];
  const IDX tid = (IDX)blockIdx.x * blockDim.x + threadIdx.x, step = (IDX)gridDim.x * blockDim.x;
  const IDX nv = n / V;
  for (IDX t = tid; t < nv; t += step) {
    const IDX base = t * V;
    IDX rem = base, o2 = 0;
    { const unsigned int sz = (unsigned int)a.w[5], qq = (__umulhi((unsigned int)rem, (unsigned int)(a.w[5] >> 32)) + (unsigned int)rem) >> (32 - __clz(sz - 1)); const IDX q = rem - (IDX)(qq * sz); rem = (IDX)qq;
      o2 += q * (IDX)a.w[7]; }
    { const unsigned int sz = (unsigned int)a.w[4], qq = (__umulhi((unsigned int)rem, (unsigned int)(a.w[4] >> 32)) + (unsigned int)rem) >> (32 - __clz(sz - 1)); const IDX q = rem - (IDX)(qq * sz); rem = (IDX)qq;
      o2 += q * (IDX)a.w[6]; }
    const Vec<V> x0 = *(const Vec<V>*)(p0 + base);
    Vec<V> x1;
    if (GELU != 2) x1 = *(const Vec<V>*)(p1 + o2);
    Vec<V> r0;
#pragma unroll
    for (int j = 0; j < V; j++) {
      const float t0 = GELU == 2 ? 0.0f : x0.v[j] + x1.v[j];
      r0.v[j] = GELU == 2 ? x0.v[j] : GELU ? 0.5f * t0 * (1.0f + erff(t0 * 0.7071067811865476f)) : t0;
    }
    *(Vec<V>*)(out0 + base) = r0;
  }
}

static u64 size_word(u64 d) {
  unsigned shift = 64 - __builtin_clzll(d - 1);
  unsigned __int128 magic = (((unsigned __int128)1 << 32) * (((unsigned __int128)1 << shift) - d)) / d + 1;
  return d | ((u64)magic << 32);
}

int main() {
  const int R = 8192, C = 8192; const size_t n = (size_t)R * C;
  float *x, *b, *y, *ref;
  cudaMalloc(&x, n * 4); cudaMalloc(&b, C * 4); cudaMalloc(&y, n * 4); cudaMalloc(&ref, n * 4);
  std::vector<float> h(n); unsigned s = 1;
  for (auto& v : h) { s = s * 1664525u + 1013904223u; v = (s >> 8) * (1.0f / 16777216.0f) * 6 - 3; }
  cudaMemcpy(x, h.data(), n * 4, cudaMemcpyHostToDevice); cudaMemcpy(b, h.data() + 5, C * 4, cudaMemcpyHostToDevice);
  KArgs a = {}; a.w[0] = n; a.w[1] = (u64)y; a.w[2] = (u64)x; a.w[3] = (u64)b; a.w[4] = size_word(R); a.w[5] = size_word(C); a.w[6] = 0; a.w[7] = 1;
  int sms; cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  struct Var { const char* name; void (*k)(KArgs); int vec; bool stride; int threads = 256; };
  Var vars[] = {
    {"as generated (vec 8)", bias_gelu<8, 1, 1, false>, 8, false},
    {"bias add only (vec 8)", bias_gelu<8, 0, 1, false>, 8, false},
    {"vec 4", bias_gelu<4, 1, 1, false>, 4, false},
    {"vec 16", bias_gelu<16, 1, 1, false>, 16, false},
    {"vec 8, min 4 blocks/SM", bias_gelu<8, 1, 4, false>, 8, false},
    {"vec 8, min 8 blocks/SM", bias_gelu<8, 1, 8, false>, 8, false},
    {"vec 8, grid 8/SM striding", bias_gelu<8, 1, 1, true>, 8, true},
    {"vec 4, grid 8/SM striding", bias_gelu<4, 1, 1, true>, 4, true},
    {"plain copy, vec 8 (kiln's copy_ form)", bias_gelu<8, 2, 1, false>, 8, false},
    {"vec 8, 128 threads", bias_gelu<8, 1, 1, false, 128>, 8, false, 128},
    {"vec 8, 512 threads", bias_gelu<8, 1, 1, false, 512>, 8, false, 512},
    {"vec 8, 1024 threads", bias_gelu<8, 1, 1, false, 1024>, 8, false, 1024},
    {"vec 8, 64 threads", bias_gelu<8, 1, 1, false, 64>, 8, false, 64},
  };
  auto grid_of = [&](const Var& v) { return v.stride ? (unsigned)(sms * 8) : (unsigned)((n / v.vec + v.threads - 1) / v.threads); };
  // reference: the generated kernel
  a.w[1] = (u64)ref; vars[0].k<<<grid_of(vars[0]), vars[0].threads>>>(a); a.w[1] = (u64)y; cudaDeviceSynchronize();
  auto time = [&](auto launch, double* b2b, double* one) {
    for (int i = 0; i < 3; i++) launch();
    cudaEventRecord(e0); for (int i = 0; i < 20; i++) launch(); cudaEventRecord(e1); cudaEventSynchronize(e1);
    float ms; cudaEventElapsedTime(&ms, e0, e1); *b2b = ms * 1e3 / 20;
    std::vector<double> ts;
    for (int i = 0; i < 30; i++) { cudaDeviceSynchronize(); cudaEventRecord(e0); launch(); cudaEventRecord(e1); cudaEventSynchronize(e1); cudaEventElapsedTime(&ms, e0, e1); ts.push_back(ms * 1e3); }
    std::sort(ts.begin(), ts.end()); *one = ts[15];
  };
  for (int round = 0; round < 3; round++) {
    double bb, one;
    time([&] { cudaMemcpyAsync(y, x, n * 4, cudaMemcpyDeviceToDevice); }, &bb, &one);
    printf("round %d %-30s regs --  back to back %6.1f us  one call %6.1f us\n", round, "cudaMemcpy", bb, one);
    for (auto& v : vars) {
      cudaFuncAttributes fa; cudaFuncGetAttributes(&fa, v.k);
      cudaMemset(y, 0xff, n * 4);
      time([&] { v.k<<<grid_of(v), v.threads>>>(a); }, &bb, &one);
      // compare with the reference (the bias-only variant differs by design)
      std::vector<float> got(4096), want(4096);
      cudaMemcpy(got.data(), y + n - 4096, 4096 * 4, cudaMemcpyDeviceToHost); cudaMemcpy(want.data(), ref + n - 4096, 4096 * 4, cudaMemcpyDeviceToHost);
      bool same = std::equal(got.begin(), got.end(), want.begin());
      printf("round %d %-30s regs %2d back to back %6.1f us  one call %6.1f us  %s\n", round, v.name, fa.numRegs, bb, one, same ? "same" : "DIFFERS");
    }
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
