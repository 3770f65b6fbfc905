// The tensor-core attention kernels (F16 / BF16, head dims a multiple of 16), 16 query or key
// rows per warp. Placed after attention_common.cu (attention.rs: `tc_common`); defined before
// it, per kernel:
//   KT            rows per block and per shared-memory tile
//   TY            the PTX type of the inputs, "f16" or "bf16"
//   THREE_BLOCKS  1 where the kernel holds its registers to leave room for 3 blocks per SM
//   KNAME         the kernel's name
//   ATTN_FWD_TC, ATTN_BWD_Q_TC or ATTN_BWD_KV_TC: which kernel to compile (the last with
//                 WANT_DV and WANT_DK, 0 or 1: which gradients it computes)

#define KP (D_ + 8)
typedef unsigned int U;
#define TC_ARGS ARGS int tid = threadIdx.x, grp = lane >> 2, t = lane & 3; (void)msb; (void)msh; (void)msl; (void)mss;
__device__ __forceinline__ U pack2(float lo, float hi) { U r; asm("cvt.rn." TY "x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r; }
__device__ __forceinline__ float quad_sum(float x) { x += __shfl_xor_sync(FULL, x, 1); return x + __shfl_xor_sync(FULL, x, 2); }
__device__ __forceinline__ float quad_max(float x) { x = fmaxf(x, __shfl_xor_sync(FULL, x, 1)); return fmaxf(x, __shfl_xor_sync(FULL, x, 2)); }
__device__ __forceinline__ void mma(float* c, const U* a, U b0, U b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// A fragments of 16 rows (this thread's rows p0 and p1 = p0 + 8; zero where !ok).
__device__ __forceinline__ void load_rows(U (&fr)[D_ / 16][4], const T* p0, const T* p1, bool ok0, bool ok1, int t) {
  #pragma unroll
  for (int kk = 0; kk < D_ / 16; kk++) {
    fr[kk][0] = ok0 ? *(const U*)(p0 + 16 * kk + 2 * t) : 0u;
    fr[kk][1] = ok1 ? *(const U*)(p1 + 16 * kk + 2 * t) : 0u;
    fr[kk][2] = ok0 ? *(const U*)(p0 + 16 * kk + 2 * t + 8) : 0u;
    fr[kk][3] = ok1 ? *(const U*)(p1 + 16 * kk + 2 * t + 8) : 0u;
  }
}
// Queues rows row0 .. row0 + 63 (row r at base + r * rs + off, zeros past n) into a tile,
// 16 bytes per cp.async.
__device__ __forceinline__ void load_tile(T (*tile)[KP], const T* base, long long row0, long long n, long long rs, long long off, int tid) {
  for (int i = tid; i < KT * (D_ / 8); i += 128) {
    int j = i / (D_ / 8), c = i - j * (D_ / 8);
    long long r = row0 + j;
    const T* src = r < n ? base + r * rs + off + 8 * c : base;
    U dst = (U)__cvta_generic_to_shared(&tile[j][8 * c]);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(r < n ? 16 : 0) : "memory");
  }
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }
// Tiles in flight: two, the next one loading while the body computes (in dynamic shared memory:
// `launch_tc`).
#define STAGES 2
extern __shared__ __align__(16) unsigned char smem_[];
typedef T Tile[KT][KP];
// The tile loop: x0 walks start .. end in steps of KT, the body reads stage `cur`; the kernel
// defines LOADS(x, st), which queues the tile at x into stage st.
#define TILE_LOOP_BEGIN(start, end) \
  LOADS((start), 0); cp_commit(); \
  int it_ = 0; \
  for (long long x0 = (start); x0 < (end); x0 += KT, it_++) { \
    const int cur = it_ & 1; \
    if (x0 + KT < (end)) LOADS(x0 + KT, cur ^ 1); \
    cp_commit(); cp_wait<1>(); \
    __syncthreads();
#define TILE_LOOP_END \
    __syncthreads(); \
  }
// sc (16 x 64) = fragments (16 x D) times the tile's rows transposed (D x 64).
__device__ __forceinline__ void scores(float (&sc)[8][4], const U (&fr)[D_ / 16][4], const T (*tile)[KP], int grp, int t) {
  #pragma unroll
  for (int nb = 0; nb < 8; nb++) {
    sc[nb][0] = 0.f; sc[nb][1] = 0.f; sc[nb][2] = 0.f; sc[nb][3] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < D_ / 16; kk++)
      mma(sc[nb], fr[kk], *(const U*)&tile[8 * nb + grp][16 * kk + 2 * t], *(const U*)&tile[8 * nb + grp][16 * kk + 2 * t + 8]);
  }
}
// acc (16 x D) += p (16 x 64, rounded to T) times the tile (64 x D).
__device__ __forceinline__ void product_pv(float (&acc)[D_ / 8][4], const float (&p)[8][4], const T (*tile)[KP], int lane) {
  #pragma unroll
  for (int j = 0; j < 4; j++) {
    U pa[4] = {pack2(p[2 * j][0], p[2 * j][1]), pack2(p[2 * j][2], p[2 * j][3]), pack2(p[2 * j + 1][0], p[2 * j + 1][1]), pack2(p[2 * j + 1][2], p[2 * j + 1][3])};
    #pragma unroll
    for (int nb = 0; nb < D_ / 8; nb++) {
      U b0, b1, s = (U)__cvta_generic_to_shared(&tile[16 * j + (lane & 15)][8 * nb]);
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];" : "=r"(b0), "=r"(b1) : "r"(s));
      mma(acc[nb], pa, b0, b1);
    }
  }
}
// Scores of query rows r0, r1 against keys s0 .. s0 + 63: scaled, the mask added (at moff +
// row msl + key mss), -inf past S or above the diagonal when causal; with MAX, mx0 and mx1
// their row maxima over the tile.
template <bool MAX>
__device__ __forceinline__ void mask_scores(float (&sc)[8][4], const T* mk, long long moff, long long msl, long long mss, long long r0, long long r1, long long s0, long long L, long long S, float scale, int causal, int t, float& mx0, float& mx1) {
  mx0 = -INFINITY; mx1 = -INFINITY;
  // A tile of keys all inside S and (causal) all at or before this thread's first row, with no
  // mask: scaling is all there is to do.
  if (!mk && s0 + KT <= S && (!causal || s0 + KT - 1 <= r0)) {
    #pragma unroll
    for (int nb = 0; nb < 8; nb++) {
      sc[nb][0] *= scale; sc[nb][1] *= scale; sc[nb][2] *= scale; sc[nb][3] *= scale;
      if (MAX) { mx0 = fmaxf(mx0, fmaxf(sc[nb][0], sc[nb][1])); mx1 = fmaxf(mx1, fmaxf(sc[nb][2], sc[nb][3])); }
    }
    if (MAX) { mx0 = quad_max(mx0); mx1 = quad_max(mx1); }
    return;
  }
  #pragma unroll
  for (int nb = 0; nb < 8; nb++)
    #pragma unroll
    for (int e = 0; e < 4; e++) {
      long long row = e < 2 ? r0 : r1, col = s0 + 8 * nb + 2 * t + (e & 1);
      float x = sc[nb][e] * scale;
      if (col >= S || (causal && col > row)) x = -INFINITY;
      else if (mk && row < L) x += LD(mk[moff + row * msl + col * mss]);
      sc[nb][e] = x;
      if (MAX) { if (e < 2) mx0 = fmaxf(mx0, x); else mx1 = fmaxf(mx1, x); }
    }
  if (MAX) { mx0 = quad_max(mx0); mx1 = quad_max(mx1); }
}
// Zeroes an FP32 accumulator of N fragments.
template <int N> __device__ __forceinline__ void zero(float (&acc)[N][4]) {
  #pragma unroll
  for (int i = 0; i < N; i++) { acc[i][0] = 0.f; acc[i][1] = 0.f; acc[i][2] = 0.f; acc[i][3] = 0.f; }
}
// One tile of the online softmax for rows r0, r1 (tile maxima mx0, mx1): the running maxima m
// and sums l (per thread; summed over the quad at the end) take the tile in, sc becomes
// exp(score - new maximum), and corr0, corr1 rescale what was accumulated before. Rows with
// every score so far masked out use 0 as their maximum, so their sums and outputs stay zero.
__device__ __forceinline__ void online_softmax(float (&sc)[8][4], float mx0, float mx1, float& m0, float& m1, float& l0, float& l1, float& corr0, float& corr1) {
  float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
  float base0 = n0 == -INFINITY ? 0.f : n0, base1 = n1 == -INFINITY ? 0.f : n1;
  corr0 = __expf(m0 - base0); corr1 = __expf(m1 - base1);
  m0 = n0; m1 = n1;
  float ps0 = 0.f, ps1 = 0.f;
  #pragma unroll
  for (int nb = 0; nb < 8; nb++) {
    sc[nb][0] = __expf(sc[nb][0] - base0); sc[nb][1] = __expf(sc[nb][1] - base0);
    sc[nb][2] = __expf(sc[nb][2] - base1); sc[nb][3] = __expf(sc[nb][3] - base1);
    ps0 += sc[nb][0] + sc[nb][1]; ps1 += sc[nb][2] + sc[nb][3];
  }
  l0 = l0 * corr0 + ps0; l1 = l1 * corr1 + ps1;
}
// Launch bounds of the forward and key-row kernels: 128 threads, with THREE_BLOCKS registers
// for 3 blocks per SM.
#if THREE_BLOCKS
#define TC_BOUNDS __launch_bounds__(128, 3)
#else
#define TC_BOUNDS __launch_bounds__(128)
#endif

