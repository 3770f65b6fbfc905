//! C source for the compiler's fused kernels on the CPU (`jit` compiles and runs it). The ops'
//! expressions are the ones the CUDA kernels use (`backend::cexpr`), over a prelude that gives
//! them the CPU's semantics (`prelude.c`). A flat kernel is one loop over a run of elements; a
//! row kernel walks each row in the passes `kir::RowPlan` gives (one per reduction, then the
//! stores), folding reductions over the interpreter's interleaved lanes in its order
//! (`fused::fold`), so both give the same sums.

use crate::backend::cexpr::{arg, lower, value_names};
use crate::backend::cuda::kernels::codegen::{convert, load, storage_type, store};
use crate::dtype::CType;
use crate::kir::{FusedKernel, KKind, RowPass, RowPlan, Space, ValueRef};
use crate::ops::{ReduceOp, UnaryOp};
use std::fmt::Write;

pub(crate) const PRELUDE: &str = include_str!("prelude.c");

/// What every kernel's library exports: one library per source, so the source names no graph
/// position and kernels of the same code share it.
pub(crate) const SYMBOL: &str = "kiln_kernel";

/// How a kernel reads one input: element i at i, at 0 (one value for the whole run or row) or
/// at i times a stride (a row kernel's row values: row i at i times their stride).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Walk {
    Contiguous,
    Broadcast,
    Strided,
}

/// Whether every op of `k` has a C form here (else it runs in the interpreter): reductions
/// other than the arg ones, accumulating in F32, F64 or I64.
pub(crate) fn supported(k: &FusedKernel) -> bool {
    k.ops.iter().all(|op| match op.kind {
        KKind::Reduce(r) => !r.is_arg() && matches!(CType::of(op.dtype), CType::F32 | CType::F64 | CType::I64),
        _ => true,
    })
}

/// Whether `k` computes F32 sin or cos (whose fast form covers |x| <= 8192: the kernel is
/// emitted twice, and runs again exactly where a value is beyond).
fn has_trig(k: &FusedKernel) -> bool {
    k.ops.iter().any(|o| matches!(o.kind, KKind::Unary(UnaryOp::Sin | UnaryOp::Cos)) && o.unary_type() == CType::F32)
}

/// `const T t{i} = ...;` for op i (nothing for views and broadcasts), given the kernel's value
/// names (`cexpr::value_names`).
fn define(k: &FusedKernel, i: usize, ins: &[(CType, String)], vals: &[(CType, String)]) -> String {
    let op = &k.ops[i];
    if let KKind::Same | KKind::Broadcast = op.kind {
        return String::new();
    }
    let args: Vec<(CType, String)> = op.args.iter().map(|a| arg(a, ins, vals)).collect();
    let (t, e) = lower(op, &args);
    format!("const {} t{i} = {e};", t.name())
}

/// The full source of kernel `k` for inputs read as `walks`, exporting `SYMBOL`.
pub(crate) fn source(k: &FusedKernel, walks: &[Walk]) -> String {
    let name = SYMBOL;
    let mut c = String::from(PRELUDE);
    let body = match k.space {
        Space::Flat { .. } => flat_body(k, walks),
        Space::Rows { .. } => rows_body(k, walks),
        Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
    };
    let args = match k.space {
        Space::Flat { .. } => "long long n, const void* const* in, const long long* st, void* const* out, void* scratch",
        Space::Rows { .. } => "long long r0, long long r1, long long K, const void* const* in, const long long* st, void* const* out, void* scratch",
        Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
    };
    let call = match k.space {
        Space::Flat { .. } => "n, in, st, out, scratch",
        Space::Rows { .. } => "r0, r1, K, in, st, out, scratch",
        Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
    };
    if has_trig(k) {
        let _ = writeln!(c, "#define sinf(x) ksinf_fast(x, &kbad)\n#define cosf(x) kcosf_fast(x, &kbad)");
        let _ = writeln!(c, "static int fast({args}) {{\n  int kbad = 0;\n{body}  return kbad;\n}}");
        let _ = writeln!(c, "#undef sinf\n#undef cosf\n#define sinf(x) ksinf_exact(x)\n#define cosf(x) kcosf_exact(x)");
        let _ = writeln!(c, "static int exact({args}) {{\n  int kbad = 0;\n{body}  return kbad;\n}}");
        let _ = writeln!(c, "int {name}({args}) {{\n  if (fast({call})) exact({call});\n  return 0;\n}}");
    } else {
        let _ = writeln!(c, "int {name}({args}) {{\n  int kbad = 0;\n{body}  return kbad;\n}}");
    }
    c
}

