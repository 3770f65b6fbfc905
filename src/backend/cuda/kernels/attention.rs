//! Fused scaled dot-product attention (flash-attention style), so the score matrix never
//! reaches memory. Forward in F16 / BF16 with head dims a multiple of 16: on the tensor cores
//! (`gen_forward_tc`, 16 query rows per warp, keys in tiles of 64); otherwise one warp per query
//! row walks the keys 32 at a time with an online softmax. The tensor-core forward keeps each
//! row's log-sum-exp beside its output (`CudaStorage::aux`). The backward recomputes the
//! probabilities: one kernel for dq (and each row's dO·O, and its log-sum-exp unless the forward
//! kept it), one for dk and dv (two for head dims over 64); on the tensor cores where the
//! forward is (16 query or key rows per warp), else one warp per query or key row. Layouts as
//! `Op::Attention`: q, k, v are read through their strides (the head dim contiguous), the
//! output is contiguous `[L, B, H, D]`.

use crate::backend::cuda::kernels::codegen::{self, PRELUDE};
use crate::dtype::CType;
use crate::backend::cuda::kernels::{data_ptr, dev_of};
use crate::backend::cuda::{CudaStorage, KArgs, KernelKey};
use crate::ops::AttnDims;
use crate::{DType, Result, Tensor};

/// Warps per block of the tensor-core kernels, and the fewest query (or key) rows per block of
/// the warp kernels (`forward_rows`, `backward_rows`).
const ROWS: usize = 4;
/// Largest head dim the kernels take (their tiles live in 48 KiB of shared memory).
const MAX_HEAD_DIM: usize = 128;
/// Most query or key rows per head: one block per ROWS rows in the grid's y (65535 at most).
const MAX_ROWS: usize = 65535 * ROWS;

/// Whether the kernels take an attention of `l` queries and `s` keys over `bh` heads of `d`
/// features (else the caller computes it with matmul and softmax).
pub(crate) fn takes(l: usize, s: usize, bh: usize, d: usize) -> bool {
    d <= MAX_HEAD_DIM && l <= MAX_ROWS && s <= MAX_ROWS && bh <= i32::MAX as usize
}

/// A kernel's name, which says all its source depends on (sources are generated only once).
fn kernel_name(kind: &str, dtype: DType, d: usize) -> String {
    format!("attention_{kind}_{}_d{d}", dtype.torch_name())
}

/// Source shared by the three kernels: types, loads, warp reductions, the argument block;
/// `rows` warps (query or key rows) per block, key and value rows loaded `vw` elements at a
/// time (`vw` divides the head dim, the rows' strides and alignment; see `key_vector`).
fn common(dtype: DType, d: usize, rows: usize, vw: usize) -> String {
    format!(
        r#"{PRELUDE}
#define D_ {d}
#define PER ((D_ + 31) / 32)
#define ROWS {rows}
#define VW {vw}
#define FULL 0xffffffffu
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef {t} T;
// The type scores and log-sum-exps are kept in: double for F32 inputs, where a float score
// past ~64 loses the digits exp() amplifies (F32 results then stay within F32's tolerance of
// the exact ones); float for F16 and BF16.
typedef {sc} SC;
struct __align__({align}) VT {{ T v[VW]; }};
#define LD(e) ({ld})
#define ST(e) ({st})
__device__ __forceinline__ SC wmax(SC x) {{ for (int o = 16; o; o >>= 1) x = fmax(x, __shfl_xor_sync(FULL, x, o)); return x; }}
__device__ __forceinline__ float wsum(float x) {{ for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(FULL, x, o); return x; }}
#define ARGS \
  const T* q = (const T*)a.w[0]; const T* k = (const T*)a.w[1]; const T* v = (const T*)a.w[2]; const T* mk = (const T*)a.w[3]; \
  long long B = a.w[5], H = a.w[6], L = a.w[7], S = a.w[8]; \
  long long qsl = a.w[9], qsb = a.w[10], qsh = a.w[11], kss = a.w[12], ksb = a.w[13], ksh = a.w[14], vss = a.w[15], vsb = a.w[16], vsh = a.w[17]; \
  long long msb = a.w[18], msh = a.w[19], msl = a.w[20], mss = a.w[21]; \
  float scale = (float)kparam_f(a.w[22]); SC sscale = (SC)kparam_f(a.w[22]); int causal = (int)a.w[23]; \
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31; \
  long long bh = blockIdx.x, b = bh / H, h = bh % H; (void)B; (void)L; (void)S;
// Score of query row l (in Qrow) against key row s (in Krow), scaled after the product (one
// rounding fewer than scaling the query first: large scores keep their digits), mask added.
#define SCORE(Qrow, Krow, l, s, out) {{ SC dot_ = 0; for (int d_ = 0; d_ < D_; d_++) dot_ += (SC)(Qrow)[d_] * (SC)(Krow)[d_]; \
  dot_ *= sscale; if (mk) dot_ += (SC)LD(mk[b * msb + h * msh + (l) * msl + (s) * mss]); out = dot_; }}
// The keys the block's query rows see: all S, or up to its last row when causal.
#define KEY_END long long last = min(L, (long long)(blockIdx.y + 1) * ROWS) - 1; \
  long long send = causal ? min(S, last + 1) : S;
// The tile of keys from s0 (all 32 but in the last: short sequences load and sum no padding)
// into Ks, with their values into Vs when WITH_V; the whole block loads, then syncs.
#define LOAD_KEYS(s0, nk, WITH_V) const int nk = (int)min(32ll, send - (s0)); __syncthreads(); \
  for (int i_ = threadIdx.x; i_ < nk * (D_ / VW); i_ += ROWS * 32) {{ \
    int j_ = i_ / (D_ / VW), d_ = (i_ - j_ * (D_ / VW)) * VW; long long s_ = (s0) + j_; \
    const VT kq_ = *(const VT*)(k + s_ * kss + b * ksb + h * ksh + d_); \
    for (int e_ = 0; e_ < VW; e_++) Ks[j_][d_ + e_] = LD(kq_.v[e_]); \
    if (WITH_V) {{ const VT vq_ = *(const VT*)(v + s_ * vss + b * vsb + h * vsh + d_); \
      for (int e_ = 0; e_ < VW; e_++) Vs[j_][d_ + e_] = LD(vq_.v[e_]); }} }} \
  __syncthreads();
// This lane's score against key s0 + lane (-inf where masked out by causality or past S),
// the row's running max m updated into mn and this lane's exp(score - mn) into p.
#define ONLINE_STEP(s0, sc, mn, p) long long s = (s0) + lane; SC sc = -INFINITY; \
  if (s < S && !(causal && s > l)) SCORE(Qs[warp], Ks[lane], l, s, sc); \
  SC mn = fmax(m, wmax(sc)); float p = sc == -INFINITY ? 0.f : expf((float)(sc - mn));
"#,
        t = codegen::storage_type(dtype),
        sc = if dtype == DType::F32 { "double" } else { "float" },
        align = vw * dtype.size_in_bytes(),
        ld = codegen::load(dtype, CType::F32, "(e)"),
        st = codegen::store(dtype, CType::F32, "(e)"),
    )
}

