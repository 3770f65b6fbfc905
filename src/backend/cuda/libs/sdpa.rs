//! Attention through cuDNN's fused scaled-dot-product attention for F16 / BF16 attention over
//! many keys, where its kernels beat kiln's own (`bash tools/device_call.sh $OUT sdpa`, figures
//! in `tools/attention/NOTES.md`):
//! - the forward is the graph API's single `OPERATION_SDPA_FWD` (cuDNN 9.13 on), which also
//!   writes each row's log-sum-exp beside the output (`CudaStorage::aux`). Causal attention,
//!   and attention with an additive mask, take the graph of matmul, pointwise and reduction
//!   operations cuDNN's engine fuses instead: the single operation takes masks only through a
//!   band-mask sub-graph (cuDNN 9.20);
//! - the backward is the graph of matmul, pointwise, reduction and reshape operations that the
//!   engine recognises (the single `OPERATION_SDPA_BWD` has engines on Blackwell only). It
//!   needs those log-sum-exps, so it follows a forward that kept them (cuDNN's or kiln's
//!   tensor-core one).
//!
//! The graphs are the ones cudnn-frontend builds (read from its logs on the H200 with
//! `bash tools/device_call.sh $OUT cudnnlog`). Everything else (a causal and an additive mask
//! together, a mask whose keys are not contiguous) and any geometry cuDNN offers no engine for
//! runs on the kernels of `attention.rs`.
//!
//! One plan per pass and geometry (dtype, sizes, q / k / v strides), built on first use and
//! kept in the device's cuDNN state; each call queues it on the thread's work stream with a
//! workspace from the caching allocator.

use crate::backend::cuda::libs::cudnn::{self, State};
use crate::backend::cuda::libs::cudnn_graph::{self, execute, ptr, tensor, Desc, Lives, Ops, Plan, Pointwise};
use crate::backend::cuda::kernels::data_ptr;
use crate::backend::cuda::{CudaDevice, CudaStorage};
use crate::ops::AttnDims;
use crate::{DType, Result, Tensor};
use cudarc::cudnn::sys as cs;
use cs::{cudnnBackendAttributeName_t as A, cudnnBackendDescriptorType_t as DT};
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::Arc;

/// Fewest keys for which cuDNN's attention forward is taken (H200: at 128 keys kiln's
/// tensor-core kernel is as fast or faster, from 256 on cuDNN's is faster;
/// `tools/attention/NOTES.md`).
const MIN_KEYS: usize = 256;
/// The same for the backward (H200, after kiln's tensor-core forward: at 128 keys cuDNN's
/// backward is as fast as kiln's kernels at D = 64 and 1.1-1.8x faster with more heads, D = 128,
/// causal or masked attention; `tools/attention/NOTES.md`).
const MIN_KEYS_BACKWARD: usize = 128;

/// `MIN_KEYS` or `MIN_KEYS_BACKWARD`, unless `KILN_CUDNN_MIN_KEYS` sets both (to time cuDNN
/// against kiln's kernels on short sequences).
fn min_keys(backward: bool) -> usize {
    crate::switches::cudnn_min_keys().unwrap_or(if backward { MIN_KEYS_BACKWARD } else { MIN_KEYS })
}
/// The first cuDNN with the operation.
const SINCE: usize = 91300;
/// The first cuDNN whose attention backward takes key counts off a multiple of 128 unpadded.
const BACKWARD_UNPADDED_SINCE: usize = 91501;
/// Largest head dim sent to cuDNN (what kiln's own kernels take too).
const MAX_HEAD_DIM: usize = 128;

thread_local! {
    static ENABLED: Cell<bool> = const { Cell::new(true) };
}

/// Runs `f` with cuDNN's fused attention allowed (`true`, the default) or not on this thread;
/// not allowed, every attention runs on kiln's own kernels. PyTorch's
/// `torch.nn.attention.sdpa_kernel` does the same for its backends. `KILN_CUDNN_ATTENTION=0`
/// turns it off for the whole process.
pub fn with_cudnn_attention<R>(enabled: bool, f: impl FnOnce() -> R) -> R {
    let before = ENABLED.with(|e| e.replace(enabled));
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            ENABLED.with(|e| e.set(self.0));
        }
    }
    let _restore = Restore(before);
    f()
}

