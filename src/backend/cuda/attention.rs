//! Fused scaled dot-product attention (flash-attention style): one warp per query row walks the
//! keys 32 at a time with an online softmax, so the score matrix never reaches memory. The
//! backward recomputes the probabilities: one kernel for dq (and each row's log-sum-exp and
//! dO·O), one for dk and dv, one warp per key row. Layouts as `Op::Attention`: q, k, v are read
//! through their strides (the head dim contiguous), the output is contiguous `[L, B, H, D]`.

use super::codegen::{self, CType, PRELUDE};
use super::kernels::{data_ptr, dev_of};
use super::{CudaStorage, KArgs, KernelKey};
use crate::ops::AttnDims;
use crate::{DType, Result, Tensor};

/// Warps (query or key rows) per block.
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

/// Source shared by the three kernels: types, loads, warp reductions, the argument block.
fn common(dtype: DType, d: usize) -> String {
    format!(
        r#"{PRELUDE}
#define D_ {d}
#define PER ((D_ + 31) / 32)
#define ROWS {ROWS}
#define FULL 0xffffffffu
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef {t} T;
#define LD(e) ({ld})
#define ST(e) ({st})
__device__ __forceinline__ float wmax(float x) {{ for (int o = 16; o; o >>= 1) x = fmaxf(x, __shfl_xor_sync(FULL, x, o)); return x; }}
__device__ __forceinline__ float wsum(float x) {{ for (int o = 16; o; o >>= 1) x += __shfl_xor_sync(FULL, x, o); return x; }}
#define ARGS \
  const T* q = (const T*)a.w[0]; const T* k = (const T*)a.w[1]; const T* v = (const T*)a.w[2]; const T* mk = (const T*)a.w[3]; \
  long long B = a.w[5], H = a.w[6], L = a.w[7], S = a.w[8]; \
  long long qsl = a.w[9], qsb = a.w[10], qsh = a.w[11], kss = a.w[12], ksb = a.w[13], ksh = a.w[14], vss = a.w[15], vsb = a.w[16], vsh = a.w[17]; \
  long long msb = a.w[18], msh = a.w[19], msl = a.w[20], mss = a.w[21]; \
  float scale = (float)kparam_f(a.w[22]); int causal = (int)a.w[23]; \
  int warp = threadIdx.x >> 5, lane = threadIdx.x & 31; \
  long long bh = blockIdx.x, b = bh / H, h = bh % H; (void)B; (void)L; (void)S;
// Score of query row l (scaled, in Qrow) against key row s (in Krow), mask added.
#define SCORE(Qrow, Krow, l, s, out) {{ float dot_ = 0.f; for (int d_ = 0; d_ < D_; d_++) dot_ += (Qrow)[d_] * (Krow)[d_]; \
  if (mk) dot_ += LD(mk[b * msb + h * msh + (l) * msl + (s) * mss]); out = dot_; }}
// The keys the block's query rows see: all S, or up to its last row when causal.
#define KEY_END long long last = min(L, (long long)(blockIdx.y + 1) * ROWS) - 1; \
  long long send = causal ? min(S, last + 1) : S;
// The tile of keys from s0 (all 32 but in the last: short sequences load and sum no padding)
// into Ks, with their values into Vs when WITH_V; the whole block loads, then syncs.
#define LOAD_KEYS(s0, nk, WITH_V) const int nk = (int)min(32ll, send - (s0)); __syncthreads(); \
  for (int i_ = threadIdx.x; i_ < nk * D_; i_ += ROWS * 32) {{ \
    int j_ = i_ / D_, d_ = i_ - j_ * D_; long long s_ = (s0) + j_; \
    Ks[j_][d_] = LD(k[s_ * kss + b * ksb + h * ksh + d_]); \
    if (WITH_V) Vs[j_][d_] = LD(v[s_ * vss + b * vsb + h * vsh + d_]); }} \
  __syncthreads();
// This lane's score against key s0 + lane (-inf where masked out by causality or past S),
// the row's running max m updated into mn and this lane's exp(score - mn) into p.
#define ONLINE_STEP(s0, sc, mn, p) long long s = (s0) + lane; float sc = -INFINITY; \
  if (s < S && !(causal && s > l)) SCORE(Qs[warp], Ks[lane], l, s, sc); \
  float mn = fmaxf(m, wmax(sc)); float p = sc == -INFINITY ? 0.f : expf(sc - mn);