/// Query rows per block of the warp forward: up to 16, so that a short sequence's rows share
/// one block and its keys and values are loaded once per head instead of once per 4 rows.
fn forward_rows(l: usize) -> usize {
    l.next_power_of_two().clamp(ROWS, 16)
}

/// Whether every row of `t` (`[rows, B, H, D]` through its strides) starts on a 16-byte
/// boundary, `vw` elements being 16 bytes.
pub(crate) fn rows_aligned(t: &Tensor, vw: usize) -> Result<bool> {
    Ok(t.strides()[..3].iter().all(|&s| s % vw == 0) && data_ptr(t)? % 16 == 0)
}

/// Elements per load of key and value rows: 16 bytes where the head dim, every row stride and
/// both base addresses allow it, else one.
fn key_vector(k: &Tensor, v: &Tensor, d: usize) -> Result<usize> {
    let vw = 16 / k.dtype().size_in_bytes();
    Ok(if d.is_multiple_of(vw) && rows_aligned(k, vw)? && rows_aligned(v, vw)? { vw } else { 1 })
}

/// A warp kernel's name: `rows` query (or key) rows per block, rows loaded `vw` at a time.
fn warp_name(kind: &str, dtype: DType, d: usize, rows: usize, vw: usize) -> String {
    format!("{}_r{rows}_v{vw}", kernel_name(kind, dtype, d))
}

/// Rows per block of the warp backward kernels: as the forward's, but at most 8 for head dims
/// over 64, where 16 would take the tiles past 48 KiB of shared memory.
fn backward_rows(n: usize, d: usize) -> usize {
    forward_rows(n).min(if d > 64 { 8 } else { 16 })
}

/// The backward's load width: the keys' and values' (`key_vector`), where the queries' strides
/// and address and the output gradient's address allow it too.
fn backward_vector(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, d: usize) -> Result<usize> {
    let vw = key_vector(k, v, d)?;
    Ok(if rows_aligned(q, vw)? && data_ptr(g)? % 16 == 0 { vw } else { 1 })
}

/// Forward: out[l] = softmax(scale q[l] k^T + mask) v, `rows` query rows per block.
fn gen_forward(dtype: DType, d: usize, rows: usize, vw: usize) -> (String, String) {
    let name = warp_name("fwd", dtype, d, rows, vw);
    let src = format!(
        r#"{common}
extern "C" __global__ void __launch_bounds__(ROWS * 32) {name}(KArgs a) {{
  ARGS
  T* out = (T*)a.w[4];
  __shared__ float Ks[32][D_ + 1]; __shared__ float Vs[32][D_]; __shared__ float Qs[ROWS][D_];
  long long l = (long long)blockIdx.y * ROWS + warp;
  bool ok = l < L;
  if (ok) for (int d = lane; d < D_; d += 32) Qs[warp][d] = LD(q[l * qsl + b * qsb + h * qsh + d]);
  SC m = -INFINITY; float den = 0.f, acc[PER];
  for (int i = 0; i < PER; i++) acc[i] = 0.f;
  KEY_END
  for (long long s0 = 0; s0 < send; s0 += 32) {{
    LOAD_KEYS(s0, nk, true)
    if (!ok) continue;
    ONLINE_STEP(s0, sc, mn, p)
    float corr = m == -INFINITY ? 0.f : expf((float)(m - mn));
    den = den * corr + wsum(p);
    for (int i = 0; i < PER; i++) acc[i] *= corr;
    for (int j = 0; j < nk; j++) {{
      float pj = __shfl_sync(FULL, p, j);
      for (int i = 0; i < PER; i++) {{ int d = lane + 32 * i; if (d < D_) acc[i] += pj * Vs[j][d]; }}
    }}
    m = mn;
  }}
  if (ok) for (int i = 0; i < PER; i++) {{ int d = lane + 32 * i; if (d < D_) out[((l * B + b) * H + h) * D_ + d] = ST(acc[i] / den); }}
}}
"#,
        common = common(dtype, d, rows, vw)
    );
    (name, src)
}

/// Rows per block of the tensor-core kernels (16 per warp), and rows per shared-memory tile.
const TC_ROWS: usize = 64;

