//! The compiler's fused kernels on the GPU. A flat kernel becomes a body of `const`
//! temporaries for the eager map generator (one generator for eager and compiled code); a row
//! kernel is emitted here: one block per row, the row's values in registers, block reductions
//! by warp shuffles, every intermediate computed once and never stored.

use crate::backend::cuda::kernels::codegen::{block_name, block_reduce, comb_name, convert, load, storage_type, PRELUDE, row_full, row_index};
use crate::dtype::CType;
use crate::backend::cuda::kernels::{data_ptr, map_launch, MapLaunches, row_shape, row_thread_candidates, row_vpt, rows_threads_forced, MapOut};
use crate::backend::cuda::{tuning::autotune, device, CudaStorage, LaunchArgs, KernelKey};
use crate::kir::{FusedKernel, ValueRef, KKind, KOp, RowPass, RowPlan, Space};
use crate::layout::Layout;
use crate::storage::BackendStorage;
use crate::{Device, Error, Result, Tensor};
use std::fmt::Write;
use crate::backend::cexpr::{arg, lower, value_names};

/// Runs a fused kernel on its inputs (real tensors, in `k.inputs` order); returns its outputs.
/// `into[m]`, when set, is a contiguous tensor of output m's size and dtype that a flat kernel
/// (or a mid kernel, for a per-row output) writes in place (a parameter or a running statistic
/// updated by a compiled step) instead of a fresh buffer. `tune`
/// (max-autotune): a row kernel's threads per row are timed on first use and the fastest kept.
pub(crate) fn run(k: &FusedKernel, shape: &[usize], inputs: &[Tensor], into: &[Option<Tensor>], tune: bool) -> Result<Vec<Tensor>> {
    let Device::Cuda(ord) = k.device else { unreachable!("a CUDA kernel for a CPU graph") };
    let dev = device(ord)?;
    match k.space {
        Space::Flat { numel } => run_flat(&dev, k, shape, numel, inputs, into),
        Space::Rows { rows, cols } => run_rows(&dev, k, rows, cols, inputs, tune),
        Space::Mid { outer, rows, inner } => run_mid(&dev, k, [outer, rows, inner], inputs, into),
    }
}

/// `t` seen with shape `shape` (same element count): a view where strides allow, else a copy.
pub(crate) fn view_as(t: &Tensor, shape: &[usize]) -> Result<Tensor> {
    if t.shape() == shape {
        return Ok(t.clone());
    }
    if t.numel() == 1 {
        let l = Layout { shape: shape.to_vec(), strides: vec![0; shape.len()], offset: t.storage_offset() };
        return Ok(t.view_as_layout(l));
    }
    match t.layout().view_strides(shape) {
        Some(strides) => Ok(t.view_as_layout(Layout { shape: shape.to_vec(), strides, offset: t.storage_offset() })),
        None => {
            let c = t.copy_contiguous()?;
            Ok(c.view_as_layout(Layout::contiguous(shape)))
        }
    }
}

/// Fresh buffers for a kernel's outputs, output `m` of `numel_of(m, its op)` elements.
fn new_outputs(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, k: &FusedKernel, numel_of: impl Fn(usize, &KOp) -> usize) -> Result<Vec<CudaStorage>> {
    k.outputs.iter().enumerate().map(|(m, (o, _))| CudaStorage::new(dev, k.ops[*o].dtype, numel_of(m, &k.ops[*o]))).collect()
}

fn wrap(outs: Vec<CudaStorage>, shapes: impl Fn(usize) -> Vec<usize>) -> Vec<Tensor> {
    outs.into_iter().enumerate().map(|(m, s)| Tensor::from_backend(BackendStorage::Cuda(s), &shapes(m))).collect()
}

/// Constants a flat kernel takes as launch parameters (the rest are literals in its source).
const CONST_PARAMS: usize = 8;

/// The code of a flat kernel for the map generator: a body of one `const` temporary per op,
/// each op's (type, C name) for the outputs' expressions, and the launch parameters. The
/// kernel's first constants are parameters rather than literals, so that a graph traced at
/// another size (a mean's divisor is a size) or with another constant (a learning rate, an
/// epsilon) launches the same kernel instead of compiling one.
#[derive(Clone, Debug)]
pub(crate) struct FlatCode {
    pub body: String,
    pub vals: Vec<(CType, String)>,
    pub params: Vec<u64>,
    /// The kernel's name, from its code (constants passed as parameters are not in it, so a
    /// kernel differing only in those shares the name and the compiled kernel).
    pub name: String,
}

/// What this backend derives from a fused kernel and keeps in its memo (`KernelMemo::backend`).
#[derive(Default)]
struct CudaMemo {
    /// A flat kernel's code (body, values, launch parameters).
    flat_code: std::sync::OnceLock<FlatCode>,
    /// A row kernel's loaded functions by launch shape.
    row_launches: RowLaunches,
    /// Products computing a one-row kernel's row first (`RowPrologue`), by the product's name,
    /// the row kernel's output that is the row, and which inputs load vectors.
    prologue_launches: crate::backend::cuda::Loaded<((String, usize, u64), crate::backend::cuda::Kernel)>,
    /// A flat kernel's loaded functions by how its operands are walked.
    flat_launches: MapLaunches,
    /// A mid kernel's constants passed as launch words: their values (`mid_params`).
    mid_words: std::sync::OnceLock<Vec<u64>>,
    /// A mid kernel's loaded functions by (64-bit indices, inner values per position, which
    /// inputs load them as one vector).
    mid_launches: crate::backend::cuda::Loaded<((bool, usize, u64), crate::backend::cuda::Kernel)>,
}

fn memo(k: &FusedKernel) -> Result<&CudaMemo> {
    k.memo.backend::<CudaMemo>().ok_or_else(|| Error::Compile(format!("{}: the kernel memo holds another backend's code", k.name)))
}

fn flat_code(k: &FusedKernel) -> FlatCode {
    let mut body = String::new();
    let mut vals: Vec<(CType, String)> = vec![];
    let mut params: Vec<u64> = vec![];
    let pairs = sincos_pairs(k);
    // Temporaries are numbered as they are written, not by op position: a view (`Same`)
    // writes nothing, so kernels that differ only in where a reshape sits get one code.
    let mut written = 0usize;
    let mut fresh = || {
        written += 1;
        format!("t{}", written - 1)
    };
    // The second of each sine and cosine pair: the name the first gave it.
    let mut pair_names: Vec<Option<String>> = vec![None; k.ops.len()];
    for (i, op) in k.ops.iter().enumerate() {
        let args: Vec<(CType, String)> = op
            .args
            .iter()
            .map(|a| match a {
                ValueRef::In(j) => (CType::of(k.inputs[*j].dtype), format!("v{j}")),
                ValueRef::Op(j) => vals[*j].clone(),
            })
            .collect();
        match pairs[i] {
            // The first of a sine and cosine of one value computes both.
            Some((sin, cos)) if i == sin.min(cos) => {
                let t = op.unary_type();
                let f = if t == CType::F64 { "sincos" } else { "sincosf" };
                let (ts, tc) = (fresh(), fresh());
                let _ = writeln!(body, "    {} {ts}, {tc}; {f}({}, &{ts}, &{tc});", t.name(), convert(args[0].0, t, &args[0].1));
                let (mine, other) = if i == sin { (ts, tc) } else { (tc, ts) };
                pair_names[sin.max(cos)] = Some(other);
                vals.push((t, mine));
                continue;
            }
            Some(_) => {
                let name = pair_names[i].take().expect("the first of a sine and cosine pair comes first");
                vals.push((op.unary_type(), name));
                continue;
            }
            None => {}
        }
        let (t, e) = match op.kind {
            KKind::Const(v) if params.len() < CONST_PARAMS => {
                let (t, e, bits) = const_param(op.dtype, v, &format!("P({})", params.len()));
                params.push(bits);
                (t, e)
            }
            _ => lower(op, &args),
        };
        if matches!(op.kind, KKind::Same) {
            vals.push((t, e));
            continue;
        }
        let name = fresh();
        let _ = writeln!(body, "    const {} {name} = {e};", t.name());
        vals.push((t, name));
    }
    let outputs: Vec<&str> = k.outputs.iter().map(|(o, _)| vals[*o].1.as_str()).collect();
    let name = k.code_name(&format!("{body}{outputs:?}"));
    FlatCode { body, vals, params, name }
}

/// A constant passed as a launch word (`word`, the C text that reads it): its type, its
/// expression, and the word's bits.
fn const_param(dtype: crate::DType, v: f64, word: &str) -> (CType, String, u64) {
    let t = CType::of(dtype);
    let bits = match t {
        CType::F32 | CType::F64 => v.to_bits(),
        CType::I64 | CType::Bool => v as i64 as u64,
    };
    let e = match t {
        CType::F32 => format!("((float)kparam_f({word}))"),
        CType::F64 => format!("kparam_f({word})"),
        CType::I64 => format!("((long long){word})"),
        CType::Bool => format!("({word} != 0)"),
    };
    (t, e, bits)
}

fn run_flat(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, k: &FusedKernel, shape: &[usize], numel: usize, inputs: &[Tensor], into: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
    let views = inputs.iter().map(|t| view_as(t, shape)).collect::<Result<Vec<_>>>()?;
    let memo = memo(k)?;
    let FlatCode { body, vals, params, name } = memo.flat_code.get_or_init(|| flat_code(k));
    let mut outs: Vec<Tensor> = Vec::with_capacity(k.outputs.len());
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        outs.push(match into.get(m).cloned().flatten() {
            // Only a tensor of exactly the kernel's elements: the kernel writes each of them.
            Some(t) if t.numel() == numel && !k.single[m] => t,
            _ if k.single[m] => Tensor::from_backend(BackendStorage::Cuda(CudaStorage::new(dev, k.ops[*o].dtype, 1)?), &[1]),
            _ => Tensor::from_backend(BackendStorage::Cuda(CudaStorage::new(dev, k.ops[*o].dtype, numel)?), shape),
        });
    }
    let mut specs = Vec::with_capacity(outs.len());
    for (m, ((o, _), t)) in k.outputs.iter().zip(&outs).enumerate() {
        specs.push(MapOut { ptr: data_ptr(t)?, dtype: k.ops[*o].dtype, result: vals[*o].0, expr: &vals[*o].1, once: k.single[m] });
    }
    let ins: Vec<(&Tensor, CType)> = views.iter().map(|t| (t, CType::of(t.dtype()))).collect();
    map_launch(dev, name, &ins, &specs, &Layout::contiguous(shape), body, params, Some(&memo.flat_launches))?;
    Ok(outs)
}

/// A row kernel's loaded functions by launch shape.
type RowLaunches = crate::backend::cuda::Loaded<(RowShape, crate::backend::cuda::Kernel)>;

/// (threads, values per thread, vector width, bit j set when input j loads vectors, bit j set
/// when it is staged in shared memory, how the threads' values cover the row).
type RowShape = (usize, usize, usize, u64, u64, Cover);

/// Per op: (sine, cosine) when it is one of a sine and a cosine of the same floating-point
/// value, which one `sincos` call computes (one argument reduction instead of two).
fn sincos_pairs(k: &FusedKernel) -> Vec<Option<(usize, usize)>> {
    use crate::ops::UnaryOp as U;
    let mut pairs = vec![None; k.ops.len()];
    let float = |op: &KOp| matches!(op.unary_type(), CType::F32 | CType::F64);
    for (s, op) in k.ops.iter().enumerate() {
        if !matches!(op.kind, KKind::Unary(U::Sin)) || !float(op) {
            continue;
        }
        let partner = k.ops.iter().enumerate().position(|(c, o)| {
            matches!(o.kind, KKind::Unary(U::Cos)) && o.args == op.args && o.dtype == op.dtype && pairs[c].is_none()
        });
        if let Some(c) = partner {
            pairs[s] = Some((s, c));
            pairs[c] = Some((s, c));
        }
    }
    pairs
}

/// Where a fused row kernel's argument words sit (`gen_fused_rows` reads them, `run_rows` fills
/// them): the row and column counts, one address per output, then per input its address, row
/// stride and column stride.
struct RowWords {
    outputs: usize,
}

impl RowWords {
    const ROWS: usize = 0;
    const COLS: usize = 1;
    fn output(&self, m: usize) -> usize {
        2 + m
    }
    /// Input `j`'s address, row stride and column stride.
    fn input(&self, j: usize) -> [usize; 3] {
        let base = 2 + self.outputs + 3 * j;
        [base, base + 1, base + 2]
    }
}

/// How a row kernel's threads cover a row: exactly (every value in range, no column checks),
/// with the last values masked, or in chunks walked again by every pass (rows longer than the
/// registers hold).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Cover {
    Exact,
    Masked,
    Looped,
    /// Looped over rows whose length divides by no vector width (`row_vec`): the vector that
    /// straddles a row's end is loaded and stored element by element, its values past the end
    /// left out of the reductions.
    LoopedTail,
}

/// What a row kernel's source is: a kernel of its own, or the prologue of a product of one row
/// (`gemv.cu`, `GEMV_ROW`): a device function that every block of the product runs over the
/// kernel's one row, after the product's wait for the kernel before. It leaves output `row`
/// (the product's row) in the caller's shared memory (`ksrow`) and stores the other outputs
/// only where `kwriter` is set (in the product's first block). `loads_first`: every input is
/// loaded before the first pass, as `KILN_PROLOGUE_LOADS_FIRST=1` asks.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowMode {
    Kernel,
    Prologue { row: usize, loads_first: bool },
}

