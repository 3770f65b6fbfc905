//! Products of one row by a matrix (`[1, K] @ [K, N]`, a decode step's every linear layer), with
//! the library product's bias and activation epilogue (ReLU, GELU's tanh form). A row's product is bound by reading the matrix
//! once; cuBLASLt's kernels for it are tiled for many rows and run well below that. Two kernels
//! (`gemv.cu`): where the matrix is stored `[N, K]` (a linear layer's `x @ W^T`, a tied output
//! head) one warp reads each output's row; where it is stored `[K, N]` (GPT-2's `Conv1D`) a
//! block reads a strip of columns down its piece of K, the pieces of a strip adding their sums
//! within a thread block cluster (Hopper). Both read 16-byte vectors and accumulate in
//! F32, as cuBLASLt does for F16 and BF16 (F32 stays FP32-accurate); operands they cannot read
//! so (unaligned, a K or N that is no multiple of the vector) go to the library.

use crate::backend::cuda::kernels::codegen::{self, PRELUDE};
use crate::backend::cuda::kernels::data_ptr;
use crate::backend::cuda::{kernel_args, CudaDevice, CudaStorage, KernelKey};
use crate::dtype::CType;
use crate::ops::matmul::Activation;
use crate::{DType, Result, Tensor};
use std::fmt::Write;
use std::sync::Arc;

const SOURCE: &str = include_str!("gemv.cu");
/// Warps per block of both kernels.
const WARPS: usize = 8;
/// Most rows a thread of the column kernel loads at once (four registers each).
const MAX_ROWS_PER_THREAD: usize = 16;
/// Most pieces the column kernel splits K into: the blocks of a strip form one cluster, and 8
/// is the largest cluster every Hopper part runs.
const MAX_SPLITS: usize = 8;

kernel_args! {
    /// What `gemv.cu` reads: the row `x` (K contiguous), the matrix `w` (rows `ldw` apart), the
    /// bias (or 0) and the activation after it (0 none, 1 ReLU, 2 GELU's tanh form), the
    /// contiguous output of N, and whether the matrix is settled (1: no grid still running
    /// writes it, so the column kernel loads it before waiting for the kernel before). The
    /// column kernel's blocks take `per` rows of K each.
    GemvArgs {
        x: u64, w: u64, bias: u64, out: u64,
        n: i64, k: i64, ldw: i64, act: i64, settled: i64,
        per: i64,
    }
}

/// How the matrix is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Walk {
    /// Stored `[N, K]`: a warp per output.
    Rows,
    /// Stored `[K, N]`: a block per strip of `lanes` vectors of columns (`lanes` lanes read a
    /// row's strip) and per one of `split` pieces of K (a strip's pieces form a cluster), each
    /// thread taking `rows` rows (all loaded before they are multiplied; 0: a loop over the
    /// piece).
    Cols { lanes: usize, split: usize, rows: usize },
}

