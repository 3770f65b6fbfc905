//! cuDNN's graph API (backend descriptors): tensors, operations and the graphs they make, an
//! execution plan from the heuristics' first engine configuration that finalizes, and its
//! execution with a workspace from the caching allocator. The fused attention (`sdpa.rs`) and
//! the convolutions with an epilogue (`conv_epilogue.rs`) build their graphs with it.

use crate::backend::cuda::CudaDevice;
use crate::{Error, Result};
use cudarc::cudnn::sys as cs;
use cs::{cudnnBackendAttributeName_t as A, cudnnBackendAttributeType_t as T, cudnnBackendDescriptorType_t as DT};
use std::ffi::c_void;
use std::sync::Arc;

/// The tensors' ids from which a graph's intermediate values are numbered (they live only
/// inside cuDNN's kernel).
pub(crate) const VIRTUAL: i64 = 100;

/// A backend descriptor, destroyed with its owner.
pub(crate) struct Desc(pub(crate) cs::cudnnBackendDescriptor_t);
// SAFETY: descriptors are used under the device's cuDNN mutex only (plans of one graph share
// its descriptors, never touched outside that mutex).
unsafe impl Send for Desc {}
// SAFETY: as for Send.
unsafe impl Sync for Desc {}

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cudnnBackendCreateDescriptor, destroyed once.
        unsafe { cs::cudnnBackendDestroyDescriptor(self.0) };
    }
}

pub(crate) fn check(status: cs::cudnnStatus_t, what: &str) -> std::result::Result<(), String> {
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
    pub(crate) fn new(ty: DT) -> std::result::Result<Desc, String> {
        let mut d = std::ptr::null_mut();
        // SAFETY: an out-pointer for a new descriptor.
        check(unsafe { cs::cudnnBackendCreateDescriptor(ty, &mut d) }, &format!("creating {ty:?}"))?;
        Ok(Desc(d))
    }
    pub(crate) fn set<V>(&self, name: A, ty: T, vals: &[V]) -> std::result::Result<(), String> {
        // SAFETY: `vals` holds vals.len() elements of the type `ty` names.
        check(unsafe { cs::cudnnBackendSetAttribute(self.0, name, ty, vals.len() as i64, vals.as_ptr() as *const c_void) }, &format!("setting {name:?}"))
    }
    pub(crate) fn set_desc(&self, name: A, d: &Desc) -> std::result::Result<(), String> {
        self.set(name, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &[d.0])
    }
    pub(crate) fn set_type(&self, name: A, t: cs::cudnnDataType_t) -> std::result::Result<(), String> {
        self.set(name, T::CUDNN_TYPE_DATA_TYPE, &[t])
    }
    pub(crate) fn finalize(self) -> std::result::Result<Desc, String> {
        // SAFETY: a live descriptor.
        check(unsafe { cs::cudnnBackendFinalize(self.0) }, "finalizing a descriptor")?;
        Ok(self)
    }
}

/// Where a tensor of a graph lives.
#[derive(Clone, Copy, PartialEq)]
pub(crate) enum Lives {
    /// In device memory, passed in the variant pack.
    Memory,
    /// On the host, passed by value (a scalar).
    ByValue,
    /// Nowhere: an intermediate value inside the fused kernel.
    Virtual,
}

/// A tensor of dims `dims` and strides `strides` (elements).
pub(crate) fn tensor(uid: i64, dtype: cs::cudnnDataType_t, dims: [usize; 4], strides: [usize; 4], lives: Lives) -> std::result::Result<Desc, String> {
    let t = Desc::new(DT::CUDNN_BACKEND_TENSOR_DESCRIPTOR)?;
    t.set(A::CUDNN_ATTR_TENSOR_UNIQUE_ID, T::CUDNN_TYPE_INT64, &[uid])?;
    t.set_type(A::CUDNN_ATTR_TENSOR_DATA_TYPE, dtype)?;
    t.set(A::CUDNN_ATTR_TENSOR_DIMENSIONS, T::CUDNN_TYPE_INT64, &dims.map(|x| x as i64))?;
    t.set(A::CUDNN_ATTR_TENSOR_STRIDES, T::CUDNN_TYPE_INT64, &strides.map(|x| x as i64))?;
    t.set(A::CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, T::CUDNN_TYPE_INT64, &[if lives == Lives::ByValue { 4i64 } else { 16 }])?;
    match lives {
        Lives::ByValue => t.set(A::CUDNN_ATTR_TENSOR_IS_BY_VALUE, T::CUDNN_TYPE_BOOLEAN, &[true])?,
        Lives::Virtual => t.set(A::CUDNN_ATTR_TENSOR_IS_VIRTUAL, T::CUDNN_TYPE_BOOLEAN, &[true])?,
        Lives::Memory => {}
    }
    t.finalize()
}

