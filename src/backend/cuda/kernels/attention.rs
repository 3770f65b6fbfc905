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
use crate::backend::cuda::{kernel_args, CudaStorage, KernelKey};
use crate::ops::AttnDims;
use crate::{DType, Result, Tensor};
use std::fmt::Write;

/// Source shared by the attention kernels, after the `#define`s of `common`.
const COMMON: &str = include_str!("attention_common.cu");
/// The warp kernels, one selected by a macro (`ATTN_FWD`, `ATTN_BWD_Q`, `ATTN_BWD_KV`).
const WARP: &str = include_str!("attention_warp.cu");
/// The tensor-core helpers and kernels, one kernel selected by a macro (`ATTN_FWD_TC`,
/// `ATTN_BWD_Q_TC`, `ATTN_BWD_KV_TC`).
const TENSOR_CORES: &str = include_str!("attention_tc.cu");

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

/// The `#define`s of the source shared by the kernels (`attention_common.cu`: types, loads,
/// warp reductions, the argument block): `rows` warps (query or key rows) per block, key and
/// value rows loaded `vw` elements at a time (`vw` divides the head dim, the rows' strides and
/// alignment; see `key_vector`).
fn common(dtype: DType, d: usize, rows: usize, vw: usize) -> String {
    let mut c = format!("#define D_ {d}\n#define ROWS {rows}\n#define VW {vw}\n");
    let _ = writeln!(c, "#define STORAGE_T {}", codegen::storage_type(dtype));
    // double for F32 inputs, float for F16 and BF16 (see the typedef of SC).
    let _ = writeln!(c, "#define SCORE_T {}", if dtype == DType::F32 { "double" } else { "float" });
    let _ = writeln!(c, "#define VT_ALIGN {}", vw * dtype.size_in_bytes());
    let _ = writeln!(c, "#define LD(e) ({})", codegen::load(dtype, CType::F32, "(e)"));
    let _ = writeln!(c, "#define ST(e) ({})", codegen::store(dtype, CType::F32, "(e)"));
    c
}

/// A kernel's source: the prelude, the `#define`s of `common` and the kernel's own (its name,
/// the macro that selects it in `file`, ...), then `attention_common.cu` and `file`.
fn source(common: String, defines: &str, file: &str) -> String {
    format!("{PRELUDE}{}{common}{defines}{COMMON}{file}", AttentionArgs::C_DECL)
}

kernel_args! {
    /// What the attention kernels read (`attention_*.cu`): the operands `[rows, B, H, D]`
    /// through their strides (rows, batch, head), the sizes, and each kernel's outputs.
    AttentionArgs {
        q: u64, k: u64, v: u64,
        /// An additive `[B, H, L, S]` mask, or 0.
        mask: u64,
        /// The forward's output.
        out: u64,
        b: i64, h: i64, l: i64, s: i64,
        q_strides: i64[3], k_strides: i64[3], v_strides: i64[3], mask_strides: i64[4],
        scale: f64,
        causal: i64,
        /// Backward: the forward's output and its gradient.
        o: u64, g: u64,
        /// Backward: the F32 gradients written.
        dq: u64, dk: u64, dv: u64,
        /// Each row's log-sum-exp (written by the forward, by the backward when `lse_in` is
        /// 0) and delta (Σ p·(dO·v)), in F32.
        lse: u64, delta: u64,
        /// The log-sum-exps the forward kept, or 0.
        lse_in: u64,
        /// F32 scores: the log-sum-exps and deltas in double between the two backward kernels;
        /// the cache forward's chunk partials and its arrival counters.
        lse_sc: u64, delta_sc: u64,
        /// The cache forward: each batch's last key seen (I64, `last_stride` apart), the query
        /// heads per key/value head, and the key and value rows read at that position instead
        /// of the cache's (or 0), strided along batch and head.
        last: u64, last_stride: i64, kv_group: i64,
        k_new: u64, v_new: u64, k_new_strides: i64[2], v_new_strides: i64[2],
        /// The cache forward: 1 where no kernel still running writes the cache or `last`
        /// (`ops::attention::SettledCache`), so their loads may come before the wait for the kernel before.
        settled: i64,
    }
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
    let qk = if scores_in_shared(dtype, d, rows) { "SC" } else { "float" };
    let src = source(common(dtype, d, rows, vw), &format!("#define KNAME {name}\n#define ATTN_FWD\n#define QK_T {qk}\n"), WARP);
    (name, src)
}

