//! Attention forward through cuDNN's fused scaled-dot-product operation (the graph API's
//! `OPERATION_SDPA_FWD`, cuDNN 9.13 on) for F16 / BF16 attention without a mask over many keys,
//! where its kernel beats kiln's own (`bash tools/device_call.sh $OUT sdpa`, figures in
//! `tools/attention/NOTES.md`). Everything else, and any geometry cuDNN offers no engine for,
//! runs on the kernels of `attention.rs`. So does every backward: kiln's backward kernels take
//! the output from here, with each row's log-sum-exp where the plan writes them, as they take
//! their own forward's; cuDNN's backward operation has engines on Blackwell only. Masks and
//! causal attention stay on kiln's kernels too: the operation takes them only through a
//! band-mask sub-graph from cuDNN 9.20.
//!
//! One plan per geometry (dtype, sizes, q / k / v strides), built on first use and kept in the
//! device's cuDNN state; each call queues it on the thread's work stream with a workspace from
//! the caching allocator.

use super::cudnn::{self, State};
use super::kernels::data_ptr;
use super::{CudaDevice, CudaStorage};
use crate::ops::AttnDims;
use crate::{DType, Error, Result, Tensor};
use cudarc::cudnn::sys as cs;
use cs::{cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as T, cudnnBackendDescriptorType_t as DT};
use std::cell::Cell;
use std::ffi::c_void;
use std::sync::Arc;

/// Fewest keys for which cuDNN's attention is taken (H200: at 128 keys kiln's tensor-core
/// kernel is as fast or faster, from 256 on cuDNN's is faster; `tools/attention/NOTES.md`).
const MIN_KEYS: usize = 256;
/// The first cuDNN with the operation.
const SINCE: usize = 91300;
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
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    ENABLED.with(|e| e.get()) && !*OFF.get_or_init(|| std::env::var("KILN_CUDNN_ATTENTION").is_ok_and(|v| v == "0"))
}

/// Whether cuDNN is asked for this attention: F16 / BF16, no mask, not causal, a head dim that
/// is a multiple of 8 (at most 128), at least `MIN_KEYS` keys, q, k and v rows 16-byte aligned,
/// and a cuDNN with the operation loaded.
pub(crate) fn takes(q: &Tensor, k: &Tensor, v: &Tensor, masked: bool, causal: bool, n: &AttnDims) -> Result<bool> {
    if masked || causal || !allowed() || !matches!(q.dtype(), DType::F16 | DType::BF16) || n.d % 8 != 0 || n.d > MAX_HEAD_DIM || n.s < MIN_KEYS || n.l == 0 {
        return Ok(false);
    }
    if !cudnn::library().is_ok_and(|v| v >= SINCE) {
        return Ok(false);
    }
    for t in [q, k, v] {
        if !super::attention::rows_aligned(t, 8)? {
            return Ok(false);
        }
    }
    Ok(true)
}

/// The tensors' ids in a plan's variant pack.
const Q: i64 = 1;
const K: i64 = 2;
const V: i64 = 3;
const O: i64 = 4;
const SCALE: i64 = 5;
const STATS: i64 = 6;

/// What a plan depends on: whether it writes each row's log-sum-exp, the dtype, the sizes (B,
/// H, L, S, D) and q, k, v's strides along L, B and H.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
pub(crate) struct Key {
    stats: bool,
    dtype: DType,
    n: [usize; 5],
    strides: [[usize; 3]; 3],
}

impl Key {
    fn new(stats: bool, q: &Tensor, k: &Tensor, v: &Tensor, n: &AttnDims) -> Key {
        let s = |t: &Tensor| [t.strides()[0], t.strides()[1], t.strides()[2]];
        Key { stats, dtype: q.dtype(), n: [n.b, n.h, n.l, n.s, n.d], strides: [s(q), s(k), s(v)] }
    }
}

