//! Matrix products through cuBLASLt: F32 (TF32 only when allowed), F64, and F16/BF16 on tensor
//! cores with F32 accumulation, batched with arbitrary batch strides, operands read transposed
//! in place. Compiled code adds a bias along the last dim, and a ReLU after it, in the same call
//! (cuBLASLt's BIAS / RELU_BIAS epilogues). The algorithm is cuBLASLt's first heuristic, or under
//! max-autotune the fastest of its heuristic candidates timed on the device (autotune.rs).
//! cuBLAS runs a product cuBLASLt has no algorithm for, and every product where libcublasLt is
//! missing. Both libraries use one private workspace, so nothing allocates while a CUDA graph is
//! captured; captured calls that use it stay in order in the graph, the others may run beside
//! each other.

use crate::ops::matmul::Activation;
use crate::backend::cuda::{tuning::autotune, CudaDevice, CudaStorage};
use crate::layout::Layout;
use crate::logging::{log, Topic};
use crate::{DType, Result, Tensor};
use cudarc::cublas::{result as br, sys as bs};
use cudarc::cublaslt::sys as ls;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// cuBLAS / cuBLASLt workspace per device (PyTorch's size on Hopper).
const WORKSPACE: usize = 32 << 20;
/// Heuristic candidates max-autotune times per problem.
const CANDIDATES: usize = 16;

type Algo = ls::cublasLtMatmulAlgo_t;

/// What a product does to its result in the same call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Epilogue {
    None,
    /// A vector added to every row.
    Bias,
    /// The bias, then ReLU.
    ReluBias,
    /// The bias, then GELU (its tanh approximation).
    GeluBias,
}

impl Epilogue {
    fn lt(self) -> u32 {
        use ls::cublasLtEpilogue_t as E;
        match self {
            Epilogue::None => E::CUBLASLT_EPILOGUE_DEFAULT as u32,
            Epilogue::Bias => E::CUBLASLT_EPILOGUE_BIAS as u32,
            Epilogue::ReluBias => E::CUBLASLT_EPILOGUE_RELU_BIAS as u32,
            Epilogue::GeluBias => E::CUBLASLT_EPILOGUE_GELU_BIAS as u32,
        }
    }
    /// The profiler's name part: `cublas_gemm{suffix}_<dtype>`.
    fn suffix(self) -> &'static str {
        match self {
            Epilogue::None => "",
            Epilogue::Bias => "_bias",
            Epilogue::ReluBias => "_bias_relu",
            Epilogue::GeluBias => "_bias_gelu",
        }
    }
}

/// Everything that decides which algorithms can run a product and how fast they are: the key
/// of the chosen algorithm, in memory and (under max-autotune) on disk.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Problem {
    dtype: DType,
    tf32: bool,
    batch: usize,
    m: usize,
    n: usize,
    k: usize,
    /// (read transposed, leading dim, batch stride) of `a` and of `b`.
    a: (bool, usize, i64),
    b: (bool, usize, i64),
    epilogue: Epilogue,
    /// Address alignment in bytes (at most 16) of a, b, the output and the bias (0: none).
    align: [u32; 4],
}

/// The per-device library state, used under the device's `blas` mutex.
pub(crate) struct Handle {
    lt: Option<ls::cublasLtHandle_t>,
    blas: Option<bs::cublasHandle_t>,
    /// cuBLASLt's workspace outside graph captures (kept for the device's lifetime).
    ws: u64,
    /// What cuBLASLt needs per problem, made on its first call.
    problems: HashMap<Problem, Planned>,
    /// What tuned winners are keyed by besides the problem: device, versions.
    ident: String,
}

/// A problem's descriptors and its algorithms: cuBLASLt's first heuristic, and max-autotune's
/// winner. `Some(None)`: cuBLASLt has none (cuBLAS runs the product, or the epilogue runs
/// unfused).
struct Planned {
    descs: Descs,
    first: Option<Option<Algo>>,
    tuned: Option<Option<Algo>>,
}
// SAFETY: the handles are used under the device's mutex only.
unsafe impl Send for Handle {}