fn allowed() -> bool {
    ENABLED.with(|e| e.get()) && !crate::switches::cudnn_attention_off()
}

/// Whether cuDNN is asked for this attention: F16 / BF16, a head dim that is a multiple of 8
/// (at most 128), at least `min_keys` keys, q, k and v rows 16-byte aligned, a cuDNN with the
/// forward operation loaded, and a causal mask or an additive one (whose keys are contiguous),
/// not both: PyTorch takes only one, so cudnn-frontend shows no graph for both, and the one
/// kiln built for them is not verified (its first check failed against a BF16 reference whose
/// own rounding was the larger error there, found after).
/// `backward`: asked for the backward pass.
pub(crate) fn takes(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, causal: bool, n: &AttnDims, backward: bool) -> Result<bool> {
    if !takes_sizes(q.dtype(), mask.is_some(), causal, n, backward) {
        return Ok(false);
    }
    if !loaded() {
        return Ok(false);
    }
    for t in [q, k, v] {
        if !crate::backend::cuda::kernels::attention::rows_aligned(t, 8)? {
            return Ok(false);
        }
    }
    match mask {
        Some(m) => Ok(bias_layout(m).is_some() && crate::backend::cuda::kernels::attention::rows_aligned(m, 8)?),
        None => Ok(true),
    }
}

/// Whether a cuDNN with the fused attention operation is loaded.
pub(crate) fn loaded() -> bool {
    cudnn::library().is_ok_and(|v| v >= SINCE)
}

/// `takes` as far as the dtype, sizes and masks tell (what a program planned for the GPU on
/// the host can know).
pub(crate) fn takes_sizes(dtype: DType, masked: bool, causal: bool, n: &AttnDims, backward: bool) -> bool {
    !(causal && masked) && allowed() && matches!(dtype, DType::F16 | DType::BF16) && n.d.is_multiple_of(8) && n.d <= MAX_HEAD_DIM && n.s >= min_keys(backward) && n.l > 0
}

/// An additive mask `[B, H, L, S]` as cuDNN's bias: (dims, strides) in cuDNN's order, a
/// broadcast dim (stride 0) of size 1. None: its keys are not contiguous.
fn bias_layout(m: &Tensor) -> Option<[[usize; 4]; 2]> {
    let (shape, strides) = (m.shape(), m.strides());
    if strides[3] != 1 && shape[3] != 1 {
        return None;
    }
    let dims: [usize; 4] = std::array::from_fn(|i| if strides[i] == 0 { 1 } else { shape[i] });
    let strides: [usize; 4] = std::array::from_fn(|i| if strides[i] == 0 { dims[i + 1..].iter().product() } else { strides[i] });
    Some([dims, strides])
}

/// The tensors' ids in a plan's variant pack (and, from `VIRTUAL` on, the graphs'
/// intermediate values, which live only inside cuDNN's kernel).
const Q: i64 = 1;
const K: i64 = 2;
const V: i64 = 3;
const O: i64 = 4;
const SCALE: i64 = 5;
const STATS: i64 = 6;
const DO: i64 = 7;
const DQ: i64 = 8;
const DK: i64 = 9;
const DV: i64 = 10;
/// Each row's sum of dO * O (the backward's `delta`), F32 `[B, H, L]`.
const DELTA: i64 = 11;
/// dq accumulated in F32 over the key tiles, `[B, H, L, D]`.
const DQ_SUM: i64 = 12;
/// A host scalar 1: the graph's dropout scale, which the engine's pattern includes.
const ONE: i64 = 13;
/// A host scalar -inf: the causal mask's masked scores.
const MINUS_INF: i64 = 14;
/// An additive mask, in the inputs' dtype, `[B | 1, H | 1, L | 1, S]`.
const BIAS: i64 = 15;

/// What a plan computes.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum PlanKind {
    /// The forward; `stats`: also each row's log-sum-exp.
    Forward { stats: bool },
    /// The forward as a graph of operations (the single operation takes neither a causal nor
    /// an additive mask here), with each row's log-sum-exp.
    MaskedForward,
    /// The backward, its gradients in the inputs' dtype. (cuDNN 9.14 builds a plan with F32
    /// gradients too, but its values are wrong: checked on the H200.)
    Backward,
}