#ifdef ATTN_FWD_TC
// Forward (attention.rs: `gen_forward_tc`).
extern "C" __global__ void TC_BOUNDS KNAME(AttentionArgs a) {
  KILN_AFTER_PREVIOUS();
  TC_ARGS
  T* out = (T*)a.out;
  Tile* Ks = (Tile*)smem_;
  Tile* Vs = Ks + STAGES;
  long long q0 = (long long)blockIdx.y * KT, w0 = q0 + 16 * warp, r0 = w0 + grp, r1 = r0 + 8;
  U qa[D_ / 16][4];
  load_rows(qa, q + r0 * qsl + b * qsb + h * qsh, q + r1 * qsl + b * qsb + h * qsh, r0 < L, r1 < L, t);
  float o[D_ / 8][4];
  zero(o);
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  bool active = w0 < L;
  long long wlast = min(L, w0 + 16) - 1, blast = min(L, q0 + KT) - 1;
  long long send = causal ? min(S, blast + 1) : S;
#define LOADS(x, st) { load_tile(Ks[st], k, x, S, kss, b * ksb + h * ksh, tid); load_tile(Vs[st], v, x, S, vss, b * vsb + h * vsh, tid); }
  TILE_LOOP_BEGIN(0, send)
    const long long s0 = x0;
    if (active && !(causal && s0 > wlast)) {
      float sc[8][4], mx0, mx1;
      scores(sc, qa, Ks[cur], grp, t);
      mask_scores<true>(sc, mk, b * msb + h * msh, msl, mss, r0, r1, s0, L, S, scale, causal, t, mx0, mx1);
      float corr0, corr1;
      online_softmax(sc, mx0, mx1, m0, m1, l0, l1, corr0, corr1);
      #pragma unroll
      for (int i = 0; i < D_ / 8; i++) { o[i][0] *= corr0; o[i][1] *= corr0; o[i][2] *= corr1; o[i][3] *= corr1; }
      product_pv(o, sc, Vs[cur], lane);
    }
  TILE_LOOP_END
#undef LOADS
  // Each row's sum is spread over the four threads of its quad.
  l0 = quad_sum(l0); l1 = quad_sum(l1);
  #pragma unroll
  for (int nb = 0; nb < D_ / 8; nb++) {
    if (r0 < L) *(U*)(out + ((r0 * B + b) * H + h) * D_ + 8 * nb + 2 * t) = pack2(o[nb][0] / l0, o[nb][1] / l0);
    if (r1 < L) *(U*)(out + ((r1 * B + b) * H + h) * D_ + 8 * nb + 2 * t) = pack2(o[nb][2] / l1, o[nb][3] / l1);
  }
  // Each row's log-sum-exp of its scaled scores, kept for the backward.
  float* lse = (float*)a.lse;
  if (t == 0) {
    if (r0 < L) lse[bh * L + r0] = m0 == -INFINITY ? -INFINITY : m0 + logf(l0);
    if (r1 < L) lse[bh * L + r1] = m1 == -INFINITY ? -INFINITY : m1 + logf(l1);
  }
}
#endif