impl Handle {
    fn new(dev: &Arc<CudaDevice>) -> Result<Handle> {
        // The workspace of uncaptured cuBLASLt products (and max-autotune's timing), outside
        // any capture pool; a captured product takes its own from the graph's memory.
        let ws = dev.alloc_block(WORKSPACE)?;
        // SAFETY: probing and creating a handle; the library is loaded only when present.
        let lt = if unsafe { ls::is_culib_present() } {
            let mut h: ls::cublasLtHandle_t = std::ptr::null_mut();
            ok(unsafe { ls::cublasLtCreate(&mut h) }).map_err(|e| dev.err("cublasLtCreate", e))?;
            Some(h)
        } else {
            log(Topic::Kernels, || "libcublasLt not found: matrix products use cuBLAS".into());
            None
        };
        // SAFETY: a plain query of the loaded library.
        let version = if lt.is_some() { unsafe { ls::cublasLtGetVersion() } } else { 0 };
        Ok(Handle { lt, blas: None, ws: ws.ptr, problems: HashMap::new(), ident: format!("{}|cublasLt {version}", dev.tune_ident) })
    }

    fn blas(&mut self, dev: &CudaDevice) -> Result<bs::cublasHandle_t> {
        if let Some(h) = self.blas {
            return Ok(h);
        }
        // cuBLAS keeps a workspace per stream itself (`cublasSetStream`, called before each
        // product, would undo a workspace set here): the capture stream's is shared by every
        // graph, so captured cuBLAS products stay in order among themselves.
        let handle = br::create_handle().map_err(|e| dev.err("cublasCreate", e))?;
        self.blas = Some(handle);
        Ok(handle)
    }
}

fn ok(s: ls::cublasStatus_t) -> std::result::Result<(), ls::cublasStatus_t> {
    if s == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
        Ok(())
    } else {
        Err(s)
    }
}

/// How cuBLAS reads a row-major [rows, cols] operand with element strides (rs, cs): as is
/// (`false`, leading dim) or transposed, or `None` when neither fits (a copy is needed).
fn blas_layout(rows: usize, cols: usize, rs: usize, cs: usize) -> Option<(bool, usize)> {
    if cs == 1 || cols == 1 {
        let ld = if rows == 1 { cols.max(1) } else { rs };
        if ld >= cols.max(1) && ld > 0 {
            return Some((false, ld));
        }
    }
    if rs == 1 || rows == 1 {
        let ld = if cols == 1 { rows.max(1) } else { cs };
        if ld >= rows.max(1) && ld > 0 {
            return Some((true, ld));
        }
    }
    None
}

/// The alignment (bytes, at most 16) of a device address.
fn align(p: u64) -> u32 {
    1u32 << (p | 16).trailing_zeros()
}

/// `a` [B, M, K] @ `b` [B, K, N] -> contiguous [B, M, N], with cuBLASLt's first heuristic.
pub(crate) fn bmm(dev: &Arc<CudaDevice>, a: &Tensor, b: &Tensor, dtype: DType) -> Result<CudaStorage> {
    Ok(gemm(dev, a, b, dtype, None, false)?.expect("a product without an epilogue always runs"))
}

/// The bias vector a broadcast view reads: `t` is [.., N] with every dim but the last of stride
/// 0 (or size 1). Packed and 16-byte aligned (copied when not); None when `t` is no such view.
pub(crate) fn bias_vector(t: &Tensor, n: usize) -> Result<Option<Tensor>> {
    let nd = t.ndim();
    if nd == 0 || t.shape()[nd - 1] != n || !(0..nd - 1).all(|d| t.strides()[d] == 0 || t.shape()[d] == 1) {
        return Ok(None);
    }
    let s = t.strides()[nd - 1];
    let v = t.view_as_layout(Layout { shape: vec![n], strides: vec![s], offset: t.storage_offset() });
    if (s == 1 || n == 1) && crate::backend::cuda::kernels::data_ptr(&v)? % 16 == 0 {
        Ok(Some(v))
    } else {
        Ok(Some(v.copy_contiguous()?))
    }
}