/// `a` [1, 1, K] @ `b` [1, K, N] (+ `bias`, a packed vector of N, then ReLU) as a new [1, 1, N]
/// buffer, or None where these kernels do not take the product (the library then runs it).
/// `settled`: no kernel still running can be writing `b` (see `KILN_WAIT_UNLESS_SETTLED`).
pub(crate) fn product(dev: &Arc<CudaDevice>, a: &Tensor, b: &Tensor, dtype: DType, bias: Option<(&Tensor, Option<Activation>)>, settled: bool) -> Result<Option<CudaStorage>> {
    let (bsz, m, k) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let n = b.shape()[2];
    if bsz != 1 || m != 1 || k == 0 || n == 0 || !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || a.dtype() != dtype || b.dtype() != dtype {
        return Ok(None);
    }
    let vw = 16 / dtype.size_in_bytes();
    let aligned = |t: &Tensor| -> Result<bool> { Ok(data_ptr(t)? % 16 == 0) };
    let (rs, cs) = (b.strides()[1], b.strides()[2]);
    let (walk, ldw, per) = if cs == 1 && n > 1 && rs % vw == 0 && n.is_multiple_of(vw) {
        let most = if dev.hopper { crate::switches::gemv_splits().unwrap_or(MAX_SPLITS) } else { 1 };
        let (lanes, split) = column_walk(n, k, vw, dev.sm_count, most);
        let per = k.div_ceil(split);
        let rows = per.div_ceil(WARPS * 32 / lanes);
        (Walk::Cols { lanes, split, rows: if rows <= MAX_ROWS_PER_THREAD { rows } else { 0 } }, rs, per)
    } else if rs == 1 && k > 1 && cs % vw == 0 && k.is_multiple_of(vw) {
        (Walk::Rows, cs, k)
    } else {
        return Ok(None);
    };
    // The row is read in vectors by the row kernel, element by element by the column kernel.
    if (a.strides()[2] != 1 && k > 1) || !aligned(b)? || (walk == Walk::Rows && !aligned(a)?) {
        return Ok(None);
    }
    let bias_ptr = match bias {
        Some((t, _)) if t.dtype() != dtype || t.numel() != n || (t.strides()[0] != 1 && n > 1) => return Ok(None),
        Some((t, _)) => data_ptr(t)?,
        None => 0,
    };
    let out = CudaStorage::new(dev, dtype, n)?;
    let name = kernel_name(walk, dtype);
    let kern = dev.kernel(KernelKey::Named(name.clone()), || (name.clone(), source(&name, walk, dtype)))?;
    let blocks = match walk {
        Walk::Rows => n.div_ceil(WARPS),
        Walk::Cols { lanes, split, .. } => n.div_ceil(lanes * vw) * split,
    };
    let args = GemvArgs { x: data_ptr(a)?, w: data_ptr(b)?, bias: bias_ptr, out: out.ptr(), n: n as i64, k: k as i64, ldw: ldw as i64, act: match bias.and_then(|(_, act)| act) {
        None => 0,
        Some(Activation::Relu) => 1,
        Some(Activation::GeluTanh) => 2,
    }, settled: i64::from(settled), per: per as i64 };
    dev.launch(kern, (blocks as u32, 1, 1), ((32 * WARPS) as u32, 1, 1), &args)?;
    Ok(Some(out))
}

/// How the column kernel reads an `[K, N]` matrix on `sms` SMs: the widest strips (`lanes` of
/// 32, 16, 8 or 4 vectors of columns, so rows are read in pieces of 512 down to 64 contiguous
/// bytes) that, with K split into `split` pieces (a power of two, at most `most`, no piece
/// shorter than a pass of the block's rows), give a block to every SM; else the narrowest.
fn column_walk(n: usize, k: usize, vw: usize, sms: usize, most: usize) -> (usize, usize) {
    let walk = |lanes: usize| {
        let pass = WARPS * 32 / lanes;
        let fits = most.clamp(1, MAX_SPLITS).min(k.div_ceil(pass));
        // (the largest power of two no greater)
        let split = 1 << fits.ilog2();
        (lanes, split, n.div_ceil(lanes * vw) * split)
    };
    let (lanes, split, _) = [32, 16, 8].into_iter().map(walk).find(|&(_, _, blocks)| blocks >= sms).unwrap_or_else(|| walk(4));
    (lanes, split)
}

/// A kernel's name, which says all its source depends on.
fn kernel_name(walk: Walk, dtype: DType) -> String {
    match walk {
        Walk::Rows => format!("gemv_rows_{}", dtype.torch_name()),
        Walk::Cols { lanes, split, rows: 0 } => format!("gemv_cols{lanes}_s{split}_{}", dtype.torch_name()),
        Walk::Cols { lanes, split, rows } => format!("gemv_cols{lanes}_s{split}_r{rows}_{}", dtype.torch_name()),
    }
}