#ifdef ATTN_BWD_Q_TC
// Backward per block of query rows: log-sum-exp, delta and dq (attention.rs:
// `gen_backward_q_tc`).
extern "C" __global__ void __launch_bounds__(128) KNAME(AttentionArgs a) {
  KILN_AFTER_PREVIOUS();
  TC_ARGS
  const T* o = (const T*)a.o; const T* g = (const T*)a.g;
  float* dq = (float*)a.dq; float* lse = (float*)a.lse; float* dl = (float*)a.delta;
  Tile* Ks = (Tile*)smem_;
  Tile* Vs = Ks + STAGES;
  long long q0 = (long long)blockIdx.y * KT, w0 = q0 + 16 * warp, r0 = w0 + grp, r1 = r0 + 8;
  const T* gr0 = g + ((r0 * B + b) * H + h) * D_;
  const T* gr1 = g + ((r1 * B + b) * H + h) * D_;
  U qa[D_ / 16][4], ga[D_ / 16][4];
  load_rows(qa, q + r0 * qsl + b * qsb + h * qsh, q + r1 * qsl + b * qsb + h * qsh, r0 < L, r1 < L, t);
  load_rows(ga, gr0, gr1, r0 < L, r1 < L, t);
  // delta of each row: dO·O over the head dims this thread's fragments hold, summed over its quad.
  float dl0 = 0.f, dl1 = 0.f;
  const T* or0 = o + ((r0 * B + b) * H + h) * D_;
  const T* or1 = o + ((r1 * B + b) * H + h) * D_;
  #pragma unroll
  for (int kk = 0; kk < D_ / 16; kk++)
    #pragma unroll
    for (int e = 0; e < 4; e++) {
      int dd = 16 * kk + 2 * t + (e & 1) + 8 * (e >> 1);
      if (r0 < L) dl0 += LD(gr0[dd]) * LD(or0[dd]);
      if (r1 < L) dl1 += LD(gr1[dd]) * LD(or1[dd]);
    }
  dl0 = quad_sum(dl0); dl1 = quad_sum(dl1);
  bool active = w0 < L;
  long long wlast = min(L, w0 + 16) - 1, blast = min(L, q0 + KT) - 1;
  long long send = causal ? min(S, blast + 1) : S;
  // Each row's log-sum-exp: the forward's where it kept them (a.lse_in), else from a first walk
  // over the keys.
  const float* lse_in = (const float*)a.lse_in;
  float ls0, ls1;
  if (lse_in) {
    ls0 = r0 < L ? lse_in[bh * L + r0] : -INFINITY;
    ls1 = r1 < L ? lse_in[bh * L + r1] : -INFINITY;
  } else {
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
#define LOADS(x, st) load_tile(Ks[st], k, x, S, kss, b * ksb + h * ksh, tid)
    {
    TILE_LOOP_BEGIN(0, send)
      const long long s0 = x0;
      if (active && !(causal && s0 > wlast)) {
        float sc[8][4];
        scores(sc, qa, Ks[cur], grp, t);
        float mx0, mx1;
        mask_scores<true>(sc, mk, b * msb + h * msh, msl, mss, r0, r1, s0, L, S, scale, causal, t, mx0, mx1);
        float corr0, corr1;
        online_softmax(sc, mx0, mx1, m0, m1, l0, l1, corr0, corr1);
      }
    TILE_LOOP_END
    }
#undef LOADS
    l0 = quad_sum(l0); l1 = quad_sum(l1);
    ls0 = m0 == -INFINITY ? -INFINITY : m0 + logf(l0); ls1 = m1 == -INFINITY ? -INFINITY : m1 + logf(l1);
  }
  float acc[D_ / 8][4];
  zero(acc);
#define LOADS(x, st) { load_tile(Ks[st], k, x, S, kss, b * ksb + h * ksh, tid); load_tile(Vs[st], v, x, S, vss, b * vsb + h * vsh, tid); }
  {
  TILE_LOOP_BEGIN(0, send)
    const long long s0 = x0;
    if (active && !(causal && s0 > wlast)) {
      float sc[8][4], dp[8][4];
      scores(sc, qa, Ks[cur], grp, t);
      float mx0, mx1;
      mask_scores<false>(sc, mk, b * msb + h * msh, msl, mss, r0, r1, s0, L, S, scale, causal, t, mx0, mx1);
      scores(dp, ga, Vs[cur], grp, t);
      // A tile of keys inside S, (causal) none after this warp's first row, no mask, and the
      // warp's rows inside L: every score and log-sum-exp is finite.
      const bool interior = !mk && s0 + KT <= S && w0 + 16 <= L && (!causal || s0 + KT - 1 <= w0);
      #pragma unroll
      for (int nb = 0; nb < 8; nb++)
        #pragma unroll
        for (int e = 0; e < 4; e++) {
          float ls = e < 2 ? ls0 : ls1, x = sc[nb][e];
          float p = (!interior && (x == -INFINITY || ls == -INFINITY)) ? 0.f : __expf(x - ls);
          sc[nb][e] = p * (dp[nb][e] - (e < 2 ? dl0 : dl1));
        }
      product_pv(acc, sc, Ks[cur], lane);
    }
  TILE_LOOP_END
  }
#undef LOADS
  #pragma unroll
  for (int nb = 0; nb < D_ / 8; nb++)
    #pragma unroll
    for (int e = 0; e < 4; e++) {
      long long r = e < 2 ? r0 : r1;
      if (r < L) dq[((r * B + b) * H + h) * D_ + 8 * nb + 2 * t + (e & 1)] = acc[nb][e] * scale;
    }
  if (t == 0) {
    if (r0 < L) { lse[bh * L + r0] = ls0; dl[bh * L + r0] = dl0; }
    if (r1 < L) { lse[bh * L + r1] = ls1; dl[bh * L + r1] = dl1; }
  }
}
#endif

