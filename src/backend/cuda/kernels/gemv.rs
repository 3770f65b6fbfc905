//! Products of one row by a matrix (`[1, K] @ [K, N]`, a decode step's every linear layer), with
//! the library product's bias and activation epilogue (ReLU, GELU's tanh form). A row's product is bound by reading the matrix
//! once; cuBLASLt's kernels for it are tiled for many rows and run well below that. Two kernels
//! (`gemv.cu`): where the matrix is stored `[N, K]` (a linear layer's `x @ W^T`, a tied output
//! head) one warp reads each output's row; where it is stored `[K, N]` (GPT-2's `Conv1D`) a
//! block reads a strip of columns down all of K. Both read 16-byte vectors and accumulate in
//! F32, as cuBLASLt does for F16 and BF16 (F32 stays FP32-accurate); operands they cannot read
//! so (unaligned, a K or N that is no multiple of the vector) go to the library.

use crate::backend::cuda::kernels::codegen::{self, PRELUDE};
use crate::backend::cuda::kernels::data_ptr;
use crate::backend::cuda::device::KernelArgs;
use crate::backend::cuda::kernels::fused::RowPrologue;
use crate::backend::cuda::{kernel_args, CudaDevice, CudaStorage, KernelKey, LaunchArgs};
use crate::dtype::CType;
use crate::ops::matmul::Activation;
use crate::{DType, Result, Tensor};
use std::fmt::Write;
use std::sync::Arc;

const SOURCE: &str = include_str!("gemv.cu");
/// Warps per block of both kernels.
const WARPS: usize = 8;
/// Blocks the column kernel wants at least (the H200 has 132 SMs): below this a block takes
/// fewer columns.
const MIN_BLOCKS: usize = 132;
/// Most rows a thread of the column kernel loads at once (four registers each).
const MAX_ROWS_PER_THREAD: usize = 16;
/// Blocks per SM the column kernel splits K to reach, where its strips of columns are fewer.
const SPLIT_BLOCKS_PER_SM: usize = 2;
/// Rows per warp of a settled matrix the row kernel fetches into L2 before its wait (an output
/// head's 50,257 rows over a grid of 4 blocks per SM: about a third of them).
const PREFETCH_ROWS: usize = 4;
/// Blocks per SM of the row kernel with an argmax (each block adds one atomic on one address).
const ARGMAX_BLOCKS_PER_SM: usize = 4;
/// Most pieces K is split into (each leaves N partial sums for the last block to add).
const MAX_SPLITS: usize = 16;

kernel_args! {
    /// What `gemv.cu` reads: the row `x` (K contiguous), the matrix `w` (rows `ldw` apart), the
    /// bias (or 0) and the activation after it (0 none, 1 ReLU, 2 GELU's tanh form), the
    /// contiguous output of N, and whether the matrix is settled (`settled_arg`: no grid still
    /// running writes it, so the column kernel loads it, and the row kernel fetches its first
    /// rows into L2, before waiting for the kernel before). The
    /// column kernel's blocks take `per` rows of K each; where K is split, the partial sums go
    /// through `part` ([splits][N] F32) and the strips' arrival counters `count`.
    GemvArgs {
        x: u64, w: u64, bias: u64, out: u64,
        n: i64, k: i64, ldw: i64, act: i64, settled: i64,
        per: i64, part: u64, count: u64,
    }
}

kernel_args! {
    /// A cache attention the column kernel runs after its product (`gemv.cu`, GEMV_ATTEND;
    /// `Attend`): where head 0's query, new key and new value rows start in the product's output
    /// and the elements between heads, the query heads and how many share a key head, the
    /// cache's keys and values (position 0 of key head 0) with their position and head strides,
    /// the I64 last position seen, the cache's length, the scale, the attention's output
    /// `[H, D]`, the per-query-head arrival counters, and whether no kernel still running writes
    /// the cache or `last`.
    AttendArgs {
        q_off: i64, k_off: i64, v_off: i64, q_hs: i64, k_hs: i64, v_hs: i64,
        heads: i64, kv_group: i64,
        kc: u64, vc: u64, kc_s: i64, kc_h: i64, vc_s: i64, vc_h: i64,
        last: u64, seq: i64, scale: f64, att: u64, count: u64, settled: i64,
    }
}