fn source(name: &str, walk: Walk, dtype: DType) -> String {
    let mut c = format!("{PRELUDE}{}", GemvArgs::C_DECL);
    let _ = writeln!(c, "#define NAME {name}\n#define WARPS {WARPS}\n#define VW {}", 16 / dtype.size_in_bytes());
    let _ = writeln!(c, "#define T {}", codegen::storage_type(dtype));
    let _ = writeln!(c, "#define LD(e) ({})", codegen::load(dtype, CType::F32, "(e)"));
    let _ = writeln!(c, "#define ST(e) ({})", codegen::store(dtype, CType::F32, "(e)"));
    // The epilogue's GELU: the pointwise op's own definition, in F32.
    let _ = writeln!(c, "#define KGELU_TANH(x) ({})", crate::ops::UnaryOp::GeluTanh.cuda("(x)", CType::F32));
    if dtype == DType::BF16 {
        c.push_str("#define GEMV_BF16\n");
    }
    match walk {
        Walk::Rows => c.push_str("#define GEMV_ROWS\n"),
        Walk::Cols { lanes, split, rows } => {
            let _ = writeln!(c, "#define GEMV_COLS\n#define LANES {lanes}\n#define SPLIT {split}");
            if rows > 0 {
                let _ = writeln!(c, "#define RPT {rows}");
            }
        }
    }
    c.push_str(SOURCE);
    c
}

/// Sources of both walks in every dtype, for the NVRTC check (`samples.rs`).
#[cfg(test)]
pub(super) fn samples() -> Vec<super::samples::Sample> {
    let mut v = vec![];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        for walk in [Walk::Rows, Walk::Cols { lanes: 4, split: 1, rows: 6 }, Walk::Cols { lanes: 32, split: 1, rows: 0 }, Walk::Cols { lanes: 16, split: 8, rows: 6 }, Walk::Cols { lanes: 4, split: 2, rows: 0 }] {
            let name = kernel_name(walk, dtype);
            let sample = super::samples::Sample::new((name.clone(), source(&name, walk, dtype)));
            // (clusters exist from compute capability 9.0)
            v.push(if matches!(walk, Walk::Cols { split: 2.., .. }) { sample.hopper_only() } else { sample });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_walk_may_start_before_the_kernel_before_ends() {
        for s in samples() {
            assert!(crate::backend::cuda::device::waits_for_previous(&s.src), "{}", s.name);
        }
    }

    #[test]
    fn column_strips_are_as_wide_as_keep_every_sm_busy_with_k_split_in_a_cluster() {
        // GPT-2's products in BF16 on 132 SMs: qkv (N 2304) and MLP up (3072) over K 768 read
        // 256-byte pieces of rows, the projections (N 768) 64-byte ones; K in 8 pieces.
        assert_eq!(column_walk(2304, 768, 8, 132, MAX_SPLITS), (16, 8));
        assert_eq!(column_walk(3072, 768, 8, 132, MAX_SPLITS), (16, 8));
        assert_eq!(column_walk(768, 768, 8, 132, MAX_SPLITS), (4, 8));
        assert_eq!(column_walk(768, 3072, 8, 132, MAX_SPLITS), (4, 8));
        // Wide enough for whole rows of 512 bytes.
        assert_eq!(column_walk(11008, 4096, 8, 132, MAX_SPLITS), (32, 8));
        // Unsplit (no clusters): the narrowest strips.
        assert_eq!(column_walk(2304, 768, 8, 132, 1), (4, 1));
        // Short K: no piece shorter than a pass of the block's rows, the split a power of two.
        assert_eq!(column_walk(64, 8, 8, 132, MAX_SPLITS), (4, 1));
        assert_eq!(column_walk(8192, 100, 8, 132, MAX_SPLITS), (32, 8));
        assert_eq!(column_walk(2048, 40, 4, 132, MAX_SPLITS), (4, 1));
        for (n, k, vw) in [(768, 3072, 8), (2304, 768, 8), (64, 8192, 4), (56, 4096, 8), (8, 1, 8)] {
            let (lanes, split) = column_walk(n, k, vw, 132, MAX_SPLITS);
            assert!(split.is_power_of_two() && split <= MAX_SPLITS && (lanes * vw) % split == 0, "{n} {k}: {lanes} {split}");
            // (every piece has rows)
            assert!((split - 1) * k.div_ceil(split) < k, "{n} {k}: {split}");
        }
    }
}
