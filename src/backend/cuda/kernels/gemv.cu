// Matrix-vector products out[n] = x · W(:, n) (+ bias[n], then ReLU or GELU when asked), F32
// accumulation. After the prelude, the argument struct and the #defines of `gemv.rs`: T (storage
// type), VW (elements per 16-byte vector), LD/ST (element load and store as float), and one of
// GEMV_ROWS (W read as [N, K] rows, K contiguous) or GEMV_COLS (W read as [K, N], N contiguous,
// TX vectors of columns per block, RPT rows per thread where a block's rows are few enough).

// The VW elements of a 16-byte vector as floats.
__device__ __forceinline__ void kunpack(const uint4 u, float* f) {
  const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#if VW == 8 && defined(GEMV_BF16)
#pragma unroll
  for (int i = 0; i < 4; i++) { f[2 * i] = __uint_as_float(w[i] << 16); f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u); }
#elif VW == 8
#pragma unroll
  for (int i = 0; i < 4; i++) { f[2 * i] = kh2f((unsigned short)(w[i] & 0xffffu)); f[2 * i + 1] = kh2f((unsigned short)(w[i] >> 16)); }
#else
#pragma unroll
  for (int i = 0; i < 4; i++) f[i] = __uint_as_float(w[i]);
#endif
}

// The row is read with plain (coherent) loads, never __ldg: under programmatic dependent launch
// the kernel before may still be writing it while this one runs, and the compiler takes an
// __ldg load as invariant, free to move above the wait (`waits_for_previous` refuses __ldg).
// Weights are read once per product: streamed past L1.
__device__ __forceinline__ uint4 kstream(const uint4* p) { return __ldcs(p); }

#ifdef GEMV_ROW
// The row computed first by a row kernel (`fused.rs`, `RowMode::Prologue`: a decode step's
// layer norm), named by GEMV_ROW, of GEMV_ROW_K elements: after the wait for the kernel before,
// every block computes it into its own shared memory and reads it from there; the first block
// alone stores the row kernel's other outputs (the residual sum a later layer norm reads).
struct GemvRowArgs { GemvArgs g; LaunchArgs r; };
#define KPARAMS const GemvRowArgs ka
#define KARGS ka.g
#define KBIND const GemvArgs& a = ka.g;
#define KROW(row) \
  __shared__ __align__(16) T ksrow[GEMV_ROW_K]; \
  GEMV_ROW(ka.r, ksrow, blockIdx.x == 0 && blockIdx.y == 0); \
  __syncthreads(); \
  row = ksrow;
#else
#define KPARAMS const GemvArgs a
#define KARGS a
#define KBIND
#define KROW(row)
#endif

// Output n's value after the bias and the activation, in F32.
__device__ __forceinline__ float kepilogue(const GemvArgs& a, long long n, float acc) {
  if (a.bias) acc += LD(((const T*)a.bias)[n]);
  if (a.act == 1) acc = fmaxf(acc, 0.0f);
  else if (a.act == 2) acc = KGELU_TANH(acc);
  return acc;
}

__device__ __forceinline__ void kstore_out(const GemvArgs& a, long long n, float acc) {
  ((T*)a.out)[n] = ST(kepilogue(a, n, acc));
}