/// A backend descriptor, destroyed with its owner.
struct Desc(cs::cudnnBackendDescriptor_t);
// SAFETY: descriptors are used under the device's cuDNN mutex only.
unsafe impl Send for Desc {}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor, destroyed once.
        unsafe { cs::cudnnBackendDestroyDescriptor(self.0) };
    }
}

fn check(status: cs::cudnnStatus_t, what: &str) -> std::result::Result<(), String> {
    if status == cs::cudnnStatus_t::CUDNN_STATUS_SUCCESS {
        return Ok(());
    }
    let mut buf = [0 as std::ffi::c_char; 512];
    // SAFETY: writes at most buf.len() bytes, NUL-terminated.
    unsafe { cs::cudnnGetLastErrorString(buf.as_mut_ptr(), buf.len()) };
    // SAFETY: NUL-terminated above.
    let last = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().trim().to_string();
    Err(format!("{what}: {status:?}{}{last}", if last.is_empty() { "" } else { ": " }))
}

impl Desc {
    fn new(ty: DT) -> std::result::Result<Desc, String> {
        let mut d = std::ptr::null_mut();
        // SAFETY: an out-pointer for a new descriptor.
        check(unsafe { cs::cudnnBackendCreateDescriptor(ty, &mut d) }, &format!("creating {ty:?}"))?;
        Ok(Desc(d))
    }
    fn set<V>(&self, name: A, ty: T, vals: &[V]) -> std::result::Result<(), String> {
        // SAFETY: `vals` holds vals.len() elements of the type `ty` names.
        check(unsafe { cs::cudnnBackendSetAttribute(self.0, name, ty, vals.len() as i64, vals.as_ptr() as *const c_void) }, &format!("setting {name:?}"))
    }
    fn set_desc(&self, name: A, d: &Desc) -> std::result::Result<(), String> {
        self.set(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[d.0])
    }
    fn finalize(self) -> std::result::Result<Desc, String> {
        // SAFETY: a live descriptor.
        check(unsafe { cs::cudnnBackendFinalize(self.0) }, "finalizing a descriptor")?;
        Ok(self)
    }
}

/// A tensor of dims `dims` and strides `strides` (elements); `by_value` for a host scalar.
fn tensor(uid: i64, dtype: cs::cudnnDataType_t, dims: [usize; 4], strides: [usize; 4], by_value: bool) -> std::result::Result<Desc, String> {
    let t = Desc::new(DT::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    t.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, T::CUDNN_TYPE_INT64, &[uid])?;
    t.set(A::CUDNN_ATTR_TENSOR_DATA_TYPE, T::CUDNN_TYPE_DATA_TYPE, &[dtype])?;
    t.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, T::CUDNN_TYPE_INT64, &dims.map(|x| x as i64))?;
    t.set(A::CUDNN_ATTR_TENSOR_STRIDES, T::CUDNN_TYPE_INT64, &strides.map(|x| x as i64))?;
    t.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, T::CUDNN_TYPE_INT64, &[if by_value { 4i64 } else { 16 }])?;
    if by_value {
        t.set(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, T::CUDNN_TYPE_BOOLEAN, &[true])?;
    }
    t.finalize()
}

/// An execution plan and the descriptors it was built from.
pub(crate) struct Plan {
    plan: Desc,
    _parts: Vec<Desc>,
    workspace: usize,
}

