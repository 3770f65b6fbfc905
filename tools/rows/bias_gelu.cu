
typedef unsigned long long u64;
struct KArgs { u64 w[64]; };
__device__ __forceinline__ float kh2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short kf2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float kb2f(unsigned short b) { return __uint_as_float(((unsigned int)b) << 16); }
__device__ __forceinline__ unsigned short kf2b(float f) { unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ double kparam_f(u64 w) { return __longlong_as_double((long long)w); }
__device__ long long kipow(long long a, long long b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  unsigned long long r = 1, x = (unsigned long long)a;
  while (b) { if (b & 1) r *= x; x *= x; b >>= 1; }
  return (long long)r;
}
// Reports an out-of-range index to the host (mapped memory at `word`): the first one wins.
__device__ void kbad_index(u64 word, u64 op, long long index, u64 size) {
  long long* e = (long long*)word;
  if (atomicCAS((unsigned long long*)e, 0ull, (unsigned long long)op) == 0ull) { e[1] = index; e[2] = (long long)size; __threadfence_system(); }
}
// Philox4x32-10, as the host generator: element i of a stream draws counter (first + i).
__device__ void kphilox(u64 seed, u64 ctr, unsigned int* o) {
  unsigned int c0 = (unsigned int)ctr, c1 = (unsigned int)(ctr >> 32), c2 = 0, c3 = 0;
  unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
  for (int r = 0; r < 10; r++) {
    unsigned long long p0 = (unsigned long long)0xD2511F53u * c0, p1 = (unsigned long long)0xCD9E8D57u * c2;
    unsigned int n0 = (unsigned int)(p1 >> 32) ^ c1 ^ k0, n1 = (unsigned int)p1, n2 = (unsigned int)(p0 >> 32) ^ c3 ^ k1, n3 = (unsigned int)p0;
    c0 = n0; c1 = n1; c2 = n2; c3 = n3;
    k0 += 0x9E3779B9u; k1 += 0xBB67AE85u;
  }
  o[0] = c0; o[1] = c1; o[2] = c2; o[3] = c3;
}
typedef int IDX;
#define P(k) (a.w[56 + (k)])
struct __align__(32) VO0 { float v[8]; };
struct __align__(32) VI0 { float v[8]; };
struct __align__(32) VI1 { float v[8]; };
extern "C" __global__ void __launch_bounds__(256) fused_add_gelu_0_f32_v8(const KArgs a) {
  const IDX n = (IDX)a.w[0];
  float* __restrict__ out0 = (float*)a.w[1];
  const float* __restrict__ p0 = (const float*)a.w[2];
  const float* __restrict__ p1 = (const float*)a.w[3];
  const IDX tid = (IDX)blockIdx.x * blockDim.x + threadIdx.x, step = (IDX)gridDim.x * blockDim.x;
  const IDX nv = n / 8;
  for (IDX t = tid; t < nv; t += step) {
    const IDX base = t * 8;
    IDX rem = base, o0 = 0;
    IDX o1 = 0;
    IDX o2 = 0;
    { const unsigned int sz = (unsigned int)a.w[5], qq = (__umulhi((unsigned int)rem, (unsigned int)(a.w[5] >> 32)) + (unsigned int)rem) >> (32 - __clz(sz - 1)); const IDX q = rem - (IDX)(qq * sz); rem = (IDX)qq;
      o2 += q * (IDX)a.w[7];
    }
    { const unsigned int sz = (unsigned int)a.w[4], qq = (__umulhi((unsigned int)rem, (unsigned int)(a.w[4] >> 32)) + (unsigned int)rem) >> (32 - __clz(sz - 1)); const IDX q = rem - (IDX)(qq * sz); rem = (IDX)qq;
      o2 += q * (IDX)a.w[6];
    }
    const VI0 x0 = *(const VI0*)(p0 + base);
    const VI1 x1 = *(const VI1*)(p1 + o2);
    VO0 r0;
    #pragma unroll
    for (int j = 0; j < 8; j++) {
    const IDX i = base + j;
    const float v0 = x0.v[j];
    const float v1 = x1.v[j];
    const float t0 = ((v0) + (v1));
    const float t1 = ((float)0.5 * (t0) * ((float)1 + erff((t0) * (float)0.7071067811865476)));
    r0.v[j] = t1;
    }
    *(VO0*)(out0 + base) = r0;
  }
  const IDX start = nv * 8;
  for (IDX i = start + tid; i < n; i += step) {
    IDX rem = i, o0 = 0;
    IDX o1 = 0;
    IDX o2 = 0;
    { const unsigned int sz = (unsigned int)a.w[5], qq = (__umulhi((unsigned int)rem, (unsigned int)(a.w[5] >> 32)) + (unsigned int)rem) >> (32 - __clz(sz - 1)); const IDX q = rem - (IDX)(qq * sz); rem = (IDX)qq;
      o2 += q * (IDX)a.w[7];
    }
    { const unsigned int sz = (unsigned int)a.w[4], qq = (__umulhi((unsigned int)rem, (unsigned int)(a.w[4] >> 32)) + (unsigned int)rem) >> (32 - __clz(sz - 1)); const IDX q = rem - (IDX)(qq * sz); rem = (IDX)qq;
      o2 += q * (IDX)a.w[6];
    }
    const float v0 = p0[i];
    const float v1 = p1[o2];
    const float t0 = ((v0) + (v1));
    const float t1 = ((float)0.5 * (t0) * ((float)1 + erff((t0) * (float)0.7071067811865476)));
    out0[i] = t1;
  }
}

