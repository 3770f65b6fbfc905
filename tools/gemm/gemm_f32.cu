// F32 matrix product on CUDA cores: C[b] = A[b] B[b] (+ bias, then ReLU), row-major C.
// A block computes a BM x BN tile of C, each thread TM x TN of it (in 4 x 4 pieces spread over
// the tile, so shared-memory reads of a warp hit distinct banks), walking K in steps of BK
// through two shared-memory buffers: the next step's global loads are in flight while this
// step's products run.
//
// A product with few output tiles (a few hundred rows) leaves most multiprocessors idle, so K
// may be split over gridDim.z: each split writes its partial tile to `ws`, and the last split
// of a tile to finish (an atomic counter) adds the partials in split order and writes C. The
// sum order is fixed, so results do not depend on which split finishes last.
//
// Set before this file: BM BN BK TM TN (tile), TA / TB (A read as A[k * lda + m], B as
// B[n * ldb + k]), VA / VB (4-float loads along the contiguous dim of A / B: leading dims,
// batch strides and that dim's size multiples of 4, bases 16-byte aligned), EPI (0 none,
// 1 bias, 2 bias then ReLU), KNAME, and the KArgs struct.
//
// Argument words: 0 A, 1 B, 2 C, 3 bias, 4 ws (splits > 1), 5 counters (splits > 1), 6 M,
// 7 N, 8 K, 9 lda, 10 ldb, 11 A's batch stride, 12 B's batch stride, 13 K per split (a
// multiple of BK), 14 splits.

#define NTX (BN / TN)
#define NT ((BM / TM) * NTX)
#define VWA (VA ? 4 : 1)
#define VWB (VB ? 4 : 1)
// Loads per thread per K step (the tile configurations make these whole numbers).
#define LA (BM * BK / (NT * VWA))
#define LB (BK * BN / (NT * VWB))

// Where load `i` of a thread reads in a tile of TILE positions along M or N (`mn`) by BK along
// K, VW floats along the operand's contiguous dim: along M/N when MNC, else along K.
template <int TILE, int VW, int MNC>
__device__ __forceinline__ void tile_pos(int i, int& mn, int& k) {
  if (MNC) {
    k = i / (TILE / VW);
    mn = (i % (TILE / VW)) * VW;
  } else {
    mn = i / (BK / VW);
    k = (i % (BK / VW)) * VW;
  }
}

// Global -> registers: one operand's tile of the K step at k0, L loads of VW floats per thread,
// zeros outside the matrix (`lim` positions along M/N, K up to `kend`). Element (mn, k) is at
// P[k * ld + mn] when MNC (contiguous along M/N), else at P[mn * ld + k].
template <int TILE, int L, int VW, int MNC>
__device__ __forceinline__ void load_tile(const float* __restrict__ P, long long ld, int mn0, int lim, int k0, int kend, int tid, float* r) {
#pragma unroll
  for (int l = 0; l < L; l++) {
    int mn, k;
    tile_pos<TILE, VW, MNC>(tid + l * NT, mn, k);
    int gmn = mn0 + mn, gk = k0 + k;
    bool in = gk < kend && gmn < lim;
    const float* at = MNC ? P + gk * ld + gmn : P + gmn * ld + gk;
    if (VW == 4) {
      float4 v = in ? *(const float4*)at : make_float4(0.f, 0.f, 0.f, 0.f);
      r[4 * l] = v.x; r[4 * l + 1] = v.y; r[4 * l + 2] = v.z; r[4 * l + 3] = v.w;
    } else {
      r[l] = in ? *at : 0.f;
    }
  }
}

// Registers -> shared memory: the tile stored [k][mn].
template <int TILE, int L, int VW, int MNC>
__device__ __forceinline__ void store_tile(float (*S)[TILE + 4], int tid, const float* r) {
#pragma unroll
  for (int l = 0; l < L; l++) {
    int mn, k;
    tile_pos<TILE, VW, MNC>(tid + l * NT, mn, k);
#pragma unroll
    for (int j = 0; j < VW; j++) {
      if (MNC) S[k][mn + j] = r[VW * l + j];
      else S[k + j][mn] = r[VW * l + j];
    }
  }
}