#ifdef GEMV_ARGMAX
// The order of (value, index) pairs as one u64, largest first: the value's bits made to order as
// unsigned integers (NaN above everything, -0 as +0), then the index reversed, so that the max
// is the first index of the largest value, as `Tensor::argmax`.
__device__ __forceinline__ unsigned long long kargmax_key(float v, long long n) {
  unsigned int u = __float_as_uint(v == 0.0f ? 0.0f : v);
  u = v != v ? 0xffffffffu : (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return ((unsigned long long)u << 32) | (0xffffffffu - (unsigned int)n);
}
#endif

#ifdef GEMV_ROWS
// Outputs n[0..R)'s sums over the row, by one warp: its lanes walk x and the R rows together in
// 16-byte vectors (R rows' loads in flight at once; rows past N are not read), then sum by
// shuffles (every lane holds the sums).
template <int R>
__device__ __forceinline__ void kdot_rows(const GemvArgs& a, const uint4* x, const long long* n, int lane, float* acc) {
  const uint4* w[R];
  bool live[R];
#pragma unroll
  for (int r = 0; r < R; r++) {
    live[r] = n[r] < a.n;
    w[r] = (const uint4*)((const T*)a.w + (live[r] ? n[r] : 0) * a.ldw);
    acc[r] = 0.0f;
  }
  const long long vectors = a.k / VW;
#pragma unroll 4
  for (long long v = lane; v < vectors; v += 32) {
    float xf[VW];
    uint4 wv[R];
#pragma unroll
    for (int r = 0; r < R; r++) wv[r] = live[r] ? kstream(w[r] + v) : make_uint4(0, 0, 0, 0);
    kunpack(x[v], xf);
#pragma unroll
    for (int r = 0; r < R; r++) {
      float wf[VW];
      kunpack(wv[r], wf);
#pragma unroll
      for (int j = 0; j < VW; j++) acc[r] = fmaf(xf[j], wf[j], acc[r]);
    }
  }
#pragma unroll
  for (int r = 0; r < R; r++)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
}

// One warp per output. With GEMV_ARGMAX no output is stored, and the grid is smaller than the
// outputs: each warp walks outputs a grid apart and keeps the largest (rounded to T, as
// stored), each block folds its warps' into a running max (`part`, a u64) with one atomic, and
// the last block to arrive writes its index to `out` (one I64) and clears the max for the next
// launch (atomics on one address queue up, so fewer blocks is fewer waits).
extern "C" __global__ void __launch_bounds__(32 * WARPS) NAME(KPARAMS) {
  KILN_WAIT_UNLESS_SETTLED(KARGS.settled);
  KBIND
  const int lane = threadIdx.x & 31;
  const long long first = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
  // A settled matrix: the warp's first rows are fetched into L2 while the kernel before still
  // runs (too many to hold in registers: an output head's matrix is larger than the register
  // files), a line per lane at a time.
  if (a.settled) {
    const long long lines = (a.k * (long long)sizeof(T) + 127) / 128;
    const int rows = (long long)gridDim.x * WARPS >= a.n ? 1 : PREFETCH_ROWS;
    for (long long i = lane; i < rows * lines; i += 32) {
      const long long n = first + i / lines * gridDim.x * WARPS;
      if (n < a.n) asm volatile("prefetch.global.L2 [%0];" :: "l"((const char*)((const T*)a.w + n * a.ldw) + i % lines * 128));
    }
  }
  KILN_WAIT_IF_SETTLED(a.settled);
  const T* xrow = (const T*)a.x;
  KROW(xrow)
  const uint4* x = (const uint4*)xrow;
#ifdef GEMV_ARGMAX
  // Two outputs a grid apart at a time: twice the loads in flight per warp.
  unsigned long long mine = 0ull;
  const long long stride = (long long)gridDim.x * WARPS;
  for (long long n0 = first; n0 < a.n; n0 += 2 * stride) {
    const long long n[2] = {n0, n0 + stride};
    float acc[2];
    kdot_rows<2>(a, x, n, lane, acc);
#pragma unroll
    for (int r = 0; r < 2; r++)
      if (n[r] < a.n) mine = max(mine, kargmax_key(LD(ST(kepilogue(a, n[r], acc[r]))), n[r]));
  }
  __shared__ unsigned long long best[WARPS];
  if (lane == 0) best[threadIdx.x >> 5] = mine;
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned long long b = best[0];
#pragma unroll
    for (int w = 1; w < WARPS; w++) b = max(b, best[w]);
    unsigned long long* running = (unsigned long long*)a.part;
    atomicMax(running, b);
    // (the arrival's release orders the max before it; the last block's acquire sees them all)
    if (klast_arrival((unsigned int*)a.count, gridDim.x)) {
      const unsigned long long all = atomicExch(running, 0ull);
      *(long long*)a.out = (long long)(0xffffffffu - (unsigned int)(all & 0xffffffffu));
    }
  }
#else
  if (first >= a.n) return;
  float acc;
  kdot_rows<1>(a, x, &first, lane, &acc);
  if (lane == 0) kstore_out(a, first, acc);
#endif
}
#endif

