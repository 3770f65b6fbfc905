//! Every `KILN_*` environment switch, read in this one module (each once, on first use, except
//! the cache directory, which tests change between calls). `docs/reference.md` lists them in
//! one table. A value that does not parse is ignored, as if the switch were unset.

use std::path::PathBuf;
use std::sync::OnceLock;

/// `KILN_LOG`: comma-separated log topics (`logging::Topic`), `all` for every one.
pub(crate) fn log() -> Option<&'static str> {
    static V: OnceLock<Option<String>> = OnceLock::new();
    V.get_or_init(|| std::env::var("KILN_LOG").ok()).as_deref()
}

/// `KILN_CACHE_DIR`: where compiled kernels and max-autotune's decisions are kept on disk.
pub(crate) fn cache_dir() -> Option<PathBuf> {
    std::env::var_os("KILN_CACHE_DIR").map(PathBuf::from)
}

/// `KILN_CPU_CODEGEN` (`c` or `interpret`): what runs the compiler's fused kernels on the CPU
/// (`backend::cpu::jit`; unset: C for kernels of 256 values or more, where a compiler is found).
pub(crate) fn cpu_codegen() -> Option<&'static str> {
    static V: OnceLock<Option<String>> = OnceLock::new();
    V.get_or_init(|| std::env::var("KILN_CPU_CODEGEN").ok()).as_deref()
}

/// `KILN_CPU_STREAM_BYTES`: the smallest output a CPU row kernel writes with streaming stores
/// (`backend::cpu::cgen`; unset: half the last-level cache).
pub(crate) fn cpu_stream_bytes() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_CPU_STREAM_BYTES"))
}

/// `KILN_CHANNELS_LAST` (`0` or `1`): whether compiled conv nets run channels-last
/// (`compile::layout`; unset: on the CPU, or when an input is).
pub(crate) fn channels_last() -> Option<bool> {
    static V: OnceLock<Option<bool>> = OnceLock::new();
    *V.get_or_init(|| match std::env::var("KILN_CHANNELS_LAST").as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    })
}

/// `KILN_MEMORY_REUSE` (`0` or `1`): whether compiled kernels write into the buffers of inputs
/// that die there (`compile::runtime`); for comparing memory and for tracking down a wrong
/// value (unset: the runtime's default).
pub(crate) fn memory_reuse() -> Option<bool> {
    static V: OnceLock<Option<bool>> = OnceLock::new();
    *V.get_or_init(|| match std::env::var("KILN_MEMORY_REUSE").as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    })
}

/// `KILN_REMAT=0`: compiled training steps keep forward values for backward instead of
/// recomputing cheap ones there (`compile::remat`).
pub(crate) fn remat_off() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_REMAT", "0"))
}

/// `KILN_ROWS_THREADS`: threads per row of the row kernels, for tuning.
pub(crate) fn rows_threads() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_ROWS_THREADS"))
}

/// `KILN_MAP_VECTOR_BYTES` (16 or 32): bytes per operand a thread of a large map reads at a time.
pub(crate) fn map_vector_bytes() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_MAP_VECTOR_BYTES").filter(|v| [16, 32].contains(v)))
}

/// `KILN_COLS_CHUNKS`: how many chunks a column reduction's rows are split into.
pub(crate) fn cols_chunks() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_COLS_CHUNKS"))
}

/// `KILN_PDL_LIBRARY=0`: in captured CUDA graphs, library kernels that wait for the kernels
/// before them themselves are not let start before those end (`graph::library_kernels_start_early`).
pub(crate) fn pdl_library_off() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_PDL_LIBRARY", "0"))
}

/// `KILN_GRAPH_BRANCHES=0`: captured CUDA graphs keep the captured order (no side-by-side steps).
pub(crate) fn graph_keeps_captured_order() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_GRAPH_BRANCHES", "0"))
}

/// `KILN_CUDNN_ATTENTION=0`: attention never runs through cuDNN.
pub(crate) fn cudnn_attention_off() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_CUDNN_ATTENTION", "0"))
}

/// `KILN_GEMV=0`: products of one row go to cuBLASLt instead of kiln's matrix-vector kernels.
pub(crate) fn gemv_off() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_GEMV", "0"))
}

/// `KILN_TF32_GEMM=1`: F32 products under `allow_tf32` in compiled programs run kiln's TF32
/// tensor-core kernels instead of cuBLASLt's (opt-in: on an H100 they ran 2.5x slower).
pub(crate) fn tf32_gemm_on() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_TF32_GEMM", "1"))
}

/// `KILN_GEMV_ARGMAX=0`: the argmax of a compiled one-row product's columns runs as a kernel of
/// its own instead of in the product's kernel (`fuse::with_argmax`), to compare the two.
pub(crate) fn gemv_argmax_on() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| !is("KILN_GEMV_ARGMAX", "0"))
}