/// What a plan depends on: its pass, the dtype, the sizes (B, H, L, S, D), q, k, v's strides
/// along L, B and H, those of the output, its gradient and the gradients of q, k and v (`io`;
/// the forward's only the first), whether it is causal, and the additive mask's layout
/// (`bias_layout`).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Key {
    pass: PlanKind,
    dtype: DType,
    n: [usize; 5],
    strides: [[usize; 3]; 3],
    io: [[usize; 3]; 5],
    causal: bool,
    bias: Option<[[usize; 4]; 2]>,
}

impl Key {
    fn new(pass: PlanKind, a: &Attn, io: [[usize; 3]; 5]) -> Key {
        let (q, k, v, n) = (a.q, a.k, a.v, a.n);
        Key { pass, dtype: q.dtype(), n: [n.b, n.h, n.l, n.s, n.d], strides: [lbh(q), lbh(k), lbh(v)], io, causal: a.causal, bias: a.mask.and_then(bias_layout) }
    }
}

/// A `[L, B, H, D]` tensor's strides along L, B and H.
fn lbh(t: &Tensor) -> [usize; 3] {
    [t.strides()[0], t.strides()[1], t.strides()[2]]
}

/// Strides along L, B and H as cuDNN's `[B, H, L, D]` strides.
fn bhld(st: [usize; 3]) -> [usize; 4] {
    [st[1], st[2], st[0], 1]
}

/// One attention's operands, as `attention.rs` has them.
pub(crate) struct Attn<'a> {
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub mask: Option<&'a Tensor>,
    pub n: &'a AttnDims,
    pub scale: f64,
    pub causal: bool,
}

/// What `Ops::scores` made: the ids of Q, Kᵀ, the log-sum-exps, the scale and the scores, and
/// the scores' dims and strides.
struct Scores {
    q: usize,
    kt: usize,
    stats: usize,
    scale: usize,
    scores: usize,
    dims: [usize; 4],
    strides: [usize; 4],
}

