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

// The kernel's parameters: the product's arguments, then a row kernel's words (GEMV_ROW) and a
// cache attention's arguments (GEMV_ATTEND) where the kernel runs those.
#if defined(GEMV_ROW) || defined(GEMV_ATTEND)
struct GemvParams {
  GemvArgs g;
#ifdef GEMV_ROW
  LaunchArgs r;
#endif
#ifdef GEMV_ATTEND
  AttendArgs t;
#endif
};
#define KPARAMS const GemvParams ka
#define KARGS ka.g
#define KBIND const GemvArgs& a = ka.g;
#else
#define KPARAMS const GemvArgs a
#define KARGS a
#define KBIND
#endif

#ifdef GEMV_ROW
// The row computed first by a row kernel (`fused.rs`, `RowMode::Prologue`: a decode step's
// layer norm), named by GEMV_ROW, of GEMV_ROW_K elements: after the wait for the kernel before,
// every block computes it into its own shared memory and reads it from there; the first block
// alone stores the row kernel's other outputs (the residual sum a later layer norm reads).
#define KROW(row) \
  __shared__ __align__(16) T ksrow[GEMV_ROW_K]; \
  GEMV_ROW(ka.r, ksrow, blockIdx.x == 0 && blockIdx.y == 0); \
  __syncthreads(); \
  row = ksrow;
#else
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

#ifdef GEMV_ATTEND
// A decode step's cache attention run by the query, key and value product (`gemv.rs`,
// `Attend`): the product's output holds each head's query, new key and new value row; the block
// whose columns complete a query head's 3 * ATT_D (the arrival counters `t.count`, one per
// query head) attends that head's query over the cache's keys 0..=last, the new key and value
// at `last` read from the product. Numbers as the cache attention's own kernel
// (`attention_warp.cu`, ATTN_FWD_UP_TO) for one chunk of keys: a thread per key, scores in F32
// scaled after the product, each warp's share of the values summed in key order, the warps in
// order, the new value row added last.
#define ATT_NT (32 * WARPS)
#define ATT_NEG_INF __int_as_float(0xff800000)
// Keys per pass: the chunk's value rows stay in shared memory.
#define ATT_CH (ATT_NT < 32768 / (ATT_D * (int)sizeof(T)) ? ATT_NT : 32768 / (ATT_D * (int)sizeof(T)))
#define ATT_PER ((ATT_D + 31) / 32)
// Most (section, head) pieces one block's columns hold.
#define ATT_MAX_PIECES 64
struct __align__(16) KAttVec { T v[VW]; };