/// `a` [B, M, K] @ `b` [B, K, N] -> contiguous [B, M, N]. With `bias` (a view broadcasting a
/// vector of N along the last dim, and whether ReLU follows) the vector is added to every row in
/// the same call (F32/F16/BF16, one batch). `tune`: the algorithm is the fastest of cuBLASLt's
/// heuristic candidates, timed on first use (max-autotune). `None` when the epilogue cannot
/// run here (no cuBLASLt algorithm for it, a bias that is not a broadcast vector): the caller
/// computes it unfused.
pub(crate) fn gemm(dev: &Arc<CudaDevice>, a: &Tensor, b: &Tensor, dtype: DType, bias: Option<(&Tensor, Option<Activation>)>, tune: bool) -> Result<Option<CudaStorage>> {
    let (bsz, m, k) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let n = b.shape()[2];
    if bias.is_some() && (bsz != 1 || k == 0 || m * n == 0 || !matches!(dtype, DType::F32 | DType::F16 | DType::BF16)) {
        return Ok(None);
    }
    let bias = match bias {
        None => None,
        Some((t, act)) => match bias_vector(t, n)? {
            Some(v) => Some((v, act)),
            None => return Ok(None),
        },
    };
    let out = CudaStorage::new(dev, dtype, bsz * m * n)?;
    let Some(stream) = dev.work().stream().filter(|_| out.len > 0) else { return Ok(Some(out)) };
    if k == 0 {
        crate::backend::cuda::kernels::zero_fill(dev, &out)?;
        return Ok(Some(out));
    }
    // Operands the libraries cannot read in place are copied to contiguous first.
    let fit = |t: &Tensor, r, c| blas_layout(r, c, t.strides()[1], t.strides()[2]);
    let a = if fit(a, m, k).is_some() { a.clone() } else { a.copy_contiguous()? };
    let b = if fit(b, k, n).is_some() { b.clone() } else { b.copy_contiguous()? };
    let (ta, lda) = fit(&a, m, k).expect("contiguous fits");
    let (tb, ldb) = fit(&b, k, n).expect("contiguous fits");
    let (pa, pb) = (crate::backend::cuda::kernels::data_ptr(&a)?, crate::backend::cuda::kernels::data_ptr(&b)?);
    let pbias = bias.as_ref().map(|(v, _)| crate::backend::cuda::kernels::data_ptr(v)).transpose()?.unwrap_or(0);
    let epilogue = match &bias {
        None => Epilogue::None,
        Some((_, None)) => Epilogue::Bias,
        Some((_, Some(Activation::Relu))) => Epilogue::ReluBias,
        Some((_, Some(Activation::GeluTanh))) => Epilogue::GeluBias,
    };
    let batch_stride = |t: &Tensor| if bsz > 1 { t.strides()[0] as i64 } else { 0 };
    let p = Problem {
        dtype,
        tf32: dtype == DType::F32 && crate::backend::cuda::allow_tf32(),
        batch: bsz,
        m,
        n,
        k,
        a: (ta, lda, batch_stride(&a)),
        b: (tb, ldb, batch_stride(&b)),
        epilogue,
        align: [align(pa), align(pb), align(out.ptr()), if pbias != 0 { align(pbias) } else { 0 }],
    };
    let mut guard = dev.blas.lock();
    if guard.is_none() {
        *guard = Some(Handle::new(dev)?);
    }
    let h = guard.as_mut().expect("created above");
    let call = Call { pa, pb, out: out.ptr(), ws: h.ws, ws_bytes: WORKSPACE, stream: stream.cu_stream() as ls::cudaStream_t, f64: dtype == DType::F64 };
    let _rec = crate::profiler::blas(dev, dtype, epilogue.suffix());
    if let Some(lt) = h.lt {
        let planned = match h.problems.entry(p.clone()) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(v) => {
                // SAFETY: cuBLASLt is loaded.
                let descs = unsafe { Descs::new(&p) }.map_err(|e| dev.err("cublasLt descriptors", e))?;
                v.insert(Planned { descs, first: None, tuned: None })
            }
        };
        if epilogue != Epilogue::None {
            // SAFETY: a live descriptor; `pbias` is a live packed vector of the output's dtype.
            unsafe { planned.descs.set_bias(pbias) }.map_err(|e| dev.err("cublasLt bias", e))?;
        }
        // Max-autotune's winner (timed now unless a CUDA graph is being captured), else the
        // first heuristic.
        let tuning = tune && (planned.tuned.is_some() || autotune::allowed(dev));
        let algo = match (tuning, planned.tuned, planned.first) {
            (true, Some(a), _) | (false, _, Some(a)) => a,
            (true, None, _) => {
                let a = tuned(dev, lt, &planned.descs, &p, &h.ident, &call);
                planned.tuned = Some(a);
                a
            }
            (false, _, None) => {
                // SAFETY: live handle and descriptors.
                let a = unsafe { heuristics(lt, &planned.descs, 1) }.first().map(|r| r.algo);
                if a.is_none() {
                    log(Topic::Kernels, || format!("cuBLASLt has no algorithm for {p:?}{}", if epilogue == Epilogue::None { "; cuBLAS runs it" } else { "; the epilogue runs unfused" }));
                }
                planned.first = Some(a);
                a
            }
        };
        if let Some(algo) = algo {
            // A captured call takes the workspace its algorithm needs from the graph's own
            // memory, never the device's shared one: captured products that shared it with other
            // threads' products and graphs computed wrong values (four threads capturing,
            // replaying and calling at once; gone with a workspace per call).
            // SAFETY: live handle and descriptors.
            // (All of it when cuBLASLt does not say how much.)
            let own_ws = match crate::backend::cuda::device::graph::capturing().map(|_| unsafe { workspace_of(lt, &planned.descs, &algo) }.unwrap_or(WORKSPACE)) {
                Some(bytes) if bytes > 0 => Some(CudaStorage::new(dev, DType::U8, bytes)?),
                _ => None,
            };
            let call = match &own_ws {
                Some(w) => Call { ws: w.ptr(), ws_bytes: w.len, ..call },
                None => call,
            };
            // SAFETY: pointers and layouts describe live buffers of these shapes; the workspace
            // and the stream outlive the call.
            match unsafe { lt_run(lt, &planned.descs, &algo, &call) } {
                Ok(()) => return Ok(Some(out)),
                Err(e) => {
                    log(Topic::Kernels, || format!("cublasLtMatmul failed ({e:?}) for {p:?}; falling back"));
                    *(if tuning { &mut planned.tuned } else { &mut planned.first }) = Some(None);
                }
            }
        }
    }
    if epilogue != Epilogue::None {
        return Ok(None);
    }
    let handle = h.blas(dev)?;
    crate::backend::cuda::device::graph::note_shared_scratch();
    // SAFETY: as above.
    unsafe { cublas_run(dev, handle, &p, &call)? };
    Ok(Some(out))
}