/// Builds the plan of `key`: the single SDPA operation as a graph, the heuristics' engine
/// configurations in their order, the first that finalizes.
fn build(h: cs::cudnnHandle_t, key: &Key) -> std::result::Result<Plan, String> {
    let dt = cudnn::data_type(key.dtype);
    let [b, heads, l, s, d] = key.n;
    // kiln's [L, B, H, D] tensors seen as cuDNN's [B, H, L, D]; the output contiguous.
    let strided = |uid, seq, st: [usize; 3]| tensor(uid, dt, [b, heads, seq, d], [st[1], st[2], st[0], 1], false);
    let mut parts = vec![strided(Q, l, key.strides[0])?, strided(K, s, key.strides[1])?, strided(V, s, key.strides[2])?];
    parts.push(tensor(O, dt, [b, heads, l, d], [heads * d, d, b * heads * d, 1], false)?);
    parts.push(tensor(SCALE, cs::cudnnDataType_t::CUDNN_DATA_FLOAT, [1; 4], [1; 4], true)?);
    parts.push(tensor(STATS, cs::cudnnDataType_t::CUDNN_DATA_FLOAT, [b, heads, l, 1], [heads * l, l, 1, 1], false)?);
    let op = Desc::new(DT::CUDNN_BACKEND_OPERATION_SDPA_FWD_DESCRIPTOR)?;
    let names = [
        A::CUDNN_ATTR_OPERATION_SDPA_FWD_QDESC,
        A::CUDNN_ATTR_OPERATION_SDPA_FWD_KDESC,
        A::CUDNN_ATTR_OPERATION_SDPA_FWD_VDESC,
        A::CUDNN_ATTR_OPERATION_SDPA_FWD_ODESC,
        A::CUDNN_ATTR_OPERATION_SDPA_FWD_SCALEDESC,
    ];
    for (name, t) in names.into_iter().zip(&parts) {
        op.set_desc(name, t)?;
    }
    if key.stats {
        op.set_desc(A::CUDNN_ATTR_OPERATION_SDPA_FWD_STATSDESC, &parts[5])?;
    }
    let op = op.finalize()?;
    let graph = Desc::new(DT::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, T::CUDNN_TYPE_HANDLE, &[h])?;
    graph.set_desc(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, &op)?;
    let graph = graph.finalize()?;
    let heur = Desc::new(DT::CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR)?;
    heur.set_desc(A::CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, &graph)?;
    heur.set(A::CUDNN_ATTR_ENGINEHEUR_MODE, T::CUDNN_TYPE_HEUR_MODE, &[cs::cudnnBackendHeurMode_t::CUDNN_HEUR_MODE_A])?;
    let heur = heur.finalize()?;
    let results = A::CUDNN_ATTR_ENGINEHEUR_RESULTS;
    let mut count = 0i64;
    // SAFETY: asks for the number of results only.
    check(unsafe { cs::cudnnBackendGetAttribute(heur.0, results, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &mut count, std::ptr::null_mut()) }, "counting engine configurations")?;
    let configs = (0..count).map(|_| Desc::new(DT::CUDNN_BACKEND_ENGINECFG_DESCRIPTOR)).collect::<std::result::Result<Vec<_>, _>>()?;
    let mut raw: Vec<cs::cudnnBackendDescriptor_t> = configs.iter().map(|c| c.0).collect();
    let mut got = 0i64;
    // SAFETY: `raw` holds `count` created engine-configuration descriptors to fill.
    check(unsafe { cs::cudnnBackendGetAttribute(heur.0, results, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &mut got, raw.as_mut_ptr() as *mut c_void) }, "reading engine configurations")?;
    let mut why = format!("the heuristics proposed {got} engine configurations");
    for config in configs.iter().take(got.max(0) as usize) {
        let plan = Desc::new(DT::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
        plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, T::CUDNN_TYPE_HANDLE, &[h])?;
        plan.set_desc(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config)?;
        match plan.finalize() {
            Ok(plan) => {
                let (mut n, mut bytes) = (0i64, 0i64);
                // SAFETY: one INT64 into `bytes`.
                check(unsafe { cs::cudnnBackendGetAttribute(plan.0, A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, T::CUDNN_TYPE_INT64, 1, &mut n, &mut bytes as *mut i64 as *mut c_void) }, "the workspace size")?;
                parts.extend([op, graph, heur]);
                parts.extend(configs);
                return Ok(Plan { plan, _parts: parts, workspace: bytes.max(0) as usize });
            }
            Err(e) => why = e,
        }
    }
    Err(why)
}