#ifdef ATTN_BWD_KV_TC
// Backward per block of key rows: dv and / or dk (attention.rs: `gen_backward_kv_tc`).
extern "C" __global__ void TC_BOUNDS KNAME(AttentionArgs a) {
  KILN_AFTER_PREVIOUS();
  TC_ARGS
  const T* g = (const T*)a.g;
  const float* lse = (const float*)a.lse; const float* dl = (const float*)a.delta;
  float* dk = (float*)a.dk; float* dv = (float*)a.dv;
  Tile* Qs = (Tile*)smem_;
  Tile* Gs = Qs + STAGES;
  float (*Ls)[KT] = (float (*)[KT])(Gs + STAGES);
  float (*Ds)[KT] = Ls + STAGES;
  long long k0 = (long long)blockIdx.y * KT, w0 = k0 + 16 * warp, c0 = w0 + grp, c1 = c0 + 8;  // this thread's key rows
  U ka[D_ / 16][4];
  load_rows(ka, k + c0 * kss + b * ksb + h * ksh, k + c1 * kss + b * ksb + h * ksh, c0 < S, c1 < S, t);
#if WANT_DK
  U va[D_ / 16][4];
  load_rows(va, v + c0 * vss + b * vsb + h * vsh, v + c1 * vss + b * vsb + h * vsh, c0 < S, c1 < S, t);
  float gk[D_ / 8][4];
  zero(gk);
#endif
#if WANT_DV
  float gv[D_ / 8][4];
  zero(gv);
#endif
  bool active = w0 < S;
  // Causal: no query before this block's first key sees it.
#define LOADS(x, st) { load_tile(Qs[st], q, x, L, qsl, b * qsb + h * qsh, tid); load_tile(Gs[st], g, x, L, B * H * D_, (b * H + h) * D_, tid); \
    if (tid < KT) { long long l_ = (x) + tid; Ls[st][tid] = l_ < L ? lse[bh * L + l_] : -INFINITY; Ds[st][tid] = l_ < L ? dl[bh * L + l_] : 0.f; } }
  TILE_LOOP_BEGIN(causal ? k0 : 0, L)
    const long long l0 = x0;
    if (active && !(causal && l0 + KT - 1 < w0)) {
      float p[8][4];
      scores(p, ka, Qs[cur], grp, t);
#if WANT_DK
      float dp[8][4];
      scores(dp, va, Gs[cur], grp, t);
#endif
      // A tile of queries all inside L and (causal) none before this warp's last key, with no
      // mask and all of the warp's keys inside S: every probability is live, no checks.
      if (!mk && l0 + KT <= L && w0 + 16 <= S && (!causal || l0 >= w0 + 15)) {
        #pragma unroll
        for (int nb = 0; nb < 8; nb++)
          #pragma unroll
          for (int e = 0; e < 4; e++) {
            int li = 8 * nb + 2 * t + (e & 1);
            float pr = __expf(p[nb][e] * scale - Ls[cur][li]);
            p[nb][e] = pr;
#if WANT_DK
            dp[nb][e] = pr * (dp[nb][e] - Ds[cur][li]);
#endif
          }
      } else {
        #pragma unroll
        for (int nb = 0; nb < 8; nb++)
          #pragma unroll
          for (int e = 0; e < 4; e++) {
            long long key = e < 2 ? c0 : c1, l = l0 + 8 * nb + 2 * t + (e & 1);
            float x = p[nb][e] * scale, pr = 0.f;
            if (l < L && key < S && !(causal && key > l)) {
              if (mk) x += LD(mk[b * msb + h * msh + l * msl + key * mss]);
              float ls = Ls[cur][l - l0];
              pr = (x == -INFINITY || ls == -INFINITY) ? 0.f : __expf(x - ls);
            }
            p[nb][e] = pr;
#if WANT_DK
            dp[nb][e] = pr * (dp[nb][e] - Ds[cur][l < L ? l - l0 : 0]);
#endif
          }
      }
#if WANT_DV
      product_pv(gv, p, Gs[cur], lane);
#endif
#if WANT_DK
      product_pv(gk, dp, Qs[cur], lane);
#endif
    }
  TILE_LOOP_END
#undef LOADS
  #pragma unroll
  for (int nb = 0; nb < D_ / 8; nb++)
    #pragma unroll
    for (int e = 0; e < 4; e++) {
      long long key = e < 2 ? c0 : c1;
      if (key < S) {
        long long r = ((key * B + b) * H + h) * D_ + 8 * nb + 2 * t + (e & 1);
#if WANT_DK
        dk[r] = gk[nb][e] * scale;
#endif
#if WANT_DV
        dv[r] = gv[nb][e];
#endif
      }
    }
}
#endif