/// Source shared by the tensor-core kernels (F16 / BF16, head dims a multiple of 16): the
/// `mma.m16n8k16` product and its fragments (A: 16 rows, from registers; B: a shared-memory
/// tile of 64 rows, directly or transposed through `ldmatrix`), tile loads, masking.
fn tc_common(dtype: DType, d: usize) -> String {
    let ty = if dtype == DType::BF16 { "bf16" } else { "f16" };
    format!(
        r#"{common}
#define KT {TC_ROWS}
#define KP (D_ + 8)
typedef unsigned int U;
#define TC_ARGS ARGS int tid = threadIdx.x, grp = lane >> 2, t = lane & 3; (void)msb; (void)msh; (void)msl; (void)mss;
__device__ __forceinline__ U pack2(float lo, float hi) {{ U r; asm("cvt.rn.{ty}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo)); return r; }}
__device__ __forceinline__ float quad_sum(float x) {{ x += __shfl_xor_sync(FULL, x, 1); return x + __shfl_xor_sync(FULL, x, 2); }}
__device__ __forceinline__ float quad_max(float x) {{ x = fmaxf(x, __shfl_xor_sync(FULL, x, 1)); return fmaxf(x, __shfl_xor_sync(FULL, x, 2)); }}
__device__ __forceinline__ void mma(float* c, const U* a, U b0, U b1) {{
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, {{%8, %9}}, {{%0, %1, %2, %3}};"
    : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}}
// A fragments of 16 rows (this thread's rows p0 and p1 = p0 + 8; zero where !ok).
__device__ __forceinline__ void load_rows(U (&fr)[D_ / 16][4], const T* p0, const T* p1, bool ok0, bool ok1, int t) {{
  #pragma unroll
  for (int kk = 0; kk < D_ / 16; kk++) {{
    fr[kk][0] = ok0 ? *(const U*)(p0 + 16 * kk + 2 * t) : 0u;
    fr[kk][1] = ok1 ? *(const U*)(p1 + 16 * kk + 2 * t) : 0u;
    fr[kk][2] = ok0 ? *(const U*)(p0 + 16 * kk + 2 * t + 8) : 0u;
    fr[kk][3] = ok1 ? *(const U*)(p1 + 16 * kk + 2 * t + 8) : 0u;
  }}
}}
// Queues rows row0 .. row0 + 63 (row r at base + r * rs + off, zeros past n) into a tile,
// 16 bytes per cp.async.
__device__ __forceinline__ void load_tile(T (*tile)[KP], const T* base, long long row0, long long n, long long rs, long long off, int tid) {{
  for (int i = tid; i < KT * (D_ / 8); i += 128) {{
    int j = i / (D_ / 8), c = i - j * (D_ / 8);
    long long r = row0 + j;
    const T* src = r < n ? base + r * rs + off + 8 * c : base;
    U dst = (U)__cvta_generic_to_shared(&tile[j][8 * c]);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(r < n ? 16 : 0) : "memory");
  }}
}}
__device__ __forceinline__ void cp_commit() {{ asm volatile("cp.async.commit_group;" ::: "memory"); }}
template <int N> __device__ __forceinline__ void cp_wait() {{ asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory"); }}
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
  for (long long x0 = (start); x0 < (end); x0 += KT, it_++) {{ \
    const int cur = it_ & 1; \
    if (x0 + KT < (end)) LOADS(x0 + KT, cur ^ 1); \
    cp_commit(); cp_wait<1>(); \
    __syncthreads();
#define TILE_LOOP_END \
    __syncthreads(); \
  }}
// sc (16 x 64) = fragments (16 x D) times the tile's rows transposed (D x 64).
__device__ __forceinline__ void scores(float (&sc)[8][4], const U (&fr)[D_ / 16][4], const T (*tile)[KP], int grp, int t) {{
  #pragma unroll
  for (int nb = 0; nb < 8; nb++) {{
    sc[nb][0] = 0.f; sc[nb][1] = 0.f; sc[nb][2] = 0.f; sc[nb][3] = 0.f;
    #pragma unroll
    for (int kk = 0; kk < D_ / 16; kk++)
      mma(sc[nb], fr[kk], *(const U*)&tile[8 * nb + grp][16 * kk + 2 * t], *(const U*)&tile[8 * nb + grp][16 * kk + 2 * t + 8]);
  }}
}}
// acc (16 x D) += p (16 x 64, rounded to T) times the tile (64 x D).
__device__ __forceinline__ void product_pv(float (&acc)[D_ / 8][4], const float (&p)[8][4], const T (*tile)[KP], int lane) {{
  #pragma unroll
  for (int j = 0; j < 4; j++) {{
    U pa[4] = {{pack2(p[2 * j][0], p[2 * j][1]), pack2(p[2 * j][2], p[2 * j][3]), pack2(p[2 * j + 1][0], p[2 * j + 1][1]), pack2(p[2 * j + 1][2], p[2 * j + 1][3])}};
    #pragma unroll
    for (int nb = 0; nb < D_ / 8; nb++) {{
      U b0, b1, s = (U)__cvta_generic_to_shared(&tile[16 * j + (lane & 15)][8 * nb]);
      asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {{%0, %1}}, [%2];" : "=r"(b0), "=r"(b1) : "r"(s));
      mma(acc[nb], pa, b0, b1);
    }}
  }}
}}
// Scores of query rows r0, r1 against keys s0 .. s0 + 63: scaled, the mask added (at moff +
// row msl + key mss), -inf past S or above the diagonal when causal; with MAX, mx0 and mx1
// their row maxima over the tile.
template <bool MAX>
__device__ __forceinline__ void mask_scores(float (&sc)[8][4], const T* mk, long long moff, long long msl, long long mss, long long r0, long long r1, long long s0, long long L, long long S, float scale, int causal, int t, float& mx0, float& mx1) {{
  mx0 = -INFINITY; mx1 = -INFINITY;
  // A tile of keys all inside S and (causal) all at or before this thread's first row, with no
  // mask: scaling is all there is to do.
  if (!mk && s0 + KT <= S && (!causal || s0 + KT - 1 <= r0)) {{
    #pragma unroll
    for (int nb = 0; nb < 8; nb++) {{
      sc[nb][0] *= scale; sc[nb][1] *= scale; sc[nb][2] *= scale; sc[nb][3] *= scale;
      if (MAX) {{ mx0 = fmaxf(mx0, fmaxf(sc[nb][0], sc[nb][1])); mx1 = fmaxf(mx1, fmaxf(sc[nb][2], sc[nb][3])); }}
    }}
    if (MAX) {{ mx0 = quad_max(mx0); mx1 = quad_max(mx1); }}
    return;
  }}
  #pragma unroll
  for (int nb = 0; nb < 8; nb++)
    #pragma unroll
    for (int e = 0; e < 4; e++) {{
      long long row = e < 2 ? r0 : r1, col = s0 + 8 * nb + 2 * t + (e & 1);
      float x = sc[nb][e] * scale;
      if (col >= S || (causal && col > row)) x = -INFINITY;
      else if (mk && row < L) x += LD(mk[moff + row * msl + col * mss]);
      sc[nb][e] = x;
      if (MAX) {{ if (e < 2) mx0 = fmaxf(mx0, x); else mx1 = fmaxf(mx1, x); }}
    }}
  if (MAX) {{ mx0 = quad_max(mx0); mx1 = quad_max(mx1); }}
}}
// Zeroes an FP32 accumulator of N fragments.
template <int N> __device__ __forceinline__ void zero(float (&acc)[N][4]) {{
  #pragma unroll
  for (int i = 0; i < N; i++) {{ acc[i][0] = 0.f; acc[i][1] = 0.f; acc[i][2] = 0.f; acc[i][3] = 0.f; }}
}}
// One tile of the online softmax for rows r0, r1 (tile maxima mx0, mx1): the running maxima m
// and sums l (per thread; summed over the quad at the end) take the tile in, sc becomes
// exp(score - new maximum), and corr0, corr1 rescale what was accumulated before. Rows with
// every score so far masked out use 0 as their maximum, so their sums and outputs stay zero.
__device__ __forceinline__ void online_softmax(float (&sc)[8][4], float mx0, float mx1, float& m0, float& m1, float& l0, float& l1, float& corr0, float& corr1) {{
  float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
  float base0 = n0 == -INFINITY ? 0.f : n0, base1 = n1 == -INFINITY ? 0.f : n1;
  corr0 = __expf(m0 - base0); corr1 = __expf(m1 - base1);
  m0 = n0; m1 = n1;
  float ps0 = 0.f, ps1 = 0.f;
  #pragma unroll
  for (int nb = 0; nb < 8; nb++) {{
    sc[nb][0] = __expf(sc[nb][0] - base0); sc[nb][1] = __expf(sc[nb][1] - base0);
    sc[nb][2] = __expf(sc[nb][2] - base1); sc[nb][3] = __expf(sc[nb][3] - base1);
    ps0 += sc[nb][0] + sc[nb][1]; ps1 += sc[nb][2] + sc[nb][3];
  }}
  l0 = l0 * corr0 + ps0; l1 = l1 * corr1 + ps1;
}}
"#,
        common = common(dtype, d, ROWS, 1)
    )
}

/// Forward on the tensor cores, flash-attention 2 style: each warp holds 16 query rows as
/// fragments, the block walks K and V in tiles of 64 keys; the scores stay in registers (FP32),
/// the online softmax rescales the FP32 output, and the probabilities enter the second product
/// rounded to the input dtype (as PyTorch's fused kernels do).
/// `three_blocks`: registers held for 3 blocks per SM (see `forward_tc_three_blocks`).
fn gen_forward_tc(dtype: DType, d: usize, three_blocks: bool) -> (String, String) {
    let minb = if three_blocks { ", 3" } else { "" };
    let name = kernel_name("fwd_tc", dtype, d);
    let src = format!(
        r#"{common}
extern "C" __global__ void __launch_bounds__(128{minb}) {name}(KArgs a) {{
  TC_ARGS
  T* out = (T*)a.w[4];
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
#define LOADS(x, st) {{ load_tile(Ks[st], k, x, S, kss, b * ksb + h * ksh, tid); load_tile(Vs[st], v, x, S, vss, b * vsb + h * vsh, tid); }}
  TILE_LOOP_BEGIN(0, send)
    const long long s0 = x0;
    if (active && !(causal && s0 > wlast)) {{
      float sc[8][4], mx0, mx1;
      scores(sc, qa, Ks[cur], grp, t);
      mask_scores<true>(sc, mk, b * msb + h * msh, msl, mss, r0, r1, s0, L, S, scale, causal, t, mx0, mx1);
      float corr0, corr1;
      online_softmax(sc, mx0, mx1, m0, m1, l0, l1, corr0, corr1);
      #pragma unroll
      for (int i = 0; i < D_ / 8; i++) {{ o[i][0] *= corr0; o[i][1] *= corr0; o[i][2] *= corr1; o[i][3] *= corr1; }}
      product_pv(o, sc, Vs[cur], lane);
    }}
  TILE_LOOP_END
#undef LOADS
  // Each row's sum is spread over the four threads of its quad.
  l0 = quad_sum(l0); l1 = quad_sum(l1);
  #pragma unroll
  for (int nb = 0; nb < D_ / 8; nb++) {{
    if (r0 < L) *(U*)(out + ((r0 * B + b) * H + h) * D_ + 8 * nb + 2 * t) = pack2(o[nb][0] / l0, o[nb][1] / l0);
    if (r1 < L) *(U*)(out + ((r1 * B + b) * H + h) * D_ + 8 * nb + 2 * t) = pack2(o[nb][2] / l1, o[nb][3] / l1);
  }}
  // Each row's log-sum-exp of its scaled scores, kept for the backward.
  float* lse = (float*)a.w[24];
  if (t == 0) {{
    if (r0 < L) lse[bh * L + r0] = m0 == -INFINITY ? -INFINITY : m0 + logf(l0);
    if (r1 < L) lse[bh * L + r1] = m1 == -INFINITY ? -INFINITY : m1 + logf(l1);
  }}
}}
"#,
        common = tc_common(dtype, d)
    );
    (name, src)
}

/// Backward on the tensor cores, per block of 64 query rows (16 per warp): each row's
/// log-sum-exp (the forward's, else a first walk over the keys, scores only) and
/// delta = dO·O, then dq = scale sum_s p (dO·v_s - delta) k_s, with dS rounded to the input
/// dtype for the product.
fn gen_backward_q_tc(dtype: DType, d: usize) -> (String, String) {
    let name = kernel_name("bwd_q_tc", dtype, d);
    let src = format!(
        r#"{common}
extern "C" __global__ void __launch_bounds__(128) {name}(KArgs a) {{
  TC_ARGS
  const T* o = (const T*)a.w[24]; const T* g = (const T*)a.w[25];
  float* dq = (float*)a.w[26]; float* lse = (float*)a.w[27]; float* dl = (float*)a.w[28];
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
    for (int e = 0; e < 4; e++) {{
      int dd = 16 * kk + 2 * t + (e & 1) + 8 * (e >> 1);
      if (r0 < L) dl0 += LD(gr0[dd]) * LD(or0[dd]);
      if (r1 < L) dl1 += LD(gr1[dd]) * LD(or1[dd]);
    }}
  dl0 = quad_sum(dl0); dl1 = quad_sum(dl1);
  bool active = w0 < L;
  long long wlast = min(L, w0 + 16) - 1, blast = min(L, q0 + KT) - 1;
  long long send = causal ? min(S, blast + 1) : S;
  // Each row's log-sum-exp: the forward's where it kept them (a.w[31]), else from a first walk
  // over the keys.
  const float* lse_in = (const float*)a.w[31];
  float ls0, ls1;
  if (lse_in) {{
    ls0 = r0 < L ? lse_in[bh * L + r0] : -INFINITY;
    ls1 = r1 < L ? lse_in[bh * L + r1] : -INFINITY;
  }} else {{
    float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
#define LOADS(x, st) load_tile(Ks[st], k, x, S, kss, b * ksb + h * ksh, tid)
    {{
    TILE_LOOP_BEGIN(0, send)
      const long long s0 = x0;
      if (active && !(causal && s0 > wlast)) {{
        float sc[8][4];
        scores(sc, qa, Ks[cur], grp, t);
        float mx0, mx1;
        mask_scores<true>(sc, mk, b * msb + h * msh, msl, mss, r0, r1, s0, L, S, scale, causal, t, mx0, mx1);
        float corr0, corr1;
        online_softmax(sc, mx0, mx1, m0, m1, l0, l1, corr0, corr1);
      }}
    TILE_LOOP_END
    }}
#undef LOADS
    l0 = quad_sum(l0); l1 = quad_sum(l1);
    ls0 = m0 == -INFINITY ? -INFINITY : m0 + logf(l0); ls1 = m1 == -INFINITY ? -INFINITY : m1 + logf(l1);
  }}
  float acc[D_ / 8][4];
  zero(acc);
#define LOADS(x, st) {{ load_tile(Ks[st], k, x, S, kss, b * ksb + h * ksh, tid); load_tile(Vs[st], v, x, S, vss, b * vsb + h * vsh, tid); }}
  {{
  TILE_LOOP_BEGIN(0, send)
    const long long s0 = x0;
    if (active && !(causal && s0 > wlast)) {{
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
        for (int e = 0; e < 4; e++) {{
          float ls = e < 2 ? ls0 : ls1, x = sc[nb][e];
          float p = (!interior && (x == -INFINITY || ls == -INFINITY)) ? 0.f : __expf(x - ls);
          sc[nb][e] = p * (dp[nb][e] - (e < 2 ? dl0 : dl1));
        }}
      product_pv(acc, sc, Ks[cur], lane);
    }}
  TILE_LOOP_END
  }}
#undef LOADS
  #pragma unroll
  for (int nb = 0; nb < D_ / 8; nb++)
    #pragma unroll
    for (int e = 0; e < 4; e++) {{
      long long r = e < 2 ? r0 : r1;
      if (r < L) dq[((r * B + b) * H + h) * D_ + 8 * nb + 2 * t + (e & 1)] = acc[nb][e] * scale;
    }}
  if (t == 0) {{
    if (r0 < L) {{ lse[bh * L + r0] = ls0; dl[bh * L + r0] = dl0; }}
    if (r1 < L) {{ lse[bh * L + r1] = ls1; dl[bh * L + r1] = dl1; }}
  }}
}}
"#,
        common = tc_common(dtype, d)
    );
    (name, src)
}

/// Which gradients a tensor-core key-row kernel computes: both (head dims up to 64), or, for
/// wider heads, dv and dk in two kernels (both accumulators and both fragment sets would not
/// fit in registers).
#[derive(Clone, Copy, PartialEq, Eq)]
enum KvPart {
    Both,
    Dv,
    Dk,
}

impl KvPart {
    fn kernel_name(self, dtype: DType, d: usize) -> String {
        let kind = match self {
            KvPart::Both => "bwd_kv_tc",
            KvPart::Dv => "bwd_dv_tc",
            KvPart::Dk => "bwd_dk_tc",
        };
        kernel_name(kind, dtype, d)
    }
}

/// Backward on the tensor cores, per block of 64 key rows (16 per warp) walking the query
/// tiles: the transposed scores K Q^T, then dv = sum_l p dO_l and
/// dk = scale sum_l p (dO_l·v - delta_l) q_l (probabilities and dS rounded to the input dtype
/// for the products).
/// `three_blocks`: registers held for 3 blocks per SM (see `dv_tc_three_blocks`).
fn gen_backward_kv_tc(dtype: DType, d: usize, part: KvPart, three_blocks: bool) -> (String, String) {
    let minb = if three_blocks { ", 3" } else { "" };
    let name = part.kernel_name(dtype, d);
    let (want_dv, want_dk) = (part != KvPart::Dk, part != KvPart::Dv);
    let src = format!(
        r#"{common}
#define WANT_DV {dv}
#define WANT_DK {dk}
extern "C" __global__ void __launch_bounds__(128{minb}) {name}(KArgs a) {{
  TC_ARGS
  const T* g = (const T*)a.w[25];
  const float* lse = (const float*)a.w[27]; const float* dl = (const float*)a.w[28];
  float* dk = (float*)a.w[29]; float* dv = (float*)a.w[30];
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
#define LOADS(x, st) {{ load_tile(Qs[st], q, x, L, qsl, b * qsb + h * qsh, tid); load_tile(Gs[st], g, x, L, B * H * D_, (b * H + h) * D_, tid); \
    if (tid < KT) {{ long long l_ = (x) + tid; Ls[st][tid] = l_ < L ? lse[bh * L + l_] : -INFINITY; Ds[st][tid] = l_ < L ? dl[bh * L + l_] : 0.f; }} }}
  TILE_LOOP_BEGIN(causal ? k0 : 0, L)
    const long long l0 = x0;
    if (active && !(causal && l0 + KT - 1 < w0)) {{
      float p[8][4];
      scores(p, ka, Qs[cur], grp, t);
#if WANT_DK
      float dp[8][4];
      scores(dp, va, Gs[cur], grp, t);
#endif
      // A tile of queries all inside L and (causal) none before this warp's last key, with no
      // mask and all of the warp's keys inside S: every probability is live, no checks.
      if (!mk && l0 + KT <= L && w0 + 16 <= S && (!causal || l0 >= w0 + 15)) {{
        #pragma unroll
        for (int nb = 0; nb < 8; nb++)
          #pragma unroll
          for (int e = 0; e < 4; e++) {{
            int li = 8 * nb + 2 * t + (e & 1);
            float pr = __expf(p[nb][e] * scale - Ls[cur][li]);
            p[nb][e] = pr;
#if WANT_DK
            dp[nb][e] = pr * (dp[nb][e] - Ds[cur][li]);
#endif
          }}
      }} else {{
        #pragma unroll
        for (int nb = 0; nb < 8; nb++)
          #pragma unroll
          for (int e = 0; e < 4; e++) {{
            long long key = e < 2 ? c0 : c1, l = l0 + 8 * nb + 2 * t + (e & 1);
            float x = p[nb][e] * scale, pr = 0.f;
            if (l < L && key < S && !(causal && key > l)) {{
              if (mk) x += LD(mk[b * msb + h * msh + l * msl + key * mss]);
              float ls = Ls[cur][l - l0];
              pr = (x == -INFINITY || ls == -INFINITY) ? 0.f : __expf(x - ls);
            }}
            p[nb][e] = pr;
#if WANT_DK
            dp[nb][e] = pr * (dp[nb][e] - Ds[cur][l < L ? l - l0 : 0]);
#endif
          }}
      }}
#if WANT_DV
      product_pv(gv, p, Gs[cur], lane);
#endif
#if WANT_DK
      product_pv(gk, dp, Qs[cur], lane);
#endif
    }}
  TILE_LOOP_END
#undef LOADS
  #pragma unroll
  for (int nb = 0; nb < D_ / 8; nb++)
    #pragma unroll
    for (int e = 0; e < 4; e++) {{
      long long key = e < 2 ? c0 : c1;
      if (key < S) {{
        long long r = ((key * B + b) * H + h) * D_ + 8 * nb + 2 * t + (e & 1);
#if WANT_DK
        dk[r] = gk[nb][e] * scale;
#endif
#if WANT_DV
        dv[r] = gv[nb][e];
#endif
      }}
    }}
}}
"#,
        common = tc_common(dtype, d),
        dv = want_dv as u8,
        dk = want_dk as u8,
    );
    (name, src)
}

/// Launches a tensor-core kernel over `rows` query rows (or key rows, `key_rows`) of `bh`
/// heads: one block per head in x, one per 64 rows in y, 128 threads. Its dynamic shared memory
/// holds two stages of two tiles of 64 rows (padded by 8 elements), and for the key-row kernels
/// each stage's log-sum-exp and delta per row.
fn launch_tc(dev: &crate::backend::cuda::CudaDevice, kern: crate::backend::cuda::Kernel, bh: usize, rows: usize, key_rows: bool, d: usize, a: &KArgs) -> Result<()> {
    let (x, _, _) = grid(bh, rows, ROWS)?;
    dev.launch_shared(kern, (x, rows.div_ceil(TC_ROWS) as u32, 1), (128, 1, 1), tc_shared(d, key_rows) as u32, a)
}

/// Dynamic shared memory of a tensor-core kernel (see `launch_tc`), in bytes.
fn tc_shared(d: usize, key_rows: bool) -> usize {
    2 * 2 * TC_ROWS * (d + 8) * 2 + if key_rows { 2 * 2 * TC_ROWS * 4 } else { 0 }
}

/// Whether the tensor-core forward asks ptxas for registers that leave room for 3 blocks per SM:
/// over 64 features it would take 181 (2 blocks); held to 3 blocks it takes 168, and on the
/// H200 the 2048-key forward at D = 128 runs 22% faster (865 -> 677 us, ncu). Only where 3
/// blocks' shared memory fits (228 KiB per SM on Hopper; an A100's 164 KiB holds 3 only below
/// D = 112): elsewhere the cap would cost registers for nothing. At 64 features and below the
/// default (127 registers, 4 blocks) is the fastest.
fn forward_tc_three_blocks(shared_per_sm: usize, d: usize) -> bool {
    d > 64 && three_blocks_fit(shared_per_sm, d, false)
}

/// Whether 3 blocks of a tensor-core kernel fit an SM's shared memory (the driver reserves
/// 1 KiB per block).
fn three_blocks_fit(shared_per_sm: usize, d: usize, key_rows: bool) -> bool {
    3 * (tc_shared(d, key_rows) + 1024) <= shared_per_sm
}

/// Whether the tensor-core backward's dv-only kernel (head dims over 64) asks for registers that
/// leave room for 3 blocks per SM, where their shared memory fits: on the H200 at D = 128 it
/// takes 168 registers instead of 178 and runs 18% faster (2048 keys: 1444 -> 1182 us, ncu).
/// The dk and dq kernels get slower under the same cap (1599 -> 1741, 1630 -> 1828 us).
fn dv_tc_three_blocks(shared_per_sm: usize, d: usize, part: KvPart) -> bool {
    part == KvPart::Dv && three_blocks_fit(shared_per_sm, d, true)
}

/// Whether the fused kernels are the faster way to compute this attention (q `[L, B, H, D]`,
/// k and v `[S, B, H, D]`): always on the tensor cores; the warp kernels only for short
/// sequences, since matmul and softmax beat them from 128 keys and 64 queries on (H200, F32,
/// D 64: 57 against 114 µs at 128 x 128, 365 against 1616 at 512 x 512), unless the scores
/// would take more than 2^28 elements. While a function is traced its tensors have no address
/// yet: their rows count as aligned (the kernel is chosen again when the graph runs).
pub(crate) fn fused_is_faster(q: &Tensor, k: &Tensor, v: &Tensor) -> bool {
    let (l, b, h, d, s) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3], k.shape()[0]);
    tensor_cores_take(q, k, v, d).unwrap_or(false) || l < 64 || s < 128 || l * s * b * h > 1 << 28
}