/// The addresses and stream of one product.
#[derive(Clone, Copy)]
struct Call {
    pa: u64,
    pb: u64,
    out: u64,
    ws: u64,
    ws_bytes: usize,
    stream: ls::cudaStream_t,
    f64: bool,
}

impl Call {
    /// alpha = 1 and beta = 0 in the scale type (host scalars that live forever).
    fn scalars(&self) -> (*const c_void, *const c_void) {
        static F32: [f32; 2] = [1.0, 0.0];
        static F64: [f64; 2] = [1.0, 0.0];
        if self.f64 {
            (&F64[0] as *const f64 as *const c_void, &F64[1] as *const f64 as *const c_void)
        } else {
            (&F32[0] as *const f32 as *const c_void, &F32[1] as *const f32 as *const c_void)
        }
    }
}

/// The descriptors of one product, destroyed on drop.
struct Descs {
    op: ls::cublasLtMatmulDesc_t,
    a: ls::cublasLtMatrixLayout_t,
    b: ls::cublasLtMatrixLayout_t,
    c: ls::cublasLtMatrixLayout_t,
    pref: ls::cublasLtMatmulPreference_t,
}

impl Drop for Descs {
    fn drop(&mut self) {
        // SAFETY: each was created by `new` (or is null) and is destroyed once.
        unsafe {
            if !self.pref.is_null() {
                ls::cublasLtMatmulPreferenceDestroy(self.pref);
            }
            for l in [self.a, self.b, self.c] {
                if !l.is_null() {
                    ls::cublasLtMatrixLayoutDestroy(l);
                }
            }
            if !self.op.is_null() {
                ls::cublasLtMatmulDescDestroy(self.op);
            }
        }
    }
}