/// The plan of `key` from the device's cache, built on first use. None: cuDNN has no engine for
/// it (said once, under `KILN_LOG=kernels`).
fn plan<'a>(st: &'a mut State, key: &Key) -> Option<&'a Plan> {
    if !st.sdpa.contains_key(key) {
        let plan = match build(st.handle, key) {
            Ok(p) => Some(p),
            Err(why) => {
                crate::logging::log(crate::logging::Category::Kernels, || format!("cudnn attention: no plan for {key:?} ({why}); the next choice (the forward without statistics, else kiln's kernels) runs it"));
                None
            }
        };
        st.sdpa.insert(key.clone(), plan);
    }
    st.sdpa.get(key).and_then(|p| p.as_ref())
}

/// Queues `plan` with the tensors `ptrs` (by id) and a workspace from the caching allocator.
fn execute(dev: &Arc<CudaDevice>, handle: cs::cudnnHandle_t, plan: &Plan, ptrs: &[(i64, *mut c_void)]) -> Result<()> {
    let fail = |e: String| Error::Cuda { op: "scaled_dot_product_attention", device: dev.kiln_device(), msg: format!("cuDNN: {e}") };
    let ws = if plan.workspace > 0 { Some(dev.alloc(plan.workspace)?) } else { None };
    let run = || -> std::result::Result<(), String> {
        let pack = Desc::new(DT::CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR)?;
        let (uids, data): (Vec<i64>, Vec<*mut c_void>) = ptrs.iter().copied().unzip();
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, T::CUDNN_TYPE_INT64, &uids)?;
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, T::CUDNN_TYPE_VOID_PTR, &data)?;
        let workspace = ws.as_ref().map_or(std::ptr::null_mut(), |b| b.ptr as *mut c_void);
        pack.set(A::CUDNN_ATTR_VARIANT_PACK_WORKSPACE, T::CUDNN_TYPE_VOID_PTR, &[workspace])?;
        let pack = pack.finalize()?;
        // SAFETY: the plan's tensors are live device buffers of its geometry (kept by the
        // caller until this returns; later reuse is in stream order), as is the workspace.
        check(unsafe { cs::cudnnBackendExecute(handle, plan.plan.0, pack.0) }, "executing the plan")
    };
    let r = run();
    if let Some(b) = ws {
        // Freed in stream order: the allocator hands it out again only to later work.
        dev.free(b);
    }
    r.map_err(fail)
}

fn ptr(p: u64) -> *mut c_void {
    p as *mut c_void
}

/// The attention of q, k, v into `out` (contiguous `[L, B, H, D]`, q's dtype), with each row's
/// log-sum-exp of its scaled scores (F32 `[B, H, L]`, returned for the backward) where cuDNN
/// has a plan that writes them. None: cuDNN has no plan for it, nothing was queued.
pub(crate) fn forward(dev: &Arc<CudaDevice>, q: &Tensor, k: &Tensor, v: &Tensor, n: &AttnDims, scale: f64, out: u64) -> Result<Option<Option<CudaStorage>>> {
    let (qp, kp, vp) = (data_ptr(q)?, data_ptr(k)?, data_ptr(v)?);
    let scale = scale as f32;
    cudnn::session(dev, "scaled_dot_product_attention", |st| {
        let h = st.handle;
        let with_stats = Key::new(true, q, k, v, n);
        let key = if plan(st, &with_stats).is_some() { with_stats } else { Key::new(false, q, k, v, n) };
        let Some(plan) = plan(st, &key) else { return Ok(None) };
        let stats = if key.stats { Some(CudaStorage::new(dev, DType::F32, n.b * n.h * n.l)?) } else { None };
        if super::rehearsal::active() {
            return Ok(Some(stats));
        }
        let mut ptrs = vec![(Q, ptr(qp)), (K, ptr(kp)), (V, ptr(vp)), (O, ptr(out)), (SCALE, &scale as *const f32 as *mut c_void)];
        ptrs.extend(stats.as_ref().map(|s| (STATS, ptr(s.ptr()))));
        let _rec = crate::profiler::cudnn(dev, "sdpa_fwd", q.dtype());
        execute(dev, h, plan, &ptrs)?;
        Ok(Some(stats))
    })
}