/// Element i of input j, read as its walk says.
fn flat_load(k: &FusedKernel, j: usize, w: Walk) -> String {
    let inp = &k.inputs[j];
    let at = match w {
        Walk::Contiguous => format!("p{j}[i]"),
        Walk::Broadcast => format!("p{j}[0]"),
        Walk::Strided => format!("p{j}[i * s{j}]"),
    };
    load(inp.dtype, CType::of(inp.dtype), &at)
}

fn pointers(k: &FusedKernel, c: &mut String) {
    for (j, inp) in k.inputs.iter().enumerate() {
        let _ = writeln!(c, "  const {t}* p{j} = (const {t}*)in[{j}]; const long long s{j} = st[{j}]; (void)s{j};", t = storage_type(inp.dtype));
    }
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        let _ = writeln!(c, "  {t}* o{m} = ({t}*)out[{m}];", t = storage_type(k.ops[*o].dtype));
    }
    c.push_str("  (void)scratch;\n");
}

fn flat_body(k: &FusedKernel, walks: &[Walk]) -> String {
    let (ins, vals) = value_names(k);
    let mut c = String::new();
    pointers(k, &mut c);
    c.push_str("  for (long long i = 0; i < n; i++) {\n");
    for (j, inp) in k.inputs.iter().enumerate() {
        let _ = writeln!(c, "    const {} x{j} = {};", CType::of(inp.dtype).name(), flat_load(k, j, walks[j]));
    }
    for i in 0..k.ops.len() {
        let d = define(k, i, &ins, &vals);
        if !d.is_empty() {
            let _ = writeln!(c, "    {d}");
        }
    }
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        let v = &vals[*o];
        let s = store(k.ops[*o].dtype, v.0, &v.1);
        // A one-element output beside the flat space: stored by the run that starts it.
        if k.single[m] {
            let _ = writeln!(c, "    if (i == 0) o{m}[0] = {s};");
        } else {
            let _ = writeln!(c, "    o{m}[i] = {s};");
        }
    }
    c.push_str("  }\n");
    c
}

/// The accumulator type of a reduction computing in `t` (`ReduceOp::acc_type`).
fn acc_type(r: ReduceOp, t: CType) -> CType {
    r.acc_type(t.dtype())
}

fn combine(r: ReduceOp, a: &str, b: &str) -> String {
    match r {
        ReduceOp::Sum => format!("({a} + {b})"),
        ReduceOp::Prod => format!("({a} * {b})"),
        ReduceOp::Max => format!("KMAX({a}, {b})"),
        ReduceOp::Min => format!("KMIN({a}, {b})"),
        _ => unreachable!("arg reductions stay in the interpreter (supported)"),
    }
}

/// The prelude's vector of eight lanes of `t`, and its functions' suffix.
fn lane_vector(t: CType) -> (&'static str, &'static str) {
    match t {
        CType::F32 => ("kv8f", "f"),
        CType::F64 => ("kv8d", "d"),
        _ => ("kv8l", "i"),
    }
}

/// Folds eight values `v` into eight lanes `acc`, lane by lane (both vectors).
fn lanes(r: ReduceOp, t: CType, acc: &str, v: &str) -> String {
    let suffix = lane_vector(t).1;
    match r {
        ReduceOp::Max => format!("{acc} = kmax8_{suffix}({acc}, {v});"),
        ReduceOp::Min => format!("{acc} = kmin8_{suffix}({acc}, {v});"),
        _ => format!("{acc} = {};", combine(r, acc, v)),
    }
}

/// Values a row reduction computes per block (in their own type, converted to the accumulator's
/// as they fold into its lanes): a multiple of `FOLD_LANES`; a block of F64 is 2 KiB of stack.
const BLOCK: usize = 256;

/// The interpreter's lanes (`fused::FOLD_LANES`) as vectors of eight.
const LANE_VECTORS: usize = super::fused::FOLD_LANES / 8;