/// The attention graphs' steps.
impl Ops {
    /// The inputs every graph of `key` but the single forward operation starts from (Q, Kᵀ,
    /// the rows' log-sum-exps, the scale) and the scores Q Kᵀ scale, plus the additive mask
    /// where there is one, in F32 `[B, H, L, S]`.
    fn scores(&mut self, key: &Key) -> std::result::Result<Scores, String> {
        let (dt, float) = (cudnn::data_type(key.dtype), cs::cudnnDataType_t::CUDNN_DATA_FLOAT);
        let [b, h, l, s, d] = key.n;
        let [sq, sk, _] = key.strides;
        // kiln's [L, B, H, D] tensors seen as cuDNN's [B, H, L, D]; K enters transposed.
        let q = self.keep(tensor(Q, dt, [b, h, l, d], bhld(sq), Lives::Memory)?);
        let kt = self.keep(tensor(K, dt, [b, h, d, s], [sk[1], sk[2], 1, sk[0]], Lives::Memory)?);
        let stats = self.keep(tensor(STATS, float, [b, h, l, 1], [h * l, l, 1, 1], Lives::Memory)?);
        let scale = self.keep(tensor(SCALE, float, [1; 4], [1; 4], Lives::ByValue)?);
        let (dims, strides) = ([b, h, l, s], [h * l * s, l * s, s, 1]);
        let raw = self.virtual_tensor(float, dims, strides)?;
        self.matmul(q, kt, raw)?;
        let scaled = self.virtual_tensor(float, dims, strides)?;
        self.pointwise(cs::cudnnPointwiseMode_t::CUDNN_POINTWISE_MUL, raw, Some(scale), scaled)?;
        let scores = self.add_bias(key, scaled, dims, strides)?;
        Ok(Scores { q, kt, stats, scale, scores, dims, strides })
    }
    /// `x` (F32 `[B, H, L, S]`) plus the additive mask of `key`, where it has one.
    fn add_bias(&mut self, key: &Key, x: usize, dims: [usize; 4], strides: [usize; 4]) -> std::result::Result<usize, String> {
        let Some([bias_dims, bias_strides]) = key.bias else { return Ok(x) };
        let bias = self.keep(tensor(BIAS, cudnn::data_type(key.dtype), bias_dims, bias_strides, Lives::Memory)?);
        let y = self.virtual_tensor(cs::cudnnDataType_t::CUDNN_DATA_FLOAT, dims, strides)?;
        self.pointwise(cs::cudnnPointwiseMode_t::CUDNN_POINTWISE_ADD, x, Some(bias), y)?;
        Ok(y)
    }
    /// `x` (F32 `[B, H, L, S]`) with -inf where the key comes after the query (top-left
    /// aligned, as PyTorch's `is_causal`).
    fn causal_mask(&mut self, x: usize, dims: [usize; 4], strides: [usize; 4]) -> std::result::Result<usize, String> {
        use cs::cudnnDataType_t as D;
        use cs::cudnnPointwiseMode_t as M;
        let index = |g: &mut Ops, axis| -> std::result::Result<usize, String> {
            let i = g.virtual_tensor(D::CUDNN_DATA_INT32, dims, strides)?;
            g.pointwise_op(Pointwise { mode: M::CUDNN_POINTWISE_GEN_INDEX, x, y: i, axis: Some(axis), ..Default::default() })?;
            Ok(i)
        };
        let (row, col) = (index(self, 2)?, index(self, 3)?);
        let keep = self.virtual_tensor(D::CUDNN_DATA_BOOLEAN, dims, strides)?;
        self.pointwise_op(Pointwise { mode: M::CUDNN_POINTWISE_CMP_GE, x: row, b: Some(col), y: keep, precision: D::CUDNN_DATA_BOOLEAN, ..Default::default() })?;
        let minus_inf = self.keep(tensor(MINUS_INF, D::CUDNN_DATA_FLOAT, [1; 4], [1; 4], Lives::ByValue)?);
        let masked = self.virtual_tensor(D::CUDNN_DATA_FLOAT, dims, strides)?;
        self.pointwise_op(Pointwise { mode: M::CUDNN_POINTWISE_BINARY_SELECT, x, b: Some(minus_inf), t: Some(keep), y: masked, ..Default::default() })?;
        Ok(masked)
    }
}

/// The forward as a graph: the single SDPA operation, with each row's log-sum-exp when asked.
fn forward_graph(key: &Key, stats: bool) -> std::result::Result<Ops, String> {
    let dt = cudnn::data_type(key.dtype);
    let float = cs::cudnnDataType_t::CUDNN_DATA_FLOAT;
    let [b, heads, l, s, d] = key.n;
    // kiln's [L, B, H, D] tensors seen as cuDNN's [B, H, L, D].
    let strided = |uid, seq, st: [usize; 3]| tensor(uid, dt, [b, heads, seq, d], bhld(st), Lives::Memory);
    let mut g = Ops::default();
    let op = Desc::new(DT::CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR)?;
    let tensors = [
        (A::CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC, strided(Q, l, key.strides[0])?),
        (A::CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC, strided(K, s, key.strides[1])?),
        (A::CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC, strided(V, s, key.strides[2])?),
        (A::CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC, strided(O, l, key.io[0])?),
        (A::CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC, tensor(SCALE, float, [1; 4], [1; 4], Lives::ByValue)?),
    ];
    for (name, t) in tensors {
        op.set_desc(name, &t)?;
        g.keep(t);
    }
    if stats {
        let t = tensor(STATS, float, [b, heads, l, 1], [heads * l, l, 1, 1], Lives::Memory)?;
        op.set_desc(A::CUDNN_ATTR_OPERATION_SDPA_FWD_STATSDESC, &t)?;
        g.keep(t);
    }
    g.ops.push(op.finalize()?);
    Ok(g)
}