/// Source of a row kernel: `threads` threads per row, `vpt` values per thread, loaded `vec` at a
/// time; `vector[j]` says whether full input j is read with vector loads, `staged[j]` (empty:
/// none) whether a looped kernel keeps its row in shared memory (`staged_inputs`); `cover`: how
/// the threads' values cover the row; `mode`: a kernel or a product's prologue.
// One parameter per choice the source depends on; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
fn gen_fused_rows(k: &FusedKernel, name: &str, threads: usize, vpt: usize, vec: usize, vector: &[bool], staged: &[bool], cover: Cover, mode: RowMode) -> String {
    let (full, looped, tail) = (cover == Cover::Exact, matches!(cover, Cover::Looped | Cover::LoopedTail), cover == Cover::LoopedTail);
    // Rows longer than the registers hold: each pass walks the row in chunks of
    // `threads * VPT` (`kbase`), loading and computing again what it needs.
    let mut plan = if looped { RowPlan::recomputing(k) } else { RowPlan::new(k) };
    // A prologue runs after the product's wait, on the critical path: loading every input
    // first (a layer norm's weight and bias too, which a kernel of its own loads only for its
    // output pass) makes the row one trip to memory, not two, but takes registers the product's
    // blocks and the next kernels' early blocks would use (slower in a decode step: off unless
    // asked).
    if matches!(mode, RowMode::Prologue { loads_first: true, .. }) {
        for (j, inp) in k.inputs.iter().enumerate() {
            plan.in_array[j] |= !looped && !inp.row && inp.columns.is_none();
        }
    }
    let is_staged = |j: usize| looped && staged.get(j).copied().unwrap_or(false) && vector[j] && k.inputs[j].columns.is_none();
    let stages = (0..k.inputs.len()).any(is_staged);
    let prologue_row = match mode {
        RowMode::Kernel => None,
        RowMode::Prologue { row, .. } => Some(row),
    };
    // A prologue stores its outputs but the product's row only in the product's first block.
    let gate = |m: usize| if prologue_row.is_some_and(|r| r != m) { "if (kwriter) " } else { "" };
    let mut c = if prologue_row.is_some() { String::new() } else { String::from(PRELUDE) };
    let _ = writeln!(c, "#define VPT {vpt}\n#define VEC {vec}");
    c.push_str(&row_index(full, threads));
    // A looped walk's chunks that lie inside the row whole (all but the last, often) run a copy
    // of the chunk's code with `kfast` true, in which no column is checked.
    // KWHOLE(k): the vector at column k lies inside the row (always, but for a tail cover,
    // which is a looped one).
    let _ = writeln!(c, "#define KWHOLE(k) {}", if tail { "(kfast || (k) + VEC <= K)" } else { "true" });
    if looped {
        c.push_str("#undef KIDX\n#define KIDX(j) (kbase + ((((j) / VEC) * KTHREADS + (int)threadIdx.x) * VEC + ((j) % VEC)))\n");
        c.push_str("#undef INROW\n#define INROW(k) (kfast || (k) < K)\n");
    }
    let mut helpers = vec![];
    for op in &k.ops {
        if let KKind::Reduce(r) = op.kind {
            let t = CType::of(op.dtype);
            if !helpers.contains(&(r, t)) {
                helpers.push((r, t));
                c.push_str(&block_reduce(r, t));
            }
        }
    }
    vector_structs(&mut c, k, vec, vector);
    if tail {
        // A vector over the row's end: its first `n` values, zeros after them.
        for (j, inp) in k.inputs.iter().enumerate() {
            if !inp.row && vector[j] {
                let _ = writeln!(c, "__device__ __forceinline__ VI{j} kpart_VI{j}(const {t}* p, int n) {{ VI{j} q; _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) q.v[e] = e < n ? p[e] : ({t})0; return q; }}", t = storage_type(inp.dtype));
            }
        }
    }
    match prologue_row {
        None => {
            // A kernel that stages rows runs two blocks per SM: registers for both.
            // `KILN_ROW_MIN_BLOCKS` asks as many of the compiler for any looped kernel (a long
            // row's kernel runs at the speed of the blocks an SM holds: 1024 threads over 32
            // registers leave room for one).
            let blocks = match (stages, crate::switches::row_min_blocks().filter(|_| looped)) {
                (true, _) => ", 2".to_string(),
                (false, Some(n)) => format!(", {n}"),
                (false, None) => String::new(),
            };
            let _ = writeln!(c, "extern \"C\" __global__ void __launch_bounds__({threads}{blocks}) {name}(const LaunchArgs a) {{\n  KILN_AFTER_PREVIOUS();");
        }
        Some(r) => {
            let _ = writeln!(c, "__device__ __forceinline__ void {name}(const LaunchArgs& a, {}* __restrict__ ksrow, const bool kwriter) {{", storage_type(k.ops[k.outputs[r].0].dtype));
        }
    }
    let words = RowWords { outputs: k.outputs.len() };
    let _ = writeln!(c, "  const long long M = (long long)a.w[{}]; const int K = (int)a.w[{}];", RowWords::ROWS, RowWords::COLS);
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        if prologue_row == Some(m) {
            let _ = writeln!(c, "  {}* __restrict__ out{m} = ksrow;", storage_type(k.ops[*o].dtype));
        } else {
            let _ = writeln!(c, "  {t}* __restrict__ out{m} = ({t}*)a.w[{}];", words.output(m), t = storage_type(k.ops[*o].dtype));
        }
        if !k.ops[*o].row {
            // A full output's row stride: its padding columns follow each row.
            let _ = writeln!(c, "  const long long os{m} = (long long)K + {};", k.row_pads[m].map_or(0, |p| p.cols));
        }
    }
    for (j, inp) in k.inputs.iter().enumerate() {
        let t = storage_type(inp.dtype);
        let [ptr, rs, cs] = words.input(j);
        let _ = write!(c, "  const {t}* __restrict__ p{j} = (const {t}*)a.w[{ptr}]; const long long rs{j} = (long long)a.w[{rs}]");
        // Only inputs read element by element need their column stride.
        if !inp.row && !vector[j] {
            let _ = write!(c, ", cs{j} = (long long)a.w[{cs}]");
        }
        c.push_str(";\n");
    }
    // Staged rows lie one after another in the block's dynamic shared memory, each rounded up
    // to whole vectors and 16 bytes (`staged_row_bytes`).
    if stages {
        c.push_str("  extern __shared__ __align__(16) unsigned char ksm[];\n  unsigned int ksoff = 0;\n");
        for j in (0..k.inputs.len()).filter(|&j| is_staged(j)) {
            let t = storage_type(k.inputs[j].dtype);
            let _ = writeln!(c, "  {t}* __restrict__ ks{j} = ({t}*)(ksm + ksoff); ksoff += (((unsigned int)K + VEC - 1) / VEC * VEC * sizeof({t}) + 15) / 16 * 16;");
        }
    }
    // A prologue's blocks each compute the one row.
    let (first, step) = if prologue_row.is_some() { ("0", "1") } else { ("blockIdx.x", "gridDim.x") };
    let _ = writeln!(c, "  for (long long row = {first}; row < M; row += {step}) {{");
    // Every value has a C name: x{j} for input j, t{i} for op i (per row or, inside a pass,
    // per element); reshapes and broadcasts are their argument's name.
    let (ins, vals) = value_names(k);
    for (j, inp) in k.inputs.iter().enumerate() {
        let t = CType::of(inp.dtype);
        if inp.row {
            let _ = writeln!(c, "    const {} x{j} = {};", t.name(), load(inp.dtype, t, &format!("p{j}[row * rs{j}]")));
        } else {
            let _ = writeln!(c, "    const {t}* __restrict__ r{j} = p{j} + row * rs{j};", t = storage_type(inp.dtype));
            if plan.in_array[j] {
                let _ = writeln!(c, "    {} ax{j}[VPT];", t.name());
            }
        }
    }
    // An op's register array takes over an input's array of the same type whose last reader
    // is the pass that fills the op's (each element is read before it is overwritten): fewer
    // registers per thread, more blocks per SM (softmax keeps exp(x - max) where x was).
    let first_in = |j: usize| plan.passes.iter().position(|p| p.inputs.contains(&j));
    let last_in = |j: usize| plan.passes.iter().rposition(|p| p.inputs.contains(&j));
    let mut taken = vec![false; k.inputs.len()];
    let arr: Vec<String> = (0..k.ops.len())
        .map(|i| {
            let fill = plan.passes.iter().position(|p| p.ops.contains(&i));
            let reusable = |j: usize| plan.in_array[j] && !taken[j] && ins[j].0 == vals[i].0 && first_in(j) < fill && last_in(j) == fill;
            match (0..k.inputs.len()).find(|&j| plan.op_array[i] && fill.is_some() && reusable(j)) {
                Some(j) => {
                    taken[j] = true;
                    format!("ax{j}")
                }
                None => format!("at{i}"),
            }
        })
        .collect();
    for (i, v) in vals.iter().enumerate() {
        if plan.op_array[i] && arr[i] == format!("at{i}") {
            let _ = writeln!(c, "    {} at{i}[VPT];", v.0.name());
        }
    }
    // Inputs kept in registers are loaded first, all at once, before any pass computes: the
    // loads are then in flight together instead of one group per step of the first pass. Every
    // pass then reads them from their arrays. (Looped kernels, tail covers among them, keep no
    // arrays: `RowPlan::recomputing`.)
    for (j, inp) in k.inputs.iter().enumerate() {
        if inp.row || !plan.in_array[j] {
            continue;
        }
        let t = ins[j].0;
        let _ = writeln!(c, "    _Pragma(\"unroll\") for (int g = 0; g < VPT / VEC; g++) {{\n      const int k0 = KIDX(g * VEC);");
        if let Some(columns) = inp.columns {
            let _ = writeln!(c, "      _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) ax{j}[g * VEC + e] = {};\n    }}", column_value(columns, t, "k0 + e"));
            continue;
        }
        if vector[j] {
            let v = load(inp.dtype, t, "q.v[e]");
            let _ = writeln!(c, "      if (INROW(k0)) {{ const VI{j} q = *(const VI{j}*)(r{j} + k0); _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) ax{j}[g * VEC + e] = {v}; }}");
        } else {
            let v = load(inp.dtype, t, &format!("r{j}[(long long)(k0 + e) * cs{j}]"));
            let _ = writeln!(c, "      if (INROW(k0)) {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) ax{j}[g * VEC + e] = {v}; }}");
        }
        let _ = writeln!(c, "      else {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) ax{j}[g * VEC + e] = ({})0; }}\n    }}", t.name());
    }
    let mut filled_op = vec![false; k.ops.len()];
    // Staged inputs already in shared memory: the first walk that reads one loads it from
    // memory and leaves a copy there; later walks read the copy. Each thread reads back only
    // the vectors it stored itself (every walk gives a thread the same columns), so no walk
    // waits for the block.
    let mut in_shared = vec![false; k.inputs.len()];
    let reduces: Vec<usize> = (0..k.ops.len()).filter(|&i| matches!(k.ops[i].kind, KKind::Reduce(_))).collect();
    let pass_of = |i: usize| reduces.iter().position(|&r| r == i).expect("a reduction");
    // A pass: a loop over this thread's columns computing what the pass needs, then `each`.
    let mut pass = |out: &mut String, p: &RowPass, each: &str, stores: &str, prologue: &str| {
        let c = &mut String::new();
        let _ = writeln!(c, "    _Pragma(\"unroll\") for (int g = 0; g < VPT / VEC; g++) {{\n      const int k0 = KIDX(g * VEC);\n      if (INROW(k0)) {{{prologue}");
        for &j in &p.inputs {
            if is_staged(j) && in_shared[j] {
                let _ = writeln!(c, "        const VI{j} q{j} = *(const VI{j}*)(ks{j} + k0);");
            } else if vector[j] && !plan.in_array[j] {
                let _ = writeln!(c, "        const VI{j} q{j} = {};", vector_load(j, tail));
                if is_staged(j) {
                    let _ = writeln!(c, "        *(VI{j}*)(ks{j} + k0) = q{j};");
                }
            }
        }
        let _ = writeln!(c, "        _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) {{\n          const int j = g * VEC + e;");
        for &j in &p.inputs {
            let (inp, t) = (&k.inputs[j], ins[j].0);
            let v = if plan.in_array[j] {
                format!("ax{j}[j]")
            } else if let Some(columns) = inp.columns {
                column_value(columns, t, "k0 + e")
            } else if vector[j] {
                load(inp.dtype, t, &format!("q{j}.v[e]"))
            } else if tail {
                format!("INROW(k0 + e) ? {} : ({})0", load(inp.dtype, t, &format!("r{j}[(long long)(k0 + e) * cs{j}]")), t.name())
            } else {
                load(inp.dtype, t, &format!("r{j}[(long long)(k0 + e) * cs{j}]"))
            };
            let _ = writeln!(c, "          const {} x{j} = {v};", t.name());
        }
        for &i in &p.ops {
            let op = &k.ops[i];
            if let KKind::Same | KKind::Broadcast = op.kind {
                continue;
            }
            let (t, e) = if filled_op[i] {
                (vals[i].0, format!("{}[j]", arr[i]))
            } else {
                let args: Vec<(CType, String)> = op.args.iter().map(|a| arg(a, &ins, &vals)).collect();
                lower(op, &args)
            };
            let _ = writeln!(c, "          const {} t{i} = {e};", t.name());
            if plan.op_array[i] && !filled_op[i] {
                let _ = writeln!(c, "          {}[j] = t{i};", arr[i]);
            }
        }
        // Past a row's end (a tail cover's last vector) a value takes part in no reduction.
        let each = if tail && !each.is_empty() { format!("          if (INROW(k0 + e)) {{\n{each}          }}\n") } else { each.to_string() };
        let _ = writeln!(c, "{each}        }}\n{stores}      }}\n    }}");
        if looped {
            let _ = write!(out, "    for (int kbase = 0; kbase < K; kbase += VPT * KTHREADS) {{\n    if (K - kbase >= VPT * KTHREADS) {{ const bool kfast = true;\n{c}    }} else {{ const bool kfast = false;\n{c}    }}\n    }}\n");
        } else {
            out.push_str(c);
        }
        for &i in &p.ops {
            filled_op[i] |= plan.op_array[i];
        }
        for &j in &p.inputs {
            in_shared[j] |= is_staged(j);
        }
    };
    // A row value computed once per row, outside any walk.
    let row_line = |i: usize| {
        let args: Vec<(CType, String)> = k.ops[i].args.iter().map(|a| arg(a, &ins, &vals)).collect();
        let (t, e) = lower(&k.ops[i], &args);
        format!("    const {} t{i} = {e};\n", t.name())
    };
    // Row values of no reduction (constants, functions of row inputs) are computed before any
    // walk, so every walk may read them.
    let mut free = vec![false; k.ops.len()];
    for (i, op) in k.ops.iter().enumerate() {
        free[i] = !plan.elem[i] && !matches!(op.kind, KKind::Reduce(_)) && op.args.iter().all(|a| matches!(a, ValueRef::In(_)) || matches!(a, ValueRef::Op(j) if free[*j]));
        if free[i] && !matches!(op.kind, KKind::Same | KKind::Broadcast) {
            c.push_str(&row_line(i));
        }
    }
    // A looped kernel walks memory once per pass: a later reduction whose pass reads only row
    // values already computed here (cross-entropy's target logit needs the row's max, not its
    // sum of exponentials) folds in the same walk. Each accumulator takes the same values in
    // the same order as in a pass of its own.
    let row_value = |a: &ValueRef| match k.through_views(*a) {
        ValueRef::Op(j) => (!plan.elem[j] && !free[j]).then_some(j),
        ValueRef::In(_) => None,
    };
    let ready_at = |r: usize, i: usize| {
        let p = &plan.passes[pass_of(r)];
        p.ops.iter().chain([&r]).all(|&o| k.ops[o].args.iter().all(|a| row_value(a).is_none_or(|b| b < i)))
    };
    let mut walked = vec![false; k.ops.len()];
    for (i, op) in k.ops.iter().enumerate() {
        match &op.kind {
            KKind::Reduce(_) if walked[i] => {}
            KKind::Reduce(_) => {
                let group: Vec<usize> = std::iter::once(i).chain(reduces.iter().copied().filter(|&r| looped && r > i && !walked[r] && ready_at(r, i))).collect();
                // Sums of exp(x - max) over this max's own values fold into its walk as online
                // sums: each thread's sum is kept relative to its running max, and the threads'
                // sums are brought to the row's max after the walk (softmax and cross-entropy
                // then read a long row twice, not three times). The running max moves a vector
                // at a time: the vector's values are kept (`ov`), their max taken, the sum
                // rescaled if that max is above the running one, then each value's exponential
                // added, with no branch per value. A vector of -inf adds nothing; so does one
                // of NaN and -inf only: a row with a NaN is NaN through its max (NaN-carrying)
                // and the `isfinite` check on it below, which is needed for that.
                let online: Vec<usize> = if looped { reduces.iter().copied().filter(|&r| r > i && !walked[r] && online_sum_of(k, r, i)).collect() } else { vec![] };
                let mut walk = RowPass::default();
                let (mut each, mut group_start, mut group_end) = (String::new(), String::new(), String::new());
                for &r in &online {
                    let t = CType::of(k.ops[r].dtype);
                    let (v, exp) = (arg(&k.ops[i].args[0], &ins, &vals).1, |e: &str| crate::ops::UnaryOp::Exp.cuda(e, t));
                    let (lowest, ty) = (crate::backend::cexpr::literal(f64::NEG_INFINITY, t), t.name());
                    let _ = writeln!(c, "    {ty} acc{r} = ({ty})0; {ty} om{r} = {lowest};");
                    let _ = write!(group_start, "\n        {ty} ov{r}[VEC]; _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) ov{r}[e] = {lowest};");
                    let _ = writeln!(each, "          ov{r}[e] = {v};");
                    let _ = writeln!(
                        group_end,
                        "        {{ {ty} gm = ov{r}[0]; _Pragma(\"unroll\") for (int e = 1; e < VEC; e++) gm = ov{r}[e] > gm ? ov{r}[e] : gm;\n          \
                         if (gm > om{r}) {{ acc{r} = acc{r} * {}; om{r} = gm; }}\n          \
                         if (!(gm == {lowest})) {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) acc{r} += {}; }} }}",
                        exp(&format!("om{r} - gm")),
                        exp(&format!("ov{r}[e] - om{r}"))
                    );
                }
                for &g in &group {
                    let KKind::Reduce(r) = k.ops[g].kind else { unreachable!("a reduction") };
                    let t = CType::of(k.ops[g].dtype);
                    let a = arg(&k.ops[g].args[0], &ins, &vals);
                    let _ = writeln!(each, "          acc{g} = {}(acc{g}, {});", comb_name(r, t), convert(a.0, t, &a.1));
                    let _ = writeln!(c, "    {} acc{g} = {};", t.name(), r.cuda_identity(t));
                    let p = &plan.passes[pass_of(g)];
                    walk.inputs.extend(&p.inputs);
                    walk.ops.extend(&p.ops);
                }
                for v in [&mut walk.inputs, &mut walk.ops] {
                    v.sort_unstable();
                    v.dedup();
                }
                pass(&mut c, &walk, &each, &group_end, &group_start);
                for &g in &group {
                    let KKind::Reduce(r) = k.ops[g].kind else { unreachable!("a reduction") };
                    let t = CType::of(k.ops[g].dtype);
                    let _ = writeln!(c, "    const {} t{g} = {}(acc{g});", t.name(), block_name(r, t));
                    walked[g] = true;
                }
                // An infinite or NaN max makes every exp(x - max) NaN or one of them exp(NaN),
                // as the sum over a walk of its own would.
                for &r in &online {
                    let t = CType::of(k.ops[r].dtype);
                    let nan = crate::backend::cexpr::literal(f64::NAN, t);
                    let scaled = format!("acc{r} == ({ty})0 ? ({ty})0 : acc{r} * {}", crate::ops::UnaryOp::Exp.cuda(&format!("om{r} - t{i}"), t), ty = t.name());
                    let _ = writeln!(c, "    const {ty} s{r} = {}({scaled});\n    const {ty} t{r} = isfinite(t{i}) ? s{r} : {nan};", block_name(crate::ops::ReduceOp::Sum, t), ty = t.name());
                    walked[r] = true;
                }
            }
            KKind::Same | KKind::Broadcast => {}
            _ if !plan.elem[i] && !free[i] => c.push_str(&row_line(i)),
            _ => {}
        }
    }
    // The output pass: full outputs stored a vector at a time; then row outputs.
    let full = k.full_outputs();
    if !full.is_empty() {
        let (mut pro, mut each, mut stores) = (String::new(), String::new(), String::new());
        for &m in &full {
            let o = k.outputs[m].0;
            let v = &vals[o];
            let _ = write!(pro, "\n        VO{m} o{m};");
            let _ = writeln!(each, "          o{m}.v[e] = {};", crate::backend::cuda::kernels::codegen::store(k.ops[o].dtype, v.0, &v.1));
            if tail {
                let _ = writeln!(
                    stores,
                    "        {}{{ if (KWHOLE(k0)) kst{m}(out{m} + row * os{m} + k0, o{m});\n          else {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) if (k0 + e < K) out{m}[row * os{m} + k0 + e] = o{m}.v[e]; }} }}",
                    gate(m)
                );
            } else {
                let _ = writeln!(stores, "        {}kst{m}(out{m} + row * os{m} + k0, o{m});", gate(m));
            }
        }
        pass(&mut c, plan.passes.last().expect("an output pass"), &each, &stores, &pro);
    }
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        if let Some(p) = k.row_pads[m] {
            let d = k.ops[*o].dtype;
            let v = crate::backend::cuda::kernels::codegen::store(d, CType::of(d), &crate::backend::cexpr::literal(p.value, CType::of(d)));
            let _ = writeln!(c, "    {}for (int j = threadIdx.x; j < {}; j += blockDim.x) out{m}[row * os{m} + K + j] = {v};", gate(m), p.cols);
        }
    }
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        if k.ops[*o].row {
            let v = &vals[*o];
            let _ = writeln!(c, "    {}if (threadIdx.x == 0) out{m}[row] = {};", gate(m), crate::backend::cuda::kernels::codegen::store(k.ops[*o].dtype, v.0, &v.1));
        }
    }
    c.push_str("  }\n}\n");
    c
}