/// One pointwise operation: y = mode(x[, b][, t]), computed in `precision`, along `axis` for
/// an index generator.
pub(crate) struct Pointwise {
    pub(crate) mode: cs::cudnnPointwiseMode_t,
    pub(crate) x: usize,
    pub(crate) b: Option<usize>,
    pub(crate) t: Option<usize>,
    pub(crate) y: usize,
    pub(crate) precision: cs::cudnnDataType_t,
    pub(crate) axis: Option<i64>,
}

impl Default for Pointwise {
    fn default() -> Self {
        let float = cs::cudnnDataType_t::CUDNN_DATA_FLOAT;
        Pointwise { mode: cs::cudnnPointwiseMode_t::CUDNN_POINTWISE_IDENTITY, x: 0, b: None, t: None, y: 0, precision: float, axis: None }
    }
}

/// A graph under construction: its operations, and every descriptor they refer to (kept alive
/// with the plan).
#[derive(Default)]
pub(crate) struct Ops {
    pub(crate) ops: Vec<Desc>,
    pub(crate) parts: Vec<Desc>,
    next_virtual: i64,
}

impl Ops {
    /// Keeps `d` alive with the graph; the index to find it again.
    pub(crate) fn keep(&mut self, d: Desc) -> usize {
        self.parts.push(d);
        self.parts.len() - 1
    }
    /// A virtual tensor of `dtype`, `dims` and `strides`.
    pub(crate) fn virtual_tensor(&mut self, dtype: cs::cudnnDataType_t, dims: [usize; 4], strides: [usize; 4]) -> std::result::Result<usize, String> {
        self.next_virtual += 1;
        let t = tensor(VIRTUAL + self.next_virtual, dtype, dims, strides, Lives::Virtual)?;
        Ok(self.keep(t))
    }
    /// y = mode(x) or mode(x, b), computed in F32.
    pub(crate) fn pointwise(&mut self, mode: cs::cudnnPointwiseMode_t, x: usize, b: Option<usize>, y: usize) -> std::result::Result<(), String> {
        self.pointwise_op(Pointwise { mode, x, b, y, ..Default::default() })
    }
    pub(crate) fn pointwise_op(&mut self, p: Pointwise) -> std::result::Result<(), String> {
        let pw = Desc::new(DT::CUDNN_BACKEND_POINTWISE_DESCRIPTOR)?;
        pw.set(A::CUDNN_ATTR_POINTWISE_MODE, T::CUDNN_TYPE_POINTWISE_MODE, &[p.mode])?;
        pw.set_type(A::CUDNN_ATTR_POINTWISE_MATH_PREC, p.precision)?;
        if let Some(axis) = p.axis {
            pw.set(A::CUDNN_ATTR_POINTWISE_AXIS, T::CUDNN_TYPE_INT64, &[axis])?;
        }
        let mut tensors = vec![(A::CUDNN_ATTR_OPERATION_POINTWISE_XDESC, p.x)];
        tensors.extend(p.b.map(|b| (A::CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b)));
        tensors.extend(p.t.map(|t| (A::CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t)));
        tensors.push((A::CUDNN_ATTR_OPERATION_POINTWISE_YDESC, p.y));
        self.push_op(DT::CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, Some((A::CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.finalize()?)), &tensors)
    }
    /// Adds an operation of `kind`: its own descriptor (a matmul's, a reduction's; kept alive
    /// with the graph) and its tensors, by index into `parts`.
    pub(crate) fn push_op(&mut self, kind: DT, own: Option<(A, Desc)>, tensors: &[(A, usize)]) -> std::result::Result<(), String> {
        self.push_op_then(kind, own, tensors, |_| Ok(()))
    }
    /// `push_op`, with `set` setting the operation's own attributes (a convolution's alpha and
    /// beta) before it is finalized.
    pub(crate) fn push_op_then(&mut self, kind: DT, own: Option<(A, Desc)>, tensors: &[(A, usize)], set: impl FnOnce(&Desc) -> std::result::Result<(), String>) -> std::result::Result<(), String> {
        let op = Desc::new(kind)?;
        if let Some((name, d)) = &own {
            op.set_desc(*name, d)?;
        }
        for &(name, t) in tensors {
            op.set_desc(name, &self.parts[t])?;
        }
        set(&op)?;
        self.ops.push(op.finalize()?);
        if let Some((_, d)) = own {
            self.keep(d);
        }
        Ok(())
    }
    /// c = a @ b over the two leading (batch) dims, accumulated in F32.
    pub(crate) fn matmul(&mut self, a: usize, b: usize, c: usize) -> std::result::Result<(), String> {
        let mm = Desc::new(DT::CUDNN_BACKEND_MATMUL_DESCRIPTOR)?;
        mm.set_type(A::CUDNN_ATTR_MATMUL_COMP_TYPE, cs::cudnnDataType_t::CUDNN_DATA_FLOAT)?;
        let tensors = [(A::CUDNN_ATTR_OPERATION_MATMUL_ADESC, a), (A::CUDNN_ATTR_OPERATION_MATMUL_BDESC, b), (A::CUDNN_ATTR_OPERATION_MATMUL_CDESC, c)];
        self.push_op(DT::CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, Some((A::CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.finalize()?)), &tensors)
    }
    /// y = the reduction `op` of x over the dims where y has size 1.
    pub(crate) fn reduce(&mut self, op: cs::cudnnReduceTensorOp_t, x: usize, y: usize) -> std::result::Result<(), String> {
        let r = Desc::new(DT::CUDNN_BACKEND_REDUCTION_DESCRIPTOR)?;
        r.set(A::CUDNN_ATTR_REDUCTION_OPERATOR, T::CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &[op])?;
        r.set_type(A::CUDNN_ATTR_REDUCTION_COMP_TYPE, cs::cudnnDataType_t::CUDNN_DATA_FLOAT)?;
        let tensors = [(A::CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x), (A::CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y)];
        self.push_op(DT::CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, Some((A::CUDNN_ATTR_OPERATION_REDUCTION_DESC, r.finalize()?)), &tensors)
    }
    /// y = x seen with y's dims, strides and dtype (a transpose, a conversion).
    pub(crate) fn reshape(&mut self, x: usize, y: usize) -> std::result::Result<(), String> {
        self.push_op(DT::CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, None, &[(A::CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x), (A::CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y)])
    }
}