"#,
        t = codegen::storage_type(dtype),
        ld = codegen::load(dtype, CType::F32, "(e)"),
        st = codegen::store(dtype, CType::F32, "(e)"),
    )
}

/// Forward: out[l] = softmax(scale q[l] k^T + mask) v.
fn gen_forward(dtype: DType, d: usize) -> (String, String) {
    let name = kernel_name("fwd", dtype, d);
    let src = format!(
        r#"{common}
extern "C" __global__ void __launch_bounds__(ROWS * 32) {name}(KArgs a) {{
  ARGS
  T* out = (T*)a.w[4];
  __shared__ float Ks[32][D_ + 1]; __shared__ float Vs[32][D_]; __shared__ float Qs[ROWS][D_];
  long long l = (long long)blockIdx.y * ROWS + warp;
  bool ok = l < L;
  if (ok) for (int d = lane; d < D_; d += 32) Qs[warp][d] = LD(q[l * qsl + b * qsb + h * qsh + d]) * scale;
  float m = -INFINITY, den = 0.f, acc[PER];
  for (int i = 0; i < PER; i++) acc[i] = 0.f;
  KEY_END
  for (long long s0 = 0; s0 < send; s0 += 32) {{
    LOAD_KEYS(s0, nk, true)
    if (!ok) continue;
    ONLINE_STEP(s0, sc, mn, p)
    float corr = m == -INFINITY ? 0.f : expf(m - mn);
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
        common = common(dtype, d)
    );
    (name, src)
}

/// Backward, per query row: the row's log-sum-exp and delta = dO·O, then
/// dq = scale sum_s p (dO·v_s - delta) k_s.
fn gen_backward_q(dtype: DType, d: usize) -> (String, String) {
    let name = kernel_name("bwd_q", dtype, d);
    let src = format!(
        r#"{common}
extern "C" __global__ void __launch_bounds__(ROWS * 32) {name}(KArgs a) {{
  ARGS
  const T* o = (const T*)a.w[24]; const T* g = (const T*)a.w[25];
  float* dq = (float*)a.w[26]; float* lse = (float*)a.w[27]; float* dl = (float*)a.w[28];
  __shared__ float Ks[32][D_ + 1]; __shared__ float Vs[32][D_ + 1]; __shared__ float Qs[ROWS][D_]; __shared__ float Gs[ROWS][D_];
  long long l = (long long)blockIdx.y * ROWS + warp;
  bool ok = l < L;
  long long row = ((l * B + b) * H + h) * D_;
  float delta = 0.f;
  if (ok) for (int d = lane; d < D_; d += 32) {{
    Qs[warp][d] = LD(q[l * qsl + b * qsb + h * qsh + d]) * scale;
    float gd = LD(g[row + d]); Gs[warp][d] = gd; delta += gd * LD(o[row + d]);
  }}
  delta = wsum(delta);
  KEY_END
  float m = -INFINITY, den = 0.f;
  for (long long s0 = 0; s0 < send; s0 += 32) {{
    LOAD_KEYS(s0, nk, false)
    if (!ok) continue;
    ONLINE_STEP(s0, sc, mn, p)
    den = den * (m == -INFINITY ? 0.f : expf(m - mn)) + wsum(p);
    m = mn;
  }}
  float ls = m == -INFINITY ? -INFINITY : m + logf(den);
  float acc[PER];
  for (int i = 0; i < PER; i++) acc[i] = 0.f;
  for (long long s0 = 0; s0 < send; s0 += 32) {{
    LOAD_KEYS(s0, nk, true)
    if (!ok) continue;
    long long s = s0 + lane;
    float ds = 0.f;
    if (s < S && !(causal && s > l)) {{
      float sc; SCORE(Qs[warp], Ks[lane], l, s, sc);
      float p = (sc == -INFINITY || ls == -INFINITY) ? 0.f : expf(sc - ls);
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
    if (lane == 0) {{ lse[bh * L + l] = ls; dl[bh * L + l] = delta; }}
  }}
}}
"#,
        common = common(dtype, d)
    );
    (name, src)
}

/// Backward, per key row: dv = sum_l p dO_l and dk = scale sum_l p (dO_l·v - delta_l) q_l.
fn gen_backward_kv(dtype: DType, d: usize) -> (String, String) {
    let name = kernel_name("bwd_kv", dtype, d);
    let src = format!(
        r#"{common}
extern "C" __global__ void __launch_bounds__(ROWS * 32) {name}(KArgs a) {{
  ARGS
  const T* g = (const T*)a.w[25];
  const float* lse = (const float*)a.w[27]; const float* dl = (const float*)a.w[28];
  float* dk = (float*)a.w[29]; float* dv = (float*)a.w[30];
  __shared__ float Qt[32][D_ + 1]; __shared__ float Gt[32][D_ + 1]; __shared__ float Kw[ROWS][D_]; __shared__ float Vw[ROWS][D_];
  __shared__ float Lt[32]; __shared__ float Dt[32];
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
    for (int i = threadIdx.x; i < nl * D_; i += ROWS * 32) {{
      int j = i / D_, d = i - j * D_; long long l = l0 + j;
      Qt[j][d] = LD(q[l * qsl + b * qsb + h * qsh + d]) * scale;
      Gt[j][d] = LD(g[((l * B + b) * H + h) * D_ + d]);
    }}
    if (threadIdx.x < 32) {{
      long long l = l0 + threadIdx.x;
      Lt[threadIdx.x] = l < L ? lse[bh * L + l] : 0.f;
      Dt[threadIdx.x] = l < L ? dl[bh * L + l] : 0.f;
    }}
    __syncthreads();
    if (!ok) continue;
    long long l = l0 + lane;
    float p = 0.f, ds = 0.f;
    if (l < L && !(causal && s > l)) {{
      float sc; SCORE(Qt[lane], Kw[warp], l, s, sc);
      float ls = Lt[lane];
      p = (sc == -INFINITY || ls == -INFINITY) ? 0.f : expf(sc - ls);
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
    if (d < D_) {{ long long r = ((s * B + b) * H + h) * D_ + d; dk[r] = ak[i]; dv[r] = av[i]; }}
  }}
}}
"#,
        common = common(dtype, d)
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

/// Blocks: one per (batch, head) in x, one per ROWS rows in y (at most 65535).
fn grid(bh: usize, rows: usize) -> Result<(u32, u32, u32)> {
    if rows > MAX_ROWS || bh > i32::MAX as usize {
        return Err(crate::Error::arg("attention", format!("{rows} rows per head (at most {MAX_ROWS}) or {bh} heads in all (at most 2^31 - 1) exceed one launch")));
    }
    Ok((bh as u32, rows.div_ceil(ROWS) as u32, 1))
}

/// The attention output `[L, B, H, D]` in q's dtype. Inputs have a contiguous head dim.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool) -> Result<CudaStorage> {
    let dev = dev_of(q)?;
    let n = AttnDims::of(q.shape(), k.shape());
    let out = CudaStorage::new(&dev, q.dtype(), n.l * n.b * n.h * n.d)?;
    if out.len == 0 || n.s == 0 {
        return Ok(out);
    }
    let kern = dev.kernel(KernelKey::Named(kernel_name("fwd", q.dtype(), n.d)), || gen_forward(q.dtype(), n.d))?;
    let mut a = shared_args(q, k, v, mask, &n, scale, causal)?;
    a.w[4] = out.ptr();
    dev.launch(kern, grid(n.b * n.h, n.l)?, ((ROWS * 32) as u32, 1, 1), &a)?;
    Ok(out)
}

/// The packed F32 gradients `[dq | dk | dv | lse | delta]` (see `Op::AttentionBackward`).
/// `out` and `g` are contiguous `[L, B, H, D]`.
pub(crate) fn attention_backward(q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, g: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool) -> Result<CudaStorage> {
    let dev = dev_of(q)?;
    let n = AttnDims::of(q.shape(), k.shape());
    let packed = CudaStorage::new(&dev, DType::F32, n.packed_len())?;
    if packed.len == 0 {
        return Ok(packed);
    }
    let (nq, nk) = (n.l * n.b * n.h * n.d, n.s * n.b * n.h * n.d);
    if n.l == 0 || n.s == 0 || n.d == 0 {
        super::kernels::zero_fill(&dev, &packed)?;
        return Ok(packed);
    }
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
    let block = ((ROWS * 32) as u32, 1, 1);
    let kq = dev.kernel(KernelKey::Named(kernel_name("bwd_q", q.dtype(), n.d)), || gen_backward_q(q.dtype(), n.d))?;
    dev.launch(kq, grid(n.b * n.h, n.l)?, block, &a)?;
    let kkv = dev.kernel(KernelKey::Named(kernel_name("bwd_kv", q.dtype(), n.d)), || gen_backward_kv(q.dtype(), n.d))?;
    dev.launch(kkv, grid(n.b * n.h, n.s)?, block, &a)?;
    Ok(packed)
}