__device__ __forceinline__ long long kfloor_div(long long a, long long b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

// Head h's attention into t.att[h * ATT_D ..], by the whole block.
__device__ void kattend_head(const GemvArgs& a, const AttendArgs& t, long long h) {
  __shared__ float Qs[ATT_D], Kn[ATT_D], Vn[ATT_D], P[ATT_CH], red[WARPS];
  __shared__ __align__(16) T Vs[ATT_CH][ATT_D];
  __shared__ float Os[WARPS][ATT_D];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const T* prod = (const T*)a.out;
  T* att = (T*)t.att + h * ATT_D;
  const long long hk = h / t.kv_group;
  const long long last = *(const long long*)t.last;
  const long long seen = last < 0 ? 0 : min(t.seq, last + 1);
  if (seen == 0) {
    // No key: the NaN row of a fully masked softmax.
    for (int d = threadIdx.x; d < ATT_D; d += ATT_NT) att[d] = ST(__int_as_float(0x7fc00000));
    return;
  }
  // The query and the new rows, written by other blocks of this grid: read past L1.
  for (int d = threadIdx.x; d < ATT_D; d += ATT_NT) {
    Qs[d] = LD(__ldcg(prod + t.q_off + h * t.q_hs + d));
    Kn[d] = LD(__ldcg(prod + t.k_off + hk * t.k_hs + d));
    Vn[d] = LD(__ldcg(prod + t.v_off + hk * t.v_hs + d));
  }
  const T* kc = (const T*)t.kc + hk * t.kc_h;
  const T* vc = (const T*)t.vc + hk * t.vc_h;
  float M = ATT_NEG_INF, L = 0.f, acc[ATT_PER];
#pragma unroll
  for (int j = 0; j < ATT_PER; j++) acc[j] = 0.f;
  for (long long s0 = 0; s0 < seen; s0 += ATT_CH) {
    const long long s1 = min(seen, s0 + ATT_CH), key = s0 + threadIdx.x;
    const bool mine = threadIdx.x < ATT_CH && key < s1, cached = mine && key != last;
    // This thread's key and value rows (the new ones at `last`: the value row left 0 here).
    KAttVec kv[ATT_D / VW];
    if (cached) {
#pragma unroll
      for (int j = 0; j < ATT_D / VW; j++) {
        kv[j] = *(const KAttVec*)(kc + key * t.kc_s + j * VW);
        *(KAttVec*)&Vs[threadIdx.x][j * VW] = *(const KAttVec*)(vc + key * t.vc_s + j * VW);
      }
    } else if (mine) {
#pragma unroll
      for (int j = 0; j < ATT_D / VW; j++) *(uint4*)&Vs[threadIdx.x][j * VW] = make_uint4(0, 0, 0, 0);
    }
    __syncthreads();
    float sc = ATT_NEG_INF;
    if (mine) {
      float dot = 0.f;
      if (!cached) {
        for (int d = 0; d < ATT_D; d++) dot += Qs[d] * Kn[d];
      } else {
#pragma unroll
        for (int j = 0; j < ATT_D / VW; j++)
#pragma unroll
          for (int e = 0; e < VW; e++) dot += Qs[j * VW + e] * LD(kv[j].v[e]);
      }
      sc = dot * (float)t.scale;
    }
    float m = sc;
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) red[warp] = m;
    __syncthreads();
    m = red[0];
    for (int w = 1; w < WARPS; w++) m = fmaxf(m, red[w]);
    __syncthreads();
    const float p = mine ? expf(sc - m) : 0.f;
    if (threadIdx.x < ATT_CH) P[threadIdx.x] = p;
    float ws = p;
    for (int o = 16; o; o >>= 1) ws += __shfl_xor_sync(0xffffffffu, ws, o);
    if (lane == 0) red[warp] = ws;
    __syncthreads();
    float l = 0.f;
    for (int w = 0; w < WARPS; w++) l += red[w];
    // This warp's keys warp, warp + WARPS, ... of the chunk, for features lane, lane + 32, ...
    float part[ATT_PER];
#pragma unroll
    for (int j = 0; j < ATT_PER; j++) part[j] = 0.f;
    for (long long s = s0 + warp; s < s1; s += WARPS) {
      const float ps = P[s - s0];
#pragma unroll
      for (int j = 0; j < ATT_PER; j++) {
        const int d = lane + 32 * j;
        if (d < ATT_D) part[j] += ps * LD(Vs[s - s0][d]);
      }
    }
#pragma unroll
    for (int j = 0; j < ATT_PER; j++) if (lane + 32 * j < ATT_D) Os[warp][lane + 32 * j] = part[j];
    __syncthreads();
    // The chunk's output (the new value row's share where it falls here), merged into the
    // running one: this thread's features.
    const bool here = last >= s0 && last < s1;
    const float pnew = here ? P[last - s0] : 0.f;
    const float nm = fmaxf(M, m), old = M == ATT_NEG_INF ? 0.f : expf(M - nm), now = expf(m - nm);
#pragma unroll
    for (int j = 0; j < ATT_PER; j++) {
      const int d = threadIdx.x + ATT_NT * j;
      if (d < ATT_D) {
        float o = 0.f;
        for (int w = 0; w < WARPS; w++) o += Os[w][d];
        if (here) o += pnew * Vn[d];
        acc[j] = s0 == 0 ? o : acc[j] * old + o * now;
      }
    }
    L = s0 == 0 ? l : L * old + l * now;
    M = s0 == 0 ? m : nm;
    __syncthreads();
  }
#pragma unroll
  for (int j = 0; j < ATT_PER; j++) {
    const int d = threadIdx.x + ATT_NT * j;
    if (d < ATT_D) att[d] = ST(acc[j] / L);
  }
}