/// An execution plan and the descriptors it was built from.
pub(crate) struct Plan {
    plan: Desc,
    /// The graph's descriptors, shared by the plans made of it.
    _parts: Arc<Vec<Desc>>,
    workspace: usize,
}

/// The plan of the graph `g`: the heuristics' engine configurations in their order, the first
/// that finalizes.
pub(crate) fn plan(h: cs::cudnnHandle_t, g: Ops) -> std::result::Result<Plan, String> {
    let mut plans = plans(h, g, 1)?;
    Ok(plans.remove(0))
}

/// The plans of the graph `g` from the first `most` of the heuristics' engine configurations
/// that finalize, in the heuristics' order (at least one, else why none did).
pub(crate) fn plans(h: cs::cudnnHandle_t, g: Ops, most: usize) -> std::result::Result<Vec<Plan>, String> {
    let Ops { ops, mut parts, .. } = g;
    let graph = Desc::new(DT::CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR)?;
    graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_HANDLE, T::CUDNN_TYPE_HANDLE, &[h])?;
    let raw_ops: Vec<cs::cudnnBackendDescriptor_t> = ops.iter().map(|o| o.0).collect();
    graph.set(A::CUDNN_ATTR_OPERATIONGRAPH_OPS, T::CUDNN_TYPE_BACKEND_DESCRIPTOR, &raw_ops)?;
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
    let mut made = vec![];
    for config in configs.iter().take(got.max(0) as usize) {
        if made.len() == most {
            break;
        }
        let plan = Desc::new(DT::CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR)?;
        plan.set(A::CUDNN_ATTR_EXECUTION_PLAN_HANDLE, T::CUDNN_TYPE_HANDLE, &[h])?;
        plan.set_desc(A::CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, config)?;
        match plan.finalize() {
            Ok(plan) => {
                let (mut n, mut bytes) = (0i64, 0i64);
                // SAFETY: one INT64 into `bytes`.
                check(unsafe { cs::cudnnBackendGetAttribute(plan.0, A::CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, T::CUDNN_TYPE_INT64, 1, &mut n, &mut bytes as *mut i64 as *mut c_void) }, "the workspace size")?;
                made.push((plan, bytes.max(0) as usize));
            }
            Err(e) => why = e,
        }
    }
    if made.is_empty() {
        return Err(why);
    }
    parts.extend(ops);
    parts.extend([graph, heur]);
    parts.extend(configs);
    let parts = Arc::new(parts);
    Ok(made.into_iter().map(|(plan, workspace)| Plan { plan, _parts: parts.clone(), workspace }).collect())
}

/// Queues `plan` with the tensors `ptrs` (by id) and a workspace from the caching allocator.
pub(crate) fn execute(dev: &Arc<CudaDevice>, handle: cs::cudnnHandle_t, plan: &Plan, ptrs: &[(i64, *mut c_void)], op: &'static str) -> Result<()> {
    let fail = |e: String| Error::Cuda { op, device: dev.kiln_device(), msg: format!("cuDNN: {e}") };
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

pub(crate) fn ptr(p: u64) -> *mut c_void {
    p as *mut c_void
}