/// The forward with a causal or additive mask as the graph cuDNN's fused attention engine
/// recognises (the one cudnn-frontend builds: the single operation takes masks only from
/// cuDNN 9.20): the scores Q Kᵀ scale plus the mask, -inf after each query where causal, their
/// softmax by its maximum and sum (each row's log-sum-exp written out), then P V.
fn masked_forward_graph(key: &Key) -> std::result::Result<Ops, String> {
    use cs::cudnnPointwiseMode_t as M;
    use cs::cudnnReduceTensorOp_t as R;
    let (dt, float) = (cudnn::data_type(key.dtype), cs::cudnnDataType_t::CUDNN_DATA_FLOAT);
    let [b, h, l, s, d] = key.n;
    let mut g = Ops::default();
    let Scores { stats, scores, dims, strides, .. } = g.scores(key)?;
    let sv = key.strides[2];
    let v = g.keep(tensor(V, dt, [b, h, s, d], bhld(sv), Lives::Memory)?);
    let o = g.keep(tensor(O, dt, [b, h, l, d], bhld(key.io[0]), Lives::Memory)?);
    let row = ([b, h, l, 1], [h * l, l, 1, 1]);
    let masked = if key.causal { g.causal_mask(scores, dims, strides)? } else { scores };
    let max = g.virtual_tensor(float, row.0, row.1)?;
    g.reduce(R::CUDNN_REDUCE_TENSOR_MAX, masked, max)?;
    let shifted = g.virtual_tensor(float, dims, strides)?;
    g.pointwise(M::CUDNN_POINTWISE_SUB, masked, Some(max), shifted)?;
    let e = g.virtual_tensor(float, dims, strides)?;
    g.pointwise(M::CUDNN_POINTWISE_EXP, shifted, None, e)?;
    let sum = g.virtual_tensor(float, row.0, row.1)?;
    g.reduce(R::CUDNN_REDUCE_TENSOR_ADD, e, sum)?;
    let log_sum = g.virtual_tensor(float, row.0, row.1)?;
    g.pointwise(M::CUDNN_POINTWISE_LOG, sum, None, log_sum)?;
    g.pointwise(M::CUDNN_POINTWISE_ADD, max, Some(log_sum), stats)?;
    let p = g.virtual_tensor(dt, dims, strides)?;
    g.pointwise(M::CUDNN_POINTWISE_DIV, e, Some(sum), p)?;
    g.matmul(p, v, o)?;
    Ok(g)
}