/// `KILN_ROW_PROLOGUE=0`: a one-row kernel before a product of one row stays a kernel of its
/// own instead of running in the product's kernel (`fuse::row_prologues`).
pub(crate) fn row_prologues_off() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_ROW_PROLOGUE", "0"))
}

/// `KILN_ATTEND_IN_PRODUCT=1`: a decode step's cache attention runs in the kernel of the product
/// whose output holds its query, key and value rows (`fuse::cache_attentions`) instead of as a
/// launch of its own (opt-in until its CUDA tests have passed on a GPU).
pub(crate) fn attend_in_product_on() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_ATTEND_IN_PRODUCT", "1"))
}

/// `KILN_ROW_TAIL=0`: row kernels over rows longer than `MAX_ROW` whose length divides by no
/// vector width load and store element by element instead of in vectors with an element-wise
/// last vector (`fused::row_vec`).
pub(crate) fn row_tail_off() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_ROW_TAIL", "0"))
}

/// `KILN_ROW_COLUMNS=1`: GPU row kernels compute an `arange` along their rows (cross-entropy's
/// column indices) from the column instead of reading it (`fuse::columns_of`); off by default,
/// as measured slower (see `docs/reference.md`).
pub(crate) fn row_columns_on() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_ROW_COLUMNS", "1"))
}

/// `KILN_ROW_STAGE=1`: row kernels over rows longer than `MAX_ROW` keep the rows several walks
/// read in shared memory (`fused::staged_inputs`); off by default, as measured slower.
pub(crate) fn row_stage_on() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_ROW_STAGE", "1"))
}

/// `KILN_ROW_MIN_BLOCKS=N` (N >= 1): row kernels over rows longer than `MAX_ROW` are compiled for
/// N blocks per SM (`__launch_bounds__`' second argument, which caps their registers; a kernel
/// that stages its rows keeps 2).
pub(crate) fn row_min_blocks() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_ROW_MIN_BLOCKS").filter(|&n: &usize| n >= 1))
}

/// `KILN_ROW_VEC=N`: row kernels over rows longer than `kir::MAX_ROW` load at most N values at
/// a time (a power of two), whatever 16 bytes of their widest input or output read from memory
/// would give.
pub(crate) fn row_vec_cap() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_ROW_VEC").filter(|&n: &usize| n.is_power_of_two()))
}

/// `KILN_ROW_LOOP_THREADS=N`: threads per block of the row kernels over rows longer than
/// `kir::MAX_ROW` (a power of two from 128 to 1024; 1024 by default).
pub(crate) fn row_loop_threads() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_ROW_LOOP_THREADS").filter(|&n: &usize| n.is_power_of_two() && (128..=1024).contains(&n)))
}

/// `KILN_GEMV_SPLIT=N`: the matrix-vector column kernel splits K into at most N pieces (1, the
/// default: never), where its strips of columns alone would leave SMs idle.
pub(crate) fn gemv_splits() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_GEMV_SPLIT"))
}

/// `KILN_CUDNN_MIN_KEYS`: the fewest keys for which attention runs through cuDNN.
pub(crate) fn cudnn_min_keys() -> Option<usize> {
    static V: OnceLock<Option<usize>> = OnceLock::new();
    *V.get_or_init(|| parsed("KILN_CUDNN_MIN_KEYS"))
}

/// Whether kiln's kernels are launched with programmatic dependent launch on Hopper and later
/// (`CudaDevice::launch_params`): on unless `KILN_PDL=0`.
pub(crate) fn pdl() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| !is("KILN_PDL", "0"))
}

/// `KILN_PDL_EARLY=0`: a kernel handed settled memory lets the next kernel start only after its
/// own wait (as every other kernel), not as soon as it starts (`prelude.cu`,
/// `KILN_WAIT_UNLESS_SETTLED`).
pub(crate) fn pdl_early() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| !is("KILN_PDL_EARLY", "0"))
}

/// `KILN_PROLOGUE_LOADS_FIRST=1`: a product's one-row prologue (a decode step's layer norm)
/// loads all its inputs before computing, not pass by pass as a row kernel of its own.
pub(crate) fn prologue_loads_first() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_PROLOGUE_LOADS_FIRST", "1"))
}

/// `KILN_ATTENTION_KERNEL=warp`: kiln's attention never uses its tensor-core kernels.
pub(crate) fn attention_warp_only() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_ATTENTION_KERNEL", "warp"))
}

/// `KILN_PLAN_FOR=cuda`: a program compiled for the CPU is also scheduled and planned as the
/// GPU would run it, its kernels and memory plan logged (`compile::build`), on machines
/// without a GPU; traced attention takes the GPU's fused op.
pub(crate) fn plan_for_cuda() -> bool {
    static V: OnceLock<bool> = OnceLock::new();
    *V.get_or_init(|| is("KILN_PLAN_FOR", "cuda"))
}

fn parsed<T: std::str::FromStr>(name: &str) -> Option<T> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn is(name: &str, value: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == value)
}