/// Bytes a row kernel writes to its full outputs from which it streams them past the caches
/// (`kstream`): half the last-level cache, so what the next kernel reads stays there below it
/// and a large output does not evict everything else above it. Regular stores into a cached
/// buffer beat streaming ones to memory as long as it fits
/// (`bench/results/compare-cpu-2026-12-05.txt`).
fn stream_bytes() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| crate::switches::cpu_stream_bytes().unwrap_or_else(|| last_level_cache_bytes().map_or(8 << 20, |b| b / 2)))
}

/// The size of the largest cache of CPU 0 as Linux reports it (`/sys/.../cache/index*/size`,
/// such as `266240K`); None elsewhere.
fn last_level_cache_bytes() -> Option<usize> {
    let dirs = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dirs.filter_map(|d| {
        let size = std::fs::read_to_string(d.ok()?.path().join("size")).ok()?;
        let size = size.trim();
        let (digits, scale) = match size.as_bytes().last()? {
            b'K' => (&size[..size.len() - 1], 1 << 10),
            b'M' => (&size[..size.len() - 1], 1 << 20),
            b'G' => (&size[..size.len() - 1], 1 << 30),
            _ => (size, 1),
        };
        digits.parse::<usize>().ok()?.checked_mul(scale)
    })
    .max()
}

/// Whether row kernel `k` writes its full outputs with streaming stores: large outputs, in rows
/// long enough that the stores stay whole cache lines.
fn streams(k: &FusedKernel) -> bool {
    let Space::Rows { rows, cols } = k.space else { return false };
    let row_bytes: usize = k.full_outputs().iter().map(|&m| cols * k.ops[k.outputs[m].0].dtype.size_in_bytes()).sum();
    row_bytes >= 1024 && rows * row_bytes >= stream_bytes()
}

/// Statements fetching this row's columns `[{from}, {from} + {n})` of the full outputs `full`
/// for writing: the output pass's stores then find their lines owned instead of each waiting
/// for one.
fn prefetch_outputs(k: &FusedKernel, full: &[usize], from: &str, n: &str) -> String {
    let mut s = String::new();
    for &m in full {
        let step = 64 / k.ops[k.outputs[m].0].dtype.size_in_bytes();
        let _ = writeln!(s, "      for (long long e = 0; e < {n}; e += {step}) __builtin_prefetch(o{m} + row * K + {from} + e, 1);");
    }
    s
}

/// Statements prefetching the next row's columns `[{from}, {from} + {n})` of every full input
/// that more than one pass reads: the first pass of the next row then finds them in the cache
/// instead of waiting on memory with little work to hide it (a max or a mean alone).
fn prefetch_next_row(k: &FusedKernel, walks: &[Walk], plan: &RowPlan, from: &str, n: &str) -> String {
    let mut s = String::new();
    for (j, inp) in k.inputs.iter().enumerate() {
        let passes = plan.passes.iter().filter(|p| p.inputs.contains(&j)).count();
        if inp.row || walks[j] == Walk::Broadcast || passes < 2 {
            continue;
        }
        let step = 64 / inp.dtype.size_in_bytes();
        let _ = writeln!(s, "      for (long long e = 0; e < {n}; e += {step}) __builtin_prefetch(r{j} + s{j} + {from} + e);");
    }
    s
}