/// The backward as the graph cuDNN's fused attention engine recognises (the one cudnn-frontend
/// builds): the probabilities recomputed from the scores and each row's log-sum-exp, then
/// dV = Pᵀ dO, dS = P (dO Vᵀ - delta) scale, dK = dSᵀ Q and dQ = dS K (accumulated in F32),
/// with delta = rowsum(dO * O). `causal`: the scores of keys after their query are -inf (an
/// index comparison and a select, which the engine fuses).
fn backward_graph(key: &Key) -> std::result::Result<Ops, String> {
    use cs::cudnnPointwiseMode_t as M;
    let (dt, float) = (cudnn::data_type(key.dtype), cs::cudnnDataType_t::CUDNN_DATA_FLOAT);
    let [b, h, l, s, d] = key.n;
    let mut g = Ops::default();
    let Scores { q, kt, stats, scale, scores, dims, strides } = g.scores(key)?;
    let mem = |uid, ty, dims, strides| tensor(uid, ty, dims, strides, Lives::Memory);
    // V enters transposed; the output, its gradient and the gradients as `key.io` lays them.
    let sv = key.strides[2];
    let [so, sdo, sdq, sdk, sdv] = key.io.map(bhld);
    let vt = g.keep(mem(V, dt, [b, h, d, s], [sv[1], sv[2], 1, sv[0]])?);
    let o = g.keep(mem(O, dt, [b, h, l, d], so)?);
    let d_o = g.keep(mem(DO, dt, [b, h, l, d], sdo)?);
    let delta = g.keep(mem(DELTA, float, [b, h, l, 1], [h * l, l, 1, 1])?);
    let dq_sum = g.keep(mem(DQ_SUM, float, [b, h, l, d], [h * l * d, l * d, d, 1])?);
    let dq = g.keep(mem(DQ, dt, [b, h, l, d], sdq)?);
    let dk = g.keep(mem(DK, dt, [b, h, s, d], sdk)?);
    let dv = g.keep(mem(DV, dt, [b, h, s, d], sdv)?);
    let one = g.keep(tensor(ONE, float, [1; 4], [1; 4], Lives::ByValue)?);
    let (dims_t, strides_t) = ([b, h, s, l], [h * l * s, l * s, 1, s]);
    // delta = rowsum(dO * O) (times the dropout scale, 1).
    let prod = g.virtual_tensor(float, [b, h, l, d], [h * l * d, l * d, d, 1])?;
    g.pointwise(M::CUDNN_POINTWISE_MUL, d_o, Some(o), prod)?;
    let sum = g.virtual_tensor(float, [b, h, l, 1], [h * l, l, 1, 1])?;
    g.reduce(cs::cudnnReduceTensorOp_t::CUDNN_REDUCE_TENSOR_ADD, prod, sum)?;
    g.pointwise(M::CUDNN_POINTWISE_MUL, sum, Some(one), delta)?;
    // P = exp(scores - lse).
    let shifted = g.virtual_tensor(float, dims, strides)?;
    g.pointwise(M::CUDNN_POINTWISE_SUB, scores, Some(stats), shifted)?;
    let shifted = if key.causal { g.causal_mask(shifted, dims, strides)? } else { shifted };
    let p = g.virtual_tensor(float, dims, strides)?;
    g.pointwise(M::CUDNN_POINTWISE_EXP, shifted, None, p)?;
    // dV = Pᵀ dO.
    let p_t = g.virtual_tensor(dt, dims_t, strides_t)?;
    g.reshape(p, p_t)?;
    g.matmul(p_t, d_o, dv)?;
    // dS = P (dO Vᵀ - delta) scale.
    let dp = g.virtual_tensor(float, dims, strides)?;
    g.matmul(d_o, vt, dp)?;
    let centred = g.virtual_tensor(float, dims, strides)?;
    g.pointwise(M::CUDNN_POINTWISE_SUB, dp, Some(delta), centred)?;
    let ds_raw = g.virtual_tensor(float, dims, strides)?;
    g.pointwise(M::CUDNN_POINTWISE_MUL, centred, Some(p), ds_raw)?;
    let ds = g.virtual_tensor(float, dims, strides)?;
    g.pointwise(M::CUDNN_POINTWISE_MUL, ds_raw, Some(scale), ds)?;
    // dK = dSᵀ Q.
    let ds_t = g.virtual_tensor(dt, dims_t, strides_t)?;
    g.reshape(ds, ds_t)?;
    g.matmul(ds_t, q, dk)?;
    // dQ = dS K, accumulated in F32, then written out.
    let k = g.virtual_tensor(float, [b, h, s, d], [h * s * d, s * d, d, 1])?;
    g.reshape(kt, k)?;
    g.matmul(ds, k, dq_sum)?;
    g.pointwise(M::CUDNN_POINTWISE_IDENTITY, dq_sum, None, dq)?;
    Ok(g)
}

/// Builds the plan of `key`: its graph, the heuristics' engine configurations in their order,
/// the first that finalizes.
fn build(h: cs::cudnnHandle_t, key: &Key) -> std::result::Result<Plan, String> {
    let g = match key.pass {
        PlanKind::Forward { stats } => forward_graph(key, stats)?,
        PlanKind::MaskedForward => masked_forward_graph(key)?,
        PlanKind::Backward => backward_graph(key)?,
    };
    cudnn_graph::plan(h, g)
}

/// The first of `keys` cuDNN has a plan for (built on first use and kept in the device's
/// cache, as is the absence of one, said once under `KILN_LOG=kernels`).
fn first_plan<const N: usize>(st: &mut State, keys: [Key; N]) -> Option<Key> {
    for key in keys {
        if !st.sdpa.contains_key(&key) {
            // cuDNN compiles the plan's kernel at run time: a first call per geometry pays it.
            let started = std::time::Instant::now();
            let plan = match build(st.handle, &key) {
                Ok(p) => {
                    crate::logging::log(crate::logging::Topic::Kernels, || format!("cudnn attention: plan for {key:?} built in {:.1} ms", started.elapsed().as_secs_f64() * 1e3));
                    Some(p)
                }
                Err(why) => {
                    crate::logging::log(crate::logging::Topic::Kernels, || format!("cudnn attention: no plan for {key:?} ({why})"));
                    None
                }
            };
            st.sdpa.insert(key.clone(), plan);
        }
        if st.sdpa[&key].is_some() {
            return Some(key);
        }
    }
    crate::logging::log(crate::logging::Topic::Kernels, || "cudnn attention: kiln's kernels run it".into());
    None
}