#ifdef GEMV_COLS
// A block owns TX * VW columns and the rows [blockIdx.y * per, + per) of K: TX adjacent lanes
// read one row's columns as vectors, the warp's 32 / TX lane groups and the WARPS warps take
// rows in turn; the partial sums meet by shuffles inside a warp, then in shared memory across
// warps. Where K is split (gridDim.y > 1, a narrow matrix would leave SMs idle), each block
// leaves its sums in `part` ([gridDim.y][N] F32) and the last block of a strip of columns adds
// them in split order (the same bits on every run) before the epilogue.
#define KY (32 / TX)
extern "C" __global__ void __launch_bounds__(32 * WARPS) NAME(KPARAMS) {
  KILN_WAIT_UNLESS_SETTLED(KARGS.settled);
  KBIND
  __shared__ float part[WARPS][TX * VW];
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int tx = lane % TX, ky = lane / TX;
  const long long col = ((long long)blockIdx.x * TX + tx) * VW;
  const bool live = col < a.n;
  const long long r0 = (long long)blockIdx.y * a.per, r1 = min(a.k, r0 + a.per);
  const T* x = (const T*)a.x;
  const T* w = (const T*)a.w + col;
  float acc[VW];
#pragma unroll
  for (int j = 0; j < VW; j++) acc[j] = 0.0f;
#ifdef RPT
  // RPT rows per thread cover the block's rows: every load is issued before the first
  // product, so a thread waits on memory once. A settled matrix is loaded before the wait for
  // the kernel before, while that kernel still runs; the row, its output, only after.
  uint4 q[RPT];
  float xr[RPT];
#pragma unroll
  for (int i = 0; i < RPT; i++) {
    const long long r = r0 + (long long)warp * KY + ky + (long long)i * WARPS * KY;
    q[i] = live && r < r1 ? kstream((const uint4*)(w + r * a.ldw)) : make_uint4(0, 0, 0, 0);
  }
  KILN_WAIT_IF_SETTLED(a.settled);
  KROW(x)
#pragma unroll
  for (int i = 0; i < RPT; i++) {
    const long long r = r0 + (long long)warp * KY + ky + (long long)i * WARPS * KY;
    xr[i] = live && r < r1 ? LD(x[r]) : 0.0f;
  }
#pragma unroll
  for (int i = 0; i < RPT; i++) {
    float wf[VW];
    kunpack(q[i], wf);
#pragma unroll
    for (int j = 0; j < VW; j++) acc[j] = fmaf(xr[i], wf[j], acc[j]);
  }
#else
  KILN_WAIT_IF_SETTLED(a.settled);
  KROW(x)
  if (live) {
#pragma unroll 4
    for (long long r = r0 + (long long)warp * KY + ky; r < r1; r += WARPS * KY) {
      float wf[VW];
      kunpack(kstream((const uint4*)(w + r * a.ldw)), wf);
      const float xr = LD(x[r]);
#pragma unroll
      for (int j = 0; j < VW; j++) acc[j] = fmaf(xr, wf[j], acc[j]);
    }
  }
#endif
#pragma unroll
  for (int j = 0; j < VW; j++) {
#pragma unroll
    for (int o = 16; o >= TX; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  }
  if (ky == 0) {
#pragma unroll
    for (int j = 0; j < VW; j++) part[warp][tx * VW + j] = acc[j];
  }
  __syncthreads();
  const long long n = (long long)blockIdx.x * TX * VW + threadIdx.x;
  float s = 0.0f;
  if (threadIdx.x < TX * VW) {
#pragma unroll
    for (int i = 0; i < WARPS; i++) s += part[i][threadIdx.x];
  }
  if (gridDim.y > 1) {
    float* sums = (float*)a.part;
    if (threadIdx.x < TX * VW && n < a.n) sums[(long long)blockIdx.y * a.n + n] = s;
    __syncthreads();
    if (threadIdx.x == 0) last = klast_arrival((unsigned int*)a.count + blockIdx.x, gridDim.y);
    __syncthreads();
    if (!last) return;
    if (threadIdx.x < TX * VW && n < a.n) {
      s = 0.0f;
      for (unsigned int y = 0; y < gridDim.y; y++) s += __ldcg(sums + (long long)y * a.n + n);
    }
  }
  if (threadIdx.x < TX * VW && n < a.n) kstore_out(a, n, s);
}
#endif