impl Descs {
    /// Row-major C = A B is column-major C^T = B^T A^T: cuBLASLt's first operand is `b`.
    ///
    /// # Safety
    /// cuBLASLt must be loaded. A problem with an epilogue needs `set_bias` before each call.
    unsafe fn new(p: &Problem) -> std::result::Result<Descs, ls::cublasStatus_t> {
        use ls::cublasLtMatmulDescAttributes_t as D;
        use ls::cublasLtMatmulPreferenceAttributes_t as P;
        use ls::cublasLtMatrixLayoutAttribute_t as L;
        let (ty, compute, scale) = match p.dtype {
            DType::F32 if p.tf32 => (ls::cudaDataType::CUDA_R_32F, ls::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32, ls::cudaDataType::CUDA_R_32F),
            DType::F32 => (ls::cudaDataType::CUDA_R_32F, ls::cublasComputeType_t::CUBLAS_COMPUTE_32F, ls::cudaDataType::CUDA_R_32F),
            DType::F64 => (ls::cudaDataType::CUDA_R_64F, ls::cublasComputeType_t::CUBLAS_COMPUTE_64F, ls::cudaDataType::CUDA_R_64F),
            DType::F16 => (ls::cudaDataType::CUDA_R_16F, ls::cublasComputeType_t::CUBLAS_COMPUTE_32F, ls::cudaDataType::CUDA_R_32F),
            DType::BF16 => (ls::cudaDataType::CUDA_R_16BF, ls::cublasComputeType_t::CUBLAS_COMPUTE_32F, ls::cudaDataType::CUDA_R_32F),
            _ => unreachable!("integer products use the generated kernel"),
        };
        let mut d = Descs { op: std::ptr::null_mut(), a: std::ptr::null_mut(), b: std::ptr::null_mut(), c: std::ptr::null_mut(), pref: std::ptr::null_mut() };
        unsafe {
            ok(ls::cublasLtMatmulDescCreate(&mut d.op, compute, scale))?;
            let op = d.op;
            let set = |attr: D, v: *const c_void, size: usize| ok(ls::cublasLtMatmulDescSetAttribute(op, attr, v, size));
            // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
            let (op_a, op_b) = (p.b.0 as i32, p.a.0 as i32);
            set(D::CUBLASLT_MATMUL_DESC_TRANSA, &op_a as *const i32 as *const c_void, 4)?;
            set(D::CUBLASLT_MATMUL_DESC_TRANSB, &op_b as *const i32 as *const c_void, 4)?;
            if p.epilogue != Epilogue::None {
                let e = p.epilogue.lt();
                set(D::CUBLASLT_MATMUL_DESC_EPILOGUE, &e as *const u32 as *const c_void, 4)?;
            }
            // An operand read transposed is stored [cols, rows] of what the product reads.
            let (ar, ac) = if p.b.0 { (p.k, p.n) } else { (p.n, p.k) };
            let (br_, bc) = if p.a.0 { (p.m, p.k) } else { (p.k, p.m) };
            ok(ls::cublasLtMatrixLayoutCreate(&mut d.a, ty, ar as u64, ac as u64, p.b.1 as i64))?;
            ok(ls::cublasLtMatrixLayoutCreate(&mut d.b, ty, br_ as u64, bc as u64, p.a.1 as i64))?;
            ok(ls::cublasLtMatrixLayoutCreate(&mut d.c, ty, p.n as u64, p.m as u64, p.n as i64))?;
            if p.batch > 1 {
                let count = p.batch as i32;
                for (l, stride) in [(d.a, p.b.2), (d.b, p.a.2), (d.c, (p.m * p.n) as i64)] {
                    ok(ls::cublasLtMatrixLayoutSetAttribute(l, L::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &count as *const i32 as *const c_void, 4))?;
                    ok(ls::cublasLtMatrixLayoutSetAttribute(l, L::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride as *const i64 as *const c_void, 8))?;
                }
            }
            ok(ls::cublasLtMatmulPreferenceCreate(&mut d.pref))?;
            let ws = WORKSPACE as u64;
            ok(ls::cublasLtMatmulPreferenceSetAttribute(d.pref, P::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws as *const u64 as *const c_void, 8))?;
            // The operands' real alignment: views at odd offsets exclude the algorithms that
            // need more (cuBLASLt assumes 256 bytes otherwise).
            for (attr, al) in [
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, p.align[1]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, p.align[0]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, p.align[2]),
                (P::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, p.align[2]),
            ] {
                ok(ls::cublasLtMatmulPreferenceSetAttribute(d.pref, attr, &al as *const u32 as *const c_void, 4))?;
            }
        }
        Ok(d)
    }
}

