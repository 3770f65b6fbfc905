//! F32 products on the tensor cores in TF32, for compiled programs under `allow_tf32`
//! (`tf32.cu`): `[1, M, K] @ [1, K, N]` with the library product's bias and activation
//! epilogue. cuBLASLt's TF32 kernels are tiled for large products; a transformer's products of a
//! few hundred rows fill few of their tiles, and each is a launch of its own that cannot start
//! before the kernel ahead of it ends. These kernels take 64 x 64 tiles, split K where the tiles
//! alone would leave SMs idle, start early under programmatic dependent launch and load a
//! settled weight before waiting. Large products (more tiles than `MAX_TILES_PER_SM` per SM) and
//! operands they cannot read in 16-byte vectors stay with the library. Opt-in (`KILN_TF32_GEMM=1`).

use crate::backend::cuda::kernels::codegen::PRELUDE;
use crate::backend::cuda::kernels::data_ptr;
use crate::backend::cuda::{kernel_args, CudaDevice, CudaStorage, KernelKey};
use crate::dtype::CType;
use crate::ops::matmul::Activation;
use crate::{DType, Result, Tensor};
use std::fmt::Write;
use std::sync::Arc;

const SOURCE: &str = include_str!("tf32.cu");
/// Output rows and columns of a block's tile, and values of K per chunk (as in `tf32.cu`).
const TILE: usize = 64;
const CHUNK: usize = 32;
/// Chunks in flight (as in `tf32.cu`).
const STAGES: usize = 3;
/// Threads per block.
const THREADS: u32 = 128;
/// Products of more tiles than this per SM go to the library, whose larger tiles do better.
const MAX_TILES_PER_SM: usize = 8;
/// Most pieces K is split into, and the fewest chunks a piece takes.
const MAX_SPLITS: usize = 8;
const MIN_CHUNKS_PER_SPLIT: usize = 4;

kernel_args! {
    /// What `tf32.cu` reads: A (rows `lda` apart, K contiguous), B (`ldb` apart along N where
    /// stored [N, K], along K where stored [K, N]), the bias (or 0) and the activation after it
    /// (0 none, 1 ReLU, 2 GELU's tanh form), the contiguous output, whether B is settled (see
    /// `gemv::product`), the rows of K per piece, and where K is split the pieces' sums `part`
    /// ([pieces][M][N] F32) and the tiles' arrival counters `count`.
    Tf32Args {
        a: u64, b: u64, bias: u64, out: u64,
        m: i64, n: i64, k: i64, lda: i64, ldb: i64, act: i64, settled: i64,
        per: i64, part: u64, count: u64,
    }
}

/// How B is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BLayout {
    /// `[N, K]`, K contiguous (a linear layer's weight, `x @ W^T`).
    Nk,
    /// `[K, N]`, N contiguous.
    Kn,
}

/// `a` [1, M, K] @ `b` [1, K, N] (+ `bias`, a packed vector of N, then the activation) in TF32
/// as a new [1, M, N] buffer, or None where these kernels do not take it (the library then
/// runs it): only F32 under `allow_tf32` of more than one row, and only with `KILN_TF32_GEMM=1`.
pub(crate) fn product(dev: &Arc<CudaDevice>, a: &Tensor, b: &Tensor, bias: Option<(&Tensor, Option<Activation>)>, settled: bool) -> Result<Option<CudaStorage>> {
    let (bsz, m, k) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let n = b.shape()[2];
    // (One row is the matrix-vector kernels' or the library's: a tile would use one row of 64.)
    if !crate::backend::cuda::allow_tf32() || !crate::switches::tf32_gemm_on() || bsz != 1 || m < 2 || n == 0 || k == 0 || a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        return Ok(None);
    }
    // cp.async and TF32 `mma.sync` need compute capability 8.0.
    if dev.arch.strip_prefix("sm_").and_then(|v| v.parse::<u32>().ok()).is_none_or(|v| v < 80) {
        return Ok(None);
    }
    if tiles(m, n) > MAX_TILES_PER_SM * dev.sm_count || !k.is_multiple_of(4) {
        return Ok(None);
    }
    let aligned = |t: &Tensor| -> Result<bool> { Ok(data_ptr(t)? % 16 == 0) };
    let (ars, acs) = (a.strides()[1], a.strides()[2]);
    let (brs, bcs) = (b.strides()[1], b.strides()[2]);
    if (acs != 1 && k > 1) || !ars.is_multiple_of(4) || !aligned(a)? || !aligned(b)? {
        return Ok(None);
    }
    let (layout, ldb) = if brs == 1 && (n == 1 || bcs.is_multiple_of(4)) {
        (BLayout::Nk, bcs)
    } else if bcs == 1 && n.is_multiple_of(4) && brs.is_multiple_of(4) {
        (BLayout::Kn, brs)
    } else {
        return Ok(None);
    };
    let Some((bias_ptr, act)) = super::gemv::epilogue_args(bias, DType::F32, n)? else { return Ok(None) };
    let out = CudaStorage::new(dev, DType::F32, m * n)?;
    let name = kernel_name(layout);
    let kern = dev.kernel(KernelKey::Named(name.clone()), || (name.clone(), source(&name, layout)))?;
    let blocks = tiles(m, n);
    let per = split_rows(k, blocks, dev.sm_count);
    let splits = k.div_ceil(per);
    // The pieces' sums, alive until the launch is queued (the allocator hands the block on in
    // stream order).
    let part = if splits > 1 { Some(CudaStorage::new(dev, DType::F32, splits * m * n)?) } else { None };
    let count = if splits > 1 { dev.reduce_counters(blocks)? } else { 0 };
    let args = Tf32Args {
        a: data_ptr(a)?,
        b: data_ptr(b)?,
        bias: bias_ptr,
        out: out.ptr(),
        m: m as i64,
        n: n as i64,
        k: k as i64,
        lda: ars as i64,
        ldb: ldb as i64,
        act,
        settled: super::settled_arg(settled),
        per: per as i64,
        part: part.as_ref().map_or(0, |p| p.ptr()),
        count,
    };
    let grid = (n.div_ceil(TILE) as u32, m.div_ceil(TILE) as u32, splits as u32);
    dev.launch_shared(kern, grid, (THREADS, 1, 1), shared_bytes(layout) as u32, &args)?;
    drop(part);
    Ok(Some(out))
}