/// Whether the tensor-core kernels (forward, and backward with it) take these inputs: F16 or
/// BF16, a head dim that is a multiple of 16 (at most 128), more than 32 keys, and q, k, v rows
/// that start 16-byte aligned (K and V tiles are copied 16 bytes at a time, Q fragments 4). `KILN_ATTENTION_KERNEL=warp` turns it off (for
/// measuring one kernel against the other).
fn tensor_cores_take(q: &Tensor, k: &Tensor, v: &Tensor, d: usize) -> Result<bool> {
    static WARP_ONLY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if *WARP_ONLY.get_or_init(|| std::env::var("KILN_ATTENTION_KERNEL").is_ok_and(|v| v == "warp")) {
        return Ok(false);
    }
    // Up to 32 keys the warp kernel's single step is faster (10 keys: 10.7 against 12.5 µs).
    if !matches!(q.dtype(), DType::F16 | DType::BF16) || !d.is_multiple_of(16) || d > MAX_HEAD_DIM || k.shape()[0] <= 32 {
        return Ok(false);
    }
    // (Its tiles load 16 bytes, 8 elements, at a time.)
    for t in [q, k, v] {
        if t.storage().traced_ref().is_none() && !rows_aligned(t, 8)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Backward, per query row: the row's log-sum-exp and delta = dO·O, then
/// dq = scale sum_s p (dO·v_s - delta) k_s.
fn gen_backward_q(dtype: DType, d: usize, rows: usize, vw: usize) -> (String, String) {
    let name = warp_name("bwd_q", dtype, d, rows, vw);
    let src = format!(
        r#"{common}
extern "C" __global__ void __launch_bounds__(ROWS * 32) {name}(KArgs a) {{
  ARGS
  const T* o = (const T*)a.w[24]; const T* g = (const T*)a.w[25];
  float* dq = (float*)a.w[26]; float* lse = (float*)a.w[27]; float* dl = (float*)a.w[28]; SC* lse_sc = (SC*)a.w[32];
  __shared__ float Ks[32][D_ + 1]; __shared__ float Vs[32][D_ + 1]; __shared__ float Qs[ROWS][D_]; __shared__ float Gs[ROWS][D_];
  long long l = (long long)blockIdx.y * ROWS + warp;
  bool ok = l < L;
  long long row = ((l * B + b) * H + h) * D_;
  float delta = 0.f;
  if (ok) for (int d = lane; d < D_; d += 32) {{
    Qs[warp][d] = LD(q[l * qsl + b * qsb + h * qsh + d]);
    float gd = LD(g[row + d]); Gs[warp][d] = gd; delta += gd * LD(o[row + d]);
  }}
  delta = wsum(delta);
  KEY_END
  SC m = -INFINITY; float den = 0.f;
  for (long long s0 = 0; s0 < send; s0 += 32) {{
    LOAD_KEYS(s0, nk, false)
    if (!ok) continue;
    ONLINE_STEP(s0, sc, mn, p)
    den = den * (m == -INFINITY ? 0.f : expf((float)(m - mn))) + wsum(p);
    m = mn;
  }}
  SC ls = m == -INFINITY ? (SC)-INFINITY : m + log((SC)den);
  float acc[PER];
  for (int i = 0; i < PER; i++) acc[i] = 0.f;
  for (long long s0 = 0; s0 < send; s0 += 32) {{
    LOAD_KEYS(s0, nk, true)
    if (!ok) continue;
    long long s = s0 + lane;
    float ds = 0.f;
    if (s < S && !(causal && s > l)) {{
      SC sc; SCORE(Qs[warp], Ks[lane], l, s, sc);
      float p = (sc == -INFINITY || ls == -INFINITY) ? 0.f : expf((float)(sc - ls));
      float dp = 0.f;
      for (int d = 0; d < D_; d++) dp += Gs[warp][d] * Vs[lane][d];
      ds = p * (dp - delta);
    }}
    for (int j = 0; j < nk; j++) {{
      float dsj = __shfl_sync(FULL, ds, j);
      for (int i = 0; i < PER; i++) {{ int d = lane + 32 * i; if (d < D_) acc[i] += dsj * Ks[j][d]; }}
    }}
  }}
  if (ok) {{
    for (int i = 0; i < PER; i++) {{ int d = lane + 32 * i; if (d < D_) dq[row + d] = acc[i] * scale; }}
    if (lane == 0) {{ lse[bh * L + l] = (float)ls; lse_sc[bh * L + l] = ls; dl[bh * L + l] = delta; }}
  }}
}}
"#,
        common = common(dtype, d, rows, vw)
    );
    (name, src)
}

/// Backward, per key row: dv = sum_l p dO_l and dk = scale sum_l p (dO_l·v - delta_l) q_l.
fn gen_backward_kv(dtype: DType, d: usize, rows: usize, vw: usize) -> (String, String) {
    let name = warp_name("bwd_kv", dtype, d, rows, vw);
    let src = format!(
        r#"{common}
extern "C" __global__ void __launch_bounds__(ROWS * 32) {name}(KArgs a) {{
  ARGS
  const T* g = (const T*)a.w[25];
  const SC* lse = (const SC*)a.w[32]; const float* dl = (const float*)a.w[28];
  float* dk = (float*)a.w[29]; float* dv = (float*)a.w[30];
  __shared__ float Qt[32][D_ + 1]; __shared__ float Gt[32][D_ + 1]; __shared__ float Kw[ROWS][D_]; __shared__ float Vw[ROWS][D_];
  __shared__ SC Lt[32]; __shared__ float Dt[32];
  long long s = (long long)blockIdx.y * ROWS + warp;
  bool ok = s < S;
  if (ok) for (int d = lane; d < D_; d += 32) {{
    Kw[warp][d] = LD(k[s * kss + b * ksb + h * ksh + d]);
    Vw[warp][d] = LD(v[s * vss + b * vsb + h * vsh + d]);
  }}
  float ak[PER], av[PER];
  for (int i = 0; i < PER; i++) {{ ak[i] = 0.f; av[i] = 0.f; }}
  // Causal: no query before this block's first key sees it.
  long long start = causal ? (long long)blockIdx.y * ROWS : 0;
  for (long long l0 = start; l0 < L; l0 += 32) {{
    const int nl = (int)min(32ll, L - l0);
    __syncthreads();
    for (int i = threadIdx.x; i < nl * (D_ / VW); i += ROWS * 32) {{
      int j = i / (D_ / VW), d = (i - j * (D_ / VW)) * VW; long long l = l0 + j;
      const VT qv = *(const VT*)(q + l * qsl + b * qsb + h * qsh + d), gv = *(const VT*)(g + ((l * B + b) * H + h) * D_ + d);
      for (int e = 0; e < VW; e++) {{ Qt[j][d + e] = LD(qv.v[e]); Gt[j][d + e] = LD(gv.v[e]); }}
    }}
    if (threadIdx.x < 32) {{
      long long l = l0 + threadIdx.x;
      Lt[threadIdx.x] = l < L ? lse[bh * L + l] : (SC)0;
      Dt[threadIdx.x] = l < L ? dl[bh * L + l] : 0.f;
    }}
    __syncthreads();
    if (!ok) continue;
    long long l = l0 + lane;
    float p = 0.f, ds = 0.f;
    if (l < L && !(causal && s > l)) {{
      SC sc; SCORE(Qt[lane], Kw[warp], l, s, sc);
      SC ls = Lt[lane];
      p = (sc == -INFINITY || ls == -INFINITY) ? 0.f : expf((float)(sc - ls));
      float dp = 0.f;
      for (int d = 0; d < D_; d++) dp += Gt[lane][d] * Vw[warp][d];
      ds = p * (dp - Dt[lane]);
    }}
    for (int j = 0; j < nl; j++) {{
      float pj = __shfl_sync(FULL, p, j), dsj = __shfl_sync(FULL, ds, j);
      for (int i = 0; i < PER; i++) {{ int d = lane + 32 * i; if (d < D_) {{ av[i] += pj * Gt[j][d]; ak[i] += dsj * Qt[j][d]; }} }}
    }}
  }}
  if (ok) for (int i = 0; i < PER; i++) {{
    int d = lane + 32 * i;
    if (d < D_) {{ long long r = ((s * B + b) * H + h) * D_ + d; dk[r] = ak[i] * scale; dv[r] = av[i]; }}
  }}
}}
"#,
        common = common(dtype, d, rows, vw)
    );
    (name, src)
}

/// The argument words the three kernels share: pointers, sizes, strides, scale, causal.
fn shared_args(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, n: &AttnDims, scale: f64, causal: bool) -> Result<KArgs> {
    let mut a = KArgs::default();
    a.w[0] = data_ptr(q)?;
    a.w[1] = data_ptr(k)?;
    a.w[2] = data_ptr(v)?;
    a.w[3] = mask.map(data_ptr).transpose()?.unwrap_or(0);
    for (i, x) in [n.b, n.h, n.l, n.s].into_iter().enumerate() {
        a.w[5 + i] = x as u64;
    }
    for (i, t) in [q, k, v].into_iter().enumerate() {
        for j in 0..3 {
            a.w[9 + 3 * i + j] = t.strides()[j] as u64;
        }
    }
    if let Some(m) = mask {
        for j in 0..4 {
            a.w[18 + j] = m.strides()[j] as u64;
        }
    }
    a.w[22] = scale.to_bits();
    a.w[23] = causal as u64;
    Ok(a)
}

/// Blocks: one per (batch, head) in x, one per `per` rows in y (at most 65535).
fn grid(bh: usize, rows: usize, per: usize) -> Result<(u32, u32, u32)> {
    if rows > MAX_ROWS || bh > i32::MAX as usize {
        return Err(crate::Error::arg("attention", format!("{rows} rows per head (at most {MAX_ROWS}) or {bh} heads in all (at most 2^31 - 1) exceed one launch")));
    }
    Ok((bh as u32, rows.div_ceil(per) as u32, 1))
}

/// The attention output `[L, B, H, D]` in q's dtype. Inputs have a contiguous head dim.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool) -> Result<CudaStorage> {
    let dev = dev_of(q)?;
    let n = AttnDims::of(q.shape(), k.shape());
    let mut out = CudaStorage::new(&dev, q.dtype(), n.l * n.b * n.h * n.d)?;
    if out.len == 0 || n.s == 0 {
        return Ok(out);
    }
    if crate::backend::cuda::libs::sdpa::takes(q, k, v, mask, causal, &n, false)? {
        let a = crate::backend::cuda::libs::sdpa::Attn { q, k, v, mask, n: &n, scale, causal };
        if let Some(lse) = crate::backend::cuda::libs::sdpa::forward(&dev, &a, out.ptr())? {
            out.aux = lse.map(Box::new);
            return Ok(out);
        }
    }
    let mut a = shared_args(q, k, v, mask, &n, scale, causal)?;
    a.w[4] = out.ptr();
    if tensor_cores_take(q, k, v, n.d)? {
        // Each row's log-sum-exp goes beside the output, for the backward (`CudaStorage::aux`).
        let lse = CudaStorage::new(&dev, DType::F32, n.b * n.h * n.l)?;
        a.w[24] = lse.ptr();
        let kern = dev.kernel(KernelKey::Named(kernel_name("fwd_tc", q.dtype(), n.d)), || gen_forward_tc(q.dtype(), n.d, forward_tc_three_blocks(dev.shared_per_sm, n.d)))?;
        launch_tc(&dev, kern, n.b * n.h, n.l, false, n.d, &a)?;
        out.aux = Some(Box::new(lse));
    } else {
        let (rows, vw) = (forward_rows(n.l), key_vector(k, v, n.d)?);
        let kern = dev.kernel(KernelKey::Named(warp_name("fwd", q.dtype(), n.d, rows, vw)), || gen_forward(q.dtype(), n.d, rows, vw))?;
        dev.launch(kern, grid(n.b * n.h, n.l, rows)?, ((rows * 32) as u32, 1, 1), &a)?;
    }
    Ok(out)
}

/// The packed gradients `[dq | dk | dv | lse | delta]` in q's dtype (see
/// `Op::AttentionBackward`). `out` and `g` are contiguous `[L, B, H, D]`.
// The op's inputs and static arguments, one each: a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward(q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, g: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool) -> Result<CudaStorage> {
    let dev = dev_of(q)?;
    let n = AttnDims::of(q.shape(), k.shape());
    if n.packed_len() == 0 || n.l == 0 || n.s == 0 || n.d == 0 {
        let packed = CudaStorage::new(&dev, q.dtype(), n.packed_len())?;
        crate::backend::cuda::kernels::zero_fill(&dev, &packed)?;
        return Ok(packed);
    }
    if crate::backend::cuda::libs::sdpa::takes(q, k, v, mask, causal, &n, true)? {
        // cuDNN writes the gradients in q's dtype, in place.
        let packed = CudaStorage::new(&dev, q.dtype(), n.packed_len())?;
        if crate::backend::cuda::libs::sdpa::backward(&dev, &crate::backend::cuda::libs::sdpa::Attn { q, k, v, mask, n: &n, scale, causal }, out, g, &packed)? {
            return Ok(packed);
        }
    }
    // kiln's kernels write F32; in F16/BF16 one kernel rounds them after.
    let wide = CudaStorage::new(&dev, DType::F32, n.packed_len())?;
    backward_kernels(&dev, q, k, v, out, g, mask, scale, causal, &wide)?;
    if q.dtype() == DType::F32 {
        return Ok(wide);
    }
    crate::backend::cuda::kernels::cast(&Tensor::from_backend(crate::storage::BackendStorage::Cuda(wide), &[n.packed_len()]), q.dtype())
}