impl Descs {
    /// Points the epilogue at the bias vector: the output's dtype (cuBLASLt's default bias type
    /// for these dtypes), one element per row of the column-major result.
    ///
    /// # Safety
    /// A live descriptor; `bias` the device address of a packed vector, alive until the call ran.
    unsafe fn set_bias(&self, bias: u64) -> std::result::Result<(), ls::cublasStatus_t> {
        let ptr = bias as *const c_void;
        // SAFETY: the attribute is a device pointer, read from `ptr`'s address.
        ok(unsafe { ls::cublasLtMatmulDescSetAttribute(self.op, ls::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr as *const *const c_void as *const c_void, std::mem::size_of::<*const c_void>()) })
    }
}

/// Up to `want` of cuBLASLt's heuristic candidates that fit the workspace, best first.
///
/// # Safety
/// A live handle and descriptors.
unsafe fn heuristics(lt: ls::cublasLtHandle_t, d: &Descs, want: usize) -> Vec<ls::cublasLtMatmulHeuristicResult_t> {
    // SAFETY: plain C structs; zero is a valid (empty) value.
    let mut res: Vec<ls::cublasLtMatmulHeuristicResult_t> = (0..want).map(|_| unsafe { std::mem::zeroed() }).collect();
    let mut count = 0i32;
    // SAFETY: `res` holds `want` results.
    let st = unsafe { ls::cublasLtMatmulAlgoGetHeuristic(lt, d.op, d.a, d.b, d.c, d.c, d.pref, want as i32, res.as_mut_ptr(), &mut count) };
    if ok(st).is_err() {
        return vec![];
    }
    res.truncate(count.clamp(0, want as i32) as usize);
    res.retain(|r| r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS && r.workspaceSize <= WORKSPACE);
    res
}

/// Whether a remembered algorithm still runs this problem (same library version, but checked:
/// a stale or foreign entry must not reach `cublasLtMatmul`).
///
/// # Safety
/// A live handle and descriptors.
unsafe fn algo_ok(lt: ls::cublasLtHandle_t, d: &Descs, algo: &Algo) -> bool {
    // SAFETY: the caller's contract.
    unsafe { workspace_of(lt, d, algo) }.is_some_and(|w| w <= WORKSPACE)
}

/// The workspace bytes `algo` needs for this problem (None where cuBLASLt does not say).
///
/// # Safety
/// A live handle and descriptors.
unsafe fn workspace_of(lt: ls::cublasLtHandle_t, d: &Descs, algo: &Algo) -> Option<usize> {
    // SAFETY: a plain C struct written by the check.
    let mut r: ls::cublasLtMatmulHeuristicResult_t = unsafe { std::mem::zeroed() };
    let st = unsafe { ls::cublasLtMatmulAlgoCheck(lt, d.op, d.a, d.b, d.c, d.c, algo, &mut r) };
    (ok(st).is_ok() && r.state == ls::cublasStatus_t::CUBLAS_STATUS_SUCCESS).then_some(r.workspaceSize)
}

/// cuBLASLt's id of an algorithm (for the log).
fn algo_id(algo: &Algo) -> i32 {
    let mut id = -1i32;
    let mut written = 0usize;
    // SAFETY: reads one i32 attribute of a plain struct.
    unsafe {
        ls::cublasLtMatmulAlgoConfigGetAttribute(algo, ls::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_ID, &mut id as *mut i32 as *mut c_void, 4, &mut written);
    }
    id
}

/// The algorithm's bytes as text (cuBLASLt algorithms may be stored and reused with the same
/// library version, which the key names).
fn algo_text(a: &Algo) -> String {
    a.data.iter().map(|w| format!("{w:016x}")).collect::<Vec<_>>().join(" ")
}

fn parse_algo(s: &str) -> Option<Algo> {
    let words: Vec<u64> = s.split_whitespace().map(|w| u64::from_str_radix(w, 16).ok()).collect::<Option<_>>()?;
    let data: [u64; 8] = words.try_into().ok()?;
    Some(Algo { data })
}