/// How the matrix is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Walk {
    /// Stored `[N, K]`: a warp per output.
    Rows,
    /// Stored `[K, N]`: a block per `tx` vectors of columns and piece of K, each thread taking
    /// `rows` rows (all loaded before they are multiplied; 0: a loop over the piece).
    Cols { tx: usize, rows: usize },
}

/// Threads per block of both kernels.
pub(crate) const THREADS: usize = 32 * WARPS;

/// Both kernels' argument block with a row kernel's words after it, for a product whose row a
/// row kernel computes first in every block (`gemv.cu`, `GEMV_ROW`).
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvRowArgs {
    g: GemvArgs,
    r: LaunchArgs,
}
// SAFETY: `#[repr(C)]` of two such blocks of eight-byte words, declared alike in `gemv.cu`.
unsafe impl KernelArgs for GemvRowArgs {}

/// The column kernel's argument block with a cache attention's after it (`gemv.cu`,
/// `GemvParams` under GEMV_ATTEND).
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvAttendArgs {
    g: GemvArgs,
    t: AttendArgs,
}
// SAFETY: `#[repr(C)]` of blocks of eight-byte words, declared alike in `gemv.cu`.
unsafe impl KernelArgs for GemvAttendArgs {}

/// The same with a row kernel's words between.
#[repr(C)]
#[derive(Clone, Copy)]
struct GemvRowAttendArgs {
    g: GemvArgs,
    r: LaunchArgs,
    t: AttendArgs,
}
// SAFETY: `#[repr(C)]` of blocks of eight-byte words, declared alike in `gemv.cu`.
unsafe impl KernelArgs for GemvRowAttendArgs {}

/// A decode step's cache attention (`Op::AttentionUpTo` of one query row per head) whose query
/// and new key and value rows are views of a product's output: the column kernel computes the
/// product into `out` (made before, contiguous), then attends each head as soon as its rows are
/// complete, one launch for both.
pub(crate) struct Attend<'a> {
    /// The product's output.
    pub out: &'a Tensor,
    /// `[1, 1, H, D]`, `[1, 1, H_kv, D]` twice: views of `out`.
    pub q: &'a Tensor,
    pub k_new: &'a Tensor,
    pub v_new: &'a Tensor,
    /// The cache `[S, 1, H_kv, D]` and the last position `[1]` (I64).
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub last: &'a Tensor,
    pub scale: f64,
    /// No kernel still running writes the cache or `last` (`ops::attention::SettledCache`).
    pub settled: bool,
}