/// Output tiles of an M x N product.
fn tiles(m: usize, n: usize) -> usize {
    m.div_ceil(TILE) * n.div_ceil(TILE)
}

/// Rows of K per block: all of K, or where the tiles are fewer than the SMs an even piece of
/// whole chunks, so that the pieces fill them (at most `MAX_SPLITS` pieces, each of at least
/// `MIN_CHUNKS_PER_SPLIT` chunks).
fn split_rows(k: usize, tiles: usize, sms: usize) -> usize {
    let chunks = k.div_ceil(CHUNK);
    let splits = sms.div_ceil(tiles).min(chunks / MIN_CHUNKS_PER_SPLIT).clamp(1, MAX_SPLITS);
    chunks.div_ceil(splits) * CHUNK
}

/// Dynamic shared memory of a block: `STAGES` chunks of both operands (`tf32.cu`'s padded tiles).
fn shared_bytes(layout: BLayout) -> usize {
    let a = TILE * (CHUNK + 4);
    let b = match layout {
        BLayout::Nk => TILE * (CHUNK + 4),
        BLayout::Kn => CHUNK * (TILE + 8),
    };
    STAGES * (a + b) * 4
}

/// A kernel's name, which says all its source depends on.
fn kernel_name(layout: BLayout) -> String {
    match layout {
        BLayout::Nk => "tf32_gemm_nk".into(),
        BLayout::Kn => "tf32_gemm_kn".into(),
    }
}

fn source(name: &str, layout: BLayout) -> String {
    let mut c = format!("{PRELUDE}{}", Tf32Args::C_DECL);
    let _ = writeln!(c, "#define NAME {name}");
    // The epilogue's GELU: the pointwise op's own definition, in F32.
    let _ = writeln!(c, "#define KGELU_TANH(x) ({})", crate::ops::UnaryOp::GeluTanh.cuda("(x)", CType::F32));
    if layout == BLayout::Kn {
        c.push_str("#define B_KN\n");
    }
    c.push_str(SOURCE);
    c
}

/// Both layouts' sources, for the NVRTC check (`samples.rs`).
#[cfg(test)]
pub(super) fn samples() -> Vec<super::samples::Sample> {
    [BLayout::Nk, BLayout::Kn]
        .into_iter()
        .map(|layout| {
            let name = kernel_name(layout);
            super::samples::Sample::new((name.clone(), source(&name, layout)))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts_may_start_before_the_kernel_before_ends() {
        for s in samples() {
            assert!(crate::backend::cuda::device::waits_for_previous(&s.src), "{}", s.name);
        }
    }

    #[test]
    fn k_splits_into_whole_chunks_where_the_tiles_leave_sms_idle() {
        // The transformer's products of 320 rows on 132 SMs. Out projection (N 512, 40 tiles,
        // K 512 = 16 chunks): four pieces of four chunks.
        assert_eq!(split_rows(512, 40, 132), 128);
        // Feed-forward down (K 2048, 64 chunks): four pieces of 16.
        assert_eq!(split_rows(2048, 40, 132), 512);
        // qkv (N 1536, 120 tiles): two pieces.
        assert_eq!(split_rows(512, 120, 132), 256);
        // Enough tiles: all of K.
        assert_eq!(split_rows(512, 480, 132), 512);
        // Short K: one piece.
        assert_eq!(split_rows(96, 1, 132), 96);
        for (k, tiles) in [(512, 40), (2048, 1), (100, 3), (4096, 7), (36, 1)] {
            let per = split_rows(k, tiles, 132);
            assert!(per.is_multiple_of(CHUNK) || per >= k, "{k} {tiles}: {per}");
            assert!(k.div_ceil(per) <= MAX_SPLITS, "{k} {tiles}: {per}");
        }
    }

    #[test]
    fn the_shared_tiles_fit_four_blocks_an_sm() {
        for layout in [BLayout::Nk, BLayout::Kn] {
            assert!(4 * shared_bytes(layout) <= 227 * 1024, "{layout:?}");
        }
    }
}