/// Max-autotune: the remembered winner for this problem, else the fastest of up to CANDIDATES
/// heuristic candidates (`chain_ms`: runs into the output, which every run overwrites whole),
/// remembered. None when cuBLASLt has no candidate.
fn tuned(dev: &Arc<CudaDevice>, lt: ls::cublasLtHandle_t, d: &Descs, p: &Problem, ident: &str, call: &Call) -> Option<Algo> {
    let key = format!("gemm|{ident}|{p:?}");
    if let Some(v) = autotune::lookup(&key) {
        // SAFETY: live handle and descriptors.
        match parse_algo(&v) {
            Some(a) if unsafe { algo_ok(lt, d, &a) } => return Some(a),
            _ => autotune::forget(&key),
        }
    }
    // SAFETY: live handle and descriptors.
    let cands = unsafe { heuristics(lt, d, CANDIDATES) };
    if cands.is_empty() {
        return None;
    }
    let mut named: Vec<(String, Algo)> = cands.iter().enumerate().map(|(i, r)| (format!("heuristic #{i} (algo {}, workspace {} KiB)", algo_id(&r.algo), r.workspaceSize >> 10), r.algo)).collect();
    // SAFETY: live handle and descriptors.
    named.extend(unsafe { split_k_variants(lt, d, &cands) });
    // A stream of its own for the chains, captured by this thread alone: the device's capture
    // stream belongs to whoever holds its turn, who may be waiting for this thread's handle.
    let side = dev.ctx.new_stream().ok();
    let timed: Vec<(String, Algo, Option<f64>)> = named
        .into_iter()
        .map(|(name, algo)| {
            let t = side.as_ref().and_then(|side| chain_ms(dev, side, lt, d, &algo, call));
            (name, algo, t)
        })
        .collect();
    match autotune::pick(&format!("gemm {p:?}"), &timed) {
        Some((_, a)) => {
            autotune::store(&key, &algo_text(&a));
            Some(a)
        }
        None => Some(cands[0].algo),
    }
}

/// Runs of a product one after another in a captured CUDA graph.
const CHAIN: usize = 8;

/// What `algo` costs in a chain of products, as a compiled program's CUDA graph runs them: the
/// median replay of a graph of `CHAIN` runs (captured on `side`), per run. Timed alone between two events, a run
/// counts the events' latency and not the gap each extra kernel (a split reduction's second
/// kernel) adds between nodes of a graph; max-autotune's programs replay graphs.
fn chain_ms(dev: &Arc<CudaDevice>, side: &Arc<cudarc::driver::CudaStream>, lt: ls::cublasLtHandle_t, d: &Descs, algo: &Algo, call: &Call) -> Option<f64> {
    use cudarc::driver::sys as ds;
    // One run outside the capture first: it loads what the algorithm's kernels need, which a
    // capture may not, and a candidate that fails is out.
    // SAFETY: as for a regular call; each run rewrites the whole output.
    unsafe { lt_run(lt, d, algo, call) }.ok()?;
    side.begin_capture(ds::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).ok()?;
    let on = Call { stream: side.cu_stream() as ls::cudaStream_t, ..*call };
    // SAFETY: as for a regular call (captured: nothing runs yet); each run rewrites the whole
    // output.
    let ran = (0..CHAIN).try_for_each(|_| unsafe { lt_run(lt, d, algo, &on) });
    let graph = side.end_capture(ds::CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH).ok().flatten()?;
    ran.ok()?;
    // SAFETY: an instantiated graph of live buffers, replayed in the device's stream order;
    // the timing waits for the last replay before the graph is dropped.
    autotune::time_ms(dev, || unsafe { cudarc::driver::result::graph::launch(graph.cu_graph_exec(), dev.stream.cu_stream()) }.map_err(|e| dev.err("graph launch", e))).map(|t| t / CHAIN as f64)
}

/// The first heuristic candidates with their reduction dim split into 2 to 8 parts, where the
/// library takes it: a product with few output tiles (a few hundred rows, as in a small
/// transformer) keeps only a few multiprocessors busy unless its K is split. The heuristics
/// rarely offer this for FP32; max-autotune times these beside them.
///
/// # Safety
/// A live handle and descriptors.
unsafe fn split_k_variants(lt: ls::cublasLtHandle_t, d: &Descs, cands: &[ls::cublasLtMatmulHeuristicResult_t]) -> Vec<(String, Algo)> {
    use ls::cublasLtMatmulAlgoConfigAttributes_t as A;
    use ls::cublasLtReductionScheme_t as R;
    let mut out = vec![];
    for (i, r) in cands.iter().take(4).enumerate() {
        for splits in [2u32, 3, 4, 8] {
            for scheme in [R::CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, R::CUBLASLT_REDUCTION_SCHEME_INPLACE] {
                let mut algo = r.algo;
                let scheme = scheme as u32;
                // SAFETY: writes two u32 attributes of a copy of a valid algorithm.
                let set = unsafe {
                    ok(ls::cublasLtMatmulAlgoConfigSetAttribute(&mut algo, A::CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splits as *const u32 as *const c_void, 4))
                        .and_then(|_| ok(ls::cublasLtMatmulAlgoConfigSetAttribute(&mut algo, A::CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme as *const u32 as *const c_void, 4)))
                };
                // SAFETY: the caller's contract.
                if set.is_ok() && unsafe { algo_ok(lt, d, &algo) } {
                    out.push((format!("heuristic #{i} (algo {}) with K split {splits} ways (reduction scheme {scheme})", algo_id(&algo)), algo));
                }
            }
        }
    }
    out
}