/// Whether reduction `r` of a row kernel is the sum of `exp(x - max)` where `max` is reduction
/// `m`, a max over the same `x` (the same expression, not necessarily the same op), all in one
/// type.
fn online_sum_of(k: &FusedKernel, r: usize, m: usize) -> bool {
    use crate::ops::{BinaryOp, ReduceOp, UnaryOp};
    let (KKind::Reduce(ReduceOp::Sum), KKind::Reduce(ReduceOp::Max)) = (&k.ops[r].kind, &k.ops[m].kind) else { return false };
    let dtype = k.ops[m].dtype;
    let ValueRef::Op(e) = k.ops[r].args[0] else { return false };
    let exp = &k.ops[e];
    if exp.kind != KKind::Unary(UnaryOp::Exp) || exp.dtype != dtype || k.ops[r].dtype != dtype {
        return false;
    }
    let ValueRef::Op(d) = exp.args[0] else { return false };
    let d = &k.ops[d];
    matches!(d.kind, KKind::Binary(BinaryOp::Sub, _)) && d.dtype == dtype && k.through_views(d.args[1]) == ValueRef::Op(m) && same_value(k, d.args[0], k.ops[m].args[0])
}

/// Whether two values of a kernel are the same expression of the same inputs.
fn same_value(k: &FusedKernel, a: ValueRef, b: ValueRef) -> bool {
    match (a, b) {
        _ if a == b => true,
        (ValueRef::Op(x), ValueRef::Op(y)) => {
            let (x, y) = (&k.ops[x], &k.ops[y]);
            x.kind == y.kind && x.dtype == y.dtype && x.row == y.row && x.args.len() == y.args.len() && x.args.iter().zip(&y.args).all(|(p, q)| same_value(k, *p, *q))
        }
        _ => false,
    }
}

/// The vector types of a kernel that handles `VEC` adjacent values at a time: `VI{j}` for each
/// full input j read as one load (`vector[j]`), `VO{m}` for each full output m, which is always
/// stored as one (fresh outputs are aligned, and the walked dim divides by `VEC`).
fn vector_structs(c: &mut String, k: &FusedKernel, vec: usize, vector: &[bool]) {
    for (j, inp) in k.inputs.iter().enumerate() {
        if !inp.row && vector[j] {
            let _ = writeln!(c, "struct __align__({}) VI{j} {{ {} v[VEC]; }};", vec * inp.dtype.size_in_bytes(), storage_type(inp.dtype));
        }
    }
    for m in k.full_outputs() {
        let d = k.ops[k.outputs[m].0].dtype;
        let _ = writeln!(c, "struct __align__({}) VO{m} {{ {} v[VEC]; }};", vec * d.size_in_bytes(), storage_type(d));
        // Two-byte values go out packed in 32-bit words: NVVM would store such a struct two
        // bytes at a time where it is built under a branch (a looped kernel's).
        let words = match (d.size_in_bytes(), vec) {
            (2, 2) => Some(("unsigned int", "w[0]")),
            (2, 4) => Some(("uint2", "make_uint2(w[0], w[1])")),
            (2, 8) => Some(("uint4", "make_uint4(w[0], w[1], w[2], w[3])")),
            _ => None,
        };
        let _ = match words {
            Some((ty, value)) => writeln!(
                c,
                "__device__ __forceinline__ void kst{m}(void* p, const VO{m}& o) {{\n  unsigned int w[VEC / 2];\n  _Pragma(\"unroll\") for (int e = 0; e < VEC / 2; e++) w[e] = (unsigned int)o.v[2 * e] | ((unsigned int)o.v[2 * e + 1] << 16);\n  *({ty}*)p = {value};\n}}"
            ),
            None => writeln!(c, "__device__ __forceinline__ void kst{m}(void* p, const VO{m}& o) {{ *(VO{m}*)p = o; }}"),
        };
    }
}

/// Which inputs load vectors, as kernel names and tuning keys say it (`v` or `s` each).
fn vector_loads(vector: &[bool]) -> String {
    vector.iter().map(|&b| if b { 'v' } else { 's' }).collect()
}

/// A row kernel's name, which says all its source depends on besides the signature (inputs
/// staged in shared memory loaded `m`).
fn rows_name(k: &FusedKernel, threads: usize, vpt: usize, vec: usize, cover: Cover, vector: &[bool], staged: &[bool]) -> String {
    let tail = match cover {
        Cover::Exact => "_full",
        Cover::Looped => "_loop",
        Cover::LoopedTail => "_looptail",
        Cover::Masked => "",
    };
    let loads: String = vector_loads(vector).chars().zip(staged.iter().chain(std::iter::repeat(&false))).map(|(l, &m)| if m { 'm' } else { l }).collect();
    format!("{}_r{threads}x{vpt}x{vec}{tail}_{loads}", k.code_name(k.signature()))
}

/// A mid kernel's signature: its constants passed as launch words are not part of its code.
fn mid_signature(k: &FusedKernel) -> String {
    let params = mid_params(k).0;
    k.signature_with(|i| params[i].is_some())
}

/// A mid kernel's name: walking columns `tx` threads across (`gen_fused_cols`), else the
/// middle dim (`gen_fused_mid`).
fn mid_name(k: &FusedKernel, tx: Option<usize>, vec: usize, wide: bool, vector: &[bool]) -> String {
    let kind = tx.map_or("mid".into(), |tx| format!("cols{tx}x"));
    format!("{}_{kind}{vec}{}_{}", k.code_name(&mid_signature(k)), if wide { "_i64" } else { "" }, vector_loads(vector))
}

/// A looped row kernel's block (`gen_fused_rows`): threads, and the most values each reads
/// per chunk.
const LOOPED_THREADS: usize = 1024;
const LOOPED_MAX_VPT: usize = 32;

/// Values per thread of a row kernel of `threads` threads over rows of `cols`, and how they
/// cover a row. A looped kernel's row is walked in as few chunks as `LOOPED_MAX_VPT` allows,
/// split evenly: every pass waits on memory once per chunk (its loads are in flight together),
/// so fewer, fuller chunks keep more bytes in flight per SM, and a last chunk nearly empty
/// would cost a whole wait.
fn row_cover(cols: usize, threads: usize, vec: usize) -> (usize, Cover) {
    if walks_in_chunks(cols) {
        let chunks = cols.div_ceil(threads * LOOPED_MAX_VPT);
        let cover = if cols.is_multiple_of(vec) { Cover::Looped } else { Cover::LoopedTail };
        return (cols.div_ceil(threads * chunks).next_multiple_of(vec), cover);
    }
    let vpt = row_vpt(cols, threads, vec);
    (vpt, if row_full(cols, threads, vpt) { Cover::Exact } else { Cover::Masked })
}

/// Whether a row kernel over rows of `cols` walks them in chunks (`Cover::Looped`): rows longer
/// than its registers hold.
fn walks_in_chunks(cols: usize) -> bool {
    cols > crate::kir::MAX_ROW
}

/// Values of a row kernel that make 16 bytes of its widest full input or output (inputs it
/// computes, `KInput::columns`, load nothing).
fn vector_width(k: &FusedKernel) -> usize {
    let widest = k.inputs.iter().filter(|i| !i.row && i.columns.is_none()).map(|i| i.dtype.size_in_bytes()).chain(k.outputs.iter().filter(|(o, _)| !k.ops[*o].row).map(|(o, _)| k.ops[*o].dtype.size_in_bytes())).max().unwrap_or(4);
    (16 / widest).max(1)
}

/// Values a row kernel loads at once: `vector_width`, where rows of `cols` divide by it, or
/// where they are walked in chunks and every full output's rows start aligned (cross-entropy's
/// gradient stored into a padded product's buffer): the vector over a row's end is then taken
/// element by element (`Cover::LoopedTail`).
fn row_vec(k: &FusedKernel, cols: usize) -> usize {
    let v = vector_width(k);
    let v = crate::switches::row_vec_cap().filter(|_| walks_in_chunks(cols)).map_or(v, |cap| v.min(cap));
    // Vector stores need every output row to start aligned, padded ones too.
    let stride = |m: usize| cols + k.row_pads[m].map_or(0, |p| p.cols);
    let aligned = k.full_outputs().into_iter().all(|m| stride(m).is_multiple_of(v));
    let walked = cols.is_multiple_of(v) || (walks_in_chunks(cols) && !crate::switches::row_tail_off());
    if aligned && walked {
        v
    } else {
        1
    }
}

/// The value at column `col` (a C int) of an input whose values `KInput::columns` gives, as
/// the kernel holds it (`t`): computed as `arange` computes it.
fn column_value((start, step): (f64, f64), t: CType, col: &str) -> String {
    use crate::backend::cexpr::literal;
    let wide = |v: f64| literal(v, CType::F64);
    match t {
        CType::I64 => format!("({}ll + {}ll * (long long)({col}))", start as i64, step as i64),
        // Rounded after the product and after the sum, as `arange` rounds (never one fused
        // multiply-add).
        CType::F32 => format!("(float)__dadd_rn({}, __dmul_rn({}, (double)({col})))", wide(start), wide(step)),
        CType::F64 => format!("__dadd_rn({}, __dmul_rn({}, (double)({col})))", wide(start), wide(step)),
        CType::Bool => unreachable!("column values are integers or floats (`fuse::columns_of`)"),
    }
}

/// A row kernel's load of input j's vector at column `k0`: whole, or (a tail cover's vector
/// over the row's end) element by element up to the end, zeros after it.
fn vector_load(j: usize, tail: bool) -> String {
    let whole = format!("*(const VI{j}*)(r{j} + k0)");
    if tail {
        format!("KWHOLE(k0) ? {whole} : kpart_VI{j}(r{j} + k0, K - k0)")
    } else {
        whole
    }
}

/// Threads per row of a row kernel unless max-autotune picked others.
fn default_row_threads(cols: usize, vec: usize) -> usize {
    if walks_in_chunks(cols) {
        crate::switches::row_loop_threads().unwrap_or(LOOPED_THREADS)
    } else {
        row_shape(cols, vec).0
    }
}

fn run_rows(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, k: &FusedKernel, rows: usize, cols: usize, inputs: &[Tensor], tune: bool) -> Result<Vec<Tensor>> {
    let outs = row_outputs_of(dev, k, rows, cols)?;
    launch_rows(dev, k, &row_words(k, rows, cols, inputs, &outs)?, tune)?;
    Ok(outs)
}

/// Fresh buffers for a row kernel's outputs: full outputs `[rows, cols]` (or wider by their
/// padding columns), row outputs `[rows]`.
fn row_outputs_of(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, k: &FusedKernel, rows: usize, cols: usize) -> Result<Vec<Tensor>> {
    let width = |m: usize| cols + k.row_pads[m].map_or(0, |p| p.cols);
    let outs = new_outputs(dev, k, |m, op| if op.row { rows } else { rows * width(m) })?;
    Ok(wrap(outs, |m| if k.ops[k.outputs[m].0].row { vec![rows] } else { vec![rows, width(m)] }))
}

/// A row kernel's launch: its words, and how it loads its inputs.
struct RowWordsFilled {
    args: LaunchArgs,
    /// The inputs as the words name them: where one had to be copied to be seen as rows, the
    /// copy lives until the launch.
    views: Vec<Tensor>,
    rows: usize,
    cols: usize,
    /// Values loaded at once (`row_vec`).
    vec: usize,
    /// Per input: whether it loads vectors.
    vector: Vec<bool>,
}