/// The attention `a` into `out` (`[L, B, H, D]` with strides `out_strides` along L, B and H,
/// q's dtype), with each row's log-sum-exp of its scaled scores (F32 `[B, H, L]`, returned for
/// the backward) where cuDNN has a plan that writes them (with a mask: always). None: cuDNN has
/// no plan for it, nothing was queued.
pub(crate) fn forward(dev: &Arc<CudaDevice>, a: &Attn, out: u64, out_strides: [usize; 3]) -> Result<Option<Option<CudaStorage>>> {
    let (qp, kp, vp, mp) = (data_ptr(a.q)?, data_ptr(a.k)?, data_ptr(a.v)?, a.mask.map(data_ptr).transpose()?);
    let (scale, minus_inf) = (a.scale as f32, f32::NEG_INFINITY);
    let n = a.n;
    cudnn::session(dev, "scaled_dot_product_attention", |st| {
        let key = |pass| Key::new(pass, a, [out_strides, [0; 3], [0; 3], [0; 3], [0; 3]]);
        let found = if a.causal || a.mask.is_some() { first_plan(st, [key(PlanKind::MaskedForward)]) } else { first_plan(st, [key(PlanKind::Forward { stats: true }), key(PlanKind::Forward { stats: false })]) };
        let Some(key) = found else { return Ok(None) };
        let stats = if key.pass != (PlanKind::Forward { stats: false }) { Some(CudaStorage::new(dev, DType::F32, n.b * n.h * n.l)?) } else { None };
        if dev.work().stream().is_none() {
            return Ok(Some(stats));
        }
        let mut ptrs = vec![(Q, ptr(qp)), (K, ptr(kp)), (V, ptr(vp)), (O, ptr(out)), (SCALE, &scale as *const f32 as *mut c_void)];
        ptrs.extend(stats.as_ref().map(|s| (STATS, ptr(s.ptr()))));
        ptrs.extend(a.causal.then_some((MINUS_INF, &minus_inf as *const f32 as *mut c_void)));
        ptrs.extend(mp.map(|m| (BIAS, ptr(m))));
        let _rec = crate::profiler::cudnn(dev, "sdpa_fwd", a.q.dtype());
        let plan = st.sdpa[&key].as_ref().expect("found above");
        execute(dev, st.handle, plan, &ptrs, "scaled_dot_product_attention")?;
        Ok(Some(stats))
    })
}

