// The warp attention kernels: one warp per query row (forward, dq) or key row (dk, dv),
// walking the other side 32 rows at a time. Placed after attention_common.cu; KNAME is the
// kernel's name, and one of ATTN_FWD, ATTN_BWD_Q, ATTN_BWD_KV says which kernel to compile.

#ifdef ATTN_FWD
// Forward (attention.rs: `gen_forward`).
extern "C" __global__ void __launch_bounds__(ROWS * 32) KNAME(AttentionArgs a) {
  KILN_AFTER_PREVIOUS();
  ARGS
  T* out = (T*)a.out;
  // Queries and keys as QK_T: the type scores are computed in where it fits (each value
  // converted once as it is loaded, not once per score).
  __shared__ QK_T Ks[32][D_ + 1]; __shared__ float Vs[32][D_]; __shared__ QK_T Qs[ROWS][D_];
  long long l = (long long)blockIdx.y * ROWS + warp;
  bool ok = l < L;
  // The warp's query row, loaded with the first keys and values and stored after them (only
  // this warp reads it): one wait on memory, not two.
  T qr[PER];
  for (int i = 0; i < PER; i++) { int d = lane + 32 * i; if (ok && d < D_) qr[i] = q[l * qsl + b * qsb + h * qsh + d]; }
  SC m = -INFINITY; float den = 0.f, acc[PER];
  for (int i = 0; i < PER; i++) acc[i] = 0.f;
  KEY_END
  for (long long s0 = 0; s0 < send; s0 += 32) {
    LOAD_KEYS(s0, nk, true)
    if (!ok) continue;
    if (s0 == 0) {
      for (int i = 0; i < PER; i++) { int d = lane + 32 * i; if (d < D_) Qs[warp][d] = LD(qr[i]); }
      __syncwarp();
    }
    ONLINE_STEP(s0, sc, mn, p)
    float corr = m == -INFINITY ? 0.f : expf((float)(m - mn));
    den = den * corr + wsum(p);
    for (int i = 0; i < PER; i++) acc[i] *= corr;
    for (int j = 0; j < nk; j++) {
      float pj = __shfl_sync(FULL, p, j);
      for (int i = 0; i < PER; i++) { int d = lane + 32 * i; if (d < D_) acc[i] += pj * Vs[j][d]; }
    }
    m = mn;
  }
  if (ok) for (int i = 0; i < PER; i++) { int d = lane + 32 * i; if (d < D_) out[((l * B + b) * H + h) * D_ + d] = ST(acc[i] / den); }
}
#endif