// The cache rows head attentions of this launch will read, fetched into L2 by the whole grid
// once its matrix loads are issued (a line per thread at a time); `last` is read here only where no kernel still
// running writes it (`t.settled`) or the kernel before has ended (`waited`).
__device__ __forceinline__ void kattend_prefetch(const AttendArgs& t, bool waited) {
  if (!t.settled && !waited) return;
  const long long last = *(const long long*)t.last;
  const long long seen = last < 0 ? 0 : min(t.seq, last + 1);
  const long long kvh = t.heads / t.kv_group, lines = (ATT_D * (long long)sizeof(T) + 127) / 128;
  const long long total = 2 * kvh * seen * lines, threads = (long long)gridDim.x * gridDim.y * ATT_NT;
  for (long long i = ((long long)blockIdx.y * gridDim.x + blockIdx.x) * ATT_NT + threadIdx.x; i < total; i += threads) {
    const long long line = i % lines, r = i / lines, s = r % seen, hv = r / seen, hh = hv % kvh;
    const T* row = hv < kvh ? (const T*)t.kc + s * t.kc_s + hh * t.kc_h : (const T*)t.vc + s * t.vc_s + hh * t.vc_h;
    asm volatile("prefetch.global.L2 [%0];" :: "l"((const char*)row + line * 128));
  }
}

// After this block stored its columns [c0, c1) of the product: each query head whose query,
// key or value columns among them it counts in, and the heads it completes, attended. Called
// by every thread of the block.
__device__ void kattend_arrivals(const GemvArgs& a, const AttendArgs& t) {
  __shared__ long long pieces[ATT_MAX_PIECES][2];
  __shared__ int npieces, ndone;
  __shared__ long long done[ATT_MAX_PIECES];
  __syncthreads();
  if (threadIdx.x == 0) {
    const long long c0 = (long long)blockIdx.x * TX * VW, c1 = min(a.n, c0 + TX * VW);
    const long long off[3] = {t.q_off, t.k_off, t.v_off}, hs[3] = {t.q_hs, t.k_hs, t.v_hs};
    const long long kvh = t.heads / t.kv_group, nh[3] = {t.heads, kvh, kvh};
    int np = 0;
    for (int sec = 0; sec < 3; sec++) {
      // The section's heads whose D columns from off + hh * hs meet [c0, c1).
      const long long lo = nh[sec] == 1 ? 0 : max(0ll, kfloor_div(c0 - off[sec] - ATT_D, hs[sec]) + 1);
      const long long hi = nh[sec] == 1 ? 0 : min(nh[sec] - 1, kfloor_div(c1 - 1 - off[sec], hs[sec]));
      for (long long hh = lo; hh <= hi; hh++) {
        const long long b0 = off[sec] + hh * hs[sec], got = min(c1, b0 + ATT_D) - max(c0, b0);
        if (got <= 0) continue;
        // A key or value head serves kv_group query heads.
        const long long q0 = sec == 0 ? hh : hh * t.kv_group, q1 = sec == 0 ? hh + 1 : q0 + t.kv_group;
        for (long long qh = q0; qh < q1 && np < ATT_MAX_PIECES; qh++) { pieces[np][0] = qh; pieces[np][1] = got; np++; }
      }
    }
    npieces = np;
    ndone = 0;
  }
  __syncthreads();
  // (the stores above this block's __syncthreads; each arrival releases them, and the one that
  // completes a head acquires every other block's)
  if (threadIdx.x < npieces) {
    const long long qh = pieces[threadIdx.x][0];
    const unsigned int got = (unsigned int)pieces[threadIdx.x][1];
    unsigned int* count = (unsigned int*)t.count + qh;
    unsigned int before;
    asm volatile("atom.acq_rel.gpu.global.add.u32 %0, [%1], %2;" : "=r"(before) : "l"(count), "r"(got) : "memory");
    if (before + got == 3u * ATT_D) {
      *count = 0;
      done[atomicAdd(&ndone, 1)] = qh;
    }
  }
  __syncthreads();
  for (int i = 0; i < ndone; i++) kattend_head(a, t, done[i]);
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
#ifdef GEMV_ATTEND
  // (after the matrix's loads are issued)
  kattend_prefetch(ka.t, !a.settled);
#endif
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
#ifdef GEMV_ATTEND
  // (after the matrix's loads are issued)
  kattend_prefetch(ka.t, !a.settled);
#endif
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
#ifdef GEMV_ATTEND
  kattend_arrivals(a, ka.t);
#endif
}
#endif