/// kiln's backward kernels, writing `[dq | dk | dv | lse | delta]` in F32 into `packed`.
#[allow(clippy::too_many_arguments)]
fn backward_kernels(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, g: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool, packed: &CudaStorage) -> Result<()> {
    let n = AttnDims::of(q.shape(), k.shape());
    let (nq, nk) = (n.l * n.b * n.h * n.d, n.s * n.b * n.h * n.d);
    let mut a = shared_args(q, k, v, mask, &n, scale, causal)?;
    let base = packed.ptr();
    let at = |elems: usize| base + 4 * elems as u64;
    a.w[24] = data_ptr(out)?;
    a.w[25] = data_ptr(g)?;
    a.w[26] = at(0);
    a.w[27] = at(nq + 2 * nk);
    a.w[28] = at(nq + 2 * nk + n.b * n.h * n.l);
    a.w[29] = at(nq);
    a.w[30] = at(nq + nk);
    // The forward's per-row log-sum-exp, where it kept them (the tensor-core and cuDNN
    // forwards do): the dq kernel then skips its walk over the keys.
    a.w[31] = crate::backend::cuda::kernels::aux_ptr(out).unwrap_or(0);
    if tensor_cores_take(q, k, v, n.d)? && data_ptr(out)? % 16 == 0 && data_ptr(g)? % 16 == 0 {
        let kq = dev.kernel(KernelKey::Named(kernel_name("bwd_q_tc", q.dtype(), n.d)), || gen_backward_q_tc(q.dtype(), n.d))?;
        launch_tc(dev, kq, n.b * n.h, n.l, false, n.d, &a)?;
        let parts: &[KvPart] = if n.d <= 64 { &[KvPart::Both] } else { &[KvPart::Dv, KvPart::Dk] };
        for &part in parts {
            let kkv = dev.kernel(KernelKey::Named(part.kernel_name(q.dtype(), n.d)), || gen_backward_kv_tc(q.dtype(), n.d, part, dv_tc_three_blocks(dev.shared_per_sm, n.d, part)))?;
            launch_tc(dev, kkv, n.b * n.h, n.s, true, n.d, &a)?;
        }
        return Ok(());
    }
    let vw = backward_vector(q, k, v, g, n.d)?;
    let (rq, rk) = (backward_rows(n.l, n.d), backward_rows(n.s, n.d));
    // F32 scores keep their log-sum-exps in double between the two kernels (`SC`).
    let lse_sc = if q.dtype() == DType::F32 { Some(CudaStorage::new(dev, DType::F64, n.b * n.h * n.l)?) } else { None };
    a.w[32] = lse_sc.as_ref().map_or(a.w[27], |s| s.ptr());
    let kq = dev.kernel(KernelKey::Named(warp_name("bwd_q", q.dtype(), n.d, rq, vw)), || gen_backward_q(q.dtype(), n.d, rq, vw))?;
    dev.launch(kq, grid(n.b * n.h, n.l, rq)?, ((rq * 32) as u32, 1, 1), &a)?;
    let kkv = dev.kernel(KernelKey::Named(warp_name("bwd_kv", q.dtype(), n.d, rk, vw)), || gen_backward_kv(q.dtype(), n.d, rk, vw))?;
    dev.launch(kkv, grid(n.b * n.h, n.s, rk)?, ((rk * 32) as u32, 1, 1), &a)
}