impl Attend<'_> {
    /// The kernel's arguments (but the output and counters) and the head dim, or None where the
    /// column kernel of `tx` vectors per block does not take it: F16 or BF16 rows of one batch
    /// whose features are contiguous and 16-byte aligned, heads apart by at least their
    /// features, every block's share of the heads within its kernel's bounds, and the static
    /// shared memory within CUDA's 48 KiB beside a row of `row_len` the kernel computes first.
    fn args(&self, dtype: DType, tx: usize, n: usize, row_len: usize) -> Result<Option<(AttendArgs, usize)>> {
        if !matches!(dtype, DType::F16 | DType::BF16) || [self.q, self.k_new, self.v_new, self.k, self.v].iter().any(|t| t.dtype() != dtype || t.ndim() != 4) || self.last.dtype() != DType::I64 || self.last.numel() != 1 {
            return Ok(None);
        }
        let (h, d) = (self.q.shape()[2], self.q.shape()[3]);
        let (s, hkv) = (self.k.shape()[0], self.k.shape()[2]);
        let vw = 16 / dtype.size_in_bytes();
        let one_row = |t: &Tensor, heads: usize| t.shape() == [1, 1, heads, d];
        if !one_row(self.q, h) || !one_row(self.k_new, hkv) || !one_row(self.v_new, hkv) || self.k.shape() != [s, 1, hkv, d] || self.v.shape() != self.k.shape() {
            return Ok(None);
        }
        if s == 0 || hkv == 0 || !h.is_multiple_of(hkv) || d == 0 || !d.is_multiple_of(vw) || d > THREADS {
            return Ok(None);
        }
        // The heads a block's columns may hold: (query, key, value) pieces, at most ATT_MAX_PIECES.
        let group = h / hkv;
        if ((tx * vw).div_ceil(d) + 1) * (1 + 2 * group) > ATT_MAX_PIECES || attend_shared(d, dtype, tx) > STATIC_SHARED || row_len > attend_row_limit(d, dtype, tx) {
            return Ok(None);
        }
        let base = data_ptr(self.out)?;
        let size = dtype.size_in_bytes() as u64;
        // (element offset in the product, head stride) of a view of it, heads apart by D or more.
        let within = |t: &Tensor, heads: usize| -> Result<Option<(i64, i64)>> {
            let (p, hs) = (data_ptr(t)?, t.strides()[2]);
            if p < base || (p - base) % size != 0 || (t.strides()[3] != 1 && d > 1) || (heads > 1 && hs < d) {
                return Ok(None);
            }
            let off = ((p - base) / size) as usize;
            Ok((off + (heads - 1) * hs + d <= n).then_some((off as i64, hs as i64)))
        };
        let (Some(q), Some(kn), Some(vn)) = (within(self.q, h)?, within(self.k_new, hkv)?, within(self.v_new, hkv)?) else { return Ok(None) };
        let rows = |t: &Tensor| -> Result<bool> { Ok(data_ptr(t)? % 16 == 0 && (t.strides()[3] == 1 || d == 1) && t.strides()[0].is_multiple_of(vw) && t.strides()[2].is_multiple_of(vw)) };
        if !rows(self.k)? || !rows(self.v)? {
            return Ok(None);
        }
        let args = AttendArgs {
            q_off: q.0, k_off: kn.0, v_off: vn.0, q_hs: q.1, k_hs: kn.1, v_hs: vn.1,
            heads: h as i64, kv_group: group as i64,
            kc: data_ptr(self.k)?, vc: data_ptr(self.v)?, kc_s: self.k.strides()[0] as i64, kc_h: self.k.strides()[2] as i64, vc_s: self.v.strides()[0] as i64, vc_h: self.v.strides()[2] as i64,
            last: data_ptr(self.last)?, seq: s as i64, scale: self.scale, att: 0, count: 0, settled: super::settled_arg(self.settled),
        };
        Ok(Some((args, d)))
    }
}

/// A block's static shared memory without opting in to more.
const STATIC_SHARED: usize = 48 << 10;

/// What a row kernel computed first (`GEMV_ROW`) may keep in shared memory for its own reductions.
const ROW_SCRATCH: usize = 1 << 10;

/// The static shared memory of the column kernel of `tx` vectors per block with a cache
/// attention of head dim `d` (`gemv.cu`, GEMV_ATTEND), but a row it computes first: its arrays,
/// counted as they are declared there.
fn attend_shared(d: usize, dtype: DType, tx: usize) -> usize {
    let size = dtype.size_in_bytes();
    // ATT_CH: keys per pass, their value rows in 32 KiB.
    let keys = THREADS.min((32 << 10) / (d * size));
    let f32s = 3 * d + keys + WARPS + WARPS * d + WARPS * tx * (16 / size);
    // Vs, then pieces, done (i64) and the two counts, the column kernel's `last`, alignment.
    f32s * 4 + keys * d * size + ATT_MAX_PIECES * 24 + 8 + 16
}

/// The longest row that kernel computes first (`GEMV_ROW`) within `STATIC_SHARED`.
pub(crate) fn attend_row_limit(d: usize, dtype: DType, tx: usize) -> usize {
    let vw = 16 / dtype.size_in_bytes();
    (STATIC_SHARED.saturating_sub(attend_shared(d, dtype, tx) + ROW_SCRATCH) / dtype.size_in_bytes()) / vw * vw
}

/// Most (section, head) pieces one block's columns hold (`gemv.cu`, ATT_MAX_PIECES).
const ATT_MAX_PIECES: usize = 64;