/// The launch words of row kernel `k` over `inputs`, writing `outs`.
fn row_words(k: &FusedKernel, rows: usize, cols: usize, inputs: &[Tensor], outs: &[Tensor]) -> Result<RowWordsFilled> {
    // Full inputs as [rows, cols], row inputs as [rows]: (row stride, col stride) each.
    let mut views = vec![];
    for (inp, t) in k.inputs.iter().zip(inputs) {
        views.push(if inp.row { view_as(t, &[rows, 1])? } else { view_as(t, &[rows, cols])? });
    }
    let vec = row_vec(k, cols);
    let mut vector = vec![];
    for (inp, t) in k.inputs.iter().zip(&views) {
        let ok = !inp.row && inp.columns.is_none() && vec > 1 && t.strides()[1] == 1 && t.strides()[0] % vec == 0 && data_ptr(t)? % (vec * inp.dtype.size_in_bytes()) as u64 == 0;
        vector.push(ok);
    }
    let mut a = LaunchArgs::default();
    let words = RowWords { outputs: outs.len() };
    a.w[RowWords::ROWS] = rows as u64;
    a.w[RowWords::COLS] = cols as u64;
    for (m, t) in outs.iter().enumerate() {
        a.w[words.output(m)] = data_ptr(t)?;
    }
    if words.input(views.len())[0] > a.w.len() {
        return Err(Error::arg("fused kernel", format!("{}: {} inputs and {} outputs exceed a launch's argument block", k.name, views.len(), outs.len())));
    }
    for (j, t) in views.iter().enumerate() {
        let [ptr, rs, cs] = words.input(j);
        a.w[ptr] = data_ptr(t)?;
        a.w[rs] = t.strides()[0] as u64;
        a.w[cs] = t.strides()[1] as u64;
    }
    Ok(RowWordsFilled { args: a, views, rows, cols, vec, vector })
}

/// Launches row kernel `k` with its words `w`: threads per row timed on first use where `tune`.
fn launch_rows(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, k: &FusedKernel, w: &RowWordsFilled, tune: bool) -> Result<()> {
    let RowWordsFilled { args: a, rows, cols, vec, vector, .. } = w;
    let (rows, cols, vec) = (*rows, *cols, *vec);
    // Which inputs load vectors, as named in kernels and tuning keys (built on a first launch).
    let vk = || vector_loads(vector);
    // One launch with `threads` threads per row. Every launch rewrites the outputs whole from
    // the inputs, so timing candidates changes nothing.
    let looped = walks_in_chunks(cols);
    let staged = if looped { staged_inputs(dev.shared_per_sm, k, w) } else { vec![] };
    let shared = staged_bytes(k, &staged, cols, vec);
    let launch = |threads: usize| -> Result<()> {
        let (vpt, cover) = row_cover(cols, threads, vec);
        let shape = (threads, vpt, vec, vector_bits(vector), vector_bits(&staged), cover);
        let launches = &memo(k)?.row_launches;
        let cached = launches.0.lock().iter().find(|(s, _)| *s == shape).map(|(_, f)| *f);
        let kern = match cached {
            Some(f) => f,
            None => {
                let signature = k.signature();
                let name = rows_name(k, threads, vpt, vec, cover, vector, &staged);
                // Keyed by what determines the source (the signature: ops and input dtypes; the
                // launch shape): kernels of the same text, in this graph or others, share it.
                let key = format!("rows {name} {signature}");
                let f = dev.kernel(KernelKey::Named(key), || {
                    let src = gen_fused_rows(k, &name, threads, vpt, vec, vector, &staged, cover, RowMode::Kernel);
                    (name.clone(), src)
                })?;
                if !f.is_rehearsed() {
                    launches.0.lock().push((shape, f));
                }
                f
            }
        };
        dev.launch_shared(kern, (rows.min(1 << 20) as u32, 1, 1), (threads as u32, 1, 1), shared as u32, a)
    };
    let tuned = if tune && !looped { tuned_threads(dev, k, rows, cols, vec, &vk(), &launch) } else { None };
    let threads = if staged.contains(&true) { STAGED_THREADS } else { default_row_threads(cols, vec) };
    launch(tuned.unwrap_or(threads))
}

/// Most shared memory a block of a looped row kernel stages rows in: two such blocks and the
/// driver's reserve per block must fit an SM.
fn stage_budget(shared_per_sm: usize) -> usize {
    // (the driver's 1 KiB per block, and up to 1 KiB of the block reductions' own arrays)
    (shared_per_sm / 2).saturating_sub(2048)
}

/// Threads of a looped row kernel that stages rows: two blocks share an SM, each thread with
/// up to 64 registers.
const STAGED_THREADS: usize = 512;

/// Bytes one staged input's row takes in shared memory: whole vectors, rounded up to 16 bytes
/// (as the kernel lays them out).
fn staged_row_bytes(cols: usize, vec: usize, dtype: crate::dtype::DType) -> usize {
    (cols.next_multiple_of(vec) * dtype.size_in_bytes()).next_multiple_of(16)
}

/// Shared memory of a row kernel's staged inputs.
fn staged_bytes(k: &FusedKernel, staged: &[bool], cols: usize, vec: usize) -> usize {
    staged.iter().zip(&k.inputs).filter(|(&s, _)| s).map(|(_, i)| staged_row_bytes(cols, vec, i.dtype)).sum()
}

/// The full inputs a looped row kernel keeps in shared memory from its first walk, so that its
/// later walks read the row from there, not from memory again (cross-entropy's logits are read
/// by the walk for the max and the sum, then by the one storing the gradient): inputs loaded as
/// vectors, read by more than one walk, with rows of their own (a row every block reads alike,
/// row stride 0, stays in the caches), taken in order while they fit `stage_budget`.
/// Only under `KILN_ROW_STAGE=1`: cross-entropy's row kernel over GPT-2's logits ran slower staged
/// (1.435 against 1.257 ms on an H200, reading an I32 column index per logit as it does by
/// default; 2.228 against 2.474 on an H100 computing them, `KILN_ROW_COLUMNS=1`).
fn staged_inputs(shared_per_sm: usize, k: &FusedKernel, w: &RowWordsFilled) -> Vec<bool> {
    let mut staged = vec![false; k.inputs.len()];
    if !crate::switches::row_stage_on() {
        return staged;
    }
    let passes = RowPlan::recomputing(k).passes;
    // Read by a reduction's walk and by the output walk (reductions' passes may share one walk,
    // the output pass never does).
    let (output, reductions) = passes.split_last().expect("an output pass");
    let mut left = stage_budget(shared_per_sm);
    for (j, inp) in k.inputs.iter().enumerate() {
        let walks_again = output.inputs.contains(&j) && reductions.iter().any(|p| p.inputs.contains(&j));
        let bytes = staged_row_bytes(w.cols, w.vec, inp.dtype);
        if w.vector[j] && walks_again && w.views[j].strides()[0] != 0 && bytes <= left {
            staged[j] = true;
            left -= bytes;
        }
    }
    staged
}

/// Bit j set when input j loads vectors.
fn vector_bits(vector: &[bool]) -> u64 {
    vector.iter().enumerate().fold(0u64, |m, (j, &v)| m | ((v as u64) << (j % 64)))
}

/// A one-row kernel whose output `row` a product of one row reads as its row
/// (`fuse::row_prologues`), not yet run: its inputs, and the buffers of its outputs (the row's
/// own buffer is written only where the kernel runs on its own).
pub(crate) struct PendingRow<'a> {
    pub kernel: &'a FusedKernel,
    pub inputs: &'a [Tensor],
    pub outputs: &'a [Tensor],
    pub row: usize,
}

/// A pending row kernel's device, rows and columns.
fn pending_space(k: &FusedKernel) -> Result<(std::sync::Arc<crate::backend::cuda::CudaDevice>, usize, usize)> {
    let (Device::Cuda(ord), Space::Rows { rows, cols }) = (k.device, k.space) else { return Err(Error::Compile(format!("{}: only a GPU row kernel runs before a product", k.name))) };
    Ok((device(ord)?, rows, cols))
}

/// The output buffers of a one-row kernel whose launch waits for its product
/// (`PendingRow::outputs`).
pub(crate) fn pending_row_outputs(k: &FusedKernel) -> Result<Vec<Tensor>> {
    let (dev, rows, cols) = pending_space(k)?;
    row_outputs_of(&dev, k, rows, cols)
}

/// Runs a pending row kernel on its own, into its output buffers.
pub(crate) fn run_pending_row(p: &PendingRow) -> Result<()> {
    let (dev, rows, cols) = pending_space(p.kernel)?;
    launch_rows(&dev, p.kernel, &row_words(p.kernel, rows, cols, p.inputs, p.outputs)?, false)
}

/// A pending row kernel as the prologue of a product whose blocks have `threads` threads
/// (`RowMode::Prologue`), with its launch words.
pub(crate) struct RowPrologue<'a> {
    kernel: &'a FusedKernel,
    row: usize,
    threads: usize,
    words: RowWordsFilled,
}

impl RowPrologue<'_> {
    /// The row kernel's launch words.
    pub(crate) fn args(&self) -> LaunchArgs {
        self.words.args
    }

    /// The row's length (the product's K).
    pub(crate) fn cols(&self) -> usize {
        self.words.cols
    }

    /// The product's kernel `product` (a name that says all the product's own source depends
    /// on) with this prologue, loaded once per product and way of loading the inputs (kept in
    /// the row kernel's memo): `source(function name, function source)` writes its source.
    pub(crate) fn product_kernel(&self, dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, product: &str, source: impl FnOnce(&str, &str) -> String) -> Result<crate::backend::cuda::Kernel> {
        let bits = vector_bits(&self.words.vector);
        let launches = &memo(self.kernel)?.prologue_launches;
        if let Some(f) = launches.0.lock().iter().find(|((p, r, b), _)| p == product && *r == self.row && *b == bits).map(|(_, f)| *f) {
            return Ok(f);
        }
        let (name, key, src) = prologue_code(self.kernel, self.row, self.threads, self.words.vec, &self.words.vector, crate::switches::prologue_loads_first());
        let f = dev.kernel(KernelKey::Named(format!("{product} {key}")), || (format!("{product}_{name}"), source(&name, &src)))?;
        if !f.is_rehearsed() {
            launches.0.lock().push(((product.to_string(), self.row, bits), f));
        }
        Ok(f)
    }
}

/// `p` as the prologue of a product of `threads` threads per block, or None where it is no
/// kernel over one row of at most `MAX_PROLOGUE_ROW` whose output `row` is full.
pub(crate) fn row_prologue<'a>(p: &PendingRow<'a>, threads: usize) -> Result<Option<RowPrologue<'a>>> {
    let Space::Rows { rows: 1, cols } = p.kernel.space else { return Ok(None) };
    if cols > crate::kir::MAX_PROLOGUE_ROW || p.kernel.ops[p.kernel.outputs[p.row].0].row {
        return Ok(None);
    }
    let words = row_words(p.kernel, 1, cols, p.inputs, p.outputs)?;
    Ok(Some(RowPrologue { kernel: p.kernel, row: p.row, threads, words }))
}

/// A one-row kernel's prologue function for a product of `threads` threads per block, loading
/// `vec` values at once (inputs as `vector` says): its name, its source's key, its source.
fn prologue_code(k: &FusedKernel, row: usize, threads: usize, vec: usize, vector: &[bool], loads_first: bool) -> (String, String, String) {
    let Space::Rows { cols, .. } = k.space else { unreachable!("a row kernel") };
    let (vpt, cover) = row_cover(cols, threads, vec);
    // The row's length sizes the product's shared copy of it: in the name (a signature need
    // not hold it).
    // (`f`: every input loaded first)
    let first = if loads_first { "f" } else { "" };
    let name = format!("{}_pro{row}{first}_k{cols}", rows_name(k, threads, vpt, vec, cover, vector, &[]));
    let key = format!("{name} {}", k.signature());
    let src = gen_fused_rows(k, &name, threads, vpt, vec, vector, &[], cover, RowMode::Prologue { row, loads_first });
    (name, key, src)
}

/// Launch words of a mid kernel (`gen_fused_mid`): sizes, the split's counters, a partials
/// buffer per reduction, outputs, four words per input (address; outer, row and inner
/// strides), then the constants passed as words (`mid_params`).
struct MidWords {
    reductions: usize,
    outputs: usize,
    inputs: usize,
}

impl MidWords {
    const SIZES: usize = 0; // P, M, Q, chunks
    const COUNT: usize = 4;
    fn part(&self, r: usize) -> usize {
        5 + r
    }
    fn output(&self, m: usize) -> usize {
        5 + self.reductions + m
    }
    fn input(&self, j: usize) -> usize {
        5 + self.reductions + self.outputs + 4 * j
    }
    fn param(&self, n: usize) -> usize {
        self.input(self.inputs) + n
    }
    fn of(k: &FusedKernel) -> MidWords {
        MidWords { reductions: mid_reductions(k).len(), outputs: k.outputs.len(), inputs: k.inputs.len() }
    }
}

/// A mid kernel's constants passed as launch words (the first `CONST_PARAMS` of those computed
/// once) rather than written into its source, as a flat kernel's are: a size (a mean's divisor)
/// or a hyperparameter then launches the same kernel at every value. Per op, the expression
/// that reads its word; and the words' values.
fn mid_params(k: &FusedKernel) -> (Vec<Option<String>>, Vec<u64>) {
    let words = MidWords::of(k);
    let mut exprs = vec![None; k.ops.len()];
    let mut bits = vec![];
    for (i, op) in k.ops.iter().enumerate() {
        if let KKind::Const(v) = op.kind {
            // (as many as the launch's argument block has room for after the inputs)
            if !op.row && bits.len() < CONST_PARAMS && words.param(bits.len()) < LaunchArgs::default().w.len() {
                let (_, e, b) = const_param(op.dtype, v, &format!("a.w[{}]", words.param(bits.len())));
                exprs[i] = Some(e);
                bits.push(b);
            }
        }
    }
    (exprs, bits)
}

/// A mid kernel's reductions: (op index, reduction, accumulator type), the accumulator as the
/// reduction's definition says (F32 sums in F64, as eager ones).
fn mid_reductions(k: &FusedKernel) -> Vec<(usize, crate::ops::ReduceOp, CType)> {
    k.ops
        .iter()
        .enumerate()
        .filter_map(|(i, op)| match op.kind {
            KKind::Reduce(r) => Some((i, r, r.acc_type(op.dtype))),
            _ => None,
        })
        .collect()
}

/// Which ops of a mid kernel run per element (they read a full value); the others run once
/// (constants) or per row (`KOp::row`).
fn mid_elementwise(k: &FusedKernel) -> Vec<bool> {
    let mut elem = vec![false; k.ops.len()];
    for (i, op) in k.ops.iter().enumerate() {
        elem[i] = !matches!(op.kind, KKind::Reduce(_)) && op.args.iter().any(|a| match a {
            ValueRef::In(j) => !k.inputs[*j].row,
            ValueRef::Op(j) => elem[*j],
        });
    }
    elem
}

/// The `const` definitions of the ops of `k` that `pick` selects, in order, at `indent`
/// (reductions, views and broadcasts name other values and are not written; a constant passed
/// as a launch word reads it through its expression in `params`).
fn mid_ops(c: &mut String, k: &FusedKernel, ins: &[(CType, String)], vals: &[(CType, String)], params: &[Option<String>], indent: &str, pick: impl Fn(usize) -> bool) {
    let written = |i: usize| !matches!(k.ops[i].kind, KKind::Reduce(_) | KKind::Same | KKind::Broadcast);
    for i in (0..k.ops.len()).filter(|&i| written(i) && pick(i)) {
        let (t, e) = match params.get(i).cloned().flatten() {
            Some(e) => (CType::of(k.ops[i].dtype), e),
            None => lower(&k.ops[i], &k.ops[i].args.iter().map(|a| arg(a, ins, vals)).collect::<Vec<_>>()),
        };
        let _ = writeln!(c, "{indent}const {} t{i} = {e};", t.name());
    }
}

