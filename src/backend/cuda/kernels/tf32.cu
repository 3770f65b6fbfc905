// F32 products on the tensor cores in TF32 (`mma.sync` m16n8k8, F32 accumulation) under
// allow_tf32: out[M, N] = A[M, K] · B (+ bias[n], then ReLU or GELU when asked). After the
// prelude, the argument struct and the #defines of `tf32.rs`: NAME, and B_KN where B is stored
// [K, N] (N contiguous; else [N, K], K contiguous, a linear layer's weight).
//
// A block computes a 64 x 64 tile of the output over its piece of K (blockIdx.z of gridDim.z
// pieces), four warps of 32 x 32 each. The operands come through shared memory in chunks of
// 32 along K, STAGES chunks in flight (cp.async); values past M, N or the piece's end are read
// as zeros. Each value is rounded to TF32 (to nearest) as a fragment is loaded. Where K is split,
// the blocks leave their sums in `part` ([pieces][M][N] F32) and the last block of a tile to
// arrive adds them in piece order (the same bits on every run) before the epilogue.
#define BM 64
#define BN 64
#define BK 32
#define STAGES 3
// Row strides of the shared tiles, padded so that a warp's fragment loads hit 32 banks.
#define SA (BK + 4)
#ifdef B_KN
#define SB (BN + 8)
#define B_TILE (BK * SB)
#else
#define SB (BK + 4)
#define B_TILE (BN * SB)
#endif
#define A_TILE (BM * SA)
// Row stride of the output tile in shared memory (over the stages once the loop is done).
#define SC (BN + 4)

__device__ __forceinline__ void kcp16(float* smem, const float* g, bool pred) {
  const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(s), "l"(g), "r"(pred ? 16 : 0) : "memory");
}
__device__ __forceinline__ unsigned int ktf32(float f) {
  unsigned int r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(f));
  return r;
}

// A thread's share of loading one operand's chunks into their stages: four 16-byte vectors,
// vector j of chunk c from `src + c * chunk + j * jump` into `dst + j * dst_jump` of the stage.
// Its index along K is `k0 + c * BK + j * k_jump`; bit j of `live`: its row (or columns) of
// the tile lie inside the matrix. Addresses are computed once, not per chunk.
struct KLoader {
  const float* src;
  long long jump, chunk, k0;
  int dst, dst_jump, k_jump;
  unsigned int live;
};

__device__ __forceinline__ void kload(const KLoader& l, float* stage, int c, long long ke) {
#pragma unroll
  for (int j = 0; j < 4; j++) {
    const bool ok = ((l.live >> j) & 1) && l.k0 + (long long)c * BK + j * l.k_jump < ke;
    kcp16(stage + l.dst + j * l.dst_jump, ok ? l.src + c * l.chunk + j * l.jump : l.src, ok);
  }
}

// The loader of a [rows, K] operand (K contiguous, rows `ld` apart; A, or B stored [N, K]) for
// the tile's rows r0.. of `rows` (both such tiles have rows SA apart): thread x takes row
// x / 8 + 16 j, columns (x % 8) * 4...
__device__ __forceinline__ KLoader krows_loader(const float* m, long long ld, long long r0, long long rows, long long kb) {
  const int r = threadIdx.x / (BK / 4), c = (threadIdx.x % (BK / 4)) * 4;
  KLoader l;
  l.src = m + (r0 + r) * ld + kb + c;
  l.jump = 16 * ld;
  l.chunk = BK;
  l.k0 = kb + c;
  l.dst = r * SA + c;
  l.dst_jump = 16 * SA;
  l.k_jump = 0;
  l.live = 0;
#pragma unroll
  for (int j = 0; j < 4; j++) l.live |= (r0 + r + 16 * j < rows ? 1u : 0u) << j;
  return l;
}

#ifdef B_KN
// The loader of B stored [K, N] (N contiguous, rows `ldb` apart) for the tile's columns n0..:
// thread x takes row x / 16 + 8 j of the chunk, columns n0 + (x % 16) * 4...
__device__ __forceinline__ KLoader kcols_loader(const float* b, long long ldb, long long n0, long long n, long long kb) {
  const int r = threadIdx.x / (BN / 4), c = (threadIdx.x % (BN / 4)) * 4;
  KLoader l;
  l.src = b + (kb + r) * ldb + n0 + c;
  l.jump = 8 * ldb;
  l.chunk = BK * ldb;
  l.k0 = kb + r;
  l.dst = r * SB + c;
  l.dst_jump = 8 * SB;
  l.k_jump = 8;
  l.live = n0 + c < n ? 0xfu : 0u;
  return l;
}
#endif

__device__ __forceinline__ float kepilogue(const Tf32Args& a, long long n, float v) {
  if (a.bias) v += ((const float*)a.bias)[n];
  if (a.act == 1) v = fmaxf(v, 0.0f);
  else if (a.act == 2) v = KGELU_TANH(v);
  return v;
}