/// `a` [1, 1, K] @ `b` [1, K, N] (+ `bias`, a packed vector of N, then ReLU) as a new [1, 1, N]
/// buffer, or None where these kernels do not take the product or under `KILN_GEMV=0` (the
/// library then runs it).
/// `settled`: no kernel still running can be writing `b` (see `KILN_WAIT_UNLESS_SETTLED`).
/// `row`: the row kernel whose output `a` is, not yet run: every block computes the row itself
/// first (`fused::RowPrologue`), and `a`'s buffer is left as it was.
/// `argmax`: the result is instead one I64, the index of the largest output (the first of
/// equals, NaN above all, as `Tensor::argmax`), from the matrix stored `[N, K]` only (else None).
// The product's operands and its epilogue's parts, one each: a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn product(dev: &Arc<CudaDevice>, a: &Tensor, b: &Tensor, dtype: DType, bias: Option<(&Tensor, Option<Activation>)>, settled: bool, row: Option<&RowPrologue>, argmax: bool) -> Result<Option<CudaStorage>> {
    run(dev, a, b, dtype, bias, settled, row, argmax, None)
}

/// `product` into `attend.out`, running the cache attention `attend` in the same launch: the
/// attention's output `[H * D]`, or None where the column kernel does not take both (nothing
/// was queued).
#[allow(clippy::too_many_arguments)]
pub(crate) fn product_attending(dev: &Arc<CudaDevice>, a: &Tensor, b: &Tensor, dtype: DType, bias: Option<(&Tensor, Option<Activation>)>, settled: bool, row: Option<&RowPrologue>, attend: &Attend) -> Result<Option<CudaStorage>> {
    run(dev, a, b, dtype, bias, settled, row, false, Some(attend))
}