/// One element `e` of a mid kernel's walk: full input j's stored value `loaded(j)`, the full
/// ops, each reduction's argument folded into `acc(i)`, full output m's value into `o{m}.v[e]`
/// (`mid_vector_outputs` declares and stores them).
fn mid_element(c: &mut String, k: &FusedKernel, ins: &[(CType, String)], vals: &[(CType, String)], loaded: &dyn Fn(usize) -> String, acc: &dyn Fn(usize) -> String, indent: &str) {
    for j in (0..k.inputs.len()).filter(|&j| !k.inputs[j].row) {
        let t = ins[j].0;
        let _ = writeln!(c, "{indent}const {} x{j} = {};", t.name(), load(k.inputs[j].dtype, t, &loaded(j)));
    }
    // (no row value is among a full op's arguments: the scheduler sees to that)
    let elem = mid_elementwise(k);
    mid_ops(c, k, ins, vals, &[], indent, |i| elem[i]);
    for &(i, r, t) in &mid_reductions(k) {
        let a = arg(&k.ops[i].args[0], ins, vals);
        let _ = writeln!(c, "{indent}{} = {}({}, {});", acc(i), comb_name(r, t), acc(i), convert(a.0, t, &a.1));
    }
    for m in k.full_outputs() {
        let o = k.outputs[m].0;
        let v = &vals[o];
        let _ = writeln!(c, "{indent}o{m}.v[e] = {};", crate::backend::cuda::kernels::codegen::store(k.ops[o].dtype, v.0, &v.1));
    }
}

/// A mid kernel's full outputs, a vector of `VEC` values each: declared (`at` is None) before
/// the walk over one position's values, else stored at `at`, the position's first value.
fn mid_vector_outputs(c: &mut String, k: &FusedKernel, at: Option<&str>, indent: &str) {
    for m in k.full_outputs() {
        let _ = match at {
            None => writeln!(c, "{indent}VO{m} o{m};"),
            Some(at) => writeln!(c, "{indent}kst{m}(out{m} + {at}, o{m});"),
        };
    }
}

/// A mid kernel's work per kept index `at` (a row, a column): the reductions' results from
/// `acc(i)`, the row inputs, the row ops, the row outputs.
fn mid_row_tail(c: &mut String, k: &FusedKernel, ins: &[(CType, String)], vals: &[(CType, String)], acc: &dyn Fn(usize) -> String, at: &str, indent: &str) {
    for &(i, _, a) in &mid_reductions(k) {
        let t = CType::of(k.ops[i].dtype);
        let _ = writeln!(c, "{indent}const {} t{i} = {};", t.name(), convert(a, t, &acc(i)));
    }
    for (j, inp) in k.inputs.iter().enumerate() {
        if inp.row {
            let t = CType::of(inp.dtype);
            let _ = writeln!(c, "{indent}const {} x{j} = {};", t.name(), load(inp.dtype, t, &format!("p{j}[{at} * ms{j}]")));
        }
    }
    mid_ops(c, k, ins, vals, &[], indent, |i| k.ops[i].row);
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        if k.ops[*o].row {
            let v = &vals[*o];
            let _ = writeln!(c, "{indent}out{m}[{at}] = {};", crate::backend::cuda::kernels::codegen::store(k.ops[*o].dtype, v.0, &v.1));
        }
    }
}

/// The split reduction's hand-over: after a block left its partials, the `leader` thread counts
/// it in at `count[counter]` (the launch's counters, `MidWords::COUNT`); every block but the
/// last of those sharing the counter returns, and the last resets it for the next launch.
fn last_block_only(c: &mut String, leader: &str, counter: &str) {
    let _ = writeln!(c, "    __syncthreads();\n    __shared__ bool last;\n    if ({leader}) last = klast_arrival((unsigned int*)a.w[{}] + {counter}, gridDim.y);", MidWords::COUNT);
    let _ = writeln!(c, "    __syncthreads();\n    if (!last) return;");
}

/// Threads of a mid kernel's block, and loads each thread has in flight.
const MID_THREADS: usize = 256;
const MID_ILP: usize = 4;

/// A mid kernel (`Space::Mid`): a block per (row, chunk of the outer x inner values). Each
/// thread walks its chunk's values a block apart, `MID_ILP` loads in flight, folding each
/// reduction's argument into an accumulator and storing full outputs; the block reduces its
/// accumulators; with chunks, each block leaves its partials and the last one of a row to
/// finish folds them in a fixed order (the same bits on every run), then computes the row ops.
fn gen_fused_mid(k: &FusedKernel, name: &str, wide: bool, vec: usize, vector: &[bool]) -> String {
    let mut c = String::from(PRELUDE);
    let idx = if wide { "long long" } else { "int" };
    let _ = writeln!(c, "typedef {idx} IDX;\n#define ILP {MID_ILP}\n#define VEC {vec}");
    vector_structs(&mut c, k, vec, vector);
    c.push_str("__device__ __forceinline__ void kadv(IDX& p, IDX& q, IDX dp, IDX dq, IDX Q) { q += dq; p += dp; if (q >= Q) { q -= Q; p++; } }\n");
    let reduces = mid_reductions(k);
    let mut helpers = vec![];
    for &(_, r, t) in &reduces {
        if !helpers.contains(&(r, t)) {
            helpers.push((r, t));
            c.push_str(&block_reduce(r, t));
        }
    }
    let words = MidWords::of(k);
    let _ = writeln!(c, "extern \"C\" __global__ void __launch_bounds__({MID_THREADS}) {name}(const LaunchArgs a) {{\n  KILN_AFTER_PREVIOUS();");
    let s = MidWords::SIZES;
    let _ = writeln!(c, "  const IDX P = (IDX)a.w[{}], M = (IDX)a.w[{}], Q = (IDX)a.w[{}], C = (IDX)a.w[{}]; (void)P;", s, s + 1, s + 2, s + 3);
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        let _ = writeln!(c, "  {t}* __restrict__ out{m} = ({t}*)a.w[{}];", words.output(m), t = storage_type(k.ops[*o].dtype));
    }
    for (j, inp) in k.inputs.iter().enumerate() {
        let w = words.input(j);
        let _ = writeln!(c, "  const {t}* __restrict__ p{j} = (const {t}*)a.w[{w}]; const IDX ps{j} = (IDX)a.w[{}], ms{j} = (IDX)a.w[{}], qs{j} = (IDX)a.w[{}]; (void)ps{j}; (void)qs{j};", w + 1, w + 2, w + 3, t = storage_type(inp.dtype));
    }
    let (ins, vals) = value_names(k);
    let _ = writeln!(c, "  const IDX row = blockIdx.x, ch = blockIdx.y, T = blockDim.x;");
    // Positions count vectors of VEC inner values (Q is a multiple of VEC).
    let _ = writeln!(c, "  const IDX Qv = Q / VEC, n = P * Qv, lo = (IDX)(((long long)n * ch) / C), hi = (IDX)(((long long)n * (ch + 1)) / C);");
    for &(i, r, t) in &reduces {
        let _ = writeln!(c, "  {} acc{i} = {};", t.name(), r.cuda_identity(t));
    }
    let full_in: Vec<usize> = (0..k.inputs.len()).filter(|&j| !k.inputs[j].row).collect();
    // Ops on full values run per element; constants (and ops of constants alone) once, here.
    let elem = mid_elementwise(k);
    mid_ops(&mut c, k, &ins, &vals, &mid_params(k).0, "  ", |i| !elem[i] && !k.ops[i].row);
    let _ = writeln!(c, "  const IDX dp = T / Qv, dq = T % Qv;\n  IDX pp = (lo + (IDX)threadIdx.x) / Qv, qq = (lo + (IDX)threadIdx.x) % Qv;");
    let _ = writeln!(c, "  for (IDX base = lo + (IDX)threadIdx.x; base < hi; base += ILP * T) {{\n    IDX pu[ILP], qu[ILP];");
    let _ = writeln!(c, "    _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) {{ pu[u] = pp; qu[u] = qq * VEC; kadv(pp, qq, dp, dq, Qv); }}");
    // Every load of the step is issued before the first value is used.
    for &j in &full_in {
        let at = format!("pu[u] * ps{j} + row * ms{j}");
        if vector[j] {
            let _ = writeln!(c, "    VI{j} l{j}[ILP];\n    _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) if (base + u * T < hi) l{j}[u] = *(const VI{j}*)(p{j} + {at} + qu[u]);");
        } else {
            let st = storage_type(k.inputs[j].dtype);
            let _ = writeln!(c, "    {st} l{j}[ILP][VEC];\n    _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) if (base + u * T < hi) {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) l{j}[u][e] = p{j}[{at} + (qu[u] + e) * qs{j}]; }}");
        }
    }
    let _ = writeln!(c, "    _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) {{\n      if (base + u * T >= hi) break;");
    mid_vector_outputs(&mut c, k, None, "      ");
    c.push_str("      _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) {\n");
    let loaded = |j: usize| if vector[j] { format!("l{j}[u].v[e]") } else { format!("l{j}[u][e]") };
    mid_element(&mut c, k, &ins, &vals, &loaded, &|i| format!("acc{i}"), "        ");
    c.push_str("      }\n");
    mid_vector_outputs(&mut c, k, Some("((long long)pu[u] * M + row) * Q + qu[u]"), "      ");
    c.push_str("    }\n  }\n");
    for &(i, r, t) in &reduces {
        let _ = writeln!(c, "  acc{i} = {}(acc{i});", block_name(r, t));
    }
    // Split rows: partials, then the last block of the row folds them.
    c.push_str("  if (C > 1) {\n");
    for (n, &(i, _, t)) in reduces.iter().enumerate() {
        let _ = writeln!(c, "    if (threadIdx.x == 0) (({t}*)a.w[{}])[ch * M + row] = acc{i};", words.part(n), t = t.name());
    }
    last_block_only(&mut c, "threadIdx.x == 0", "row");
    // Every thread folds every T-th partial, then the block folds the threads' results (a
    // fixed order); one thread folding them all waited on one load at a time.
    for (n, &(i, r, t)) in reduces.iter().enumerate() {
        let _ = writeln!(c, "    {{ const {tn}* part = (const {tn}*)a.w[{}]; acc{i} = {}; for (IDX q = threadIdx.x; q < C; q += T) acc{i} = {}(acc{i}, __ldcg(part + q * M + row)); acc{i} = {}(acc{i}); }}", words.part(n), r.cuda_identity(t), comb_name(r, t), block_name(r, t), tn = t.name());
    }
    c.push_str("  }\n  if (threadIdx.x != 0) return;\n");
    mid_row_tail(&mut c, k, &ins, &vals, &|i| format!("acc{i}"), "row", "  ");
    c.push_str("}\n");
    c
}

/// A mid kernel whose inner dim is 1 (`[P, M]`, reduced over P: batch norm's statistics of
/// channels-last `[N, H, W, C]`): a block per (tile of columns, chunk of P). Its threads are
/// `TX` x `TY` (`mid_shape`): each walks its `VEC` adjacent columns down every `TY`-th row of
/// its chunk (a warp reads whole sectors of rows, `MID_ILP` loads in flight), folding each
/// reduction's argument into one accumulator per column; the block folds its threads'
/// accumulators as a tree through shared memory, and with chunks the last block of a tile
/// folds the tile's partials in a fixed order (the same bits on every run), then computes
/// the column ops.
fn gen_fused_cols(k: &FusedKernel, name: &str, wide: bool, vec: usize, tx: usize, vector: &[bool]) -> String {
    let ty = MID_THREADS / tx;
    let mut c = String::from(PRELUDE);
    let idx = if wide { "long long" } else { "int" };
    let _ = writeln!(c, "typedef {idx} IDX;\n#define ILP {MID_ILP}\n#define VEC {vec}\n#define TX {tx}\n#define TY {ty}");
    vector_structs(&mut c, k, vec, vector);
    let reduces = mid_reductions(k);
    let mut helpers = vec![];
    for &(_, r, t) in &reduces {
        if !helpers.contains(&(r, t)) {
            helpers.push((r, t));
            let _ = writeln!(c, "__device__ __forceinline__ {n} {}({n} a, {n} b) {{ return {}; }}", comb_name(r, t), r.cuda_combine(), n = t.name());
        }
    }
    let words = MidWords::of(k);
    let widest_acc = reduces.iter().map(|r| r.2.dtype().size_in_bytes()).max().unwrap_or(4);
    let _ = writeln!(c, "extern \"C\" __global__ void __launch_bounds__({MID_THREADS}) {name}(const LaunchArgs a) {{\n  KILN_AFTER_PREVIOUS();");
    let s = MidWords::SIZES;
    let _ = writeln!(c, "  const IDX P = (IDX)a.w[{}], M = (IDX)a.w[{}], C = (IDX)a.w[{}];", s, s + 1, s + 3);
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        let _ = writeln!(c, "  {t}* __restrict__ out{m} = ({t}*)a.w[{}];", words.output(m), t = storage_type(k.ops[*o].dtype));
    }
    for (j, inp) in k.inputs.iter().enumerate() {
        let w = words.input(j);
        let _ = writeln!(c, "  const {t}* __restrict__ p{j} = (const {t}*)a.w[{w}]; const IDX ps{j} = (IDX)a.w[{}], ms{j} = (IDX)a.w[{}]; (void)ps{j}; (void)ms{j};", w + 1, w + 2, t = storage_type(inp.dtype));
    }
    let (ins, vals) = value_names(k);
    let _ = writeln!(c, "  const IDX col0 = ((IDX)blockIdx.x * TX + (IDX)threadIdx.x) * VEC, ch = blockIdx.y;");
    let _ = writeln!(c, "  const IDX lo = (IDX)(((long long)P * ch) / C), hi = (IDX)(((long long)P * (ch + 1)) / C);");
    for &(i, r, t) in &reduces {
        let _ = writeln!(c, "  {} acc{i}[VEC];\n  _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) acc{i}[e] = {};", t.name(), r.cuda_identity(t));
    }
    let full_in: Vec<usize> = (0..k.inputs.len()).filter(|&j| !k.inputs[j].row).collect();
    let elem = mid_elementwise(k);
    mid_ops(&mut c, k, &ins, &vals, &mid_params(k).0, "  ", |i| !elem[i] && !k.ops[i].row);
    // M is a multiple of VEC: a thread's columns are all in or all out.
    let _ = writeln!(c, "  if (col0 < M) for (IDX base = lo + (IDX)threadIdx.y; base < hi; base += ILP * TY) {{");
    for &j in &full_in {
        let at = |u: &str| format!("(base + {u} * TY) * ps{j}");
        if vector[j] {
            let _ = writeln!(c, "    VI{j} l{j}[ILP];\n    _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) if (base + u * TY < hi) l{j}[u] = *(const VI{j}*)(p{j} + {} + col0);", at("u"));
        } else {
            let st = storage_type(k.inputs[j].dtype);
            let _ = writeln!(c, "    {st} l{j}[ILP][VEC];\n    _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) if (base + u * TY < hi) {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) l{j}[u][e] = p{j}[{} + (col0 + e) * ms{j}]; }}", at("u"));
        }
    }
    let _ = writeln!(c, "    _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) {{\n      if (base + u * TY >= hi) break;");
    mid_vector_outputs(&mut c, k, None, "      ");
    c.push_str("      _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) {\n");
    let loaded = |j: usize| if vector[j] { format!("l{j}[u].v[e]") } else { format!("l{j}[u][e]") };
    mid_element(&mut c, k, &ins, &vals, &loaded, &|i| format!("acc{i}[e]"), "        ");
    c.push_str("      }\n");
    mid_vector_outputs(&mut c, k, Some("(long long)(base + u * TY) * M + col0"), "      ");
    c.push_str("    }\n  }\n");
    // The block's thread rows folded as a tree (a fixed order), one reduction at a time through
    // one shared buffer laid out so that a warp's threads read adjacent values: thread row 0
    // holds the block's result.
    let _ = writeln!(c, "  __shared__ __align__(8) unsigned char shm[TY * TX * VEC * {widest_acc}];");
    let mut fold = String::new();
    for &(i, r, t) in &reduces {
        let tn = t.name();
        let _ = writeln!(fold, "  {{\n    {tn}* red = ({tn}*)shm;\n    _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) red[(e * TY + threadIdx.y) * TX + threadIdx.x] = acc{i}[e];\n    __syncthreads();");
        let _ = writeln!(fold, "    for (int s = TY / 2; s > 0; s >>= 1) {{\n      if (threadIdx.y < s) {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) red[(e * TY + threadIdx.y) * TX + threadIdx.x] = {}(red[(e * TY + threadIdx.y) * TX + threadIdx.x], red[(e * TY + threadIdx.y + s) * TX + threadIdx.x]); }}\n      __syncthreads();\n    }}", comb_name(r, t));
        let _ = writeln!(fold, "    if (threadIdx.y == 0) {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) acc{i}[e] = red[e * TY * TX + threadIdx.x]; }}\n    __syncthreads();\n  }}");
    }
    c.push_str(&fold);
    // Split rows: partials; the last block of the tile folds them, its thread rows taking every
    // TY-th chunk, then the same fold as above (a fixed order: the same bits on every run).
    c.push_str("  if (C > 1) {\n    if (threadIdx.y == 0 && col0 < M) {\n");
    for (n, &(i, _, t)) in reduces.iter().enumerate() {
        let _ = writeln!(c, "      _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) (({t}*)a.w[{}])[ch * M + col0 + e] = acc{i}[e];", words.part(n), t = t.name());
    }
    c.push_str("      __threadfence();\n    }\n");
    last_block_only(&mut c, "threadIdx.x == 0 && threadIdx.y == 0", "blockIdx.x");
    c.push_str("    __threadfence();\n");
    // Each step has ILP chunks' partials of all VEC columns in flight before it folds them: a
    // fold that waited for one load at a time left a thousand chunks to a few hundred
    // serial round trips to L2.
    for (n, &(i, r, t)) in reduces.iter().enumerate() {
        let _ = writeln!(c, "    {{\n      const {tn}* part = (const {tn}*)a.w[{}];\n      _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) acc{i}[e] = {};", words.part(n), r.cuda_identity(t), tn = t.name());
        let _ = writeln!(c, "      if (col0 < M) for (IDX q0 = threadIdx.y; q0 < C; q0 += ILP * TY) {{\n        {tn} v[ILP][VEC];", tn = t.name());
        let _ = writeln!(c, "        _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) if (q0 + u * TY < C) {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) v[u][e] = __ldcg(part + (q0 + u * TY) * M + col0 + e); }}");
        let _ = writeln!(c, "        _Pragma(\"unroll\") for (int u = 0; u < ILP; u++) {{ if (q0 + u * TY >= C) break; _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) acc{i}[e] = {}(acc{i}[e], v[u][e]); }}\n      }}\n    }}", comb_name(r, t));
    }
    c.push_str(&fold);
    c.push_str("  }\n");
    c.push_str("  if (threadIdx.y != 0 || col0 >= M) return;\n  _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) {\n    const IDX col = col0 + e;\n");
    mid_row_tail(&mut c, k, &ins, &vals, &|i| format!("acc{i}[e]"), "col", "    ");
    c.push_str("  }\n}\n");
    c
}

