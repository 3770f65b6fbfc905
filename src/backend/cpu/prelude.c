// Shared by every generated CPU kernel (cgen.rs: `PRELUDE`, placed before each kernel's own
// source). It defines what the ops' C expressions call (ops::pointwise, backend::cexpr) with the
// CPU's semantics: F16 / BF16 conversions rounding as the `half` crate does, integer and
// rounded arithmetic as the eager loops compute it, and F32 exp, log, sin, cos and tanh by the
// same branch-free polynomials as the eager functions (so compiled and eager agree and loops
// over them vectorise). Compiled with FP contraction off: no FMA the eager code does not do
// (exp fuses its products with `fmaf` where the eager one calls `mul_add`).
#include <math.h>
#include <stdbool.h>
#include <string.h>
typedef unsigned long long u64;

#if defined(__SSE2__)
#include <immintrin.h>
#endif

// Copies a finished row to its output with non-temporal stores where the CPU has them: a
// large output goes to memory without first being read into the cache (which doubles a
// kernel's memory traffic) and without evicting its inputs. `kfence` orders them before the
// kernel returns.
static inline void kstream(void* dst, const void* src, long long bytes) {
  char* d = (char*)dst;
  const char* s = (const char*)src;
#if defined(__AVX512F__) || defined(__AVX__) || defined(__SSE2__)
  long long head = (long long)((64 - ((unsigned long long)d & 63)) & 63);
  head = head < bytes ? head : bytes;
  memcpy(d, s, (size_t)head);
  d += head; s += head; bytes -= head;
  for (; bytes >= 64; bytes -= 64, d += 64, s += 64) {
#if defined(__AVX512F__)
    _mm512_stream_si512((__m512i*)d, _mm512_loadu_si512((const void*)s));
#elif defined(__AVX__)
    _mm256_stream_si256((__m256i*)d, _mm256_loadu_si256((const __m256i*)s));
    _mm256_stream_si256((__m256i*)(d + 32), _mm256_loadu_si256((const __m256i*)(s + 32)));
#else
    for (int k = 0; k < 64; k += 16) _mm_stream_si128((__m128i*)(d + k), _mm_loadu_si128((const __m128i*)(s + k)));
#endif
  }
#endif
  memcpy(d, s, (size_t)bytes);
}
static inline void kfence(void) {
#if defined(__SSE2__)
  _mm_sfence();
#endif
}

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline double __longlong_as_double(long long i) { double d; memcpy(&d, &i, 8); return d; }
static inline unsigned int kbits(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
static inline float kfrom(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }

#if defined(__FLT16_MAX__)
// The compiler's _Float16 (F16C instructions where the CPU has them).
static inline float kh2f(unsigned short h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline unsigned short kf2h(float f) { _Float16 x = (_Float16)f; unsigned short h; memcpy(&h, &x, 2); return h; }
#else
// Compilers without _Float16: the same conversions by bits (round to nearest even, NaN quieted).
static inline float kh2f(unsigned short h) {
  unsigned int sign = (unsigned int)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0x1f) return kfrom(m ? (sign | 0x7fc00000u | (m << 13)) : (sign | 0x7f800000u));
  if (e == 0) { float v = (float)m * 5.9604644775390625e-8f; return sign ? -v : v; }
  return kfrom(sign | ((e + 112) << 23) | (m << 13));
}
static inline unsigned short kf2h(float f) {
  unsigned int x = kbits(f), sign = (x >> 16) & 0x8000u, e = (x >> 23) & 0xffu, m = x & 0x7fffffu;
  if (e == 0xff) return (unsigned short)(sign | 0x7c00u | (m ? (0x200u | (m >> 13)) : 0u));
  int ee = (int)e - 112;
  if (ee >= 31) return (unsigned short)(sign | 0x7c00u);
  if (ee <= 0) {
    if (ee < -10) return (unsigned short)sign;
    m |= 0x800000u;
    int shift = 14 - ee;
    unsigned int r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return (unsigned short)(sign | r);
  }
  unsigned int r = ((unsigned int)ee << 10) | (m >> 13), rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) r++;
  return (unsigned short)(sign | r);
}
#endif
static inline float kb2f(unsigned short b) { return kfrom(((unsigned int)b) << 16); }
static inline unsigned short kf2b(float f) {
  unsigned int x = kbits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);
  return (unsigned short)((x >> 16) + (((x & 0x8000u) != 0 && (x & 0x17fffu) != 0) ? 1u : 0u));
}