/// `product`, or with `attend` `product_attending`; None under `KILN_GEMV=0`.
#[allow(clippy::too_many_arguments)]
fn run(dev: &Arc<CudaDevice>, a: &Tensor, b: &Tensor, dtype: DType, bias: Option<(&Tensor, Option<Activation>)>, settled: bool, row: Option<&RowPrologue>, argmax: bool, attend: Option<&Attend>) -> Result<Option<CudaStorage>> {
    if crate::switches::gemv_off() {
        return Ok(None);
    }
    let (bsz, m, k) = (a.shape()[0], a.shape()[1], a.shape()[2]);
    let n = b.shape()[2];
    if bsz != 1 || m != 1 || k == 0 || n == 0 || !matches!(dtype, DType::F32 | DType::F16 | DType::BF16) || a.dtype() != dtype || b.dtype() != dtype {
        return Ok(None);
    }
    if row.is_some_and(|r| r.cols() != k) {
        return Ok(None);
    }
    let vw = 16 / dtype.size_in_bytes();
    let aligned = |t: &Tensor| -> Result<bool> { Ok(data_ptr(t)? % 16 == 0) };
    let (rs, cs) = (b.strides()[1], b.strides()[2]);
    let (walk, ldw, per) = if cs == 1 && n > 1 && rs % vw == 0 && n.is_multiple_of(vw) {
        let tx = columns_per_block(n, vw);
        let per = split_rows(n, k, vw, tx, dev.sm_count, crate::switches::gemv_splits().unwrap_or(1));
        let rows = per.div_ceil(WARPS * 32 / tx);
        (Walk::Cols { tx, rows: if rows <= MAX_ROWS_PER_THREAD { rows } else { 0 } }, rs, per)
    } else if rs == 1 && k > 1 && cs % vw == 0 && k.is_multiple_of(vw) {
        (Walk::Rows, cs, k)
    } else {
        return Ok(None);
    };
    if argmax && (walk != Walk::Rows || n > u32::MAX as usize) {
        return Ok(None);
    }
    // The row is read in vectors by the row kernel, element by element by the column kernel
    // (a row computed in the kernel lies aligned in shared memory).
    if !aligned(b)? || (row.is_none() && ((a.strides()[2] != 1 && k > 1) || (walk == Walk::Rows && !aligned(a)?))) {
        return Ok(None);
    }
    let Some((bias_ptr, act)) = epilogue_args(bias, dtype, n)? else { return Ok(None) };
    // The attention's arguments; its value rows in shared memory beside the row's.
    let attending = match (attend, walk) {
        (None, _) => None,
        (Some(t), Walk::Cols { tx, .. }) if t.out.numel() == n && t.out.is_contiguous() && t.out.dtype() == dtype => match t.args(dtype, tx, n, row.map_or(0, |_| k))? {
            Some(x) => Some(x),
            None => return Ok(None),
        },
        (Some(_), _) => return Ok(None),
    };
    // The product's output: made here, or `attend.out`, with the attention's beside it.
    let (out, out_ptr, att) = match (attending, attend) {
        (Some((_, d)), Some(t)) => (None, data_ptr(t.out)?, Some(CudaStorage::new(dev, dtype, t.q.shape()[2] * d)?)),
        _ => {
            let out = if argmax { CudaStorage::new(dev, DType::I64, 1)? } else { CudaStorage::new(dev, dtype, n)? };
            let p = out.ptr();
            (Some(out), p, None)
        }
    };
    let head_dim = attending.map(|(_, d)| d);
    let name = kernel_name(walk, dtype, argmax) + &head_dim.map_or(String::new(), |d| format!("_attend{d}"));
    let kern = match row {
        None => dev.kernel(KernelKey::Named(name.clone()), || (name.clone(), source(&name, walk, dtype, None, argmax, head_dim)))?,
        Some(r) => r.product_kernel(dev, &name, |row_name, row_src| source(&format!("{name}_{row_name}"), walk, dtype, Some((row_name, row_src, k)), argmax, head_dim))?,
    };
    let (blocks, splits) = match walk {
        // The argmax's blocks each walk several outputs: one atomic per block.
        Walk::Rows if argmax => (n.div_ceil(WARPS).min(dev.sm_count * ARGMAX_BLOCKS_PER_SM), 1),
        Walk::Rows => (n.div_ceil(WARPS), 1),
        Walk::Cols { tx, .. } => (n.div_ceil(tx * vw), k.div_ceil(per)),
    };
    // The partial sums of a split K, alive until the launch is queued (the allocator hands the
    // block on in stream order).
    let part = if splits > 1 { Some(CudaStorage::new(dev, DType::F32, splits * n)?) } else { None };
    // The argmax (one row walk, never split) takes the first counter for its arrivals and the
    // third and fourth (8-byte aligned) for its running best, left zero by its last block.
    // The attention's per-head counters follow the strips' (a strip's blocks arrive at its own).
    let (part_ptr, count) = if argmax {
        let c = dev.reduce_counters(4)?;
        (c + 8, c)
    } else {
        let heads = attending.map_or(0, |(t, _)| t.heads as usize);
        (part.as_ref().map_or(0, |p| p.ptr()), if splits > 1 || heads > 0 { dev.reduce_counters(blocks + heads)? } else { 0 })
    };
    let args = GemvArgs { x: if row.is_some() { 0 } else { data_ptr(a)? }, w: data_ptr(b)?, bias: bias_ptr, out: out_ptr, n: n as i64, k: k as i64, ldw: ldw as i64, act, settled: super::settled_arg(settled), per: per as i64, part: part_ptr, count };
    let (grid, block) = ((blocks as u32, splits as u32, 1), (THREADS as u32, 1, 1));
    let t = attending.map(|(t, _)| AttendArgs { att: att.as_ref().map_or(0, |a| a.ptr()), count: count + 4 * blocks as u64, ..t });
    match (row, t) {
        (None, None) => dev.launch(kern, grid, block, &args)?,
        (Some(r), None) => dev.launch(kern, grid, block, &GemvRowArgs { g: args, r: r.args() })?,
        (None, Some(t)) => dev.launch(kern, grid, block, &GemvAttendArgs { g: args, t })?,
        (Some(r), Some(t)) => dev.launch(kern, grid, block, &GemvRowAttendArgs { g: args, r: r.args(), t })?,
    }
    drop(part);
    Ok(att.or(out))
}

/// The epilogue as the product kernels read it (`gemv.cu`, `tf32.cu`): the bias's pointer (0
/// for none) and the activation's code (`act`: 0 none, 1 ReLU, 2 GELU's tanh form); None where
/// the bias is no packed vector of N in `dtype`.
pub(crate) fn epilogue_args(bias: Option<(&Tensor, Option<Activation>)>, dtype: DType, n: usize) -> Result<Option<(u64, i64)>> {
    let ptr = match bias {
        Some((t, _)) if t.dtype() != dtype || t.numel() != n || (t.strides()[0] != 1 && n > 1) => return Ok(None),
        Some((t, _)) => data_ptr(t)?,
        None => 0,
    };
    let act = match bias.and_then(|(_, act)| act) {
        None => 0,
        Some(Activation::Relu) => 1,
        Some(Activation::GeluTanh) => 2,
    };
    Ok(Some((ptr, act)))
}

