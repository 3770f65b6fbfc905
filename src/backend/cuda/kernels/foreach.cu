// A multi-tensor optimiser update (foreach.rs: `gen`), placed after the prelude. Defined before
// this text, per kernel:
//   KNAME                  the kernel's name
//   NT, ILP, CHUNK, THREADS  tensors per table, loads in flight per thread, elements per block,
//                          threads per block
//   DEPTH                  addresses per tensor (slots: parameter, gradient, state)
//   COMPUTE_T, STORAGE_T   the type updates are computed in (T), and the stored one (S)
//   LD(x), ST(x)           a stored element as T, and a T as a stored element
//   SQRT                   the square root of a T
//   ADAM                   1: Adam (AdamW with DECOUPLED); 0: SGD (MOMENTUM, NESTEROV)
//   WEIGHT_DECAY, DECOUPLED, MOMENTUM, NESTEROV  the rule's flags, 0 or 1
struct Table { u64 n; u64 first[NT]; u64 numel[NT]; u64 ptr[DEPTH][NT]; };
typedef COMPUTE_T T;
typedef STORAGE_T S;
// One eager op's rounding: its result is stored in the parameter's dtype.
__device__ __forceinline__ T kr(T x) { return LD(ST(x)); }
__device__ __forceinline__ T kld(S x) { return LD(x); }
__device__ __forceinline__ S kst(T x) { return ST(x); }
// The scalar parameters, in the order of `Rule`'s doc.
#if ADAM
#define SCALARS const double s0, const double s1, const double s2, const double s3, const double s4, const double s5, const double s6, const double s7, const double s8,
#else
#define SCALARS const double s0, const double s1, const double s2, const double s3,
#endif
extern "C" __global__ void __launch_bounds__(THREADS) KNAME(const Table tb, SCALARS const int first) {
  KILN_AFTER_PREVIOUS();
  const u64 b = blockIdx.x;
  int lo = 0, hi = (int)tb.n - 1;
  while (lo < hi) { const int mid = (lo + hi + 1) >> 1; if (tb.first[mid] <= b) lo = mid; else hi = mid - 1; }
  const long long n = (long long)tb.numel[lo];
  const long long begin = (long long)(b - tb.first[lo]) * CHUNK;
  const long long end = begin + CHUNK < n ? begin + CHUNK : n;
  const long long stride = (long long)blockDim.x;
  S* __restrict__ q0 = (S*)tb.ptr[0][lo];
  const S* __restrict__ q1 = (const S*)tb.ptr[1][lo];
#if DEPTH > 2
  S* __restrict__ q2 = (S*)tb.ptr[2][lo];
#endif
#if DEPTH > 3
  S* __restrict__ q3 = (S*)tb.ptr[3][lo];
#endif
  // The scalars in the compute type, those the update uses.
#if ADAM
  const T
#if WEIGHT_DECAY && DECOUPLED
    decay = (T)s1,
#elif WEIGHT_DECAY
    wd = (T)s0,
#endif
    beta1 = (T)s2, keep1 = (T)s3, beta2 = (T)s4, keep2 = (T)s5, bc2s = (T)s6, eps = (T)s7, step_size = (T)s8;
#else
  const T lr = (T)s0
#if WEIGHT_DECAY
    , wd = (T)s1
#endif
#if MOMENTUM
    , mom = (T)s2, keep = (T)s3
#endif
    ;
#endif
  // Values per element: p (parameter), g (gradient), then the state (Adam's m and v, SGD's
  // momentum buffer); slot s is q<s>.
  for (long long base = begin + (long long)threadIdx.x; base < end; base += ILP * stride) {
    T rp[ILP], rg[ILP]
#if ADAM
      , rm[ILP], rv[ILP]
#elif MOMENTUM
      , rbuf[ILP]
#endif
      ;
    // Every load first, so that a thread has ILP of each in flight; then update and store.
    #pragma unroll
    for (int j = 0; j < ILP; j++) {
      const long long i = base + j * stride;
      if (i < end) {
        rp[j] = kld(q0[i]); rg[j] = kld(q1[i]);
#if ADAM
        rm[j] = kld(q2[i]); rv[j] = kld(q3[i]);
#elif MOMENTUM
        // A first SGD step's buffer is uninitialised memory: written, never read.
        rbuf[j] = first ? (T)0 : kld(q2[i]);
#endif
      }
    }
    #pragma unroll
    for (int j = 0; j < ILP; j++) {
      const long long i = base + j * stride;
      if (i >= end) continue;
      T p = rp[j], g = rg[j]
#if ADAM
        , m = rm[j], v = rv[j]
#elif MOMENTUM
        , buf = rbuf[j]
#endif
        ;
#if ADAM
#if WEIGHT_DECAY && DECOUPLED
      p = kr(p * decay);
#elif WEIGHT_DECAY
      g = kr(g + kr(p * wd));
#endif
      m = kr(kr(m * beta1) + kr(g * keep1));
      v = kr(kr(v * beta2) + kr(kr(g * g) * keep2));
      const T denom = kr(kr(kr(SQRT(v)) / bc2s) + eps);
      p = kr(p - kr(kr(m / denom) * step_size));
#else
#if WEIGHT_DECAY
      g = kr(g + kr(p * wd));
#endif
#if MOMENTUM
      buf = first ? g : kr(kr(buf * mom) + kr(g * keep));
#if NESTEROV
      g = kr(g + kr(buf * mom));
#else
      g = buf;
#endif
#endif
      p = kr(p - kr(g * lr));
#endif
      // Written back: the parameter and the state (not the gradient, slot 1).
      q0[i] = kst(p);
#if ADAM
      q2[i] = kst(m); q3[i] = kst(v);
#elif MOMENTUM
      q2[i] = kst(buf);
#endif
    }
  }
}