/// Whether the warp forward keeps its queries and keys in shared memory in the type scores are
/// computed in (double for F32): where its tiles then fit the static shared memory a kernel
/// has (`SHARED_WITHOUT_OPT_IN`).
/// Otherwise they stay float and each score converts them as it reads them, which for F32
/// runs on the GPU's slow conversion pipe: 2 * D conversions per score instead of one per
/// value loaded.
fn scores_in_shared(dtype: DType, d: usize, rows: usize) -> bool {
    let score_bytes = if dtype == DType::F32 { 8 } else { 4 };
    (32 * (d + 1) + rows * d) * score_bytes + 32 * d * 4 <= crate::backend::cuda::device::SHARED_WITHOUT_OPT_IN
}

/// Warps per block of the cache forward (`gen_forward_up_to`): a thread per key of its chunk.
const UP_TO_WARPS: usize = 8;
/// Keys per block of the cache forward.
const UP_TO_CHUNK: usize = UP_TO_WARPS * 32;

/// Forward of one query row per head over the first keys of a static cache
/// (`Op::AttentionUpTo`, a decode step's attention): the cache in chunks of `UP_TO_CHUNK` keys, a
/// block each, a thread per key; blocks past the row's last key leave at once, a single chunk
/// writes the row itself, and the last of several folds them.
fn gen_forward_up_to(dtype: DType, d: usize, vw: usize) -> (String, String) {
    let name = warp_name("fwd_up_to", dtype, d, UP_TO_WARPS, vw);
    // Values a warp loads before it needs them: its share of the chunk, where 64 registers hold it.
    let preload = (UP_TO_CHUNK / UP_TO_WARPS).min(64 / d.div_ceil(32));
    let src = source(common(dtype, d, UP_TO_WARPS, vw), &format!("#define KNAME {name}\n#define ATTN_FWD_UP_TO\n#define VU {preload}\n"), WARP);
    (name, src)
}

/// Rows per block of the tensor-core kernels (16 per warp), and rows per shared-memory tile.
const TC_ROWS: usize = 64;

/// The `#define`s of the source shared by the tensor-core kernels (`attention_tc.cu`; F16 /
/// BF16, head dims a multiple of 16): the `mma.m16n8k16` product and its fragments (A: 16
/// rows, from registers; B: a shared-memory tile of 64 rows, directly or transposed through
/// `ldmatrix`), tile loads, masking.
fn tc_common(dtype: DType, d: usize) -> String {
    let ty = if dtype == DType::BF16 { "bf16" } else { "f16" };
    format!("{}#define KT {TC_ROWS}\n#define TY \"{ty}\"\n", common(dtype, d, ROWS, 1))
}

/// Forward on the tensor cores, flash-attention 2 style: each warp holds 16 query rows as
/// fragments, the block walks K and V in tiles of 64 keys; the scores stay in registers (FP32),
/// the online softmax rescales the FP32 output, and the probabilities enter the second product
/// rounded to the input dtype (as PyTorch's fused kernels do).
/// `three_blocks`: registers held for 3 blocks per SM (see `forward_tc_three_blocks`).
fn gen_forward_tc(dtype: DType, d: usize, three_blocks: bool) -> (String, String) {
    let name = kernel_name("fwd_tc", dtype, d);
    let src = source(tc_common(dtype, d), &format!("#define KNAME {name}\n#define ATTN_FWD_TC\n#define THREE_BLOCKS {}\n", three_blocks as u8), TENSOR_CORES);
    (name, src)
}