/// Vectors of columns per block of the column kernel: as many (4, 2 or 1) as keep `MIN_BLOCKS`
/// blocks.
fn columns_per_block(n: usize, vw: usize) -> usize {
    [4, 2].into_iter().find(|tx| (n / vw).div_ceil(*tx) >= MIN_BLOCKS).unwrap_or(1)
}

/// Rows of K per block of the column kernel: all of K, or (where its strips of `tx` vectors of
/// columns are fewer than `SPLIT_BLOCKS_PER_SM` blocks per SM) an even piece of whole passes
/// of the block's rows, so that the pieces fill the SMs, at most `most` of them
/// (`KILN_GEMV_SPLIT`; 1, the default, never splits: GPT-2's decode step ran slower split).
fn split_rows(n: usize, k: usize, vw: usize, tx: usize, sms: usize, most: usize) -> usize {
    let (strips, pass) = ((n / vw).div_ceil(tx), WARPS * 32 / tx);
    let most = most.clamp(1, MAX_SPLITS);
    let splits = (SPLIT_BLOCKS_PER_SM * sms).div_ceil(strips).min(k.div_ceil(pass)).clamp(1, most);
    k.div_ceil(splits).next_multiple_of(pass)
}

/// A kernel's name, which says all its source depends on.
fn kernel_name(walk: Walk, dtype: DType, argmax: bool) -> String {
    match walk {
        Walk::Rows if argmax => format!("gemv_rows_argmax_{}", dtype.torch_name()),
        Walk::Rows => format!("gemv_rows_{}", dtype.torch_name()),
        Walk::Cols { tx, rows: 0 } => format!("gemv_cols{tx}_{}", dtype.torch_name()),
        Walk::Cols { tx, rows } => format!("gemv_cols{tx}_r{rows}_{}", dtype.torch_name()),
    }
}