#ifdef ATTN_BWD_Q
// Backward per query row: log-sum-exp, delta and dq (attention.rs: `gen_backward_q`).
extern "C" __global__ void __launch_bounds__(ROWS * 32) KNAME(AttentionArgs a) {
  KILN_AFTER_PREVIOUS();
  ARGS
  const T* g = (const T*)a.g;
  float* dq = (float*)a.dq; float* lse = (float*)a.lse; float* dl = (float*)a.delta;
  SC* lse_sc = (SC*)a.lse_sc; SC* dl_sc = (SC*)a.delta_sc;
  __shared__ float Ks[32][D_ + 1]; __shared__ float Vs[32][D_ + 1]; __shared__ float Qs[ROWS][D_]; __shared__ float Gs[ROWS][D_];
  long long l = (long long)blockIdx.y * ROWS + warp;
  bool ok = l < L;
  long long row = ((l * B + b) * H + h) * D_;
  if (ok) for (int d = lane; d < D_; d += 32) {
    Qs[warp][d] = LD(q[l * qsl + b * qsb + h * qsh + d]);
    Gs[warp][d] = LD(g[row + d]);
  }
  KEY_END
  // The first walk: the row's log-sum-exp and delta = sum_s p_s (dO·v_s) (= dO·O, without the
  // rounding of O), online: both sums rescaled as the running maximum m grows.
  SC m = -INFINITY, den = 0, pd = 0;
  for (long long s0 = 0; s0 < send; s0 += 32) {
    LOAD_KEYS(s0, nk, true)
    if (!ok) continue;
    long long s = s0 + lane; SC sc = -INFINITY;
    if (s < S && !(causal && s > l)) SCORE(Qs[warp], Ks[lane], l, s, sc);
    SC mn = fmax(m, wmax(sc));
    SC p = sc == -INFINITY ? (SC)0 : kexp(sc - mn), dp = 0;
    if (sc != -INFINITY) for (int d = 0; d < D_; d++) dp += (SC)Gs[warp][d] * (SC)Vs[lane][d];
    SC corr = m == -INFINITY ? (SC)0 : kexp(m - mn);
    den = den * corr + wsum(p);
    pd = pd * corr + wsum(p * dp);
    m = mn;
  }
  SC ls = m == -INFINITY ? (SC)-INFINITY : m + log(den);
  SC delta = den > 0 ? pd / den : (SC)0;
  float acc[PER];
  for (int i = 0; i < PER; i++) acc[i] = 0.f;
  for (long long s0 = 0; s0 < send; s0 += 32) {
    LOAD_KEYS(s0, nk, true)
    if (!ok) continue;
    long long s = s0 + lane;
    float ds = 0.f;
    if (s < S && !(causal && s > l)) {
      SC sc; SCORE(Qs[warp], Ks[lane], l, s, sc);
      SC p = (sc == -INFINITY || ls == -INFINITY) ? (SC)0 : kexp(sc - ls), dp = 0;
      for (int d = 0; d < D_; d++) dp += (SC)Gs[warp][d] * (SC)Vs[lane][d];
      ds = (float)(p * (dp - delta));
    }
    for (int j = 0; j < nk; j++) {
      float dsj = __shfl_sync(FULL, ds, j);
      for (int i = 0; i < PER; i++) { int d = lane + 32 * i; if (d < D_) acc[i] += dsj * Ks[j][d]; }
    }
  }
  if (ok) {
    for (int i = 0; i < PER; i++) { int d = lane + 32 * i; if (d < D_) dq[row + d] = acc[i] * scale; }
    if (lane == 0) { lse[bh * L + l] = (float)ls; lse_sc[bh * L + l] = ls; dl[bh * L + l] = (float)delta; dl_sc[bh * L + l] = delta; }
  }
}
#endif

#ifdef ATTN_BWD_KV
// Backward per key row: dk and dv (attention.rs: `gen_backward_kv`).
extern "C" __global__ void __launch_bounds__(ROWS * 32) KNAME(AttentionArgs a) {
  KILN_AFTER_PREVIOUS();
  ARGS
  const T* g = (const T*)a.g;
  const SC* lse = (const SC*)a.lse_sc; const SC* dl = (const SC*)a.delta_sc;
  float* dk = (float*)a.dk; float* dv = (float*)a.dv;
  __shared__ float Qt[32][D_ + 1]; __shared__ float Gt[32][D_ + 1]; __shared__ float Kw[ROWS][D_]; __shared__ float Vw[ROWS][D_];
  __shared__ SC Lt[32]; __shared__ SC Dt[32];
  long long s = (long long)blockIdx.y * ROWS + warp;
  bool ok = s < S;
  if (ok) for (int d = lane; d < D_; d += 32) {
    Kw[warp][d] = LD(k[s * kss + b * ksb + h * ksh + d]);
    Vw[warp][d] = LD(v[s * vss + b * vsb + h * vsh + d]);
  }
  float ak[PER], av[PER];
  for (int i = 0; i < PER; i++) { ak[i] = 0.f; av[i] = 0.f; }
  // Causal: no query before this block's first key sees it.
  long long start = causal ? (long long)blockIdx.y * ROWS : 0;
  for (long long l0 = start; l0 < L; l0 += 32) {
    const int nl = (int)min(32ll, L - l0);
    __syncthreads();
    for (int i = threadIdx.x; i < nl * (D_ / VW); i += ROWS * 32) {
      int j = i / (D_ / VW), d = (i - j * (D_ / VW)) * VW; long long l = l0 + j;
      const VT qv = *(const VT*)(q + l * qsl + b * qsb + h * qsh + d), gv = *(const VT*)(g + ((l * B + b) * H + h) * D_ + d);
      for (int e = 0; e < VW; e++) { Qt[j][d + e] = LD(qv.v[e]); Gt[j][d + e] = LD(gv.v[e]); }
    }
    if (threadIdx.x < 32) {
      long long l = l0 + threadIdx.x;
      Lt[threadIdx.x] = l < L ? lse[bh * L + l] : (SC)0;
      Dt[threadIdx.x] = l < L ? dl[bh * L + l] : (SC)0;
    }
    __syncthreads();
    if (!ok) continue;
    long long l = l0 + lane;
    float p = 0.f, ds = 0.f;
    if (l < L && !(causal && s > l)) {
      SC sc; SCORE(Qt[lane], Kw[warp], l, s, sc);
      SC ls = Lt[lane];
      SC ps = (sc == -INFINITY || ls == -INFINITY) ? (SC)0 : kexp(sc - ls), dp = 0;
      for (int d = 0; d < D_; d++) dp += (SC)Gt[lane][d] * (SC)Vw[warp][d];
      p = (float)ps;
      ds = (float)(ps * (dp - Dt[lane]));
    }
    for (int j = 0; j < nl; j++) {
      float pj = __shfl_sync(FULL, p, j), dsj = __shfl_sync(FULL, ds, j);
      for (int i = 0; i < PER; i++) { int d = lane + 32 * i; if (d < D_) { av[i] += pj * Gt[j][d]; ak[i] += dsj * Qt[j][d]; } }
    }
  }
  if (ok) for (int i = 0; i < PER; i++) {
    int d = lane + 32 * i;
    if (d < D_) { long long r = ((s * B + b) * H + h) * D_ + d; dk[r] = ak[i] * scale; dv[r] = av[i]; }
  }
}
#endif