static inline long long kipow(long long a, long long b) {
  if (b < 0) return a == 1 ? 1 : (a == -1 ? ((b & 1) ? -1 : 1) : 0);
  unsigned long long r = 1, x = (unsigned long long)a;
  while (b) { if (b & 1) r *= x; x *= x; b >>= 1; }
  return (long long)r;
}
static inline float kdivtrunc_f(float a, float b) { return truncf(a / b); }
static inline double kdivtrunc_d(double a, double b) { return trunc(a / b); }
static inline long long kdivtrunc_i(long long a, long long b) { return b == 0 ? 0 : (b == -1 ? (long long)(0ull - (u64)a) : a / b); }
#define KDIVFLOOR(N, T, FMOD, FLOOR, COPYSIGN) static inline T N(T a, T b) { \
  if (b == (T)0) return a / b; \
  T m = FMOD(a, b), d = (a - m) / b; \
  if (m != (T)0 && ((b < (T)0) != (m < (T)0))) d -= (T)1; \
  if (d != (T)0) { T f = FLOOR(d); return d - f > (T)0.5 ? f + (T)1 : f; } \
  return COPYSIGN((T)0, a / b); }
KDIVFLOOR(kdivfloor_f, float, fmodf, floorf, copysignf)
KDIVFLOOR(kdivfloor_d, double, fmod, floor, copysign)
static inline long long kdivfloor_i(long long a, long long b) {
  if (b == 0) return 0;
  if (b == -1) return (long long)(0ull - (u64)a);
  long long q = a / b, r = a % b;
  return (r != 0 && ((r < 0) != (b < 0))) ? q - 1 : q;
}
static inline float kfmod_f(float a, float b) { return fmodf(a, b); }
static inline double kfmod_d(double a, double b) { return fmod(a, b); }
static inline long long kfmod_i(long long a, long long b) { return (b == 0 || b == -1) ? 0 : a % b; }
static inline float kremainder_f(float a, float b) { float r = kfmod_f(a, b); return (r != 0 && ((b < 0) != (r < 0))) ? r + b : r; }
static inline double kremainder_d(double a, double b) { double r = kfmod_d(a, b); return (r != 0 && ((b < 0) != (r < 0))) ? r + b : r; }
static inline long long kremainder_i(long long a, long long b) { long long r = kfmod_i(a, b); return (r != 0 && ((b < 0) != (r < 0))) ? r + b : r; }
#define KTYPED(N, a, b) _Generic((a), float: N##_f, double: N##_d, default: N##_i)(a, b)
#define kdivtrunc(a, b) KTYPED(kdivtrunc, a, b)
#define kdivfloor(a, b) KTYPED(kdivfloor, a, b)
#define kfmod(a, b) KTYPED(kfmod, a, b)
#define kremainder(a, b) KTYPED(kremainder, a, b)

// A reduction's step and combination: max and min keep the first NaN (ops::reduce::beats).
#define KMAX(a, b) ((((a) == (a)) & (((b) != (b)) | ((b) > (a)))) ? (b) : (a))
#define KMIN(a, b) ((((a) == (a)) & (((b) != (b)) | ((b) < (a)))) ? (b) : (a))
// A row's eight lanes as one vector (lane e holds every eighth value from e on): max and min
// lane by lane as above (the compiler does not vectorise those selects itself).
typedef float kv8f __attribute__((vector_size(32)));
typedef int kv8i __attribute__((vector_size(32)));
typedef double kv8d __attribute__((vector_size(64)));
typedef long long kv8l __attribute__((vector_size(64)));
#define KLANES(V, M, N, OP) static inline V N(V a, V b) { \
  M m = (a == a) & ((b != b) | (b OP a)); \
  M r = ((M)b & m) | ((M)a & ~m); return (V)r; }
KLANES(kv8f, kv8i, kmax8_f, >)
KLANES(kv8f, kv8i, kmin8_f, <)
KLANES(kv8d, kv8l, kmax8_d, >)
KLANES(kv8d, kv8l, kmin8_d, <)
KLANES(kv8l, kv8l, kmax8_i, >)
KLANES(kv8l, kv8l, kmin8_i, <)

