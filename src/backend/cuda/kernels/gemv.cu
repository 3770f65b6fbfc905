// Matrix-vector products out[n] = x · W(:, n) (+ bias[n], then ReLU or GELU when asked), F32
// accumulation. After the prelude, the argument struct and the #defines of `gemv.rs`: T (storage
// type), VW (elements per 16-byte vector), LD/ST (element load and store as float), and one of
// GEMV_ROWS (W read as [N, K] rows, K contiguous) or GEMV_COLS (W read as [K, N], N contiguous,
// LANES vectors of columns per block, K split over SPLIT blocks, RPT rows per thread where a
// block's rows are few enough).

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

__device__ __forceinline__ void kstore_out(const GemvArgs& a, long long n, float acc) {
  if (a.bias) acc += LD(((const T*)a.bias)[n]);
  if (a.act == 1) acc = fmaxf(acc, 0.0f);
  else if (a.act == 2) acc = KGELU_TANH(acc);
  ((T*)a.out)[n] = ST(acc);
}

#ifdef GEMV_ROWS
// One warp per output: its lanes walk the row and x in 16-byte vectors, then sum by shuffles.
extern "C" __global__ void __launch_bounds__(32 * WARPS) NAME(const GemvArgs a) {
  KILN_AFTER_PREVIOUS();
  const int lane = threadIdx.x & 31;
  const long long n = (long long)blockIdx.x * WARPS + (threadIdx.x >> 5);
  if (n >= a.n) return;
  const uint4* x = (const uint4*)a.x;
  const uint4* w = (const uint4*)((const T*)a.w + n * a.ldw);
  const long long vectors = a.k / VW;
  float acc = 0.0f;
#pragma unroll 4
  for (long long v = lane; v < vectors; v += 32) {
    float xf[VW], wf[VW];
    kunpack(x[v], xf);
    kunpack(kstream(w + v), wf);
#pragma unroll
    for (int j = 0; j < VW; j++) acc = fmaf(xf[j], wf[j], acc);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) kstore_out(a, n, acc);
}
#endif

#ifdef GEMV_COLS
// A block owns a strip of LANES * VW columns and the rows [rank * per, + per) of K, where rank
// is its place among the SPLIT blocks of its strip: LANES adjacent lanes read one row's strip
// (LANES * 16 contiguous bytes), a warp's 32 / LANES lane groups and the WARPS warps take rows
// in turn. The partial sums meet by shuffles inside a warp, then in shared memory across warps;
// where K is split, a strip's blocks form a thread block cluster and add their sums through
// distributed shared memory in rank order (the same bits on every run), each block finishing
// SPLIT-th of the strip's columns.
#define RW (32 / LANES)
#define STRIP (LANES * VW)
#if SPLIT > 1
#if __CUDA_ARCH__ < 900
#error "a split K needs thread block clusters (compute capability 9.0)"
#endif
#define KCLUSTER __cluster_dims__(SPLIT, 1, 1)
// Every thread of every block of the cluster arrives; shared memory written before is visible
// to the cluster's blocks after.
__device__ __forceinline__ void kcluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The float at `p` in the shared memory of block `rank` of this cluster.
__device__ __forceinline__ float kcluster_load(const float* p, unsigned int rank) {
  const unsigned int local = (unsigned int)__cvta_generic_to_shared(p);
  unsigned int remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
  return v;
}
#else
#define KCLUSTER
#endif
extern "C" __global__ void KCLUSTER __launch_bounds__(32 * WARPS) NAME(const GemvArgs a) {
  KILN_WAIT_UNLESS_SETTLED(a.settled);
  __shared__ float part[WARPS][STRIP];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lx = lane % LANES, ly = lane / LANES;
  const unsigned int rank = blockIdx.x % SPLIT;
  const long long strip = blockIdx.x / SPLIT;
  const long long col = (strip * LANES + lx) * VW;
  const bool live = col < a.n;
  const long long r0 = (long long)rank * a.per, r1 = min(a.k, r0 + a.per);
  const long long first = r0 + (long long)warp * RW + ly;
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
    const long long r = first + (long long)i * WARPS * RW;
    q[i] = live && r < r1 ? kstream((const uint4*)(w + r * a.ldw)) : make_uint4(0, 0, 0, 0);
  }
  KILN_WAIT_IF_SETTLED(a.settled);
#pragma unroll
  for (int i = 0; i < RPT; i++) {
    const long long r = first + (long long)i * WARPS * RW;
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
  if (live) {
#pragma unroll 4
    for (long long r = first; r < r1; r += WARPS * RW) {
      float wf[VW];
      kunpack(kstream((const uint4*)(w + r * a.ldw)), wf);
      const float xr = LD(x[r]);
#pragma unroll
      for (int j = 0; j < VW; j++) acc[j] = fmaf(xr, wf[j], acc[j]);
    }
  }
#endif
  // Lanes of the same columns (lx) differ in ly, the bits of the lane above LANES.
#pragma unroll
  for (int j = 0; j < VW; j++) {
#pragma unroll
    for (int o = 16; o >= LANES; o >>= 1) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], o);
  }
  if (ly == 0) {
#pragma unroll
    for (int j = 0; j < VW; j++) part[warp][lx * VW + j] = acc[j];
  }
  __syncthreads();
  float s = 0.0f;
  if (threadIdx.x < STRIP) {
#pragma unroll
    for (int i = 0; i < WARPS; i++) s += part[i][threadIdx.x];
  }
#if SPLIT > 1
  __shared__ float sums[STRIP];
  if (threadIdx.x < STRIP) sums[threadIdx.x] = s;
  kcluster_sync();
  if (threadIdx.x < STRIP / SPLIT) {
    const int c = rank * (STRIP / SPLIT) + threadIdx.x;
    s = 0.0f;
    for (unsigned int b = 0; b < SPLIT; b++) s += kcluster_load(sums + c, b);
    const long long n = strip * STRIP + c;
    if (n < a.n) kstore_out(a, n, s);
  }
  // No block leaves (its shared memory with it) while another still reads its sums.
  kcluster_sync();
#else
  const long long n = strip * STRIP + threadIdx.x;
  if (threadIdx.x < STRIP && n < a.n) kstore_out(a, n, s);
#endif
}
#endif