/// Backward on the tensor cores, per block of 64 query rows (16 per warp): each row's
/// log-sum-exp (the forward's, else a first walk over the keys, scores only) and
/// delta = dO·O, then dq = scale sum_s p (dO·v_s - delta) k_s, with dS rounded to the input
/// dtype for the product.
fn gen_backward_q_tc(dtype: DType, d: usize) -> (String, String) {
    let name = kernel_name("bwd_q_tc", dtype, d);
    let src = source(tc_common(dtype, d), &format!("#define KNAME {name}\n#define ATTN_BWD_Q_TC\n#define THREE_BLOCKS 0\n"), TENSOR_CORES);
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
    let name = part.kernel_name(dtype, d);
    let (want_dv, want_dk) = (part != KvPart::Dk, part != KvPart::Dv);
    let defines = format!("#define KNAME {name}\n#define ATTN_BWD_KV_TC\n#define THREE_BLOCKS {}\n#define WANT_DV {}\n#define WANT_DK {}\n", three_blocks as u8, want_dv as u8, want_dk as u8);
    let src = source(tc_common(dtype, d), &defines, TENSOR_CORES);
    (name, src)
}

/// Launches a tensor-core kernel over `rows` query rows (or key rows, `key_rows`) of `bh`
/// heads: one block per head in x, one per 64 rows in y, 128 threads. Its dynamic shared memory
/// holds two stages of two tiles of 64 rows (padded by 8 elements), and for the key-row kernels
/// each stage's log-sum-exp and delta per row.
fn launch_tc(dev: &crate::backend::cuda::CudaDevice, kern: crate::backend::cuda::Kernel, bh: usize, rows: usize, key_rows: bool, d: usize, a: &AttentionArgs) -> Result<()> {
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
    if crate::switches::attention_warp_only() {
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

/// Backward, per query row: a first walk over the keys for the row's log-sum-exp and
/// delta = sum_s p_s dO·v_s (dO·O without the rounding of O), then
/// dq = scale sum_s p (dO·v_s - delta) k_s.
fn gen_backward_q(dtype: DType, d: usize, rows: usize, vw: usize) -> (String, String) {
    let name = warp_name("bwd_q", dtype, d, rows, vw);
    let src = source(common(dtype, d, rows, vw), &format!("#define KNAME {name}\n#define ATTN_BWD_Q\n"), WARP);
    (name, src)
}

/// Backward, per key row: dv = sum_l p dO_l and dk = scale sum_l p (dO_l·v - delta_l) q_l.
fn gen_backward_kv(dtype: DType, d: usize, rows: usize, vw: usize) -> (String, String) {
    let name = warp_name("bwd_kv", dtype, d, rows, vw);
    let src = source(common(dtype, d, rows, vw), &format!("#define KNAME {name}\n#define ATTN_BWD_KV\n"), WARP);
    (name, src)
}

/// The arguments every attention kernel reads: pointers, sizes, strides, scale, causal.
fn shared_args(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, n: &AttnDims, scale: f64, causal: bool) -> Result<AttentionArgs> {
    let strides = |t: &Tensor, n: usize| -> [i64; 4] { std::array::from_fn(|j| if j < n { t.strides()[j] as i64 } else { 0 }) };
    let three = |t: &Tensor| -> [i64; 3] { strides(t, 3)[..3].try_into().expect("three") };
    Ok(AttentionArgs {
        q: data_ptr(q)?,
        k: data_ptr(k)?,
        v: data_ptr(v)?,
        mask: mask.map(data_ptr).transpose()?.unwrap_or(0),
        b: n.b as i64,
        h: n.h as i64,
        l: n.l as i64,
        s: n.s as i64,
        q_strides: three(q),
        k_strides: three(k),
        v_strides: three(v),
        mask_strides: mask.map_or([0; 4], |m| strides(m, 4)),
        scale,
        causal: causal as i64,
        ..Default::default()
    })
}

/// Blocks: one per (batch, head) in x, one per `per` rows in y (at most 65535).
fn grid(bh: usize, rows: usize, per: usize) -> Result<(u32, u32, u32)> {
    if rows > MAX_ROWS || bh > i32::MAX as usize {
        return Err(crate::Error::arg("attention", format!("{rows} rows per head (at most {MAX_ROWS}) or {bh} heads in all (at most 2^31 - 1) exceed one launch")));
    }
    Ok((bh as u32, rows.div_ceil(per) as u32, 1))
}

/// The attention output of q `[L, B, H, D]` in q's dtype, contiguous `[L, B, H, D]`, or
/// `[B, L, H, D]` when `batch_first`. Inputs have a contiguous head dim.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool, batch_first: bool) -> Result<CudaStorage> {
    let dev = dev_of(q)?;
    let n = AttnDims::of(q.shape(), k.shape());
    let mut out = CudaStorage::new(&dev, q.dtype(), n.l * n.b * n.h * n.d)?;
    if out.len == 0 || n.s == 0 {
        return Ok(out);
    }
    if crate::backend::cuda::libs::sdpa::takes(q, k, v, mask, causal, &n, false)? {
        let a = crate::backend::cuda::libs::sdpa::Attn { q, k, v, mask, n: &n, scale, causal };
        if let Some(lse) = crate::backend::cuda::libs::sdpa::forward(&dev, &a, out.ptr(), n.out_strides(batch_first))? {
            out.aux = lse.map(Box::new);
            return Ok(out);
        }
    }
    if batch_first {
        // kiln's kernels store `[L, B, H, D]`: copied into the batch-first order, the rows'
        // log-sum-exps kept beside it for the backward.
        drop(out);
        let mut seq_first = attention(q, k, v, mask, scale, causal, false)?;
        let aux = seq_first.aux.take();
        let t = Tensor::from_backend(crate::storage::BackendStorage::Cuda(seq_first), q.shape());
        let mut out = crate::backend::cuda::kernels::cast(&crate::ops::attention::swap_seq_batch(&t)?, q.dtype())?;
        out.aux = aux;
        return Ok(out);
    }
    let mut a = shared_args(q, k, v, mask, &n, scale, causal)?;
    a.out = out.ptr();
    if tensor_cores_take(q, k, v, n.d)? {
        // Each row's log-sum-exp goes beside the output, for the backward (`CudaStorage::aux`).
        let lse = CudaStorage::new(&dev, DType::F32, n.b * n.h * n.l)?;
        a.lse = lse.ptr();
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

/// Whether the cache forward takes an `Op::AttentionUpTo` of `l` query rows over `s` keys, `bh`
/// query heads in all of `d` features: one row per head, F16 or BF16 (the functional sends it
/// nothing else: it computes the rest as the masked attention).
pub(crate) fn up_to_takes(l: usize, s: usize, bh: usize, d: usize, dtype: DType) -> bool {
    l == 1 && matches!(dtype, DType::F16 | DType::BF16) && (1..=MAX_HEAD_DIM).contains(&d) && s > 0 && (1..=i32::MAX as usize).contains(&bh) && s.div_ceil(UP_TO_CHUNK) <= 65535
}

/// `Op::AttentionUpTo`'s output `[1, B, H, D]` (q `[1, B, H, D]`, k and v `[S, B, H_kv, D]`,
/// their head dims contiguous, `last` `[B]` I64, and the new key and value rows
/// `[1, B, H_kv, D]` where given), where `up_to_takes`.
/// `settled`: no kernel still running writes k, v or `last` (`ops::attention::SettledCache`):
/// the kernel loads them before it waits for the kernel before.
pub(crate) fn attention_up_to(q: &Tensor, k: &Tensor, v: &Tensor, last: &Tensor, new: Option<(&Tensor, &Tensor)>, scale: f64, settled: bool) -> Result<CudaStorage> {
    let n = AttnDims::of(q.shape(), k.shape());
    let (bh, hkv, chunks) = (n.b * n.h, k.shape()[2], n.s.div_ceil(UP_TO_CHUNK));
    if !up_to_takes(n.l, n.s, bh, n.d, q.dtype()) {
        return Err(crate::Error::arg("attention_up_to", format!("the GPU kernel takes one F16 or BF16 query row per head of at most {MAX_HEAD_DIM} features, got {} rows of {} in {:?}", n.l, n.d, q.dtype())));
    }
    let dev = dev_of(q)?;
    let out = CudaStorage::new(&dev, q.dtype(), bh * n.d)?;
    // The new key row is loaded as the cache's rows are (values element by element).
    let vw = match key_vector(k, v, n.d)? {
        vw if vw > 1 && new.is_some_and(|(kn, _)| !rows_aligned(kn, vw).unwrap_or(false)) => 1,
        vw => vw,
    };
    // (Op::Attention's arguments over k and v; only the key/value heads differ.)
    let mut a = shared_args(q, k, v, None, &n, scale, false)?;
    let part = CudaStorage::new(&dev, DType::F32, bh * chunks * (n.d + 2))?;
    (a.out, a.lse_sc, a.delta_sc) = (out.ptr(), part.ptr(), dev.reduce_counters(bh)?);
    (a.last, a.last_stride, a.kv_group) = (data_ptr(last)?, last.strides()[0] as i64, (n.h / hkv) as i64);
    if let Some((kn, vn)) = new {
        let bh_strides = |t: &Tensor| [t.strides()[1] as i64, t.strides()[2] as i64];
        (a.k_new, a.v_new, a.k_new_strides, a.v_new_strides) = (data_ptr(kn)?, data_ptr(vn)?, bh_strides(kn), bh_strides(vn));
    }
    a.settled = super::settled_arg(settled);
    let kern = dev.kernel(KernelKey::Named(warp_name("fwd_up_to", q.dtype(), n.d, UP_TO_WARPS, vw)), || gen_forward_up_to(q.dtype(), n.d, vw))?;
    dev.launch(kern, (bh as u32, chunks as u32, 1), (UP_TO_CHUNK as u32, 1, 1), &a)?;
    Ok(out)
}

/// The packed gradients `[dq | dk | dv | lse | delta]` of `Op::AttentionBackward` from cuDNN,
/// laid out as the op's `batch_first` says (`AttnDims::grads`), from q, k, v, `out` and `g`
/// as `[L, B, H, D]` views (`out` and `g` of any strides along L, B and H). None: cuDNN does
/// not take it, nothing was queued.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward_cudnn(q: &Tensor, k: &Tensor, v: &Tensor, out: &Tensor, g: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool, batch_first: bool) -> Result<Option<CudaStorage>> {
    let n = AttnDims::of(q.shape(), k.shape());
    if n.packed_len() == 0 || n.l == 0 || n.s == 0 || n.d == 0 || !crate::backend::cuda::libs::sdpa::takes(q, k, v, mask, causal, &n, true)? {
        return Ok(None);
    }
    let dev = dev_of(q)?;
    // cuDNN writes the gradients in q's dtype, in place.
    let packed = CudaStorage::new(&dev, q.dtype(), n.packed_len())?;
    let a = crate::backend::cuda::libs::sdpa::Attn { q, k, v, mask, n: &n, scale, causal };
    Ok(crate::backend::cuda::libs::sdpa::backward(&dev, &a, out, g, &packed, n.grads(batch_first))?.then_some(packed))
}

/// The packed gradients `[dq | dk | dv | lse | delta]` in q's dtype (see
/// `Op::AttentionBackward`, seq-first). `out` and `g` are contiguous `[L, B, H, D]`.
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
    if let Some(packed) = attention_backward_cudnn(q, k, v, out, g, mask, scale, causal, false)? {
        return Ok(packed);
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
    a.o = data_ptr(out)?;
    a.g = data_ptr(g)?;
    a.dq = at(0);
    a.lse = at(nq + 2 * nk);
    a.delta = at(nq + 2 * nk + n.b * n.h * n.l);
    a.dk = at(nq);
    a.dv = at(nq + nk);
    // The forward's per-row log-sum-exp, where it kept them (the tensor-core and cuDNN
    // forwards do): the dq kernel then skips its walk over the keys.
    a.lse_in = crate::backend::cuda::kernels::aux_ptr(out).unwrap_or(0);
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
    // F32 scores keep each row's log-sum-exp and delta in double between the two kernels (`SC`).
    let rows_sc = if q.dtype() == DType::F32 { Some(CudaStorage::new(dev, DType::F64, 2 * n.b * n.h * n.l)?) } else { None };
    a.lse_sc = rows_sc.as_ref().map_or(a.lse, |s| s.ptr());
    a.delta_sc = rows_sc.as_ref().map_or(a.delta, |s| s.ptr() + 8 * (n.b * n.h * n.l) as u64);
    let kq = dev.kernel(KernelKey::Named(warp_name("bwd_q", q.dtype(), n.d, rq, vw)), || gen_backward_q(q.dtype(), n.d, rq, vw))?;
    dev.launch(kq, grid(n.b * n.h, n.l, rq)?, ((rq * 32) as u32, 1, 1), &a)?;
    let kkv = dev.kernel(KernelKey::Named(warp_name("bwd_kv", q.dtype(), n.d, rk, vw)), || gen_backward_kv(q.dtype(), n.d, rk, vw))?;
    dev.launch(kkv, grid(n.b * n.h, n.s, rk)?, ((rk * 32) as u32, 1, 1), &a)
}

/// Sources of every attention kernel and variant, for the NVRTC check (`samples.rs`).
#[cfg(test)]
pub(super) fn samples() -> Vec<super::samples::Sample> {
    use super::samples::Sample;
    let mut v = vec![];
    for dtype in [DType::F32, DType::F16, DType::BF16] {
        let wide = 16 / dtype.size_in_bytes();
        for (d, rows, vw) in [(64, ROWS, wide), (64, 16, 1), (128, backward_rows(64, 128), wide), (40, ROWS, 1)] {
            v.push(Sample::new(gen_forward(dtype, d, rows, vw)));
            v.push(Sample::new(gen_backward_q(dtype, d, rows, vw)));
            v.push(Sample::new(gen_backward_kv(dtype, d, rows, vw)));
        }
        if dtype == DType::F32 {
            continue;
        }
        v.push(Sample::new(gen_forward_up_to(dtype, 80, 1)));
        for d in [64, 128] {
            v.push(Sample::new(gen_forward_up_to(dtype, d, wide)));
            v.push(Sample::new(gen_forward_up_to(dtype, d, 1)));
            v.push(Sample::new(gen_forward_tc(dtype, d, false)));
            v.push(Sample::new(gen_forward_tc(dtype, d, true)));
            v.push(Sample::new(gen_backward_q_tc(dtype, d)));
        }
        v.push(Sample::new(gen_backward_kv_tc(dtype, 64, KvPart::Both, false)));
        v.push(Sample::new(gen_backward_kv_tc(dtype, 128, KvPart::Dv, true)));
        v.push(Sample::new(gen_backward_kv_tc(dtype, 128, KvPart::Dk, false)));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::{forward_tc_three_blocks, scores_in_shared};
    use crate::DType;

    #[test]
    fn f32_forward_keeps_queries_and_keys_in_double_where_they_fit() {
        // The transformer rows' heads (64 features, up to 16 query rows a block): 33,024 bytes.
        assert!(scores_in_shared(DType::F32, 64, 16));
        assert!(!scores_in_shared(DType::F32, 128, 16) && !scores_in_shared(DType::F32, 128, 4));
        assert!(scores_in_shared(DType::BF16, 128, 16), "16-bit inputs score in float");
    }

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
            let op = Op::Attention { scale: 0.125, causal, batch_first: false };
            let y = crate::cuda::with_cudnn_attention(false, || apply(op, &[&q, &k, &v])).unwrap();
            let copy = y.copy_contiguous().unwrap();
            assert!(crate::backend::cuda::kernels::aux_ptr(&y).is_some() && crate::backend::cuda::kernels::aux_ptr(&copy).is_none());
            let back = Op::AttentionBackward { scale: 0.125, causal, batch_first: false };
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
