// Shared by the attention kernels (attention.rs: `common`): types, loads, warp reductions,
// the argument block, and the warp kernels' score, key-range, key-loading and online-softmax
// steps. Defined before this text, per kernel:
//   D_          the head dim
//   ROWS        warps (query or key rows) per block
//   VW          elements per load of a key or value row (divides D_, the rows' strides and
//               alignment)
//   STORAGE_T   the stored element type (T)
//   SCORE_T     the type scores and log-sum-exps are kept in (SC)
//   VT_ALIGN    the alignment of VW elements, in bytes
//   LD(e), ST(e)  a stored element as float, and a float as a stored element
#define PER ((D_ + 31) / 32)
#define FULL 0xffffffffu
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef STORAGE_T T;
// The type scores and log-sum-exps are kept in: double for F32 inputs, where a float score
// past ~64 loses the digits exp() amplifies (F32 results then stay within F32's tolerance of
// the exact ones); float for F16 and BF16.
typedef SCORE_T SC;
struct __align__(VT_ALIGN) VT { T v[VW]; };
__device__ __forceinline__ SC wmax(SC x) { for (int o = 16; o; o >>= 1) x = fmax(x, __shfl_xor_sync(FULL, x, o)); return x; }
__device__ __forceinline__ float wsum(float x) { for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(FULL, x, o); return x; }
__device__ __forceinline__ double wsum(double x) { for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(FULL, x, o); return x; }
__device__ __forceinline__ float kexp(float x) { return expf(x); }
__device__ __forceinline__ double kexp(double x) { return exp(x); }
#define ARGS \
  const T* q = (const T*)a.q; const T* k = (const T*)a.k; const T* v = (const T*)a.v; const T* mk = (const T*)a.mask; \
  long long B = a.b, H = a.h, L = a.l, S = a.s; \
  long long qsl = a.q_strides[0], qsb = a.q_strides[1], qsh = a.q_strides[2], kss = a.k_strides[0], ksb = a.k_strides[1], ksh = a.k_strides[2], vss = a.v_strides[0], vsb = a.v_strides[1], vsh = a.v_strides[2]; \
  long long msb = a.mask_strides[0], msh = a.mask_strides[1], msl = a.mask_strides[2], mss = a.mask_strides[3]; \
  float scale = (float)a.scale; SC sscale = (SC)a.scale; int causal = (int)a.causal; \
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31; \
  long long bh = blockIdx.x, b = bh / H, h = bh % H; (void)B; (void)L; (void)S;
// Score of query row l (in Qrow) against key row s (in Krow), scaled after the product (one
// rounding fewer than scaling the query first: large scores keep their digits), mask added.
#define SCORE(Qrow, Krow, l, s, out) { SC dot_ = 0; for (int d_ = 0; d_ < D_; d_++) dot_ += (SC)(Qrow)[d_] * (SC)(Krow)[d_]; \
  dot_ *= sscale; if (mk) dot_ += (SC)LD(mk[b * msb + h * msh + (l) * msl + (s) * mss]); out = dot_; }
// The keys the block's query rows see: all S, or up to its last row when causal.
#define KEY_END long long last = min(L, (long long)(blockIdx.y + 1) * ROWS) - 1; \
  long long send = causal ? min(S, last + 1) : S;
// The tile of keys from s0 (all 32 but in the last: short sequences load and sum no padding)
// into Ks, with their values into Vs when WITH_V; the whole block loads, then syncs. A key's
// and its value's vectors are both loaded before either is stored: one wait on memory.
#define LOAD_KEYS(s0, nk, WITH_V) const int nk = (int)min(32ll, send - (s0)); __syncthreads(); \
  for (int i_ = threadIdx.x; i_ < nk * (D_ / VW); i_ += ROWS * 32) { \
    int j_ = i_ / (D_ / VW), d_ = (i_ - j_ * (D_ / VW)) * VW; long long s_ = (s0) + j_; \
    const VT kq_ = *(const VT*)(k + s_ * kss + b * ksb + h * ksh + d_); \
    VT vq_; if (WITH_V) vq_ = *(const VT*)(v + s_ * vss + b * vsb + h * vsh + d_); \
    for (int e_ = 0; e_ < VW; e_++) Ks[j_][d_ + e_] = LD(kq_.v[e_]); \
    if (WITH_V) for (int e_ = 0; e_ < VW; e_++) Vs[j_][d_ + e_] = LD(vq_.v[e_]); } \
  __syncthreads();
// This lane's score against key s0 + lane (-inf where masked out by causality or past S),
// the row's running max m updated into mn and this lane's exp(score - mn) into p.
#define ONLINE_STEP(s0, sc, mn, p) long long s = (s0) + lane; SC sc = -INFINITY; \
  if (s < S && !(causal && s > l)) SCORE(Qs[warp], Ks[lane], l, s, sc); \
  SC mn = fmax(m, wmax(sc)); float p = sc == -INFINITY ? 0.f : expf((float)(sc - mn));
