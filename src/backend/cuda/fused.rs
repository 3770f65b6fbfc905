//! The compiler's fused kernels on the GPU. A flat kernel becomes a body of `const`
//! temporaries for the eager map generator (one generator for eager and compiled code); a row
//! kernel is emitted here: one block per row, the row's values in registers, block reductions
//! by warp shuffles, every intermediate computed once and never stored.

use super::codegen::{convert, load, storage_type, CType, PRELUDE};
use super::kernels::{data_ptr, map_launch, MapOut};
use super::{device, CudaStorage, KArgs, KernelKey};
use crate::compile::fuse::{FusedKernel, KArg, KKind, KOp, Space};
use crate::layout::Layout;
use crate::ops::ReduceOp;
use crate::storage::BackendStorage;
use crate::{Device, Error, Result, Tensor};
use std::fmt::Write;

/// The type each op computes in and the C expression of its value, given its arguments'.
fn lower(op: &KOp, args: &[(CType, String)]) -> (CType, String) {
    let out = CType::of(op.dtype);
    let arg = |k: usize, t: CType| convert(args[k].0, t, &args[k].1);
    match &op.kind {
        KKind::Unary(u) => {
            let t = op.unary_type();
            (t, u.cuda(&format!("({})", arg(0, t)), t))
        }
        KKind::Binary(b, _) => {
            let (t, res) = op.binary_types();
            (res, b.cuda(&format!("({})", arg(0, t)), &format!("({})", arg(1, t)), t))
        }
        KKind::Where => (out, format!("({} ? {} : {})", arg(0, CType::Bool), arg(1, out), arg(2, out))),
        // A cast rounds to its dtype (an f16 in the middle of a kernel holds f16 values).
        KKind::Cast => (out, load(op.dtype, out, &super::codegen::store(op.dtype, args[0].0, &args[0].1))),
        KKind::Const(v) => (out, literal(*v, out)),
        KKind::Same | KKind::Broadcast => args[0].clone(),
        KKind::Reduce(_) => unreachable!("reductions are emitted by the row generator"),
    }
}

fn literal(v: f64, t: CType) -> String {
    match t {
        CType::F32 => format!("__int_as_float({})", (v as f32).to_bits() as i32),
        CType::F64 => format!("__longlong_as_double({}ll)", v.to_bits() as i64),
        CType::I64 => format!("{}ll", v as i64),
        CType::Bool => (if v != 0.0 { "true" } else { "false" }).into(),
    }
}