#[cfg(test)]
mod tests {
    use super::forward_tc_three_blocks;

    #[test]
    fn the_forward_asks_for_three_blocks_only_where_their_shared_memory_fits() {
        // Shared memory per SM: Hopper 228 KiB, A100 164 KiB, Ada / Ampere consumer 100 KiB.
        let (hopper, a100, ada) = (233_472, 167_936, 102_400);
        assert!([80, 96, 112, 128].iter().all(|&d| forward_tc_three_blocks(hopper, d)));
        assert!(!forward_tc_three_blocks(hopper, 64), "64 features keep the default");
        assert!(forward_tc_three_blocks(a100, 96) && !forward_tc_three_blocks(a100, 112));
        assert!(!forward_tc_three_blocks(ada, 80));
        assert!(!forward_tc_three_blocks(0, 128), "an unknown size takes no cap");
    }

    /// On a GPU (`KILN_TEST_DEVICE=cuda`): the tensor-core backward gives the same gradients
    /// whether it reads the forward's log-sum-exp beside the output or walks the keys for them
    /// (an output copied elsewhere has none).
    #[test]
    fn the_backward_reads_the_forwards_log_sum_exp_or_computes_it_alike() {
        use crate::ops::{apply, Op};
        use crate::{DType, Device, Tensor};
        if !std::env::var("KILN_TEST_DEVICE").is_ok_and(|d| d.starts_with("cuda")) {
            return;
        }
        let dev = Device::Cuda(0);
        crate::manual_seed(3);
        let (l, s, b, h, d) = (150, 200, 2, 3, 64);
        let r = |shape: &[usize]| Tensor::randn(shape, DType::BF16, &dev).unwrap();
        let (q, k, v, g) = (r(&[l, b, h, d]), r(&[s, b, h, d]), r(&[s, b, h, d]), r(&[l, b, h, d]));
        for causal in [false, true] {
            let op = Op::Attention { scale: 0.125, causal };
            let y = crate::cuda::with_cudnn_attention(false, || apply(op, &[&q, &k, &v])).unwrap();
            let copy = y.copy_contiguous().unwrap();
            assert!(crate::backend::cuda::kernels::aux_ptr(&y).is_some() && crate::backend::cuda::kernels::aux_ptr(&copy).is_none());
            let back = Op::AttentionBackward { scale: 0.125, causal };
            let kept = apply(back.clone(), &[&q, &k, &v, &y, &g]).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            let walked = apply(back, &[&q, &k, &v, &copy, &g]).unwrap().to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap();
            // dq, dk, dv (the packed result's first part); BF16 probabilities may round apart.
            let n = (l + 2 * s) * b * h * d;
            for (i, (x, y)) in kept[..n].iter().zip(&walked[..n]).enumerate() {
                assert!((x - y).abs() <= 2e-2 + 2e-2 * y.abs(), "causal {causal}, element {i}: {x} against {y}");
            }
        }
    }

    #[test]
    fn the_backward_asks_for_three_blocks_for_its_dv_kernel_only() {
        use super::{dv_tc_three_blocks, KvPart};
        let (hopper, ada) = (233_472, 102_400);
        assert!(dv_tc_three_blocks(hopper, 128, KvPart::Dv) && dv_tc_three_blocks(hopper, 96, KvPart::Dv));
        assert!(!dv_tc_three_blocks(hopper, 128, KvPart::Dk) && !dv_tc_three_blocks(hopper, 64, KvPart::Both));
        assert!(!dv_tc_three_blocks(ada, 128, KvPart::Dv) && !dv_tc_three_blocks(0, 128, KvPart::Dv));
    }
}