extern "C" __global__ void __launch_bounds__(NT) KNAME(const KArgs a) {
  const float* __restrict__ A = (const float*)a.w[0];
  const float* __restrict__ B = (const float*)a.w[1];
  float* C = (float*)a.w[2];
  const float* bias = (const float*)a.w[3];
  (void)bias;
  float* ws = (float*)a.w[4];
  unsigned int* counters = (unsigned int*)a.w[5];
  const int M = (int)a.w[6], N = (int)a.w[7], K = (int)a.w[8];
  const long long lda = (long long)a.w[9], ldb = (long long)a.w[10];
  const int kper = (int)a.w[13], splits = (int)a.w[14];
  const int bz = blockIdx.z / splits, sp = blockIdx.z - bz * splits;
  A += bz * (long long)a.w[11];
  B += bz * (long long)a.w[12];
  const int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
  const int kbeg = sp * kper, kend = min(K, kbeg + kper);
  const int tid = threadIdx.x, tx = tid % NTX, ty = tid / NTX;

  __shared__ __align__(16) float As[2][BK][BM + 4];
  __shared__ __align__(16) float Bs[2][BK][BN + 4];
  float ra[LA * VWA], rb[LB * VWB];

  // Global -> registers: the A and B tiles of the K step at k0; registers -> shared memory
  // buffer `s`. A is contiguous along M when TA, B along N unless TB.
  auto load = [&](int k0) {
    load_tile<BM, LA, VWA, TA>(A, lda, m0, M, k0, kend, tid, ra);
    load_tile<BN, LB, VWB, !TB>(B, ldb, n0, N, k0, kend, tid, rb);
  };
  auto store = [&](int s) {
    store_tile<BM, LA, VWA, TA>(As[s], tid, ra);
    store_tile<BN, LB, VWB, !TB>(Bs[s], tid, rb);
  };

  float acc[TM][TN];
#pragma unroll
  for (int i = 0; i < TM; i++)
#pragma unroll
    for (int j = 0; j < TN; j++) acc[i][j] = 0.f;

  int cur = 0;
  if (kbeg < kend) {
    load(kbeg);
    store(0);
  }
  __syncthreads();
  for (int k0 = kbeg; k0 < kend; k0 += BK) {
    const bool more = k0 + BK < kend;
    if (more) load(k0 + BK);
#pragma unroll
    for (int k = 0; k < BK; k++) {
      float x[TM], y[TN];
#pragma unroll
      for (int i = 0; i < TM / 4; i++) {
        float4 v = *(const float4*)&As[cur][k][i * (BM / (TM / 4)) + ty * 4];
        x[4 * i] = v.x; x[4 * i + 1] = v.y; x[4 * i + 2] = v.z; x[4 * i + 3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < TN / 4; j++) {
        float4 v = *(const float4*)&Bs[cur][k][j * (BN / (TN / 4)) + tx * 4];
        y[4 * j] = v.x; y[4 * j + 1] = v.y; y[4 * j + 2] = v.z; y[4 * j + 3] = v.w;
      }
#pragma unroll
      for (int i = 0; i < TM; i++)
#pragma unroll
        for (int j = 0; j < TN; j++) acc[i][j] = fmaf(x[i], y[j], acc[i][j]);
    }
    if (more) store(cur ^ 1);
    __syncthreads();
    cur ^= 1;
  }

  // Row i, column j of this thread's outputs.
#define ROW(i) (m0 + ((i) / 4) * (BM / (TM / 4)) + ty * 4 + ((i) % 4))
#define COL(j) (n0 + ((j) / 4) * (BN / (TN / 4)) + tx * 4 + ((j) % 4))
  const long long plane = (long long)M * N;
  // Calls f(offset in a plane of C, column, value) for each of this thread's outputs inside C.
  auto each_output = [&](auto f) {
#pragma unroll
    for (int i = 0; i < TM; i++) {
      int r = ROW(i);
      if (r >= M) continue;
#pragma unroll
      for (int j = 0; j < TN; j++) {
        int c = COL(j);
        if (c < N) f((long long)r * N + c, c, acc[i][j]);
      }
    }
  };
  if (splits > 1) {
    float* part = ws + ((long long)bz * splits + sp) * plane;
    each_output([&](long long at, int, float v) { part[at] = v; });
    __shared__ int last;
    __threadfence();
    __syncthreads();
    unsigned int* ctr = counters + ((long long)bz * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (tid == 0) last = atomicAdd(ctr, 1u) == (unsigned int)(splits - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    const float* p0 = ws + (long long)bz * splits * plane;
#pragma unroll
    for (int i = 0; i < TM; i++) {
      int r = ROW(i);
#pragma unroll
      for (int j = 0; j < TN; j++) {
        int c = COL(j);
        float s = 0.f;
        if (r < M && c < N)
          for (int q = 0; q < splits; q++) s += __ldcg(p0 + q * plane + (long long)r * N + c);
        acc[i][j] = s;
      }
    }
    if (tid == 0) *ctr = 0u;
  }
  float* out = C + bz * plane;
  each_output([&](long long at, int c, float v) {
    (void)c;
#if EPI >= 1
    v += bias[c];
#endif
#if EPI == 2
    v = fmaxf(v, 0.f);
#endif
    out[at] = v;
  });
}