extern "C" __global__ void __launch_bounds__(128) NAME(const Tf32Args a) {
  KILN_WAIT_UNLESS_SETTLED(a.settled);
  extern __shared__ __align__(16) float ksm[];
  float* As = ksm;
  float* Bs = ksm + STAGES * A_TILE;
  __shared__ bool last;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
  const int wm = (warp >> 1) * 32, wn = (warp & 1) * 32;
  const long long m0 = (long long)blockIdx.y * BM, n0 = (long long)blockIdx.x * BN;
  // This block's piece of K: whole chunks, the last piece taking what is left.
  const long long kb = (long long)blockIdx.z * a.per, ke = min(a.k, kb + a.per);
  const int chunks = (int)((ke - kb + BK - 1) / BK);
  const KLoader la = krows_loader((const float*)a.a, a.lda, m0, a.m, kb);
#ifdef B_KN
  const KLoader lb = kcols_loader((const float*)a.b, a.ldb, n0, a.n, kb);
#else
  const KLoader lb = krows_loader((const float*)a.b, a.ldb, n0, a.n, kb);
#endif
  // The first stages: B (a settled weight: before the wait for the kernel before), then A.
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++)
    if (s < chunks) kload(lb, Bs + s * B_TILE, s, ke);
  KILN_WAIT_IF_SETTLED(a.settled);
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < chunks) kload(la, As + s * A_TILE, s, ke);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  float acc[2][4][4];
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[i][j][e] = 0.0f;
  // The stages of chunk c and of chunk c + STAGES - 1, counted round (no division per chunk).
  int stage = 0, ahead = STAGES - 1;
  for (int c = 0; c < chunks; c++) {
    asm volatile("cp.async.wait_group %0;" :: "n"(STAGES - 2) : "memory");
    __syncthreads();
    // The chunk STAGES - 1 ahead, into the stage every warp has finished with.
    const int next = c + STAGES - 1;
    if (next < chunks) {
      kload(la, As + ahead * A_TILE, next, ke);
      kload(lb, Bs + ahead * B_TILE, next, ke);
    }
    asm volatile("cp.async.commit_group;" ::: "memory");
    const float* as = As + stage * A_TILE;
    const float* bs = Bs + stage * B_TILE;
    stage = stage == STAGES - 1 ? 0 : stage + 1;
    ahead = ahead == STAGES - 1 ? 0 : ahead + 1;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 8) {
      unsigned int af[2][4], bf[4][2];
#pragma unroll
      for (int i = 0; i < 2; i++) {
        const float* p = as + (wm + i * 16 + g) * SA + kk + t;
        af[i][0] = ktf32(p[0]);
        af[i][1] = ktf32(p[8 * SA]);
        af[i][2] = ktf32(p[4]);
        af[i][3] = ktf32(p[8 * SA + 4]);
      }
#pragma unroll
      for (int j = 0; j < 4; j++) {
#ifdef B_KN
        const float* p = bs + (kk + t) * SB + wn + j * 8 + g;
        bf[j][0] = ktf32(p[0]);
        bf[j][1] = ktf32(p[4 * SB]);
#else
        const float* p = bs + (wn + j * 8 + g) * SB + kk + t;
        bf[j][0] = ktf32(p[0]);
        bf[j][1] = ktf32(p[4]);
#endif
      }
#pragma unroll
      for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
          asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
                       : "+f"(acc[i][j][0]), "+f"(acc[i][j][1]), "+f"(acc[i][j][2]), "+f"(acc[i][j][3])
                       : "r"(af[i][0]), "r"(af[i][1]), "r"(af[i][2]), "r"(af[i][3]), "r"(bf[j][0]), "r"(bf[j][1]));
    }
  }
  asm volatile("cp.async.wait_group 0;" ::: "memory");
  // The tile through shared memory (the stages are free once every warp is done with them),
  // then stored by loops over its elements, a row's columns by adjacent threads: unrolled
  // over each thread's 32 outputs, the split fix-up and the epilogue took 10,000 instructions,
  // and their fetch stalled every warp.
  __syncthreads();
  float* Cs = ksm;
#pragma unroll
  for (int i = 0; i < 2; i++)
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
      for (int e = 0; e < 4; e++) Cs[(wm + i * 16 + g + (e >> 1) * 8) * SC + wn + j * 8 + 2 * t + (e & 1)] = acc[i][j][e];
  __syncthreads();
  const int rows = (int)min((long long)BM, a.m - m0), cols = (int)min((long long)BN, a.n - n0);
  if (gridDim.z > 1) {
    const float* part = (const float*)a.part;
    float* mine = (float*)a.part + (long long)blockIdx.z * a.m * a.n;
#pragma unroll 4
    for (int v = threadIdx.x; v < BM * BN; v += 128) {
      const int r = v / BN, c = v % BN;
      if (r < rows && c < cols) mine[(m0 + r) * a.n + n0 + c] = Cs[r * SC + c];
    }
    __syncthreads();
    if (threadIdx.x == 0) last = klast_arrival((unsigned int*)a.count + blockIdx.y * gridDim.x + blockIdx.x, gridDim.z);
    __syncthreads();
    if (!last) return;
    // Eight outputs a thread at a time, their pieces loaded together: one output at a time,
    // each load waited for in turn, this tail outlasted the product.
    for (int v0 = threadIdx.x; v0 < BM * BN; v0 += 128 * 8) {
      float sum[8];
#pragma unroll
      for (int u = 0; u < 8; u++) sum[u] = 0.0f;
      for (unsigned int z = 0; z < gridDim.z; z++) {
        const float* pz = part + ((long long)z * a.m + m0) * a.n + n0;
#pragma unroll
        for (int u = 0; u < 8; u++) {
          const int v = v0 + 128 * u, r = v / BN, c = v % BN;
          if (r < rows && c < cols) sum[u] += __ldcg(pz + (long long)r * a.n + c);
        }
      }
#pragma unroll
      for (int u = 0; u < 8; u++) {
        const int v = v0 + 128 * u;
        Cs[(v / BN) * SC + v % BN] = sum[u];
      }
    }
  }
  float* out = (float*)a.out;
  for (int v = threadIdx.x; v < BM * BN; v += 128) {
    const int r = v / BN, c = v % BN;
    if (r < rows && c < cols) out[(m0 + r) * a.n + n0 + c] = kepilogue(a, n0 + c, Cs[r * SC + c]);
  }
}