// F32 functions as ops::pointwise defines them for the CPU (exp_f32, ln_f32, sincos_f32,
// tanh_f32), with the same constants.
static inline float kpow2(int k) { return kfrom(((unsigned int)k + 127u) << 23); }
static inline float kexpf(float x) {
  const float round = 12582912.0f;
  float t = fmaf(x, 1.44269504088896340735992468100189214f, round);
  float n = t - round;
  float r = fmaf(n, 2.1219444e-4f, fmaf(n, -0.6933594f, x));
  float p = fmaf(fmaf(fmaf(fmaf(fmaf(fmaf(1.9875691e-4f, r, 1.3981999e-3f), r, 8.333452e-3f), r, 4.1665796e-2f), r, 0.16666665f), r, 0.5f), r * r, r) + 1.0f;
  int ni = (int)(kbits(t) - kbits(round));
  int half = ni >> 1;
  float y = p * kpow2(half) * kpow2((int)((unsigned int)ni - (unsigned int)half));
  y = x < -104.0f ? 0.0f : y;
  return x > 89.0f ? __int_as_float(0x7f800000) : y;
}
static inline float klogf(float x) {
  bool tiny = x < 1.17549435e-38f;
  float xs = tiny ? x * 8388608.0f : x;
  unsigned int bits = kbits(xs);
  int e = (int)((bits >> 23) & 0xff) - 127 - (tiny ? 23 : 0);
  float m = kfrom((bits & 0x007fffffu) | 0x3f800000u);
  bool big = m > 1.41421356237309504880168872420969808f;
  m = big ? m * 0.5f : m;
  e += big ? 1 : 0;
  float f = m - 1.0f;
  float z = f * f;
  float p = ((((((((7.0376836e-2f * f - 0.1151461f) * f + 0.11676998f) * f - 0.12420141f) * f + 0.14249323f) * f - 0.16668057f) * f + 0.20000715f) * f - 0.24999994f) * f + 0.3333333f) * f * z;
  float ef = (float)e;
  float y = (p + ef * -2.1219444e-4f - 0.5f * z) + f + ef * 0.6933594f;
  y = x == 0.0f ? -INFINITY : y;
  y = x == INFINITY ? x : y;
  return (x < 0.0f || x != x) ? NAN : y;
}
// sin or cos of |x| <= 8192 without branches; `bad` is set where x is beyond (or not a
// number), and those values are then computed by the C library (as the eager loop's second
// pass does): the kernel runs again with `ksinf_exact` / `kcosf_exact`.
static inline float ksincos(float x, bool cosine) {
  float a = fabsf(x);
  a = a < 8192.0f ? a : 8192.0f;
  int j = (int)(a * 0.63661977236758134307553505349005745f * 2.0f);
  j += j & 1;
  float y = (float)j;
  float z = ((a - y * 0.78515625f) - y * 2.4187565e-4f) - y * 3.774895e-8f;
  float zz = z * z;
  float s = z + z * zz * ((-1.9515296e-4f * zz + 8.332161e-3f) * zz - 0.16666655f);
  float c = 1.0f - 0.5f * zz + zz * zz * ((2.4433157e-5f * zz - 1.3887316e-3f) * zz + 4.1666646e-2f);
  int q = (j >> 1) & 3;
  if (cosine) {
    float v = (q & 1) ? s : c;
    return (q == 1 || q == 2) ? -v : v;
  }
  float v = (q & 1) ? c : s;
  v = (q & 2) ? -v : v;
  return kfrom(kbits(v) ^ (kbits(x) & 0x80000000u));
}
static inline float ksinf_fast(float x, int* bad) { *bad |= !(fabsf(x) <= 8192.0f); return ksincos(x, false); }
static inline float kcosf_fast(float x, int* bad) { *bad |= !(fabsf(x) <= 8192.0f); return ksincos(x, true); }
static inline float ksinf_exact(float x) { return fabsf(x) <= 8192.0f ? ksincos(x, false) : sinf(x); }
static inline float kcosf_exact(float x) { return fabsf(x) <= 8192.0f ? ksincos(x, true) : cosf(x); }
// tanh_f32 takes e^(2|x|) from the C library, as here.
static inline float ktanhf(float x) {
  float a = fabsf(x), x2 = x * x;
  if (a < 0.4f)
    return x * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f + x2 * (-17.0f / 315.0f + x2 * (62.0f / 2835.0f + x2 * (-1382.0f / 155925.0f + x2 * (21844.0f / 6081075.0f)))))));
  return copysignf(1.0f - 2.0f / (expf(2.0f * a) + 1.0f), x);
}
#define expf(x) kexpf(x)
#define logf(x) klogf(x)
#define tanhf(x) ktanhf(x)