fn rows_body(k: &FusedKernel, walks: &[Walk]) -> String {
    let plan = RowPlan::new(k);
    let (ins, vals) = value_names(k);
    let stream = streams(k);
    let mut c = String::new();
    pointers(k, &mut c);
    // Expensive values read by several passes: one row's worth each, in the scratch buffer
    // (the caller gives 8 bytes per column per array).
    let arrays: Vec<usize> = (0..k.ops.len()).filter(|&i| plan.op_array[i]).collect();
    for (a, &i) in arrays.iter().enumerate() {
        // `restrict`: scratch aliases nothing, so the passes' loops need no overlap checks.
        let _ = writeln!(c, "  {t}* restrict at{i} = ({t}*)((char*)scratch + (long long){a} * K * 8);", t = vals[i].0.name());
    }
    let full = k.full_outputs();
    if stream {
        // Each full output's row is finished in scratch, then streamed out.
        for (a, &m) in full.iter().enumerate() {
            let _ = writeln!(c, "  {t}* restrict ob{m} = ({t}*)((char*)scratch + (long long){} * K * 8);", arrays.len() + a, t = storage_type(k.ops[k.outputs[m].0].dtype));
        }
    }
    c.push_str("  for (long long row = r0; row < r1; row++) {\n");
    for (j, inp) in k.inputs.iter().enumerate() {
        let t = CType::of(inp.dtype);
        if inp.row {
            let _ = writeln!(c, "    const {} x{j} = {};", t.name(), load(inp.dtype, t, &format!("p{j}[row * s{j}]")));
        } else {
            let _ = writeln!(c, "    const {s}* r{j} = p{j} + row * s{j};", s = storage_type(inp.dtype));
        }
    }
    let mut filled = vec![false; k.ops.len()];
    // The statements computing element q of what pass `p` needs.
    let element = |p: &RowPass, filled: &[bool]| -> String {
        let mut s = String::new();
        for &j in &p.inputs {
            let inp = &k.inputs[j];
            let at = if walks[j] == Walk::Broadcast { format!("r{j}[0]") } else { format!("r{j}[q]") };
            let _ = writeln!(s, "        const {} x{j} = {};", CType::of(inp.dtype).name(), load(inp.dtype, CType::of(inp.dtype), &at));
        }
        for &i in &p.ops {
            if let KKind::Same | KKind::Broadcast = k.ops[i].kind {
                continue;
            }
            if filled[i] {
                let _ = writeln!(s, "        const {} t{i} = at{i}[q];", vals[i].0.name());
            } else {
                let _ = writeln!(s, "        {}", define(k, i, &ins, &vals));
                if plan.op_array[i] {
                    let _ = writeln!(s, "        at{i}[q] = t{i};");
                }
            }
        }
        s
    };
    let reduces: Vec<usize> = (0..k.ops.len()).filter(|&i| matches!(k.ops[i].kind, KKind::Reduce(_))).collect();
    // Outputs kept in the caches are fetched for writing in the first reduction pass that
    // computes an expensive op (softmax's `exp`), whose arithmetic hides the fetches; a layer
    // norm's passes are too light for that (fetching in its variance pass made it slower).
    let fetch_outputs_in = if stream { None } else { plan.passes[..reduces.len()].iter().position(|p| p.ops.iter().any(|&o| crate::kir::expensive(&k.ops[o]))) };
    for (i, op) in k.ops.iter().enumerate() {
        match op.kind {
            KKind::Reduce(r) => {
                let pass = reduces.iter().position(|&x| x == i).expect("a reduction");
                let p = &plan.passes[pass];
                let t = CType::of(op.dtype);
                let at = acc_type(r, t);
                let v = arg(&op.args[0], &ins, &vals);
                let v = convert(v.0, t, &v.1);
                let id = r.cuda_identity(at);
                let vt = lane_vector(at).0;
                let lanes_init = vec![format!("{{{id}, {id}, {id}, {id}, {id}, {id}, {id}, {id}}}"); LANE_VECTORS].join(", ");
                let _ = writeln!(c, "    {vt} l{i}[{LANE_VECTORS}] = {{{lanes_init}}};\n    long long c{i} = 0;");
                // A block of values computed by a plain loop (which the compiler vectorises at
                // its widest), then folded into the interpreter's lanes, eight at a time into
                // each vector of them (independent chains): the interpreter's order, so the
                // same bits.
                let w = super::fused::FOLD_LANES;
                // Values already in memory one column apart (a row of an input, or an array
                // this pass or an earlier one fills) fold from there, not from a copy.
                let direct = match op.args[0] {
                    ValueRef::In(j) if !k.inputs[j].row && walks[j] != Walk::Broadcast && storage_type(k.inputs[j].dtype) == t.name() => Some(format!("r{j}[c{i} + ")),
                    ValueRef::Op(o) if plan.op_array[o] && vals[o].0 == t => Some(format!("at{o}[c{i} + ")),
                    _ => None,
                };
                let _ = writeln!(c, "    while (c{i} + {w} <= K) {{\n      long long n{i} = (K - c{i}) & ~{}LL;\n      if (n{i} > {BLOCK}) n{i} = {BLOCK};", w - 1);
                if direct.is_none() {
                    let _ = writeln!(c, "      {tn} b{i}[{BLOCK}] __attribute__((aligned(64)));", tn = t.name());
                }
                if Some(pass) == fetch_outputs_in {
                    c.push_str(&prefetch_outputs(k, &full, &format!("c{i}"), &format!("n{i}")));
                }
                if pass == 1 {
                    c.push_str(&prefetch_next_row(k, walks, &plan, &format!("c{i}"), &format!("n{i}")));
                }
                let _ = writeln!(c, "      for (long long e = 0; e < n{i}; e++) {{\n        const long long q = c{i} + e;");
                c.push_str(&element(p, &filled));
                if direct.is_none() {
                    let _ = writeln!(c, "        b{i}[e] = {v};");
                }
                c.push_str("      }\n");
                let folded = format!("{}e + 8 * u + j]", direct.unwrap_or_else(|| format!("b{i}[")));
                let _ = writeln!(c, "      for (long long e = 0; e < n{i}; e += {w}) for (int u = 0; u < {LANE_VECTORS}; u++) {{\n        {vt} v{i};\n        for (int j = 0; j < 8; j++) v{i}[j] = {};\n        {}\n      }}\n      c{i} += n{i};\n    }}", convert(t, at, &folded), lanes(r, at, &format!("l{i}[u]"), &format!("v{i}")));
                let _ = writeln!(c, "    {a} a{i} = {id};\n    for (int e = 0; e < {w}; e++) a{i} = {};", combine(r, &format!("a{i}"), &format!("l{i}[e >> 3][e & 7]")), a = at.name());
                let _ = writeln!(c, "    for (; c{i} < K; c{i}++) {{\n      {{\n        const long long q = c{i};");
                c.push_str(&element(p, &filled));
                let _ = writeln!(c, "        a{i} = {};\n      }}\n    }}", combine(r, &format!("a{i}"), &convert(t, at, &v)));
                let _ = writeln!(c, "    const {} t{i} = {};", t.name(), convert(at, t, &format!("a{i}")));
                for &o in &p.ops {
                    filled[o] |= plan.op_array[o];
                }
            }
            KKind::Same | KKind::Broadcast => {}
            _ if !plan.elem[i] => {
                let _ = writeln!(c, "    {}", define(k, i, &ins, &vals));
            }
            _ => {}
        }
    }
    if !full.is_empty() {
        let p = plan.passes.last().expect("an output pass");
        // With one reduction, the output pass is the second and prefetches the next row, by
        // blocks (a prefetch per element would keep the loop from vectorising).
        let fetch = if reduces.len() == 1 { prefetch_next_row(k, walks, &plan, "c", "n") } else { String::new() };
        if !fetch.is_empty() {
            let _ = writeln!(c, "    for (long long c = 0; c < K; c += {BLOCK}) {{\n      const long long n = K - c < {BLOCK} ? K - c : {BLOCK};");
            c.push_str(&fetch);
            c.push_str("    for (long long q = c; q < c + n; q++) {\n      {\n");
        } else {
            c.push_str("    for (long long q = 0; q < K; q++) {\n      {\n");
        }
        c.push_str(&element(p, &filled));
        for &m in &full {
            let o = k.outputs[m].0;
            let to = if stream { format!("ob{m}[q]") } else { format!("o{m}[row * K + q]") };
            let _ = writeln!(c, "        {to} = {};", store(k.ops[o].dtype, vals[o].0, &vals[o].1));
        }
        c.push_str("      }\n    }\n");
        if !fetch.is_empty() {
            c.push_str("    }\n");
        }
        if stream {
            for &m in &full {
                let _ = writeln!(c, "    kstream(o{m} + row * K, ob{m}, K * (long long)sizeof(*ob{m}));");
            }
        }
    }
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        if k.ops[*o].row {
            let _ = writeln!(c, "    o{m}[row] = {};", store(k.ops[*o].dtype, vals[*o].0, &vals[*o].1));
        }
    }
    c.push_str("  }\n");
    if stream {
        c.push_str("  kfence();\n");
    }
    c
}

/// Bytes of scratch a row kernel's run needs per column: 8 per kept array, and per full output
/// when it streams.
pub(crate) fn scratch_per_col(k: &FusedKernel) -> usize {
    match k.space {
        Space::Rows { .. } => {
            let outs = if streams(k) { k.full_outputs().len() } else { 0 };
            8 * (RowPlan::new(k).op_array.iter().filter(|&&a| a).count() + outs)
        }
        Space::Flat { .. } => 0,
        Space::Mid { .. } => unreachable!("mid kernels are scheduled on CUDA only"),
    }
}