/// The gradients of the attention `a` whose output is `out` and output gradient `g` (both
/// `[L, B, H, D]`, any strides along L, B and H), in q's dtype into `packed` where `grads`
/// puts dq, dk and dv (first element, strides along L or S, B and H: `AttnDims::grads`; the
/// packed `lse` and `delta` are left as they are). `out` must carry its rows' log-sum-exps
/// (`CudaStorage::aux`). Ok(false): cuDNN has no plan for it (or `out` has no log-sum-exps, or
/// a row of `out` or `g` is not 16-byte aligned), nothing was queued.
pub(crate) fn backward(dev: &Arc<CudaDevice>, a: &Attn, out: &Tensor, g: &Tensor, packed: &CudaStorage, grads: [(usize, [usize; 3]); 3]) -> Result<bool> {
    let (Some(lse), op, gp) = (crate::backend::cuda::kernels::aux_ptr(out), data_ptr(out)?, data_ptr(g)?) else { return Ok(false) };
    use crate::backend::cuda::kernels::attention::rows_aligned;
    // (A broadcast gradient, stride 0 along a dim, is copied first.)
    let dense = |t: &Tensor| t.shape().iter().zip(t.strides()).all(|(&n, &s)| n <= 1 || s > 0);
    if out.strides()[3] != 1 || g.strides()[3] != 1 || !dense(out) || !dense(g) || !rows_aligned(out, 8)? || !rows_aligned(g, 8)? {
        return Ok(false);
    }
    let n = a.n;
    // Before 9.15.1 the backward of key counts off a multiple of 128 needs a padding mask in
    // the graph (what cudnn-frontend adds); those run on kiln's kernels there.
    let padded = !n.s.is_multiple_of(128) && cudnn::library().map_or(true, |v| v < BACKWARD_UNPADDED_SINCE);
    if padded {
        return Ok(false);
    }
    let (qp, kp, vp, mp) = (data_ptr(a.q)?, data_ptr(a.k)?, data_ptr(a.v)?, a.mask.map(data_ptr).transpose()?);
    let nq = n.l * n.b * n.h * n.d;
    let at = |elems: usize| packed.ptr() + (elems * packed.dtype.size_in_bytes()) as u64;
    let (scale, one, minus_inf) = (a.scale as f32, 1f32, f32::NEG_INFINITY);
    let dtype = a.q.dtype();
    cudnn::session(dev, "scaled_dot_product_attention", |st| {
        let io = [lbh(out), lbh(g), grads[0].1, grads[1].1, grads[2].1];
        let Some(key) = first_plan(st, [Key::new(PlanKind::Backward, a, io)]) else { return Ok(false) };
        // Each row's delta, and dq's F32 sums (cuDNN adds each key tile's part into them; from
        // cuDNN 9.6 on it clears them itself).
        let delta = CudaStorage::new(dev, DType::F32, n.b * n.h * n.l)?;
        let dq_sum = CudaStorage::new(dev, DType::F32, nq)?;
        if dev.work().stream().is_none() {
            return Ok(true);
        }
        let mut ptrs = vec![
            (Q, ptr(qp)),
            (K, ptr(kp)),
            (V, ptr(vp)),
            (O, ptr(op)),
            (DO, ptr(gp)),
            (STATS, ptr(lse)),
            (SCALE, &scale as *const f32 as *mut c_void),
            (ONE, &one as *const f32 as *mut c_void),
            (DELTA, ptr(delta.ptr())),
            (DQ_SUM, ptr(dq_sum.ptr())),
            (DQ, ptr(at(grads[0].0))),
            (DK, ptr(at(grads[1].0))),
            (DV, ptr(at(grads[2].0))),
        ];
        ptrs.extend(a.causal.then_some((MINUS_INF, &minus_inf as *const f32 as *mut c_void)));
        ptrs.extend(mp.map(|m| (BIAS, ptr(m))));
        let _rec = crate::profiler::cudnn(dev, "sdpa_bwd", dtype);
        let plan = st.sdpa[&key].as_ref().expect("found above");
        execute(dev, st.handle, plan, &ptrs, "scaled_dot_product_attention")?;
        Ok(true)
    })
}

#[cfg(test)]
mod tests {
    use super::bias_layout;
    use crate::{DType, Device, Tensor};

    #[test]
    fn a_mask_becomes_a_bias_with_its_broadcast_dims_of_size_one() {
        let m = |shape: &[usize]| Tensor::zeros(shape, DType::BF16, &Device::Cpu).unwrap();
        // A padding mask per batch and key, broadcast over heads and queries.
        let padding = m(&[2, 1, 1, 256]).expand(&[2, 4, 200, 256]).unwrap();
        assert_eq!(bias_layout(&padding), Some([[2, 1, 1, 256], [256, 256, 256, 1]]));
        // A full mask keeps its dims and strides; one shared by the batch has a batch of 1.
        assert_eq!(bias_layout(&m(&[2, 4, 200, 256])), Some([[2, 4, 200, 256], [204800, 51200, 256, 1]]));
        let shared = m(&[1, 4, 200, 256]).expand(&[3, 4, 200, 256]).unwrap();
        assert_eq!(bias_layout(&shared), Some([[1, 4, 200, 256], [204800, 51200, 256, 1]]));
        // Keys that are not contiguous are not a bias cuDNN takes.
        let transposed = m(&[2, 4, 256, 200]).transpose(2, 3).unwrap();
        assert_eq!(bias_layout(&transposed), None);
    }
}