/// Tiles of columns a column kernel aims for: the last block of each tile folds that tile's
/// partials, so with one tile a single block folded every chunk's partials of every column
/// while the rest of the GPU waited.
const COL_TILES: usize = 8;

/// Bytes of a row a column kernel's tile reads at least: narrower tiles read DRAM well below its
/// rate (the ResNet-50 profiles in `bench/results/HISTORY.md`, 12-05d).
const COL_TILE_BYTES: usize = 256;

/// Blocks per SM a column kernel's chunks aim for (each thread keeps `MID_ILP` 16-byte loads
/// in flight): fewer chunks leave fewer partials for the last block of a tile to fold.
const COL_BLOCKS_PER_SM: usize = 4;

/// A mid kernel's inner values per position (16 bytes of the widest full input where the
/// walked dim divides by it), and for an inner dim of 1 (channels-last statistics), which walks
/// the columns instead (`gen_fused_cols`: VEC adjacent columns per thread), the threads across
/// a tile of columns: at most 32, fewer while that leaves under `COL_TILES` tiles and the
/// tile's row still spans `COL_TILE_BYTES` of the narrowest full input.
fn mid_shape(k: &FusedKernel, m: usize, q: usize) -> (usize, Option<usize>) {
    let sizes = || k.inputs.iter().filter(|i| !i.row).map(|i| i.dtype.size_in_bytes());
    let (widest, narrowest) = (sizes().max().unwrap_or(4), sizes().min().unwrap_or(4));
    let cols = q == 1;
    let walked = if cols { m } else { q };
    let vec = [16 / widest, 4, 2].into_iter().find(|&v| v <= 16 / widest && walked.is_multiple_of(v)).unwrap_or(1);
    let tx = || {
        let mut tx = (m / vec).next_power_of_two().min(32);
        while tx * vec * narrowest >= 2 * COL_TILE_BYTES && (m / vec).div_ceil(tx) < COL_TILES {
            tx /= 2;
        }
        tx
    };
    (vec, cols.then(tx))
}

fn run_mid(dev: &std::sync::Arc<crate::backend::cuda::CudaDevice>, k: &FusedKernel, [p, m, q]: [usize; 3], inputs: &[Tensor], into: &[Option<Tensor>]) -> Result<Vec<Tensor>> {
    let mut views = vec![];
    for (inp, t) in k.inputs.iter().zip(inputs) {
        views.push(if inp.row { view_as(t, &[1, m, 1])? } else { view_as(t, &[p, m, q])? });
    }
    let reduces = mid_reductions(k);
    let words = MidWords::of(k);
    let params = memo(k)?.mid_words.get_or_init(|| mid_params(k).1);
    if words.param(params.len()) > LaunchArgs::default().w.len() {
        return Err(Error::arg("fused kernel", format!("{}: {} inputs, {} outputs and {} constants exceed a launch's argument block", k.name, views.len(), k.outputs.len(), params.len())));
    }
    // Per-row outputs the plan writes in place (`into`), the rest fresh.
    let mut outs = vec![];
    for (j, (o, _)) in k.outputs.iter().enumerate() {
        let op = &k.ops[*o];
        outs.push(match into.get(j).cloned().flatten() {
            Some(t) if op.row && t.numel() == m && t.is_contiguous() && t.dtype() == op.dtype => t,
            // A dying input's buffer (`plan_reuse`), stored as vectors like a fresh one.
            Some(t) if !op.row && t.numel() == p * m * q && t.is_contiguous() && t.dtype() == op.dtype && data_ptr(&t)? % 16 == 0 => t,
            _ => {
                let shape = if op.row { vec![m] } else { vec![p * m * q] };
                Tensor::from_backend(BackendStorage::Cuda(CudaStorage::new(dev, op.dtype, shape[0])?), &shape)
            }
        });
    }
    // `cols_tx`: the threads across a tile of columns, where the kernel walks columns.
    let (vec, cols_tx) = mid_shape(k, m, q);
    let cols = cols_tx.is_some();
    let tiles = cols_tx.map_or(m, |tx| m.div_ceil(tx * vec));
    // About eight blocks per SM (`COL_BLOCKS_PER_SM` for a column kernel), each reading at
    // least 2048 values (a column kernel's chunk at least `MID_ILP` rows per thread).
    let chunks = match cols_tx {
        Some(tx) => (dev.sm_count * COL_BLOCKS_PER_SM).div_ceil(tiles).clamp(1, (p / (MID_ILP * (MID_THREADS / tx))).max(1)),
        None => (dev.sm_count * 8).div_ceil(m).clamp(1, (p * q / 2048).max(1)),
    };
    let parts: Vec<CudaStorage> = if chunks > 1 { reduces.iter().map(|&(_, _, acc)| CudaStorage::new(dev, acc.dtype(), chunks * m)).collect::<Result<_>>()? } else { vec![] };
    let mut a = LaunchArgs::default();
    a.w[MidWords::SIZES..MidWords::SIZES + 4].copy_from_slice(&[p as u64, m as u64, q as u64, chunks as u64]);
    if chunks > 1 {
        a.w[MidWords::COUNT] = dev.reduce_counters(tiles)?;
    }
    for (r, s) in parts.iter().enumerate() {
        a.w[words.part(r)] = s.ptr();
    }
    for (j, t) in outs.iter().enumerate() {
        a.w[words.output(j)] = data_ptr(t)?;
    }
    for (n, &bits) in params.iter().enumerate() {
        a.w[words.param(n)] = bits;
    }
    let mut reach = p * m * q;
    for (j, t) in views.iter().enumerate() {
        let w = words.input(j);
        a.w[w] = data_ptr(t)?;
        for d in 0..3 {
            a.w[w + 1 + d] = t.strides()[d] as u64;
        }
        reach = reach.max(t.shape().iter().zip(t.strides()).map(|(n, s)| n.saturating_sub(1) * s).sum::<usize>());
    }
    let wide = reach + MID_ILP * MID_THREADS * 8 >= i32::MAX as usize;
    // VEC inner values (columns) per position: 16 bytes of the widest full input, where the
    // inner dim (the columns) divides by it; inputs whose values there are contiguous and
    // aligned load them as one.
    let mut vector = vec![];
    for (inp, t) in k.inputs.iter().zip(&views) {
        let s = t.strides();
        let runs = if cols { s[1] == 1 && s[0] % vec == 0 } else { s[2] == 1 && s[1] % vec == 0 && s[0] % vec == 0 };
        let ok = !inp.row && vec > 1 && runs && data_ptr(t)? % (vec * inp.dtype.size_in_bytes()) as u64 == 0;
        vector.push(ok);
    }
    let mask = vector.iter().enumerate().fold(0u64, |m, (j, &v)| m | ((v as u64) << (j % 64)));
    let shape = (wide, vec, mask);
    let launches = &memo(k)?.mid_launches;
    let cached = launches.0.lock().iter().find(|(s, _)| *s == shape).map(|(_, f)| *f);
    let kern = match cached {
        Some(f) => f,
        None => {
            let signature = mid_signature(k);
            let name = mid_name(k, cols_tx, vec, wide, &vector);
            let f = dev.kernel(KernelKey::Named(format!("mid {name} {signature}")), || {
                let src = match cols_tx {
                    Some(tx) => gen_fused_cols(k, &name, wide, vec, tx, &vector),
                    None => gen_fused_mid(k, &name, wide, vec, &vector),
                };
                (name.clone(), src)
            })?;
            if !f.is_rehearsed() {
                launches.0.lock().push((shape, f));
            }
            f
        }
    };
    match cols_tx {
        Some(tx) => dev.launch(kern, (tiles as u32, chunks as u32, 1), (tx as u32, (MID_THREADS / tx) as u32, 1), &a)?,
        None => dev.launch(kern, (m as u32, chunks as u32, 1), (MID_THREADS as u32, 1, 1), &a)?,
    }
    drop(parts);
    Ok(outs)
}

