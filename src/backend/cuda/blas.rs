//! Matrix products through cuBLAS (F32 with TF32 only when allowed, F64, and F16/BF16 on
//! tensor cores with F32 accumulation), batched with arbitrary batch strides.

use super::{CudaDevice, CudaStorage};
use crate::{DType, Result, Tensor};
use cudarc::cublas::{result as br, sys as bs};
use std::sync::Arc;

pub(crate) struct Handle(bs::cublasHandle_t);

/// cuBLAS workspace per device (PyTorch's size on Hopper).
const WORKSPACE: usize = 32 << 20;
// SAFETY: the handle is used under the device's mutex only.
unsafe impl Send for Handle {}

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

/// `a` [B, M, K] @ `b` [B, K, N] -> contiguous [B, M, N].
pub(crate) fn bmm(dev: &Arc<CudaDevice>, a: &Tensor, b: &Tensor, dtype: DType) -> Result<CudaStorage> {
    let (bsz, m, k) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let n = b.shape()[2];
    let out = CudaStorage::new(dev, dtype, bsz * m * n)?;
    if out.len == 0 {
        return Ok(out);
    }
    if k == 0 {
        super::kernels::zero_fill(dev, &out)?;
        return Ok(out);
    }
    // Operands cuBLAS cannot read in place are copied to contiguous first.
    let fit = |t: &Tensor, r, c| blas_layout(r, c, t.strides()[1], t.strides()[2]);
    let a = if fit(a, m, k).is_some() { a.clone() } else { a.copy_contiguous()? };
    let b = if fit(b, k, n).is_some() { b.clone() } else { b.copy_contiguous()? };
    let (ta, lda) = fit(&a, m, k).expect("contiguous fits");
    let (tb, ldb) = fit(&b, k, n).expect("contiguous fits");
    let (pa, pb) = (super::kernels::data_ptr(&a)?, super::kernels::data_ptr(&b)?);
    let mut h = dev.blas.lock();
    if h.is_none() {
        let handle = br::create_handle().map_err(|e| dev.err("cublasCreate", e))?;
        // SAFETY: a fresh handle; the device's stream outlives it.
        unsafe { br::set_stream(handle, dev.stream.cu_stream() as _) }.map_err(|e| dev.err("cublasSetStream", e))?;
        // A workspace of our own, kept for the device's lifetime: cuBLAS then allocates nothing
        // while a CUDA graph is captured.
        let ws = dev.alloc(WORKSPACE)?;
        // SAFETY: `ws` holds WORKSPACE bytes and is never freed while the handle lives.
        let st = unsafe { bs::cublasSetWorkspace_v2(handle, ws.ptr as *mut std::ffi::c_void, WORKSPACE) };
        if st != bs::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
            return Err(dev.err("cublasSetWorkspace", st));
        }
        *h = Some(Handle(handle));
    }
    let handle = h.as_ref().expect("created above").0;
    // SAFETY: a live handle; the stream outlives it. (The capture stream while a graph is
    // captured on this thread.)
    unsafe { br::set_stream(handle, dev.work_stream().cu_stream() as _) }.map_err(|e| dev.err("cublasSetStream", e))?;
    let (ty, compute) = match dtype {
        DType::F32 => (
            bs::cudaDataType::CUDA_R_32F,
            if super::allow_tf32() { bs::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32 } else { bs::cublasComputeType_t::CUBLAS_COMPUTE_32F },
        ),
        DType::F64 => (bs::cudaDataType::CUDA_R_64F, bs::cublasComputeType_t::CUBLAS_COMPUTE_64F),
        DType::F16 => (bs::cudaDataType::CUDA_R_16F, bs::cublasComputeType_t::CUBLAS_COMPUTE_32F),
        DType::BF16 => (bs::cudaDataType::CUDA_R_16BF, bs::cublasComputeType_t::CUBLAS_COMPUTE_32F),
        _ => unreachable!("integer products use the generated kernel"),
    };
    let op = |t: bool| if t { bs::cublasOperation_t::CUBLAS_OP_T } else { bs::cublasOperation_t::CUBLAS_OP_N };
    let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
    let (alpha, beta) = if dtype == DType::F64 {
        (&one64 as *const f64 as *const _, &zero64 as *const f64 as *const _)
    } else {
        (&one32 as *const f32 as *const _, &zero32 as *const f32 as *const _)
    };
    let _rec = crate::profiler::blas(dev, dtype);
    // Row-major C = A B is column-major C^T = B^T A^T: B comes first.
    // SAFETY: pointers and strides describe live buffers of these shapes; alpha/beta are host
    // scalars of the compute type.
    unsafe {
        br::gemm_strided_batched_ex(
            handle,
            op(tb),
            op(ta),
            n as i32,
            m as i32,
            k as i32,
            alpha,
            pb as *const _,
            ty,
            ldb as i32,
            b.strides()[0] as i64,
            pa as *const _,
            ty,
            lda as i32,
            a.strides()[0] as i64,
            beta,
            out.ptr() as *mut _,
            ty,
            n as i32,
            (m * n) as i64,
            bsz as i32,
            compute,
            bs::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| dev.err("cublasGemmStridedBatchedEx", e))?;
    Ok(out)
}