/// Runs a fused kernel on its inputs (real tensors, in `k.inputs` order); returns its outputs.
pub(crate) fn run(k: &FusedKernel, shape: &[usize], inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let Device::Cuda(ord) = k.device else { unreachable!("a CUDA kernel for a CPU graph") };
    let dev = device(ord)?;
    match k.space {
        Space::Flat { numel } => run_flat(&dev, k, shape, numel, inputs),
        Space::Rows { rows, cols } => run_rows(&dev, k, rows, cols, inputs),
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

fn new_outputs(dev: &std::sync::Arc<super::CudaDevice>, k: &FusedKernel, numel_of: impl Fn(&KOp) -> usize) -> Result<Vec<CudaStorage>> {
    k.outputs.iter().map(|(o, _)| CudaStorage::new(dev, k.ops[*o].dtype, numel_of(&k.ops[*o]))).collect()
}

fn wrap(outs: Vec<CudaStorage>, shapes: impl Fn(usize) -> Vec<usize>) -> Vec<Tensor> {
    outs.into_iter().enumerate().map(|(m, s)| Tensor::from_backend(BackendStorage::Cuda(s), &shapes(m))).collect()
}

fn run_flat(dev: &std::sync::Arc<super::CudaDevice>, k: &FusedKernel, shape: &[usize], numel: usize, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    let views = inputs.iter().map(|t| view_as(t, shape)).collect::<Result<Vec<_>>>()?;
    let mut body = String::new();
    let mut vals: Vec<(CType, String)> = vec![];
    for (i, op) in k.ops.iter().enumerate() {
        let args: Vec<(CType, String)> = op
            .args
            .iter()
            .map(|a| match a {
                KArg::In(j) => (CType::of(k.inputs[*j].dtype), format!("v{j}")),
                KArg::Op(j) => vals[*j].clone(),
            })
            .collect();
        let (t, e) = lower(op, &args);
        if matches!(op.kind, KKind::Same) {
            vals.push((t, e));
            continue;
        }
        let _ = writeln!(body, "    const {} t{i} = {e};", t.name());
        vals.push((t, format!("t{i}")));
    }
    let outs = new_outputs(dev, k, |_| numel)?;
    let specs = k.outputs.iter().zip(&outs).map(|((o, _), s)| MapOut { ptr: s.ptr(), dtype: k.ops[*o].dtype, result: vals[*o].0, expr: vals[*o].1.clone() }).collect();
    let ins: Vec<(&Tensor, CType)> = views.iter().map(|t| (t, CType::of(t.dtype()))).collect();
    map_launch(dev, &k.name, &ins, specs, &Layout::contiguous(shape), body, &[])?;
    Ok(wrap(outs, |_| shape.to_vec()))
}

/// Reduction in the row generator: (template op code, identity) for the value type.
fn reduce_parts(r: ReduceOp, t: CType) -> (u32, String) {
    let inf = |neg: bool| match t {
        CType::F32 => format!("{}__int_as_float(0x7f800000)", if neg { "-" } else { "" }),
        CType::F64 => format!("{}__longlong_as_double(0x7ff0000000000000ll)", if neg { "-" } else { "" }),
        _ => (if neg { "(-9223372036854775807ll - 1)" } else { "9223372036854775807ll" }).into(),
    };
    match r {
        ReduceOp::Sum => (0, format!("({})0", t.name())),
        ReduceOp::Prod => (1, format!("({})1", t.name())),
        ReduceOp::Max => (2, inf(true)),
        ReduceOp::Min => (3, inf(false)),
        _ => unreachable!("arg reductions are not fused"),
    }
}

const ROW_HELPERS: &str = r#"
#define KIDX(j) ((((j) / VEC) * (int)blockDim.x + (int)threadIdx.x) * VEC + ((j) % VEC))
template <typename T, int OP> __device__ __forceinline__ T kcomb(T a, T b) {
  if (OP == 0) return a + b;
  if (OP == 1) return a * b;
  if (OP == 2) return (a > b || a != a) ? a : b;
  return (a < b || a != a) ? a : b;
}
// Combines one value per thread across the block; every thread gets the result.
template <typename T, int OP> __device__ T kblockred(T v, T* red) {
  for (int o = 16; o > 0; o >>= 1) v = kcomb<T, OP>(v, __shfl_xor_sync(0xffffffffu, v, o));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  __syncthreads();
  if (lane == 0) red[warp] = v;
  __syncthreads();
  T r = red[0];
  for (int w = 1; w < nw; w++) r = kcomb<T, OP>(r, red[w]);
  return r;
}
"#;

/// Source of a row kernel for `vpt` values per thread, loaded `vec` at a time; `vector[k]`
/// says whether full input k is read with vector loads.
fn gen_rows(k: &FusedKernel, name: &str, vpt: usize, vec: usize, vector: &[bool]) -> String {
    let mut c = String::from(PRELUDE);
    let _ = writeln!(c, "#define VPT {vpt}\n#define VEC {vec}");
    c.push_str(ROW_HELPERS);
    let nout = k.outputs.len();
    for (j, inp) in k.inputs.iter().enumerate() {
        if !inp.row && vector[j] {
            let _ = writeln!(c, "struct __align__({}) VI{j} {{ {} v[VEC]; }};", vec * inp.dtype.size_in_bytes(), storage_type(inp.dtype));
        }
    }
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        let d = k.ops[*o].dtype;
        if !k.ops[*o].row {
            let _ = writeln!(c, "struct __align__({}) VO{m} {{ {} v[VEC]; }};", vec * d.size_in_bytes(), storage_type(d));
        }
    }
    let _ = writeln!(c, "extern \"C\" __global__ void __launch_bounds__(512) {name}(const KArgs a) {{");
    let _ = writeln!(c, "  const long long M = (long long)a.w[0]; const int K = (int)a.w[1];\n  __shared__ double kred[32];");
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        let _ = writeln!(c, "  {t}* __restrict__ out{m} = ({t}*)a.w[{}];", 2 + m, t = storage_type(k.ops[*o].dtype));
    }
    let base = 2 + nout;
    for (j, inp) in k.inputs.iter().enumerate() {
        let _ = writeln!(
            c,
            "  const {t}* __restrict__ p{j} = (const {t}*)a.w[{}]; const long long rs{j} = (long long)a.w[{}], cs{j} = (long long)a.w[{}];",
            base + 3 * j,
            base + 3 * j + 1,
            base + 3 * j + 2,
            t = storage_type(inp.dtype)
        );
    }
    let _ = writeln!(c, "  for (long long row = blockIdx.x; row < M; row += gridDim.x) {{");
    // Loads: a full input into a register array, a row input into one register.
    let mut vals: Vec<(CType, String, bool)> = vec![]; // (type, name, is an array)
    let mut ins: Vec<(CType, String, bool)> = vec![];
    for (j, inp) in k.inputs.iter().enumerate() {
        let t = CType::of(inp.dtype);
        if inp.row {
            let _ = writeln!(c, "    const {} x{j} = {};", t.name(), load(inp.dtype, t, &format!("p{j}[row * rs{j}]")));
            ins.push((t, format!("x{j}"), false));
        } else if vector[j] {
            let _ = writeln!(
                c,
                "    {tn} x{j}[VPT];\n    _Pragma(\"unroll\") for (int g = 0; g < VPT / VEC; g++) {{ const int k0 = KIDX(g * VEC);\n      if (k0 < K) {{ const VI{j} q = *(const VI{j}*)(p{j} + row * rs{j} + k0); _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) x{j}[g * VEC + e] = {}; }}\n      else {{ _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) x{j}[g * VEC + e] = 0; }} }}",
                load(inp.dtype, t, "q.v[e]"),
                tn = t.name()
            );
            ins.push((t, format!("x{j}"), true));
        } else {
            let _ = writeln!(
                c,
                "    {tn} x{j}[VPT];\n    _Pragma(\"unroll\") for (int jj = 0; jj < VPT; jj++) {{ const int kk = KIDX(jj); x{j}[jj] = kk < K ? {} : 0; }}",
                load(inp.dtype, t, &format!("p{j}[row * rs{j} + kk * cs{j}]")),
                tn = t.name()
            );
            ins.push((t, format!("x{j}"), true));
        }
    }
    // A full value read once is not kept in registers: its expression is inlined where it is
    // read (fewer live arrays, no spills); values read more often get an array.
    let mut uses = vec![0usize; k.ops.len()];
    for op in &k.ops {
        for a in &op.args {
            if let KArg::Op(j) = a {
                uses[*j] += 1;
            }
        }
    }
    for (o, _) in &k.outputs {
        uses[*o] += 1;
    }
    let at = |v: &(CType, String, bool)| if v.2 && !v.1.contains("[j]") && !v.1.starts_with('(') { format!("{}[j]", v.1) } else { v.1.clone() };
    for (i, op) in k.ops.iter().enumerate() {
        let args: Vec<&(CType, String, bool)> = op.args.iter().map(|a| match a {
            KArg::In(j) => &ins[*j],
            KArg::Op(j) => &vals[*j],
        }).collect();
        let t = CType::of(op.dtype);
        match &op.kind {
            KKind::Reduce(r) => {
                let (code, init) = reduce_parts(*r, t);
                let a = convert(args[0].0, t, &at(args[0]));
                let _ = writeln!(
                    c,
                    "    {tn} t{i};\n    {{ {tn} acc = {init};\n      _Pragma(\"unroll\") for (int j = 0; j < VPT; j++) if (KIDX(j) < K) acc = kcomb<{tn}, {code}>(acc, {a});\n      t{i} = kblockred<{tn}, {code}>(acc, ({tn}*)kred); }}",
                    tn = t.name()
                );
                vals.push((t, format!("t{i}"), false));
            }
            KKind::Same | KKind::Broadcast => vals.push(args[0].clone()),
            _ => {
                let full = args.iter().any(|a| a.2) && !op.row;
                let lowered: Vec<(CType, String)> = args.iter().map(|a| (a.0, at(a))).collect();
                let (rt, e) = lower(op, &lowered);
                if full && uses[i] <= 1 && !matches!(op.kind, KKind::Cast) {
                    vals.push((rt, format!("({e})"), true));
                } else if full {
                    let _ = writeln!(c, "    {tn} t{i}[VPT];\n    _Pragma(\"unroll\") for (int j = 0; j < VPT; j++) t{i}[j] = {e};", tn = rt.name());
                    vals.push((rt, format!("t{i}"), true));
                } else {
                    let _ = writeln!(c, "    const {} t{i} = {e};", rt.name());
                    vals.push((rt, format!("t{i}"), false));
                }
            }
        }
    }
    for (m, (o, _)) in k.outputs.iter().enumerate() {
        let d = k.ops[*o].dtype;
        let v = &vals[*o];
        if k.ops[*o].row {
            let _ = writeln!(c, "    if (threadIdx.x == 0) out{m}[row] = {};", super::codegen::store(d, v.0, &v.1));
        } else {
            let e = super::codegen::store(d, v.0, &at(v));
            let _ = writeln!(
                c,
                "    _Pragma(\"unroll\") for (int g = 0; g < VPT / VEC; g++) {{ const int k0 = KIDX(g * VEC); if (k0 < K) {{ VO{m} o;\n      _Pragma(\"unroll\") for (int e = 0; e < VEC; e++) {{ const int j = g * VEC + e; o.v[e] = {e}; }}\n      *(VO{m}*)(out{m} + row * (long long)K + k0) = o; }} }}"
            );
        }
    }
    c.push_str("  }\n}\n");
    c
}