/// A kernel's source; `row`: the name, source and row length of a row kernel's prologue
/// function (`fused::RowPrologue`) that computes the row first.
/// `attend`: the head dim of a cache attention run after the product (`gemv.cu`, GEMV_ATTEND).
fn source(name: &str, walk: Walk, dtype: DType, row: Option<(&str, &str, usize)>, argmax: bool, attend: Option<usize>) -> String {
    let mut c = format!("{PRELUDE}{}", GemvArgs::C_DECL);
    if let Some(d) = attend {
        let _ = writeln!(c, "{}#define GEMV_ATTEND\n#define ATT_D {d}", AttendArgs::C_DECL);
    }
    if let Some((row_name, row_src, cols)) = row {
        // The row kernel's function, then what the kernels call it by.
        c.push_str(row_src);
        let _ = writeln!(c, "#define GEMV_ROW {row_name}\n#define GEMV_ROW_K {cols}");
    }
    let _ = writeln!(c, "#define NAME {name}\n#define WARPS {WARPS}\n#define VW {}", 16 / dtype.size_in_bytes());
    let _ = writeln!(c, "#define T {}", codegen::storage_type(dtype));
    let _ = writeln!(c, "#define LD(e) ({})", codegen::load(dtype, CType::F32, "(e)"));
    let _ = writeln!(c, "#define ST(e) ({})", codegen::store(dtype, CType::F32, "(e)"));
    // The epilogue's GELU: the pointwise op's own definition, in F32.
    let _ = writeln!(c, "#define KGELU_TANH(x) ({})", crate::ops::UnaryOp::GeluTanh.cuda("(x)", CType::F32));
    if dtype == DType::BF16 {
        c.push_str("#define GEMV_BF16\n");
    }
    if argmax {
        c.push_str("#define GEMV_ARGMAX\n");
    }
    match walk {
        Walk::Rows => {
            let _ = writeln!(c, "#define GEMV_ROWS\n#define PREFETCH_ROWS {PREFETCH_ROWS}");
        }
        Walk::Cols { tx, rows } => {
            let _ = writeln!(c, "#define GEMV_COLS\n#define TX {tx}");
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
        for walk in [Walk::Rows, Walk::Cols { tx: 2, rows: 6 }, Walk::Cols { tx: 1, rows: 0 }] {
            let name = kernel_name(walk, dtype, false);
            v.push(super::samples::Sample::new((name.clone(), source(&name, walk, dtype, None, false, None))));
        }
        let name = kernel_name(Walk::Rows, dtype, true);
        v.push(super::samples::Sample::new((name.clone(), source(&name, Walk::Rows, dtype, None, true, None))));
    }
    // With a cache attention after the product (F16 and BF16 only), head dims 64 and 128.
    for (dtype, walk, d) in [(DType::BF16, Walk::Cols { tx: 2, rows: 6 }, 64), (DType::F16, Walk::Cols { tx: 1, rows: 0 }, 128)] {
        let name = format!("{}_attend{d}", kernel_name(walk, dtype, false));
        v.push(super::samples::Sample::new((name.clone(), source(&name, walk, dtype, None, false, Some(d)))));
    }
    v
}

/// Sources of every walk computing the row first with the prologue function `row_name`
/// (`row_src`, over rows of `cols`; `fused.rs` samples).
#[cfg(test)]
pub(super) fn row_samples(row_name: &str, row_src: &str, cols: usize, dtype: DType) -> Vec<super::samples::Sample> {
    [Walk::Rows, Walk::Cols { tx: 2, rows: 6 }, Walk::Cols { tx: 1, rows: 0 }]
        .into_iter()
        .map(|walk| {
            let name = format!("{}_{row_name}", kernel_name(walk, dtype, false));
            super::samples::Sample::new((name.clone(), source(&name, walk, dtype, Some((row_name, row_src, cols)), false, None)))
        })
        .chain(matches!(dtype, DType::F16 | DType::BF16).then(|| {
            let walk = Walk::Cols { tx: 2, rows: 6 };
            let name = format!("{}_attend64_{row_name}", kernel_name(walk, dtype, false));
            super::samples::Sample::new((name.clone(), source(&name, walk, dtype, Some((row_name, row_src, cols)), false, Some(64))))
        }))
        .collect()
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
    fn column_blocks_narrow_for_narrow_matrices() {
        // GPT-2's qkv (N = 2304), MLP up (3072) and projections (768), in BF16.
        assert_eq!(columns_per_block(2304, 8), 2);
        assert_eq!(columns_per_block(3072, 8), 2);
        assert_eq!(columns_per_block(768, 8), 1);
        assert_eq!(columns_per_block(3072 * 4, 8), 4);
        assert_eq!(columns_per_block(8 * 132 * 2, 8), 2);
    }

    #[test]
    fn narrow_matrices_split_k_into_whole_passes_that_fill_the_sms() {
        // GPT-2's MLP down projection (K 3072, N 768: 96 strips of one vector) on 132 SMs: three
        // pieces of 1024 rows (4 passes of 256 rows).
        assert_eq!(split_rows(768, 3072, 8, 1, 132, MAX_SPLITS), 1024);
        // The qkv product (144 strips of two vectors): two pieces of 384 rows.
        assert_eq!(split_rows(2304, 768, 8, 2, 132, MAX_SPLITS), 384);
        // Wide enough already: all of K.
        assert_eq!(split_rows(8 * 4 * 300, 4096, 8, 4, 132, MAX_SPLITS), 4096);
        // Unsplit unless asked.
        assert_eq!(split_rows(768, 3072, 8, 1, 132, 1), 3072);
        // Short K: never a piece smaller than one pass.
        assert_eq!(split_rows(64, 100, 8, 1, 132, MAX_SPLITS), 256);
        for (n, k, tx) in [(768, 3072, 1), (2304, 768, 2), (64, 8192, 1), (50, 4096, 1)] {
            let per = split_rows(n, k, 8, tx, 132, MAX_SPLITS);
            assert!(per.is_multiple_of(WARPS * 32 / tx) && k.div_ceil(per) <= MAX_SPLITS, "{n} {k}: {per}");
        }
    }
}