/// One cuBLASLt product (alpha 1, beta 0: the output is only written).
///
/// # Safety
/// Addresses and descriptors describe live buffers of the problem's shapes; the workspace
/// and stream outlive the call.
unsafe fn lt_run(lt: ls::cublasLtHandle_t, d: &Descs, algo: &Algo, c: &Call) -> std::result::Result<(), ls::cublasStatus_t> {
    let (alpha, beta) = c.scalars();
    // SAFETY: the caller's contract; alpha/beta are host scalars of the scale type.
    ok(unsafe {
        ls::cublasLtMatmul(
            lt,
            d.op,
            alpha,
            c.pb as *const c_void,
            d.a,
            c.pa as *const c_void,
            d.b,
            beta,
            c.out as *const c_void,
            d.c,
            c.out as *mut c_void,
            d.c,
            algo,
            c.ws as *mut c_void,
            c.ws_bytes,
            c.stream,
        )
    })
}

/// One cuBLAS strided-batched product (what cuBLASLt has no algorithm for).
///
/// # Safety
/// As `lt_run`.
unsafe fn cublas_run(dev: &CudaDevice, handle: bs::cublasHandle_t, p: &Problem, c: &Call) -> Result<()> {
    // SAFETY: a live handle; the stream outlives it. (The capture stream while a graph is
    // captured on this thread.)
    unsafe { br::set_stream(handle, c.stream as _) }.map_err(|e| dev.err("cublasSetStream", e))?;
    let (ty, compute) = match p.dtype {
        DType::F32 => (
            bs::cudaDataType::CUDA_R_32F,
            if p.tf32 { bs::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32 } else { bs::cublasComputeType_t::CUBLAS_COMPUTE_32F },
        ),
        DType::F64 => (bs::cudaDataType::CUDA_R_64F, bs::cublasComputeType_t::CUBLAS_COMPUTE_64F),
        DType::F16 => (bs::cudaDataType::CUDA_R_16F, bs::cublasComputeType_t::CUBLAS_COMPUTE_32F),
        DType::BF16 => (bs::cudaDataType::CUDA_R_16BF, bs::cublasComputeType_t::CUBLAS_COMPUTE_32F),
        _ => unreachable!("integer products use the generated kernel"),
    };
    let op = |t: bool| if t { bs::cublasOperation_t::CUBLAS_OP_T } else { bs::cublasOperation_t::CUBLAS_OP_N };
    let (alpha, beta) = c.scalars();
    // SAFETY: the caller's contract.
    unsafe {
        br::gemm_strided_batched_ex(
            handle,
            op(p.b.0),
            op(p.a.0),
            p.n as i32,
            p.m as i32,
            p.k as i32,
            alpha,
            c.pb as *const _,
            ty,
            p.b.1 as i32,
            p.b.2,
            c.pa as *const _,
            ty,
            p.a.1 as i32,
            p.a.2,
            beta,
            c.out as *mut _,
            ty,
            p.n as i32,
            (p.m * p.n) as i64,
            p.batch as i32,
            compute,
            bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| dev.err("cublasGemmStridedBatchedEx", e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithms_round_trip_through_text() {
        let a = Algo { data: [1, 2, u64::MAX, 0, 42, 7, 0xdead_beef, 9] };
        assert_eq!(parse_algo(&algo_text(&a)).map(|b| b.data), Some(a.data));
        assert!(parse_algo("1 2 3").is_none());
        assert!(parse_algo("zz").is_none());
    }

    #[test]
    fn alignment_is_capped_at_16_bytes() {
        assert_eq!((align(0x1000), align(0x1008), align(0x1002), align(0x1001)), (16, 8, 2, 1));
    }
}