fn run_rows(dev: &std::sync::Arc<super::CudaDevice>, k: &FusedKernel, rows: usize, cols: usize, inputs: &[Tensor]) -> Result<Vec<Tensor>> {
    // Full inputs as [rows, cols], row inputs as [rows]: (row stride, col stride) each.
    let mut views = vec![];
    for (inp, t) in k.inputs.iter().zip(inputs) {
        views.push(if inp.row { view_as(t, &[rows, 1])? } else { view_as(t, &[rows, cols])? });
    }
    let widest = k.inputs.iter().filter(|i| !i.row).map(|i| i.dtype.size_in_bytes()).chain(k.outputs.iter().filter(|(o, _)| !k.ops[*o].row).map(|(o, _)| k.ops[*o].dtype.size_in_bytes())).max().unwrap_or(4);
    let v = (16 / widest).max(1);
    let vec = if cols % v == 0 { v } else { 1 };
    let mut vector = vec![];
    for (inp, t) in k.inputs.iter().zip(&views) {
        let ok = !inp.row && vec > 1 && t.strides()[1] == 1 && t.strides()[0] % vec == 0 && data_ptr(t)? % (vec * inp.dtype.size_in_bytes()) as u64 == 0;
        vector.push(ok);
    }
    let threads = (cols.div_ceil(16)).next_power_of_two().clamp(32, 512);
    let vpt = cols.div_ceil(threads).next_power_of_two().max(vec);
    let vk: String = vector.iter().map(|&b| if b { 'v' } else { 's' }).collect();
    let name = format!("{}_r{vpt}x{vec}_{vk}", k.name);
    let src = gen_rows(k, &name, vpt, vec, &vector);
    let kern = dev.kernel(KernelKey::Named(src.clone()), || (name, src))?;
    let outs = new_outputs(dev, k, |op| if op.row { rows } else { rows * cols })?;
    let mut a = KArgs::default();
    a.w[0] = rows as u64;
    a.w[1] = cols as u64;
    for (m, s) in outs.iter().enumerate() {
        a.w[2 + m] = s.ptr();
    }
    let base = 2 + outs.len();
    if base + 3 * views.len() > a.w.len() {
        return Err(Error::arg("fused kernel", format!("{}: {} inputs and {} outputs exceed a launch's argument block", k.name, views.len(), outs.len())));
    }
    for (j, t) in views.iter().enumerate() {
        a.w[base + 3 * j] = data_ptr(t)?;
        a.w[base + 3 * j + 1] = t.strides()[0] as u64;
        a.w[base + 3 * j + 2] = t.strides()[1] as u64;
    }
    dev.launch(kern, (rows.min(1 << 20) as u32, 1, 1), (threads as u32, 1, 1), &a)?;
    Ok(wrap(outs, |m| if k.ops[k.outputs[m].0].row { vec![rows] } else { vec![rows, cols] }))
}