#ifdef ATTN_FWD_UP_TO
// Forward of one query row per head over the keys 0..=last[b] of a static cache (attention.rs:
// `gen_forward_up_to`, `Op::AttentionUpTo`: a decode step's attention). The cache's keys lie in
// chunks of ROWS * 32, a block each and a thread per key; the blocks of chunks past the row's
// last key leave at once, so only the keys the row sees are read. A block issues its keys'
// rows, the first VU of each warp's values (warp w takes keys w, w + ROWS, ..., its lanes the
// features lane, lane + 32, ...) and the query together, then scores its keys and takes the
// chunk's max, sum and unnormalised output. The only chunk writes the row; else each leaves
// them in `lse_sc` scratch ([B * H][chunks][D_ + 2] F32) and the last block of the (batch,
// head) to finish folds them in chunk order (the same bits on every run). F16 / BF16 inputs
// (scores in F32). Query head h reads key/value head h / kv_group. Given `k_new` and `v_new`,
// the key and value at position `last` come from them instead of the cache.
// Where the cache and `last` are settled (no kernel still running writes them), the cache's
// keys and first values are loaded before the wait for the kernel before, while it still runs;
// the query, the new row and every store only after it.
extern "C" __global__ void __launch_bounds__(ROWS * 32) KNAME(AttentionArgs a) {
  KILN_WAIT_UNLESS_SETTLED(a.settled);
  ARGS
  (void)mk; (void)msb; (void)msh; (void)msl; (void)mss; (void)sscale; (void)causal; (void)qsl;
  T* out = (T*)a.out;
  float* part = (float*)a.lse_sc;
  unsigned int* count = (unsigned int*)a.delta_sc;
  const int NT = ROWS * 32, G = NT / D_;
  const long long hk = h / a.kv_group;
  const long long last = ((const long long*)a.last)[b * a.last_stride];
  const long long seen = last < 0 ? 0 : min(S, last + 1);
  const int chunks = (int)((seen + NT - 1) / NT);
  if (seen == 0) {
    // No key: the NaN row of a fully masked softmax.
    KILN_WAIT_IF_SETTLED(a.settled);
    if (blockIdx.y == 0) for (int d = threadIdx.x; d < D_; d += NT) out[bh * D_ + d] = ST(__int_as_float(0x7fc00000));
    return;
  }
  if ((int)blockIdx.y >= chunks) return;
  const long long s0 = (long long)blockIdx.y * NT, s1 = min(seen, s0 + NT);
  __shared__ float Qs[D_];
  __shared__ float P[ROWS * 32];
  __shared__ float red[ROWS];
  // Each warp's output, then each thread's share of the fold.
  __shared__ float Os[D_ > 32 ? ROWS * D_ : ROWS * 32];
  __shared__ bool lastc;
  const T* vb = v + b * vsb + hk * vsh;
  const T* kn = a.k_new ? (const T*)a.k_new + b * a.k_new_strides[0] + hk * a.k_new_strides[1] : nullptr;
  const T* vn = a.v_new ? (const T*)a.v_new + b * a.v_new_strides[0] + hk * a.v_new_strides[1] : nullptr;
  const long long key = s0 + threadIdx.x;
  // The cache's rows first; the new key and value (at `last`) after the wait.
  const bool key_new = key == last && kn;
  VT kv[D_ / VW];
  if (key < s1 && !key_new) {
    const T* kr = k + key * kss + b * ksb + hk * ksh;
#pragma unroll
    for (int j = 0; j < D_ / VW; j++) kv[j] = *(const VT*)(kr + j * VW);
  }
  float vu[VU][PER];
#pragma unroll
  for (int u = 0; u < VU; u++) {
    const long long s = s0 + warp + u * ROWS;
#pragma unroll
    for (int j = 0; j < PER; j++) {
      const int d = lane + 32 * j;
      vu[u][j] = s < s1 && d < D_ && !(s == last && vn) ? LD(vb[s * vss + d]) : 0.f;
    }
  }
  KILN_WAIT_IF_SETTLED(a.settled);
  // The query and the new key and value rows, all loaded before any is stored (one wait on
  // memory after the wait for the kernel before); the new rows land in shared memory, read by
  // the thread of key `last` and by the output's fold (in registers they would cost as many
  // again as `kv` and `vu`).
  static_assert(D_ <= NT, "a thread per feature");
  __shared__ float Kn[D_], Vn[D_];
  {
    const int t = threadIdx.x;
    const bool tq = t < D_, tk = kn && t < D_ / VW, tv = vn && t < D_;
    float qx = 0.f, vx = 0.f;
    VT kx;
    if (tq) qx = LD(q[b * qsb + h * qsh + t]);
    if (tk) kx = *(const VT*)(kn + t * VW);
    if (tv) vx = LD(vn[t]);
    if (tq) Qs[t] = qx;
    if (tk) {
#pragma unroll
      for (int e = 0; e < VW; e++) Kn[t * VW + e] = LD(kx.v[e]);
    }
    if (tv) Vn[t] = vx;
  }
  __syncthreads();
  // This thread's key's score, and the chunk's max.
  float sc = -INFINITY;
  if (key < s1) {
    float dot = 0.f;
    if (key_new) {
      for (int d = 0; d < D_; d++) dot += Qs[d] * Kn[d];
    } else {
#pragma unroll
      for (int j = 0; j < D_ / VW; j++)
#pragma unroll
        for (int e = 0; e < VW; e++) dot += Qs[j * VW + e] * LD(kv[j].v[e]);
    }
    sc = dot * scale;
  }
  float m = wmax(sc);
  if (lane == 0) red[warp] = m;
  __syncthreads();
  m = red[0];
  for (int w = 1; w < ROWS; w++) m = fmaxf(m, red[w]);
  __syncthreads();
  // Probabilities (unnormalised) and their sum.
  const float p = key < s1 ? expf(sc - m) : 0.f;
  P[threadIdx.x] = p;
  const float ws = wsum(p);
  if (lane == 0) red[warp] = ws;
  __syncthreads();
  float l = 0.f;
  for (int w = 0; w < ROWS; w++) l += red[w];
  // The chunk's output: the values already loaded, then any keys past them four at a time.
  float acc[PER];
#pragma unroll
  for (int j = 0; j < PER; j++) acc[j] = 0.f;
#pragma unroll
  for (int u = 0; u < VU; u++) {
    const long long s = s0 + warp + u * ROWS;
    const float pu = s < s1 ? P[s - s0] : 0.f;
#pragma unroll
    for (int j = 0; j < PER; j++) acc[j] += pu * vu[u][j];
  }
  for (long long base = s0 + warp + VU * ROWS; base < s1; base += 4 * ROWS) {
    float pu[4], vw[4][PER];
#pragma unroll
    for (int u = 0; u < 4; u++) {
      const long long s = base + u * ROWS;
      pu[u] = s < s1 ? P[s - s0] : 0.f;
#pragma unroll
      for (int j = 0; j < PER; j++) {
        const int d = lane + 32 * j;
        vw[u][j] = s < s1 && d < D_ && !(s == last && vn) ? LD(vb[s * vss + d]) : 0.f;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; u++)
#pragma unroll
      for (int j = 0; j < PER; j++) acc[j] += pu[u] * vw[u][j];
  }
#pragma unroll
  for (int j = 0; j < PER; j++) if (lane + 32 * j < D_) Os[warp * D_ + lane + 32 * j] = acc[j];
  __syncthreads();
  // The chunk's output: the warps' sums, and the new value row's share where it falls here
  // (the warps left it 0).
  // (only there: elsewhere an infinite new value times 0 would be a NaN the row never saw)
  const bool here = vn && last >= s0 && last < s1;
  const float pnew = here ? P[last - s0] : 0.f;
  if (chunks == 1) {
    for (int d = threadIdx.x; d < D_; d += NT) {
      float o = 0.f;
      for (int w = 0; w < ROWS; w++) o += Os[w * D_ + d];
      out[bh * D_ + d] = ST((here ? o + pnew * Vn[d] : o) / l);
    }
    return;
  }
  float* mine = part + ((long long)bh * gridDim.y + blockIdx.y) * (D_ + 2);
  for (int d = threadIdx.x; d < D_; d += NT) {
    float o = 0.f;
    for (int w = 0; w < ROWS; w++) o += Os[w * D_ + d];
    mine[d] = here ? o + pnew * Vn[d] : o;
  }
  if (threadIdx.x == 0) { mine[D_] = m; mine[D_ + 1] = l; }
  // The last block of this (batch, head) folds every chunk.
  __syncthreads();
  if (threadIdx.x == 0) lastc = klast_arrival(&count[bh], (unsigned int)chunks);
  __syncthreads();
  if (!lastc) return;
  const float* all = part + (long long)bh * gridDim.y * (D_ + 2);
  // The row's max and denominator over the chunks (a thread each, NT at a time).
  float tm = -INFINITY, tl = 0.f;
  for (int c = threadIdx.x; c < chunks; c += NT) {
    const float cm = __ldcg(all + c * (D_ + 2) + D_), cl = __ldcg(all + c * (D_ + 2) + D_ + 1);
    const float nm = fmaxf(tm, cm);
    tl = (tm == -INFINITY ? 0.f : tl * expf(tm - nm)) + cl * expf(cm - nm);
    tm = nm;
  }
  float M = wmax(tm);
  if (lane == 0) red[warp] = M;
  __syncthreads();
  M = red[0];
  for (int w = 1; w < ROWS; w++) M = fmaxf(M, red[w]);
  __syncthreads();
  float den = wsum(tm == -INFINITY ? 0.f : tl * expf(tm - M));
  if (lane == 0) red[warp] = den;
  __syncthreads();
  den = 0.f;
  for (int w = 0; w < ROWS; w++) den += red[w];
  // The output: group g's chunks g, g + G, ... in order, then the groups in order.
  const int g = threadIdx.x / D_, d = threadIdx.x - g * D_;
  float o = 0.f;
  if (g < G) {
    for (int c = g; c < chunks; c += G) {
      const float* pc = all + c * (D_ + 2);
      o += __ldcg(pc + d) * expf(__ldcg(pc + D_) - M);
    }
  }
  __syncthreads();
  Os[threadIdx.x] = o;
  __syncthreads();
  for (int e = threadIdx.x; e < D_; e += NT) {
    float r = 0.f;
    for (int j = 0; j < G; j++) r += Os[j * D_ + e];
    out[bh * D_ + e] = ST(r / den);
  }
}
#endif