/// Max-autotune for a row kernel: the remembered thread count for this kernel, rows and layout,
/// else the fastest candidate timed on the device (remembered). None: use the default shape
/// (`KILN_ROWS_THREADS` set, a single candidate, or timing not allowed now).
fn tuned_threads(dev: &crate::backend::cuda::CudaDevice, k: &FusedKernel, rows: usize, cols: usize, vec: usize, layout: &str, launch: &dyn Fn(usize) -> Result<()>) -> Option<usize> {
    if rows_threads_forced().is_some() {
        return None;
    }
    let cands = row_thread_candidates(cols, vec);
    if cands.len() < 2 {
        return None;
    }
    let key = format!("rows|{}|{rows}x{cols} vec {vec} {layout}|{}", dev.tune_ident, k.signature());
    if let Some(v) = autotune::lookup(&key) {
        match v.strip_prefix("threads=").and_then(|t| t.parse::<usize>().ok()) {
            Some(t) if cands.contains(&t) => return Some(t),
            _ => autotune::forget(&key),
        }
    }
    if dev.work().stream().is_none() {
        // A rehearsal asks for every candidate's kernel, so that all are built side by side
        // before the real run times them.
        for &t in &cands {
            let _ = launch(t);
        }
        return None;
    }
    if !autotune::allowed(dev) {
        return None;
    }
    let timed: Vec<(String, usize, Option<f64>)> =
        cands.iter().map(|&t| (format!("{t} threads x {} values", row_vpt(cols, t, vec)), t, autotune::time_ms(dev, || launch(t)))).collect();
    let (_, best) = autotune::pick(&format!("{} rows {rows}x{cols}", k.name), &timed)?;
    autotune::store(&key, &format!("threads={best}"));
    Some(best)
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use crate::backend::cuda::kernels::codegen::{Class, MapSpec};
    use crate::compile::{compile_with, Backend, CompileOptions};
    use crate::DType;
    use crate::nn::functional as F;
    use std::sync::{Arc, Mutex};

    /// The row kernels the compiler schedules for `f` (traced on the CPU; the plan and the
    /// source do not depend on the device).
    fn row_kernels(x: &Tensor, mut f: impl FnMut(&Tensor) -> Result<Tensor> + Send + 'static) -> Vec<FusedKernel> {
        fused_kernels(std::slice::from_ref(x), move |xs| Ok(vec![f(&xs[0])?])).into_iter().filter(|k| matches!(k.space, Space::Rows { .. })).collect()
    }

    /// Every fused kernel the schedule makes of `f`'s graph.
    fn fused_kernels(args: &[Tensor], f: impl FnMut(&[Tensor]) -> Result<Vec<Tensor>> + Send + 'static) -> Vec<FusedKernel> {
        let seen = Arc::new(Mutex::new(vec![]));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, _| {
            s2.lock().unwrap().extend(crate::compile::fuse::schedule(g).kernels);
            Ok(g.eager_runner())
        });
        compile_with(CompileOptions::new().backend(backend), f).call(args).unwrap();
        let v = seen.lock().unwrap().clone();
        v
    }

    /// The fused kernels of `f`'s graph (traced on the CPU) after the compiler's passes
    /// (`compile::optimise`), as the fused backend builds them for the GPU.
    fn optimised_kernels(args: &[Tensor], f: impl FnMut(&[Tensor]) -> Result<Vec<Tensor>> + Send + 'static) -> Vec<FusedKernel> {
        let seen = Arc::new(Mutex::new(vec![]));
        let s2 = seen.clone();
        let backend = Backend::custom(move |g, inputs| {
            s2.lock().unwrap().extend(crate::compile::fuse::schedule(&crate::compile::optimise(&g.as_on_cuda(), inputs)).kernels);
            Ok(g.eager_runner())
        });
        compile_with(CompileOptions::new().backend(backend), f).call(args).unwrap();
        let v = seen.lock().unwrap().clone();
        v
    }

    /// The fused kernels of a small GPT-2's training step (`n_layer` blocks) under BF16
    /// autocast, with cross-entropy and AdamW, as the GPU would run them.
    fn gpt2_training_kernels(n_layer: usize) -> Vec<FusedKernel> {
        let cpu = Device::Cpu;
        let cfg = crate::models::Gpt2Config { vocab_size: 96, n_positions: 16, n_embd: 64, n_layer, n_head: 4, n_inner: 256, ..Default::default() };
        let model = Arc::new(crate::models::Gpt2::new(cfg, DType::F32, &cpu).unwrap());
        let mut opt = crate::optim::AdamW::new(crate::nn::Module::parameters(model.as_ref()), crate::optim::AdamConfig { weight_decay: 0.1, ..Default::default() });
        let ids = Tensor::from_vec((0..32).map(|i| (i * 7) % 96).collect::<Vec<i64>>(), &[2, 16], &cpu).unwrap();
        let targets = Tensor::from_vec((0..32).map(|i| (i * 5) % 96).collect::<Vec<i64>>(), &[32], &cpu).unwrap();
        optimised_kernels(&[ids, targets], move |xs| {
            let logits = crate::amp::autocast(&Device::Cpu, DType::BF16, || crate::nn::Module::forward(model.as_ref(), &xs[0]))?;
            let loss = F::cross_entropy(&logits.reshape(&[-1, 96])?, &xs[1])?;
            loss.backward()?;
            crate::optim::Optimizer::step(&mut opt)?;
            crate::optim::Optimizer::zero_grad(&mut opt);
            Ok(vec![loss])
        })
    }

    /// The sources the fused backend would write for the kernels of a small GPT-2 and a small
    /// ResNet training step under BF16 autocast, and of F32 rows too long for registers, for
    /// the NVRTC check (`samples.rs`): each kernel at its default launch shape, and with
    /// scalar loads.
    pub(crate) fn samples() -> Vec<crate::backend::cuda::kernels::samples::Sample> {
        use crate::backend::cuda::kernels::samples::Sample;
        let cpu = Device::Cpu;
        // GPT-2: layer norms, GELU, attention's pieces, cross-entropy, AdamW.
        let mut kernels = gpt2_training_kernels(1);
        // ResNet: channels-last convolutions' batch norm statistics, ReLU, pooling, SGD.
        let net = Arc::new(crate::nn::ResNet::bottleneck([1, 1, 1, 1], 10, &cpu).unwrap());
        let mut sgd = crate::optim::Sgd::new(crate::nn::Module::parameters(net.as_ref()), 0.01).momentum(0.9).weight_decay(1e-4);
        let x = Tensor::randn(&[2, 3, 32, 32], DType::F32, &cpu).unwrap().to_memory_format(crate::MemoryFormat::ChannelsLast).unwrap();
        let y = Tensor::from_vec(vec![3i64, 7], &[2], &cpu).unwrap();
        kernels.extend(optimised_kernels(&[x, y], move |xs| {
            let logits = crate::amp::autocast(&Device::Cpu, DType::BF16, || crate::nn::Module::forward(net.as_ref(), &xs[0]))?;
            let loss = F::cross_entropy(&logits, &xs[1])?;
            loss.backward()?;
            crate::optim::Optimizer::step(&mut sgd)?;
            crate::optim::Optimizer::zero_grad(&mut sgd);
            Ok(vec![loss])
        }));
        // Batch norm's statistics over contiguous images (a mid kernel with an inner dim) and
        // rows past `MAX_ROW` (looped), in F32.
        let img = Tensor::randn(&[4, 8, 6, 6], DType::F32, &cpu).unwrap();
        let (rm, rv) = (Tensor::zeros(&[8], DType::F32, &cpu).unwrap(), Tensor::ones(&[8], DType::F32, &cpu).unwrap());
        kernels.extend(optimised_kernels(&[img], move |xs| Ok(vec![F::batch_norm(&xs[0], Some(&rm), Some(&rv), None, None, true, 0.1, 1e-5)?.relu()?])));
        let long = Tensor::randn(&[2, crate::kir::MAX_ROW + 64], DType::F32, &cpu).unwrap();
        kernels.extend(optimised_kernels(&[long], |xs| Ok(vec![xs[0].softmax(-1)?, F::layer_norm(&xs[0], &[crate::kir::MAX_ROW + 64], None, None, 1e-5)?])));
        // Cross-entropy over rows past `MAX_ROW`, with its gradient: a looped kernel whose
        // independent reductions share a walk; over GPT-2's vocabulary (50,257 columns, which
        // no vector width divides) also with its column indices computed, as
        // `KILN_ROW_COLUMNS=1` has them.
        for cols in [crate::kir::MAX_ROW + 64, 50257] {
            let logits = Tensor::randn(&[2, cols], DType::F32, &cpu).unwrap().to_dtype(DType::BF16).unwrap().requires_grad();
            let classes = Tensor::from_vec(vec![3i64, 700], &[2], &cpu).unwrap();
            let ce = optimised_kernels(&[logits, classes], |xs| {
                let loss = F::cross_entropy(&xs[0].to_dtype(DType::F32)?, &xs[1])?;
                loss.backward()?;
                Ok(vec![loss, xs[0].grad().expect("a gradient")])
            });
            if cols == 50257 {
                for k in &ce {
                    if let Some(j) = k.inputs.iter().position(|i| !i.row && i.dtype == DType::I32 && i.columns.is_none()) {
                        let mut computed = k.clone();
                        computed.inputs[j].columns = Some((0.0, 1.0));
                        kernels.push(computed);
                    }
                }
            }
            kernels.extend(ce);
        }
        // A one-element input (a decode position) read by row values and by element values of
        // one row kernel: a row input, so the row values computed from it are computed.
        {
            let s = 16usize;
            let (k, kn, last) = (Tensor::randn(&[s, 1, 2, 8], DType::F32, &cpu).unwrap(), Tensor::randn(&[1, 1, 2, 8], DType::F32, &cpu).unwrap(), Tensor::from_vec(vec![3i64], &[1], &cpu).unwrap());
            kernels.extend(optimised_kernels(&[k, kn, last], move |xs| {
                let (k, kn, last) = (&xs[0], &xs[1], &xs[2]);
                let rows = Tensor::arange(0.0, s as f64, 1.0, DType::I64, &Device::Cpu)?.unsqueeze(1)?;
                let at = rows.eq(&last.unsqueeze(0)?)?.reshape_usize(&[s, 1, 1, 1])?;
                let k2 = at.where_(&kn.broadcast_to(k.shape())?, k)?;
                let keys = Tensor::arange(0.0, s as f64, 1.0, DType::I64, &Device::Cpu)?.unsqueeze(0)?;
                let unseen = keys.le(&last.unsqueeze(1)?)?.logical_not()?;
                let mask = Tensor::zeros(&[1, s], DType::F32, &Device::Cpu)?.masked_fill(&unseen, f64::NEG_INFINITY)?;
                Ok(vec![k2, mask])
            }));
        }
        // A row kernel storing its rows padded (a padded product's gradient).
        let odd = Tensor::randn(&[4, 50], DType::F32, &cpu).unwrap().to_dtype(DType::BF16).unwrap();
        kernels.extend(optimised_kernels(&[odd], |xs| Ok(vec![xs[0].to_dtype(DType::F32)?.softmax(-1)?.to_dtype(DType::BF16)?.pad(&[0, 6], 0.0)?])));

        let mut v = vec![];
        // A decode step's layer norms computed by the products that read them (GPT-2's
        // `[K, N]` matrices, a linear layer's `[N, K]`), both ways of loading the inputs (in
        // vectors or one by one; all first or pass by pass, which differ for the affine one);
        // the longest row the kernel attending after its product takes for head dim 64.
        let longest = crate::backend::cuda::kernels::gemv::attend_row_limit(64, DType::BF16, 2);
        for (dt, c) in [(DType::BF16, 64), (DType::F32, 64), (DType::BF16, longest)] {
            let (x, res, w) = (Tensor::randn(&[1, 1, c], dt, &cpu).unwrap(), Tensor::randn(&[1, 1, c], dt, &cpu).unwrap(), Tensor::randn(&[c, 96], dt, &cpu).unwrap());
            let lw = Tensor::randn(&[96, c], dt, &cpu).unwrap();
            let (nw, nb) = (Tensor::randn(&[c], dt, &cpu).unwrap(), Tensor::randn(&[c], dt, &cpu).unwrap());
            let g = crate::compile::fuse::tests::graph_of(&[x, res], move |xs| {
                let h = xs[0].add(&xs[1])?;
                let n = F::layer_norm(&h, &[c], Some(&nw), Some(&nb), 1e-5)?;
                Ok(vec![n.matmul(&w)?, F::layer_norm(&h.mul(&h)?, &[c], None, None, 1e-5)?.matmul(&lw.transpose(0, 1)?)?, h])
            });
            let s = crate::compile::fuse::schedule(&g);
            let found: Vec<_> = s.gemms.iter().filter_map(|gm| gm.prologue).collect();
            assert!(!found.is_empty(), "no product computes its row: {:?}", s.notes);
            for p in found {
                let k = &s.kernels[p.kernel];
                let Space::Rows { cols, .. } = k.space else { unreachable!("a row kernel") };
                let vec = row_vec(k, cols);
                for vector in [k.inputs.iter().map(|i| !i.row && vec > 1).collect::<Vec<bool>>(), vec![false; k.inputs.len()]] {
                    for loads_first in [false, true] {
                        let (name, _, src) = prologue_code(k, p.output, crate::backend::cuda::kernels::gemv::THREADS, vec, &vector, loads_first);
                        v.extend(crate::backend::cuda::kernels::gemv::row_samples(&name, &src, cols, dt));
                    }
                }
            }
        }
        for k in &kernels {
            let scalar = vec![false; k.inputs.len()];
            match k.space {
                Space::Flat { .. } => {
                    let code = flat_code(k);
                    let widest = k.inputs.iter().map(|i| i.dtype.size_in_bytes()).chain(k.outputs.iter().map(|(o, _)| k.ops[*o].dtype.size_in_bytes())).max().unwrap_or(4);
                    for (class, ndim, vec) in [(Class::Contig, 0, (16 / widest).max(2)), (Class::Strided, 3, 1)] {
                        let spec = MapSpec {
                            name: code.name.clone(),
                            inputs: k.inputs.iter().map(|i| (i.dtype, CType::of(i.dtype), class)).collect(),
                            outs: k.outputs.iter().enumerate().map(|(m, (o, _))| (k.ops[*o].dtype, code.vals[*o].0, code.vals[*o].1.clone(), k.single[m])).collect(),
                            out_class: Class::Contig,
                            body: code.body.clone(),
                            ndim,
                            vec,
                            idx64: false,
                        };
                        v.push(Sample::new((spec.kernel_name(), crate::backend::cuda::kernels::codegen::gen_map(&spec))));
                    }
                }
                Space::Rows { cols, .. } => {
                    let vec = row_vec(k, cols);
                    let vector: Vec<bool> = k.inputs.iter().map(|i| !i.row && vec > 1).collect();
                    let threads = default_row_threads(cols, vec);
                    for (threads, vector) in [(threads, &vector), (threads.max(64) / 2, &scalar)] {
                        let (vpt, cover) = row_cover(cols, threads, vec);
                        let name = rows_name(k, threads, vpt, vec, cover, vector, &[]);
                        v.push(Sample::new((name.clone(), gen_fused_rows(k, &name, threads, vpt, vec, vector, &[], cover, RowMode::Kernel))));
                    }
                    if walks_in_chunks(cols) {
                        // Rows of a length no vector width divides: vectors, the last one taken
                        // element by element.
                        let vec = vector_width(k);
                        let vector: Vec<bool> = k.inputs.iter().map(|i| !i.row && i.columns.is_none()).collect();
                        let (vpt, _) = row_cover(cols, threads, vec);
                        let name = rows_name(k, threads, vpt, vec, Cover::LoopedTail, &vector, &[]);
                        v.push(Sample::new((name.clone(), gen_fused_rows(k, &name, threads, vpt, vec, &vector, &[], Cover::LoopedTail, RowMode::Kernel))));
                        // The same with every full input staged in shared memory.
                        let (threads, staged) = (STAGED_THREADS, vector.clone());
                        let (vpt, _) = row_cover(cols, threads, vec);
                        let name = rows_name(k, threads, vpt, vec, Cover::LoopedTail, &vector, &staged);
                        v.push(Sample::new((name.clone(), gen_fused_rows(k, &name, threads, vpt, vec, &vector, &staged, Cover::LoopedTail, RowMode::Kernel))));
                    }
                }
                Space::Mid { rows, inner, .. } => {
                    let (vec, tx) = mid_shape(k, rows, inner);
                    let vector: Vec<bool> = k.inputs.iter().map(|i| !i.row && vec > 1).collect();
                    for (wide, vector) in [(false, &vector), (true, &scalar)] {
                        let name = mid_name(k, tx, vec, wide, vector);
                        let src = match tx {
                            Some(tx) => gen_fused_cols(k, &name, wide, vec, tx, vector),
                            None => gen_fused_mid(k, &name, wide, vec, vector),
                        };
                        v.push(Sample::new((name, src)));
                    }
                }
            }
        }
        v
    }

    /// A six-layer GPT-2's training step with AdamW: its bias gradients' column sums carry
    /// their parameters' updates (new values and state written back), and no kernel, however
    /// merged, takes more operands than its launch holds.
    #[test]
    fn every_kernel_of_a_deep_training_step_fits_its_launch() {
        let kernels = gpt2_training_kernels(6);
        let words = LaunchArgs::default().w.len();
        for k in &kernels {
            let needed = match k.space {
                Space::Mid { .. } => MidWords::of(k).param(mid_params(k).1.len()),
                Space::Rows { .. } => RowWords { outputs: k.outputs.len() }.input(k.inputs.len())[0],
                Space::Flat { .. } => continue,
            };
            assert!(needed <= words, "{} needs {needed} argument words of {words}: {}", k.name, k.describe());
        }
    }

    /// A layer norm of a residual sum trained under autocast (GPT-2's blocks): the forward's
    /// row kernel stores the centred values the backward reads, not the normalised values too;
    /// the kernel of the weight's gradient computes those from the centred values it loads.
    #[test]
    fn a_layer_norms_forward_stores_no_normalised_values_for_its_backward() {
        let r = Tensor::randn(&[64, 48], DType::F32, &Device::Cpu).unwrap().requires_grad();
        let a = Tensor::randn(&[64, 48], DType::F32, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap().requires_grad();
        let w = Tensor::ones(&[48], DType::F32, &Device::Cpu).unwrap().requires_grad();
        let b = Tensor::zeros(&[48], DType::F32, &Device::Cpu).unwrap().requires_grad();
        let ks = optimised_kernels(&[r, a, w, b], |xs| {
            let sum = xs[0].add(&xs[1].to_dtype(DType::F32)?)?;
            let y = crate::amp::autocast(&Device::Cpu, DType::BF16, || F::layer_norm(&sum, &[48], Some(&xs[2]), Some(&xs[3]), 1e-5)?.to_dtype(DType::BF16)?.mul_scalar(2.0))?;
            y.to_dtype(DType::F32)?.sum_all()?.add(&sum.sum_all()?)?.backward()?;
            Ok(vec![xs[0].grad().unwrap(), xs[1].grad().unwrap(), xs[2].grad().unwrap(), xs[3].grad().unwrap()])
        });
        let forward = ks.iter().find(|k| matches!(k.space, Space::Rows { .. }) && k.ops.iter().any(|o| o.kind == KKind::Unary(crate::ops::UnaryOp::Rsqrt))).expect("the forward's row kernel");
        let products = forward.outputs.iter().filter(|(o, _)| !forward.ops[*o].row && matches!(forward.ops[*o].kind, KKind::Binary(crate::ops::BinaryOp::Mul, _))).count();
        assert_eq!(products, 0, "no normalised values among the outputs: {}", forward.describe());
    }

    /// GELU's derivative, an F32 function of the BF16 pre-activation, is computed by the
    /// backward's kernel (which then loads the pre-activation: half the bytes, and no store),
    /// not by the forward's kernel, which stores GELU's BF16 output alone.
    #[test]
    fn a_gelus_derivative_is_computed_by_the_backward_from_the_pre_activation() {
        let ks = gpt2_training_kernels(1);
        let gelu = KKind::Unary(crate::ops::UnaryOp::GeluTanh);
        let forward = ks.iter().find(|k| k.ops.iter().any(|o| o.kind == gelu)).expect("GELU's kernel");
        let stored: Vec<DType> = forward.outputs.iter().map(|(o, _)| forward.ops[*o].dtype).collect();
        assert_eq!(stored, [DType::BF16], "{}", forward.describe());
        let tanh = KKind::Unary(crate::ops::UnaryOp::Tanh);
        let backward = ks.iter().find(|k| k.ops.iter().any(|o| o.kind == tanh)).expect("the derivative's kernel");
        assert!(matches!(backward.space, Space::Mid { .. }) && backward.inputs.iter().all(|i| i.dtype != DType::F32 || i.row), "{}", backward.describe());
    }

    #[test]
    fn a_column_kernel_folds_every_statistic_and_stores_per_channel_values() {
        // Batch norm's statistics of a channels-last convolution's BF16 output (layout pass):
        // each is a mid kernel with an inner dim of 1, rendered as the column kernel: 16-byte
        // loads of 8 channels, a fold through shared memory, the chunks' partials.
        let x = Tensor::randn(&[8, 3, 6, 16], DType::F32, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap().to_memory_format(crate::MemoryFormat::ChannelsLast).unwrap();
        let w = Tensor::randn(&[16, 3, 3, 3], DType::F32, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap();
        let args = [x, w];
        let (rm, rv) = (Tensor::zeros(&[16], DType::F32, &Device::Cpu).unwrap(), Tensor::ones(&[16], DType::F32, &Device::Cpu).unwrap());
        let f = move |xs: &[Tensor]| Ok(vec![F::batch_norm(&F::conv2d(&xs[0], &xs[1], None, F::Conv2dArgs { padding: (1, 1), ..Default::default() })?, Some(&rm), Some(&rv), None, None, true, 0.1, 1e-5)?]);
        let g = crate::compile::layout::channels_last(&crate::compile::fuse::tests::graph_of(&args, f), &args);
        let g = crate::compile::recompute::recompute_cheap(&crate::compile::simplify::simplify(&g));
        let ks: Vec<FusedKernel> = crate::compile::fuse::schedule(&g).kernels.into_iter().filter(|k| matches!(k.space, Space::Mid { inner: 1, .. })).collect();
        assert_eq!(ks.len(), 2);
        for k in &ks {
            let vector: Vec<bool> = k.inputs.iter().map(|i| !i.row).collect();
            let src = gen_fused_cols(k, "cols", false, 8, 2, &vector);
            assert_eq!(src.matches('{').count(), src.matches('}').count(), "{src}");
            assert!(src.contains("#define TX 2") && src.contains("#define TY 128") && src.contains("struct __align__(16)"), "{src}");
            let reductions = mid_reductions(k).len();
            assert!(reductions >= 1);
            // Each reduction folded twice through shared memory (the block, then the partials).
            assert_eq!(src.matches("* red = (").count(), 2 * reductions, "{src}");
            assert!(k.outputs.iter().all(|(o, _)| k.ops[*o].row) && src.contains("out0[col] ="), "{src}");
            // ResNet's channel counts: at least `COL_TILES` tiles (their last blocks fold the
            // partials side by side) unless a tile would then read less than
            // `COL_TILE_BYTES` of a row.
            let sizes = || k.inputs.iter().filter(|i| !i.row).map(|i| i.dtype.size_in_bytes());
            let (widest, narrowest) = (sizes().max().unwrap(), sizes().min().unwrap());
            for m in [64, 256, 512, 2048] {
                let (vec, tx) = mid_shape(k, m, 1);
                let tx = tx.expect("a column kernel");
                assert_eq!(vec * widest, 16);
                assert!(tx <= 32 && (tx * vec == m.min(32 * vec) || tx * vec * narrowest >= COL_TILE_BYTES), "{m} columns: {tx} threads of {vec}");
                assert!(m.div_ceil(tx * vec) >= COL_TILES || tx * vec * narrowest < 2 * COL_TILE_BYTES || tx * vec >= m, "{m} columns: {tx} threads of {vec}");
            }
            if std::env::var("KILN_PRINT_SOURCE").is_ok() {
                println!("{src}");
            }
        }
    }

    /// A column mean's divisor is the row count: a launch word, not a literal in the source,
    /// so a graph traced at another size (dynamic shapes) launches the same compiled kernel.
    #[test]
    fn a_mid_kernels_constants_are_launch_words() {
        let code = |rows: usize| {
            let x = Tensor::randn(&[rows, 64], DType::F32, &Device::Cpu).unwrap();
            let f = |xs: &[Tensor]| {
                let y = xs[0].tanh()?.mul(&xs[0])?;
                Ok(vec![y.sub(&y.mean(&[0], true)?)?])
            };
            let mids: Vec<FusedKernel> = optimised_kernels(&[x], f).into_iter().filter(|k| matches!(k.space, Space::Mid { .. })).collect();
            assert_eq!(mids.len(), 1, "the column sum is a mid kernel");
            let k = &mids[0];
            let Space::Mid { rows: m, inner: q, .. } = k.space else { unreachable!("filtered") };
            let (vec, tx) = mid_shape(k, m, q);
            let vector: Vec<bool> = k.inputs.iter().map(|i| !i.row && vec > 1).collect();
            let name = mid_name(k, tx, vec, false, &vector);
            let src = match tx {
                Some(tx) => gen_fused_cols(k, &name, false, vec, tx, &vector),
                None => gen_fused_mid(k, &name, false, vec, &vector),
            };
            (name, src, mid_params(k).1)
        };
        let ((name_a, src_a, words_a), (name_b, src_b, words_b)) = (code(24), code(40));
        assert_eq!((name_a, &src_a), (name_b, &src_b));
        assert_eq!((words_a, words_b), (vec![24f64.to_bits()], vec![40f64.to_bits()]));
        assert!(src_a.contains("kparam_f(a.w["), "{src_a}");
    }

    #[test]
    fn sine_and_cosine_of_one_value_share_a_sincos() {
        let x = Tensor::randn(&[64], DType::F32, &Device::Cpu).unwrap();
        let ks = fused_kernels(&[x], |xs| Ok(vec![xs[0].sin()?.exp()?.add(&xs[0].cos()?.abs()?.log()?)?]));
        assert_eq!(ks.len(), 1);
        let body = flat_code(&ks[0]).body;
        assert_eq!(body.matches("sincosf(").count(), 1, "{body}");
        assert!(!body.contains("sinf(") && !body.contains("cosf(("), "{body}");
    }

    #[test]
    fn constants_are_launch_parameters() {
        // Two graphs that differ in a constant (a mean's divisor at two sizes) have one body.
        let codes: Vec<FlatCode> = [3usize, 5]
            .iter()
            .map(|&n| {
                let x = Tensor::randn(&[n, 4], DType::F32, &Device::Cpu).unwrap();
                let k = fused_kernels(&[x], |xs| Ok(vec![xs[0].mul_scalar(xs[0].shape()[0] as f64)?.add_scalar(0.5)?])).remove(0);
                flat_code(&k)
            })
            .collect();
        assert_eq!(codes[0].body, codes[1].body);
        assert_eq!(codes[0].params.len(), 2, "{:?}", codes[0]);
        assert_eq!(f64::from_bits(codes[1].params[0]), 5.0);
    }

    #[test]
    fn a_view_inside_a_kernel_does_not_change_its_code() {
        // exp -> tanh before a product, and after it (behind the reshape of the product's
        // [1, m, n] result): one code, one compiled kernel.
        let x = Tensor::randn(&[8, 6], DType::F32, &Device::Cpu).unwrap();
        let w = Tensor::randn(&[6, 6], DType::F32, &Device::Cpu).unwrap();
        let ks = fused_kernels(&[x, w], |xs| Ok(vec![xs[0].exp()?.tanh()?.matmul(&xs[1])?.exp()?.tanh()?]));
        assert_eq!(ks.len(), 2);
        assert!(ks.iter().any(|k| k.ops.iter().any(|o| matches!(o.kind, KKind::Same))), "the case this checks: a view fused into one of them");
        let (a, b) = (flat_code(&ks[0]), flat_code(&ks[1]));
        assert_eq!((&a.name, &a.body), (&b.name, &b.body));
    }

    #[test]
    fn softmax_keeps_exp_where_its_input_was() {
        // One register array per thread: exp(x - max) overwrites x, whose last reader is the
        // pass that computes it (as the eager softmax kernel does).
        let x = Tensor::zeros(&[4, 8192], DType::F32, &Device::Cpu).unwrap();
        let k = row_kernels(&x, |x: &Tensor| x.softmax(-1)).remove(0);
        let (threads, vpt) = crate::backend::cuda::kernels::row_shape(8192, 4);
        let src = gen_fused_rows(&k, "softmax_rows", threads, vpt, 4, &[true], &[], Cover::Exact, RowMode::Kernel);
        assert_eq!(src.matches("[VPT];").count(), 1, "{src}");
    }

    #[test]
    fn softmax_keeps_exp_and_input_only() {
        let x = Tensor::randn(&[4, 64], DType::F32, &Device::Cpu).unwrap();
        let ks = row_kernels(&x, |x| x.softmax(-1));
        assert_eq!(ks.len(), 1);
        let plan = RowPlan::new(&ks[0]);
        // max, sum and the output pass; exp is read by the last two, x by the first two.
        assert_eq!(plan.passes.len(), 3);
        let arrays: Vec<&KOp> = (0..ks[0].ops.len()).filter(|&i| plan.op_array[i]).map(|i| &ks[0].ops[i]).collect();
        assert!(matches!(arrays[..], [KOp { kind: KKind::Unary(crate::ops::UnaryOp::Exp), .. }]), "{arrays:?}");
        assert_eq!(plan.in_array, vec![true]);
        let src = gen_fused_rows(&ks[0], "k", 32, 2, 1, &[false], &[], Cover::Exact, RowMode::Kernel);
        assert!(!src.contains("__shared__ double"), "f32 statistics need no double:\n{src}");
    }

    #[test]
    fn long_rows_take_their_sum_of_exponentials_in_the_max_walk() {
        // Rows past `MAX_ROW`: softmax walks the row for its max and online sum, then once to
        // store; cross-entropy with its gradient (one kernel) takes the target's logit in the
        // same first walk.
        let cols = crate::kir::MAX_ROW + 64;
        let walks = |k: &FusedKernel| {
            let (threads, vec) = (default_row_threads(cols, 4), 4);
            let (vpt, cover) = row_cover(cols, threads, vec);
            assert!(matches!(cover, Cover::Looped | Cover::LoopedTail));
            gen_fused_rows(k, "k", threads, vpt, vec, &vec![false; k.inputs.len()], &[], cover, RowMode::Kernel).matches("for (int kbase").count()
        };
        let x = Tensor::randn(&[2, cols], DType::F32, &Device::Cpu).unwrap();
        let softmax = row_kernels(&x, |x| x.softmax(-1)).remove(0);
        assert_eq!(walks(&softmax), 2);
        let logits = Tensor::randn(&[2, cols], DType::F32, &Device::Cpu).unwrap().to_dtype(DType::BF16).unwrap().requires_grad();
        let classes = Tensor::from_vec(vec![3i64, 700], &[2], &Device::Cpu).unwrap();
        let ks = optimised_kernels(&[logits, classes], |xs| {
            let loss = F::cross_entropy(&xs[0].to_dtype(DType::F32)?, &xs[1])?;
            loss.backward()?;
            Ok(vec![loss, xs[0].grad().expect("a gradient")])
        });
        let rows: Vec<&FusedKernel> = ks.iter().filter(|k| matches!(k.space, Space::Rows { cols: c, .. } if c == cols)).collect();
        assert_eq!(rows.len(), 1, "loss and gradient in one row kernel");
        assert_eq!(rows[0].ops.iter().filter(|o| matches!(o.kind, KKind::Reduce(_))).count(), 3, "max, sum of exponentials, target's logit");
        assert_eq!(walks(rows[0]), 2);
        // The column indices compared with each row's class: read from memory by default, so
        // that their I32 sets the vector width (4); where `KILN_ROW_COLUMNS=1` has the schedule
        // mark them (`KInput::columns`) they are computed, and the BF16 logits and gradient set
        // it (8).
        let mut k = rows[0].clone();
        let index = k.inputs.iter().position(|i| !i.row && i.dtype == DType::I32).expect("the column indices");
        if crate::switches::row_columns_on() {
            assert_eq!(k.inputs[index].columns, Some((0.0, 1.0)));
        } else {
            assert_eq!((k.inputs[index].columns, vector_width(&k)), (None, 4));
            k.inputs[index].columns = Some((0.0, 1.0));
        }
        let k = &k;
        assert_eq!(vector_width(k), 8);
        let vector: Vec<bool> = k.inputs.iter().map(|i| !i.row && i.columns.is_none()).collect();
        let (vpt, cover) = row_cover(cols, default_row_threads(cols, 8), 8);
        let src = gen_fused_rows(k, "k", default_row_threads(cols, 8), vpt, 8, &vector, &[], cover, RowMode::Kernel);
        assert!(!src.contains(&format!("r{index} + k0")) && !src.contains(&format!("r{index}[")), "{src}");
        assert!(src.contains("(0ll + 1ll * (long long)(k0 + e))"), "{src}");
        // Staged, the logits come from memory in the first walk only: the second reads the
        // copy the first left in shared memory. (Each walk's chunk code is there twice: for
        // whole chunks, unchecked, and for the last.)
        let logits = k.inputs.iter().position(|i| !i.row && i.dtype == DType::BF16).expect("the logits");
        let staged: Vec<bool> = (0..k.inputs.len()).map(|j| j == logits).collect();
        let (vpt, _) = row_cover(cols, STAGED_THREADS, 8);
        let src = gen_fused_rows(k, "k", STAGED_THREADS, vpt, 8, &vector, &staged, Cover::LoopedTail, RowMode::Kernel);
        assert_eq!(src.matches(&format!("r{logits} + k0")).count(), 2 * 2, "one load from memory (a whole vector, or the row's last part):\n{src}");
        assert_eq!(src.matches(&format!("*(VI{logits}*)(ks{logits} + k0) = q{logits};")).count(), 2, "{src}");
        assert_eq!(src.matches(&format!("*(const VI{logits}*)(ks{logits} + k0)")).count(), 2, "{src}");
        assert!(staged_bytes(k, &staged, cols, 8) <= stage_budget(228 * 1024));
        let name = rows_name(k, STAGED_THREADS, vpt, 8, Cover::LoopedTail, &vector, &staged);
        assert_eq!(name.rsplit('_').next().and_then(|l| l.chars().nth(logits)), Some('m'), "{name}");
    }

    /// A product's prologue (a decode step's layer norm) asked to load every input first loads
    /// its weight and bias with its row, before the first statistic (one trip to memory after
    /// the product's wait); otherwise only the row comes first, as in a kernel of its own.
    #[test]
    fn a_prologue_loads_every_input_first_when_asked() {
        let x = Tensor::randn(&[1, 64], DType::F32, &Device::Cpu).unwrap();
        let (w, b) = (Tensor::randn(&[64], DType::F32, &Device::Cpu).unwrap(), Tensor::randn(&[64], DType::F32, &Device::Cpu).unwrap());
        let ks = row_kernels(&x, move |x| F::layer_norm(x, &[64], Some(&w), Some(&b), 1e-5));
        let k = &ks[0];
        assert_eq!(k.inputs.len(), 3);
        for loads_first in [true, false] {
            let (name, _, src) = prologue_code(k, 0, 256, 4, &vec![true; k.inputs.len()], loads_first);
            let first_sum = src.find("= kb_sum").expect("a block reduction");
            let early = (0..k.inputs.len()).filter(|j| src.find(&format!("ax{j}[g * VEC + e] = ")).is_some_and(|at| at < first_sum)).count();
            assert_eq!(early, if loads_first { 3 } else { 1 }, "loads first: {loads_first}\n{src}");
            assert_eq!(name.contains("_pro0f_k64"), loads_first, "{name}");
        }
    }

    #[test]
    fn layer_norm_recomputes_centered_values_and_streams_weights() {
        let x = Tensor::randn(&[4, 64], DType::F32, &Device::Cpu).unwrap();
        let (w, b) = (Tensor::randn(&[64], DType::F32, &Device::Cpu).unwrap(), Tensor::randn(&[64], DType::F32, &Device::Cpu).unwrap());
        let ks = row_kernels(&x, move |x| F::layer_norm(x, &[64], Some(&w), Some(&b), 1e-5));
        assert_eq!(ks.len(), 1);
        let k = &ks[0];
        let plan = RowPlan::new(k);
        assert!(plan.op_array.iter().all(|&a| !a), "no op is kept in registers");
        // Only x (read by both statistics passes and the output pass) is kept; weight and bias
        // are read in the output pass alone.
        let kept: Vec<bool> = k.inputs.iter().zip(&plan.in_array).filter(|(i, _)| !i.row).map(|(_, &a)| a).collect();
        assert_eq!(kept.iter().filter(|&&a| a).count(), 1, "{kept:?}");
        let last = plan.passes.last().unwrap();
        assert_eq!(last.inputs.len(), 3);
    }
}
