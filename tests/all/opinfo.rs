//! kiln against PyTorch's own OpInfo samples: tests/fixtures/make_opinfo.py walks PyTorch's
//! `op_db` for every op kiln has and stores its sample and reference inputs (inf and nan among
//! them) with PyTorch's outputs and the gradients of sum(out * cot). Each case runs here on the
//! test device through one dispatch `match`; outputs and gradients must agree within
//! `torch.testing.assert_close`'s default tolerances, and a table counts, per op, the cases that
//! pass, fail and that kiln cannot express (with the reasons).

use crate::common::dev;
use kiln::nn::functional::{self as F, Conv2dArgs, CrossEntropyOptions, Reduction, SdpaOptions};
use kiln::{DType, Device, Scalar, Tensor};
use safetensors::tensor::{Dtype, SafeTensors};
use serde_json::Value;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::panic::{catch_unwind, AssertUnwindSafe};

// The test binary may run where the source tree is absent, so the fixture is part of it.
static FIXTURE: &[u8] = include_bytes!("../fixtures/opinfo.safetensors");

/// `torch.testing.assert_close`'s default (rtol, atol) per dtype; integers and bools exact.
/// NaN equals NaN (equal_nan=True); infinities must match exactly.
fn tolerance(dt: DType) -> (f64, f64) {
    match dt {
        DType::F32 => (1.3e-6, 1e-5),
        DType::F64 => (1e-7, 1e-7),
        DType::F16 => (1e-3, 1e-5),
        DType::BF16 => (1.6e-2, 1e-5),
        _ => (0.0, 0.0),
    }
}

/// An argument of a case, as the fixture's JSON encodes it.
#[derive(Clone, Debug)]
enum Arg {
    T(usize),
    I(i64),
    F(f64),
    B(bool),
    S(String),
    L(Vec<Arg>),
    Dtype(String),
    None,
}

fn parse_arg(v: &Value) -> Arg {
    match v {
        Value::Null => Arg::None,
        Value::Bool(b) => Arg::B(*b),
        Value::Number(n) => match n.as_i64() {
            Some(i) if !n.is_f64() => Arg::I(i),
            _ => Arg::F(n.as_f64().unwrap()),
        },
        Value::String(s) => Arg::S(s.clone()),
        Value::Array(a) => Arg::L(a.iter().map(parse_arg).collect()),
        Value::Object(o) => {
            if let Some(t) = o.get("t") {
                Arg::T(t.as_u64().unwrap() as usize)
            } else if let Some(f) = o.get("f") {
                Arg::F(match f.as_str().unwrap() {
                    "inf" => f64::INFINITY,
                    "-inf" => f64::NEG_INFINITY,
                    _ => f64::NAN,
                })
            } else {
                Arg::Dtype(o["dtype"].as_str().unwrap().to_string())
            }
        }
    }
}

fn dtype_of(s: &str) -> DType {
    match s {
        "f32" => DType::F32,
        "f64" => DType::F64,
        "f16" => DType::F16,
        "bf16" => DType::BF16,
        "i64" => DType::I64,
        "i32" => DType::I32,
        "u8" => DType::U8,
        "bool" => DType::Bool,
        _ => panic!("fixture dtype {s}"),
    }
}

struct TensorSpec {
    dt: DType,
    shape: Vec<usize>,
    /// 1: PyTorch's gradient is stored; 0: none needed; -1: PyTorch gives none (unused input).
    grad: i64,
    /// The sample's strides where it was not contiguous.
    strides: Option<Vec<usize>>,
}

struct OutSpec {
    cot: bool,
}

struct Case {
    id: usize,
    op: String,
    dt: String,
    src: String,
    inp: Arg,
    args: Vec<Arg>,
    kw: BTreeMap<String, Arg>,
    tens: Vec<TensorSpec>,
    outs: Vec<OutSpec>,
    note: Option<String>,
}

impl Case {
    fn parse(id: usize, v: &Value) -> Case {
        let usizes = |v: &Value| v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as usize).collect::<Vec<_>>();
        Case {
            id,
            op: v["op"].as_str().unwrap().to_string(),
            dt: v["dt"].as_str().unwrap().to_string(),
            src: v["src"].as_str().unwrap().to_string(),
            inp: parse_arg(&v["inp"]),
            args: v["args"].as_array().unwrap().iter().map(parse_arg).collect(),
            kw: v["kw"].as_object().unwrap().iter().map(|(k, a)| (k.clone(), parse_arg(a))).collect(),
            tens: v["tens"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| TensorSpec {
                    dt: dtype_of(t["dt"].as_str().unwrap()),
                    shape: usizes(&t["shape"]),
                    grad: t.get("grad").and_then(Value::as_i64).unwrap_or(0),
                    strides: t.get("str").map(usizes),
                })
                .collect(),
            outs: v["outs"].as_array().unwrap().iter().map(|o| OutSpec { cot: o.get("cot").and_then(Value::as_bool).unwrap_or(false) }).collect(),
            note: v.get("note").and_then(Value::as_str).map(String::from),
        }
    }

    /// The call in PyTorch's terms, e.g. `f32[5,10]nc, f32[10], alpha=2`.
    fn describe(&self) -> String {
        fn arg(c: &Case, a: &Arg) -> String {
            match a {
                Arg::T(k) => {
                    let t = &c.tens[*k];
                    let dims: Vec<String> = t.shape.iter().map(|d| d.to_string()).collect();
                    format!("{:?}[{}]{}", t.dt, dims.join(","), if t.strides.is_some() { "nc" } else { "" })
                }
                Arg::I(i) => i.to_string(),
                Arg::F(f) => format!("{f:?}"),
                Arg::B(b) => (if *b { "True" } else { "False" }).to_string(),
                Arg::S(s) => format!("'{s}'"),
                Arg::L(l) => format!("({})", l.iter().map(|x| arg(c, x)).collect::<Vec<_>>().join(",")),
                Arg::Dtype(d) => d.clone(),
                Arg::None => "None".to_string(),
            }
        }
        let mut parts = vec![arg(self, &self.inp)];
        parts.extend(self.args.iter().map(|a| arg(self, a)));
        parts.extend(self.kw.iter().map(|(k, a)| format!("{k}={}", arg(self, a))));
        parts.join(", ")
    }
}

/// The fixture: tensors by name, the cases, and the samples kiln cannot express.
struct Fixture<'a> {
    st: SafeTensors<'a>,
    cases: Vec<Case>,
    /// (op, dtype, reason, count) of the samples kiln cannot express.
    ne: Vec<(String, String, String, usize)>,
    /// Per op: duplicates, samples too large to store, samples beyond the cap.
    dropped: BTreeMap<String, [usize; 3]>,
    no_nc: Vec<String>,
}

impl<'a> Fixture<'a> {
    fn load(bytes: &'a [u8]) -> Fixture<'a> {
        let (_, meta) = SafeTensors::read_metadata(bytes).unwrap();
        let meta = meta.metadata().clone().expect("fixture metadata");
        let all: Value = serde_json::from_str(&meta["opinfo"]).unwrap();
        let json = |k: &str| -> Value { all[k].clone() };
        let cases = json("cases").as_array().unwrap().iter().enumerate().map(|(i, v)| Case::parse(i, v)).collect();
        let ne = json("ne")
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["op"].as_str().unwrap().into(), e["dt"].as_str().unwrap().into(), e["why"].as_str().unwrap().into(), e["n"].as_u64().unwrap() as usize))
            .collect();
        let mut dropped = BTreeMap::new();
        for (op, per_dt) in json("dropped").as_object().unwrap() {
            let d: &mut [usize; 3] = dropped.entry(op.clone()).or_default();
            for counts in per_dt.as_object().unwrap().values() {
                for (i, k) in ["dup", "large", "cap"].iter().enumerate() {
                    d[i] += counts[*k].as_u64().unwrap() as usize;
                }
            }
        }
        let no_nc = json("no_nc").as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect();
        Fixture { st: SafeTensors::deserialize(bytes).unwrap(), cases, ne, dropped, no_nc }
    }

    /// Tensor `c{id}.{name}` on the CPU, or None where the fixture has none.
    fn tensor(&self, id: usize, name: &str) -> Option<Tensor> {
        let v = self.st.tensor(&format!("c{id:05}.{name}")).ok()?;
        let (d, shape, cpu) = (v.data(), v.shape(), &Device::Cpu);
        fn le<const N: usize, T>(d: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
            d.chunks_exact(N).map(|b| f(b.try_into().unwrap())).collect()
        }
        Some(
            match v.dtype() {
                Dtype::F32 => Tensor::from_vec(le(d, f32::from_le_bytes), shape, cpu),
                Dtype::F64 => Tensor::from_vec(le(d, f64::from_le_bytes), shape, cpu),
                Dtype::F16 => Tensor::from_vec(le(d, |b| half::f16::from_bits(u16::from_le_bytes(b))), shape, cpu),
                Dtype::BF16 => Tensor::from_vec(le(d, |b| half::bf16::from_bits(u16::from_le_bytes(b))), shape, cpu),
                Dtype::I64 => Tensor::from_vec(le(d, i64::from_le_bytes), shape, cpu),
                Dtype::I32 => Tensor::from_vec(le(d, i32::from_le_bytes), shape, cpu),
                Dtype::U8 => Tensor::from_vec(d.to_vec(), shape, cpu),
                Dtype::BOOL => Tensor::from_vec(d.iter().map(|&b| b != 0).collect::<Vec<bool>>(), shape, cpu),
                other => panic!("fixture dtype {other:?}"),
            }
            .unwrap(),
        )
    }
}

/// `t` (contiguous) laid out with `strides`, as PyTorch's sample was: a contiguous buffer in
/// the strides' order, every k-th element of it along dims whose stride skips elements, and
/// stride-0 dims expanded. make_opinfo.py's `rebuildable` admits exactly these layouts.
fn strided(t: &Tensor, strides: &[usize]) -> kiln::Result<Tensor> {
    let shape = t.shape().to_vec();
    let n = shape.len();
    let mut mem: Vec<usize> = (0..n).filter(|&d| shape[d] > 1 && strides[d] > 0).collect();
    mem.sort_by_key(|&d| std::cmp::Reverse(strides[d]));
    let mut step = vec![1usize; n];
    let mut inner = 1;
    for &d in mem.iter().rev() {
        step[d] = strides[d] / inner;
        inner *= shape[d] * step[d];
    }
    // Memory order: the strided dims outermost first, then size-1 and expanded dims.
    let order: Vec<usize> = mem.iter().copied().chain((0..n).filter(|d| !mem.contains(d))).collect();
    let mut small = t.clone();
    for d in 0..n {
        if shape[d] > 1 && strides[d] == 0 {
            small = small.narrow(d as i64, 0, 1)?;
        }
    }
    let sizes: Vec<usize> = order.iter().map(|&d| small.shape()[d]).collect();
    let mut buf = small.permute(&order.iter().map(|&d| d as i64).collect::<Vec<_>>())?.contiguous()?;
    for (j, &d) in order.iter().enumerate() {
        if step[d] > 1 {
            // Each element followed by step - 1 zeros along this dim.
            let z = buf.zeros_like()?;
            let mut parts = vec![&buf];
            parts.extend(std::iter::repeat_n(&z, step[d] - 1));
            buf = kiln::stack(&parts, j as i64 + 1)?.flatten(j as i64, j as i64 + 1)?;
        }
    }
    for (j, &d) in order.iter().enumerate() {
        if step[d] > 1 {
            buf = buf.slice(j as i64, 0, (sizes[j] * step[d]) as i64, step[d])?;
        }
    }
    let mut inv = vec![0i64; n];
    for (j, &d) in order.iter().enumerate() {
        inv[d] = j as i64;
    }
    buf.permute(&inv)?.broadcast_to(&shape)
}

/// Why a case produced no outputs.
enum Why {
    Kiln(kiln::Error),
    /// The fixture holds an argument this file does not understand.
    Bad(String),
}

impl From<kiln::Error> for Why {
    fn from(e: kiln::Error) -> Why {
        Why::Kiln(e)
    }
}

type Out = Result<Vec<Tensor>, Why>;

fn one(t: kiln::Result<Tensor>) -> Out {
    Ok(vec![t?])
}

fn bad<T>(msg: impl Into<String>) -> Result<T, Why> {
    Err(Why::Bad(msg.into()))
}

/// A case's call over its input tensors (on the test device).
struct Call<'a> {
    c: &'a Case,
    ts: &'a [Tensor],
}

impl<'a> Call<'a> {
    /// Positional argument `i` (after the input) or keyword `name`; None when absent or None.
    fn get(&self, i: Option<usize>, name: &str) -> Option<&'a Arg> {
        let a = i.and_then(|i| self.c.args.get(i)).or_else(|| self.c.kw.get(name))?;
        if matches!(a, Arg::None) {
            None
        } else {
            Some(a)
        }
    }
    fn tensor(&self, a: &Arg) -> Result<&'a Tensor, Why> {
        match a {
            Arg::T(k) => Ok(&self.ts[*k]),
            other => bad(format!("expected a tensor, got {other:?}")),
        }
    }
    fn x(&self) -> Result<&'a Tensor, Why> {
        self.tensor(&self.c.inp)
    }
    fn t(&self, i: usize) -> Result<&'a Tensor, Why> {
        match self.get(Some(i), "") {
            Some(a) => self.tensor(a),
            None => bad(format!("missing tensor argument {i}")),
        }
    }
    fn opt_t(&self, i: Option<usize>, name: &str) -> Result<Option<&'a Tensor>, Why> {
        self.get(i, name).map(|a| self.tensor(a)).transpose()
    }
    fn int(&self, i: Option<usize>, name: &str, default: i64) -> Result<i64, Why> {
        match self.get(i, name) {
            None => Ok(default),
            Some(Arg::I(v)) => Ok(*v),
            Some(Arg::B(b)) => Ok(*b as i64),
            Some(other) => bad(format!("{name}: expected an int, got {other:?}")),
        }
    }
    fn float(&self, i: Option<usize>, name: &str, default: f64) -> Result<f64, Why> {
        match self.get(i, name) {
            None => Ok(default),
            Some(Arg::I(v)) => Ok(*v as f64),
            Some(Arg::F(v)) => Ok(*v),
            Some(other) => bad(format!("{name}: expected a number, got {other:?}")),
        }
    }
    fn flag(&self, i: Option<usize>, name: &str, default: bool) -> Result<bool, Why> {
        match self.get(i, name) {
            None => Ok(default),
            Some(Arg::B(b)) => Ok(*b),
            Some(other) => bad(format!("{name}: expected a bool, got {other:?}")),
        }
    }
    /// An int or a list of ints (a dim, dims, a shape).
    fn ints(&self, i: Option<usize>, name: &str) -> Result<Option<Vec<i64>>, Why> {
        match self.get(i, name) {
            None => Ok(None),
            Some(Arg::I(v)) => Ok(Some(vec![*v])),
            Some(Arg::L(l)) => l.iter().map(|a| if let Arg::I(v) = a { Ok(*v) } else { bad(format!("{name}: {a:?} in a list of ints")) }).collect::<Result<Vec<_>, _>>().map(Some),
            Some(other) => bad(format!("{name}: expected ints, got {other:?}")),
        }
    }
    /// An (h, w) pair from an int or a list of two.
    fn pair(&self, i: Option<usize>, name: &str, default: usize) -> Result<(usize, usize), Why> {
        match self.ints(i, name)?.as_deref() {
            None => Ok((default, default)),
            Some([v]) => Ok((*v as usize, *v as usize)),
            Some([h, w]) => Ok((*h as usize, *w as usize)),
            Some(other) => bad(format!("{name}: {other:?} is not one or two ints")),
        }
    }
    fn reduction(&self, i: usize) -> Result<Reduction, Why> {
        match self.get(Some(i), "reduction") {
            None => Ok(Reduction::Mean),
            Some(Arg::S(s)) if s == "mean" => Ok(Reduction::Mean),
            Some(Arg::S(s)) if s == "sum" => Ok(Reduction::Sum),
            Some(Arg::S(s)) if s == "none" => Ok(Reduction::None),
            Some(other) => bad(format!("reduction {other:?}")),
        }
    }
}

fn scalar(a: &Arg) -> Option<Scalar> {
    match a {
        Arg::I(i) => Some(Scalar::Int(*i)),
        Arg::F(f) => Some(Scalar::Float(*f)),
        Arg::B(b) => Some(Scalar::Bool(*b)),
        _ => None,
    }
}

type TT = fn(&Tensor, &Tensor) -> kiln::Result<Tensor>;
type TS = fn(&Tensor, Scalar) -> kiln::Result<Tensor>;

/// `x op y` over a tensor and a tensor or number; `rev` computes `s op x` where the first
/// operand is the number (a commuted, mirrored or reversed form).
fn binary(c: &Call, tt: TT, ts: TS, rev: Option<TS>) -> Out {
    let b = c.get(Some(0), "other").ok_or_else(|| Why::Bad("missing second operand".into()))?;
    match (&c.c.inp, b) {
        (Arg::T(_), Arg::T(_)) => one(tt(c.x()?, c.tensor(b)?)),
        (Arg::T(_), s) => one(ts(c.x()?, scalar(s).ok_or_else(|| Why::Bad(format!("operand {s:?}")))?)),
        (s, Arg::T(_)) => match (rev, scalar(s)) {
            (Some(rev), Some(s)) => one(rev(c.tensor(b)?, s)),
            _ => bad("a number first operand"),
        },
        _ => bad("no tensor operand"),
    }
}

/// Runs one case's op with kiln: the one place that maps PyTorch's calls to kiln's.
fn dispatch(c: &Call) -> Out {
    let op = c.c.op.as_str();
    match op {
        "neg" => one(c.x()?.neg()),
        "abs" => one(c.x()?.abs()),
        "sign" => one(c.x()?.sign()),
        "exp" => one(c.x()?.exp()),
        "log" => one(c.x()?.log()),
        "log1p" => one(c.x()?.log1p()),
        "sin" => one(c.x()?.sin()),
        "cos" => one(c.x()?.cos()),
        "tanh" => one(c.x()?.tanh()),
        "sigmoid" => one(c.x()?.sigmoid()),
        "nn.functional.relu" => one(c.x()?.relu()),
        "nn.functional.silu" => one(c.x()?.silu()),
        "sqrt" => one(c.x()?.sqrt()),
        "rsqrt" => one(c.x()?.rsqrt()),
        "erf" => one(c.x()?.erf()),
        "logical_not" => one(c.x()?.logical_not()),
        "reciprocal" => one(c.x()?.reciprocal()),
        "square" => one(c.x()?.square()),
        "nn.functional.gelu" => match c.get(None, "approximate") {
            None => one(c.x()?.gelu()),
            Some(Arg::S(s)) if s == "none" => one(c.x()?.gelu()),
            Some(Arg::S(s)) if s == "tanh" => one(c.x()?.gelu_tanh()),
            Some(other) => bad(format!("approximate={other:?}")),
        },
        "add" => binary(c, Tensor::add, |a, s| a.add_scalar(s), Some(|a, s| a.add_scalar(s))),
        "sub" => binary(c, Tensor::sub, |a, s| a.sub_scalar(s), Some(|a, s| a.rsub_scalar(s))),
        "mul" => binary(c, Tensor::mul, |a, s| a.mul_scalar(s), Some(|a, s| a.mul_scalar(s))),
        "div.no_rounding_mode" => binary(c, Tensor::div, |a, s| a.div_scalar(s), Some(|a, s| a.rdiv_scalar(s))),
        "pow" => binary(c, Tensor::pow, |a, s| a.pow_scalar(s), None),
        "maximum" | "max.binary" => binary(c, Tensor::maximum, |a, s| a.maximum_scalar(s), None),
        "minimum" | "min.binary" => binary(c, Tensor::minimum, |a, s| a.minimum_scalar(s), None),
        "eq" => binary(c, Tensor::eq, |a, s| a.eq_scalar(s), Some(|a, s| a.eq_scalar(s))),
        "ne" => binary(c, Tensor::ne, |a, s| a.ne_scalar(s), Some(|a, s| a.ne_scalar(s))),
        "lt" => binary(c, Tensor::lt, |a, s| a.lt_scalar(s), Some(|a, s| a.gt_scalar(s))),
        "le" => binary(c, Tensor::le, |a, s| a.le_scalar(s), Some(|a, s| a.ge_scalar(s))),
        "gt" => binary(c, Tensor::gt, |a, s| a.gt_scalar(s), Some(|a, s| a.lt_scalar(s))),
        "ge" => binary(c, Tensor::ge, |a, s| a.ge_scalar(s), Some(|a, s| a.le_scalar(s))),
        "logical_and" => binary(c, Tensor::logical_and, |a, s| a.logical_and_scalar(s), Some(|a, s| a.logical_and_scalar(s))),
        "logical_or" => binary(c, Tensor::logical_or, |a, s| a.logical_or_scalar(s), Some(|a, s| a.logical_or_scalar(s))),
        "logical_xor" => binary(c, Tensor::logical_xor, |a, s| a.logical_xor_scalar(s), Some(|a, s| a.logical_xor_scalar(s))),
        "where" => one(c.t(0)?.where_(c.x()?, c.t(1)?)),
        "masked_fill" => {
            let v = c.get(Some(1), "value").and_then(scalar).ok_or_else(|| Why::Bad("masked_fill value".into()))?;
            one(c.x()?.masked_fill(c.t(0)?, v))
        }
        "clamp" | "clamp_min" | "clamp_max" => {
            let (lo, hi) = match op {
                "clamp" => (c.get(Some(0), "min"), c.get(Some(1), "max")),
                "clamp_min" => (c.get(Some(0), "min"), None),
                _ => (None, c.get(Some(0), "max")),
            };
            if matches!(lo, Some(Arg::T(_))) || matches!(hi, Some(Arg::T(_))) {
                return one(c.x()?.clamp_tensor(lo.map(|a| c.tensor(a)).transpose()?, hi.map(|a| c.tensor(a)).transpose()?));
            }
            let num = |b: Option<&Arg>| b.map(|a| scalar(a).map(|s| s.to_f64()).ok_or_else(|| Why::Bad(format!("bound {a:?}")))).transpose();
            one(c.x()?.clamp(num(lo)?, num(hi)?))
        }
        "sum" | "mean" | "amax" | "amin" => {
            let dims = c.ints(Some(0), "dim")?.unwrap_or_default();
            let keepdim = c.flag(Some(1), "keepdim", false)?;
            let x = c.x()?;
            one(match op {
                "sum" => x.sum(&dims, keepdim),
                "mean" => x.mean(&dims, keepdim),
                "amax" => x.amax(&dims, keepdim),
                _ => x.amin(&dims, keepdim),
            })
        }
        "prod" => match c.get(Some(0), "dim") {
            None => one(c.x()?.prod_all()),
            Some(_) => one(c.x()?.prod(c.int(Some(0), "dim", 0)?, c.flag(Some(1), "keepdim", false)?)),
        },
        "max.reduction_no_dim" => one(c.x()?.max_all()),
        "min.reduction_no_dim" => one(c.x()?.min_all()),
        "max.reduction_with_dim" | "min.reduction_with_dim" => {
            let (d, k) = (c.int(Some(0), "dim", 0)?, c.flag(Some(1), "keepdim", false)?);
            let (v, i) = if op.starts_with("max") { c.x()?.max(d, k)? } else { c.x()?.min(d, k)? };
            Ok(vec![v, i])
        }
        "argmax" | "argmin" => {
            let x = c.x()?;
            let keepdim = c.flag(Some(1), "keepdim", false)?;
            match c.get(Some(0), "dim") {
                None => {
                    let i = if op == "argmax" { x.argmax_all()? } else { x.argmin_all()? };
                    // keepdim without a dim keeps every dim as size 1, as PyTorch.
                    one(if keepdim { i.reshape(&vec![1; x.ndim()]) } else { Ok(i) })
                }
                Some(_) => {
                    let d = c.int(Some(0), "dim", 0)?;
                    one(if op == "argmax" { x.argmax(d, keepdim) } else { x.argmin(d, keepdim) })
                }
            }
        }
        "var" | "std" | "var.unbiased" | "std.unbiased" => {
            let x = c.x()?;
            let (dims, correction, keepdim) = if op.ends_with("unbiased") {
                (vec![], if c.flag(Some(0), "unbiased", true)? { 1.0 } else { 0.0 }, false)
            } else {
                let correction = match (c.get(None, "correction"), c.get(None, "unbiased")) {
                    (Some(_), _) => c.float(None, "correction", 1.0)?,
                    (None, Some(_)) => {
                        if c.flag(None, "unbiased", true)? {
                            1.0
                        } else {
                            0.0
                        }
                    }
                    (None, None) => 1.0,
                };
                (c.ints(Some(0), "dim")?.unwrap_or_default(), correction, c.flag(None, "keepdim", false)?)
            };
            one(if op.starts_with("var") { x.var(&dims, correction, keepdim) } else { x.std(&dims, correction, keepdim) })
        }
        "logsumexp" => one(c.x()?.logsumexp(&c.ints(Some(0), "dim")?.unwrap_or_default(), c.flag(Some(1), "keepdim", false)?)),
        "matmul" => one(c.x()?.matmul(c.t(0)?)),
        "reshape" | "view" => {
            let shape = c.ints(Some(0), "shape")?.unwrap_or_default();
            one(if op == "view" { c.x()?.view(&shape) } else { c.x()?.reshape(&shape) })
        }
        "permute" => one(c.x()?.permute(&c.ints(Some(0), "dims")?.unwrap_or_default())),
        "transpose" => one(c.x()?.transpose(c.int(Some(0), "dim0", 0)?, c.int(Some(1), "dim1", 0)?)),
        "t" => one(c.x()?.t()),
        "expand" => one(c.x()?.expand(&c.ints(Some(0), "size")?.unwrap_or_default())),
        "squeeze" => match c.get(Some(0), "dim") {
            None => one(c.x()?.squeeze_all()),
            Some(_) => one(c.x()?.squeeze(c.int(Some(0), "dim", 0)?)),
        },
        "squeeze.multiple" => match c.ints(Some(0), "dim")?.unwrap_or_default().as_slice() {
            [d] => one(c.x()?.squeeze(*d)),
            dims => one(c.x()?.squeeze_dims(dims)),
        },
        "unsqueeze" => one(c.x()?.unsqueeze(c.int(Some(0), "dim", 0)?)),
        "flatten" => one(c.x()?.flatten(c.int(Some(0), "start_dim", 0)?, c.int(Some(1), "end_dim", -1)?)),
        "narrow" => {
            let x = c.x()?;
            let d = c.int(Some(0), "dim", 0)?;
            let start = c.int(Some(1), "start", 0)?;
            // A negative start counts from the end, as in PyTorch; kiln takes it counted.
            let start = if start < 0 { start + x.size(d)? as i64 } else { start };
            one(x.narrow(d, start as usize, c.int(Some(2), "length", 0)? as usize))
        }
        "cat" | "stack" => {
            let ts = match &c.c.inp {
                Arg::L(l) => l.iter().map(|a| c.tensor(a)).collect::<Result<Vec<_>, _>>()?,
                other => return bad(format!("{op} of {other:?}")),
            };
            let d = c.int(Some(0), "dim", 0)?;
            one(if op == "cat" { kiln::cat(&ts, d) } else { kiln::stack(&ts, d) })
        }
        "split" | "split.list_args" | "split_with_sizes" => {
            let d = c.int(Some(1), "dim", 0)?;
            match c.get(Some(0), "split_size_or_sections").or(c.get(None, "split_sizes")) {
                Some(Arg::I(size)) => Ok(c.x()?.split(*size as usize, d)?),
                Some(Arg::L(_)) => {
                    let sizes = c.ints(Some(0), "split_size_or_sections")?.or(c.ints(None, "split_sizes")?).unwrap_or_default();
                    Ok(c.x()?.split_sizes(&sizes.iter().map(|&s| s as usize).collect::<Vec<_>>(), d)?)
                }
                other => bad(format!("split sizes {other:?}")),
            }
        }
        "chunk" => Ok(c.x()?.chunk(c.int(Some(0), "chunks", 1)? as usize, c.int(Some(1), "dim", 0)?)?),
        "tril" => one(c.x()?.tril(c.int(Some(0), "diagonal", 0)?)),
        "triu" => one(c.x()?.triu(c.int(Some(0), "diagonal", 0)?)),
        "nn.functional.pad.constant" => one(c.x()?.pad(&c.ints(Some(0), "pad")?.unwrap_or_default(), c.float(Some(2), "value", 0.0)?)),
        "index_select" => one(c.x()?.index_select(c.int(Some(0), "dim", 0)?, c.t(1)?)),
        "gather" => one(c.x()?.gather(c.int(Some(0), "dim", 0)?, c.t(1)?)),
        "scatter_add" => one(c.x()?.scatter_add(c.int(Some(0), "dim", 0)?, c.t(1)?, c.t(2)?)),
        "nn.functional.one_hot" => {
            let n = c.int(Some(0), "num_classes", -1)?;
            one(c.x()?.one_hot(if n < 0 { None } else { Some(n as usize) }))
        }
        "softmax" | "softmax.with_dtype" => one(F::softmax(c.x()?, c.int(Some(0), "dim", 0)?)),
        "log_softmax" | "log_softmax.with_dtype" => one(F::log_softmax(c.x()?, c.int(Some(0), "dim", 0)?)),
        "nn.functional.layer_norm" => {
            let shape: Vec<usize> = c.ints(Some(0), "normalized_shape")?.unwrap_or_default().iter().map(|&d| d as usize).collect();
            one(F::layer_norm(c.x()?, &shape, c.opt_t(Some(1), "weight")?, c.opt_t(Some(2), "bias")?, c.float(Some(3), "eps", 1e-5)?))
        }
        "nn.functional.linear" => one(F::linear(c.x()?, c.t(0)?, c.opt_t(Some(1), "bias")?)),
        "nn.functional.conv2d" => {
            let args = Conv2dArgs {
                stride: c.pair(Some(2), "stride", 1)?,
                padding: c.pair(Some(3), "padding", 0)?,
                dilation: c.pair(Some(4), "dilation", 1)?,
                groups: c.int(Some(5), "groups", 1)? as usize,
            };
            one(F::conv2d(c.x()?, c.t(0)?, c.opt_t(Some(1), "bias")?, args))
        }
        "nn.functional.max_pool2d" => {
            let kernel = c.pair(Some(0), "kernel_size", 1)?;
            let stride = if c.get(Some(1), "stride").is_some() { c.pair(Some(1), "stride", 1)? } else { kernel };
            let padding = c.pair(Some(2), "padding", 0)?;
            let (dilation, ceil_mode) = (c.pair(Some(3), "dilation", 1)?, c.flag(Some(4), "ceil_mode", false)?);
            if c.flag(Some(5), "return_indices", false)? {
                let a = F::MaxPool2dArgs { kernel, stride, padding, dilation, ceil_mode };
                let (v, i) = F::max_pool2d_with_indices(c.x()?, &a)?;
                return Ok(vec![v, i]);
            }
            if dilation != (1, 1) || ceil_mode {
                return one(F::max_pool2d_with(c.x()?, &F::MaxPool2dArgs { kernel, stride, padding, dilation, ceil_mode }));
            }
            one(F::max_pool2d(c.x()?, kernel, stride, padding))
        }
        "nn.functional.adaptive_avg_pool2d" => one(F::adaptive_avg_pool2d(c.x()?, c.pair(Some(0), "output_size", 1)?)),
        "nn.functional.cross_entropy" | "nn.functional.nll_loss" => {
            let opts = CrossEntropyOptions {
                weight: c.opt_t(Some(1), "weight")?.cloned(),
                ignore_index: c.int(Some(3), "ignore_index", -100)?,
                label_smoothing: c.float(Some(6), "label_smoothing", 0.0)?,
                reduction: c.reduction(5)?,
            };
            let (x, target) = (c.x()?, c.t(0)?);
            one(if op.ends_with("cross_entropy") { F::cross_entropy_with(x, target, &opts) } else { F::nll_loss_with(x, target, &opts) })
        }
        "nn.functional.mse_loss" => one(F::mse_loss(c.x()?, c.t(0)?, c.reduction(3)?)),
        "nn.functional.binary_cross_entropy_with_logits" => {
            let (weight, pos_weight, reduction) = (c.opt_t(Some(1), "weight")?, c.opt_t(Some(5), "pos_weight")?, c.reduction(4)?);
            one(F::binary_cross_entropy_with_logits(c.x()?, c.t(0)?, weight, pos_weight, reduction))
        }
        "nn.functional.scaled_dot_product_attention" => {
            let opts = SdpaOptions {
                attn_mask: c.opt_t(Some(2), "attn_mask")?,
                dropout_p: c.float(Some(3), "dropout_p", 0.0)?,
                is_causal: c.flag(Some(4), "is_causal", false)?,
                scale: c.get(Some(5), "scale").map(|_| c.float(Some(5), "scale", 0.0)).transpose()?,
            };
            one(F::scaled_dot_product_attention(c.x()?, c.t(0)?, c.t(1)?, &opts))
        }
        // The parity ops.
        "expm1" => one(c.x()?.expm1()),
        "tan" => one(c.x()?.tan()),
        "floor" => one(c.x()?.floor()),
        "ceil" => one(c.x()?.ceil()),
        "round" => one(c.x()?.round()),
        "round.decimals_0" | "round.decimals_3" | "round.decimals_neg_3" => one(c.x()?.round_decimals(c.int(None, "decimals", 0)?)),
        "trunc" => one(c.x()?.trunc()),
        "cumsum" => one(c.x()?.cumsum(c.int(Some(0), "dim", 0)?)),
        "cumprod" => one(c.x()?.cumprod(c.int(Some(0), "dim", 0)?)),
        "mm" => one(c.x()?.mm(c.t(0)?)),
        "bmm" => one(c.x()?.bmm(c.t(0)?)),
        "addmm" | "addmm.decomposed" => one(c.x()?.addmm(c.t(0)?, c.t(1)?, c.float(None, "beta", 1.0)?, c.float(None, "alpha", 1.0)?)),
        "remainder" => binary(c, Tensor::remainder, |a, s| a.remainder_scalar(s), None),
        "fmod" => binary(c, Tensor::fmod, |a, s| a.fmod_scalar(s), None),
        "div.trunc_rounding" => one(c.x()?.div_mode(c.t(0)?, kiln::RoundingMode::Trunc)),
        "div.floor_rounding" => one(c.x()?.div_mode(c.t(0)?, kiln::RoundingMode::Floor)),
        "nn.functional.avg_pool2d" => one(F::avg_pool2d(c.x()?, c.pair(Some(0), "kernel_size", 1)?, if c.get(Some(1), "stride").is_some() { c.pair(Some(1), "stride", 1)? } else { c.pair(Some(0), "kernel_size", 1)? }, c.pair(Some(2), "padding", 0)?, c.flag(Some(3), "ceil_mode", false)?, c.flag(Some(4), "count_include_pad", true)?)),
        _ => bad(format!("no dispatch arm for {op}")),
    }
}

thread_local! {
    /// Set while this thread runs cases: its panics are recorded here instead of printed.
    static PANIC: RefCell<Option<Option<String>>> = const { RefCell::new(None) };
}

/// Runs `f`, turning a panic into an error carrying its message and location.
fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    let outer = PANIC.with(|p| p.replace(Some(None)));
    let r = catch_unwind(AssertUnwindSafe(f));
    let msg = PANIC.with(|p| p.replace(outer)).flatten();
    r.map_err(|_| format!("panicked: {}", msg.unwrap_or_default()))
}

fn install_panic_recorder() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let recorded = PANIC.with(|p| match p.borrow_mut().as_mut() {
                Some(slot) => {
                    *slot = Some(info.to_string().replace('\n', " "));
                    true
                }
                None => false,
            });
            if !recorded {
                previous(info);
            }
        }));
    });
}

/// The first element where `got` is not close to `want`, described; None when all are.
fn mismatch(what: &str, got: &Tensor, want: &Tensor) -> Option<String> {
    if got.dtype() != want.dtype() {
        return Some(format!("{what}: dtype {:?}, PyTorch {:?}", got.dtype(), want.dtype()));
    }
    if got.shape() != want.shape() {
        return Some(format!("{what}: shape {:?}, PyTorch {:?}", got.shape(), want.shape()));
    }
    let index = |mut i: usize| {
        let mut idx = vec![0; want.ndim()];
        for d in (0..want.ndim()).rev() {
            idx[d] = i % want.shape()[d];
            i /= want.shape()[d];
        }
        idx
    };
    fn host<T: kiln::WithDType>(t: &Tensor, dt: DType) -> Result<Vec<T>, String> {
        kiln::no_grad(|| t.detach().to_device(&Device::Cpu)?.to_dtype(dt)?.to_vec::<T>()).map_err(|e| e.to_string())
    }
    if want.dtype().is_float() {
        let (rtol, atol) = tolerance(want.dtype());
        let (a, b) = match (host::<f64>(got, DType::F64).map_err(|e| format!("{what}: reading kiln's result: {e}")), host::<f64>(want, DType::F64)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Some(e),
        };
        let bad = a.iter().zip(&b).position(|(x, y)| !((x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= atol + rtol * y.abs()))?;
        Some(format!("{what}{:?}: kiln {:e}, PyTorch {:e} (rtol {rtol}, atol {atol})", index(bad), a[bad], b[bad]))
    } else {
        let (a, b) = match (host::<i64>(got, DType::I64).map_err(|e| format!("{what}: reading kiln's result: {e}")), host::<i64>(want, DType::I64)) {
            (Ok(a), Ok(b)) => (a, b),
            (Err(e), _) | (_, Err(e)) => return Some(e),
        };
        let bad = a.iter().zip(&b).position(|(x, y)| x != y)?;
        Some(format!("{what}{:?}: kiln {}, PyTorch {} (exact)", index(bad), a[bad], b[bad]))
    }
}

enum Outcome {
    Pass,
    /// Passed against the float64 computation, not PyTorch's float32 result.
    PassF64,
    Fail(String),
}

/// Runs one case: its outputs, then the gradients of sum(out * cot) where PyTorch has them.
fn run_case(fx: &Fixture, c: &Case, grads_checked: &mut usize) -> Outcome {
    let d = dev();
    let build = || -> Result<Vec<Tensor>, String> {
        (0..c.tens.len())
            .map(|k| {
                let spec = &c.tens[k];
                let t = fx.tensor(c.id, &format!("in{k}")).ok_or(format!("no in{k}"))?.to_device(&d).map_err(|e| e.to_string())?;
                let t = match &spec.strides {
                    None => t,
                    Some(st) => {
                        let s = kiln::no_grad(|| strided(&t, st)).map_err(|e| format!("laying out in{k}: {e}"))?.detach();
                        let same = s.shape().iter().zip(s.strides()).zip(st).all(|((&n, a), b)| n <= 1 || a == b);
                        if !same {
                            return Err(format!("in{k} laid out with strides {:?}, the sample's are {st:?}", s.strides()));
                        }
                        s
                    }
                };
                debug_assert_eq!((t.dtype(), t.shape()), (spec.dt, spec.shape.as_slice()));
                Ok(if spec.grad != 0 { t.requires_grad() } else { t })
            })
            .collect()
    };
    let ts = match build() {
        Ok(ts) => ts,
        Err(e) => return Outcome::Fail(format!("harness: {e}")),
    };
    let outs = match guarded(|| kiln::enable_grad(|| dispatch(&Call { c, ts: &ts }))) {
        Err(p) => return Outcome::Fail(p),
        Ok(Err(Why::Kiln(e))) => return Outcome::Fail(format!("kiln error: {e}")),
        Ok(Err(Why::Bad(e))) => return Outcome::Fail(format!("harness: {e}")),
        Ok(Ok(outs)) => outs,
    };
    if outs.len() != c.outs.len() {
        return Outcome::Fail(format!("{} outputs, PyTorch {}", outs.len(), c.outs.len()));
    }
    let mut by_f64 = false;
    for (i, o) in outs.iter().enumerate() {
        match close_to(fx, c, &format!("out{i}"), o) {
            Ok(f) => by_f64 |= f,
            Err(m) => return Outcome::Fail(m),
        }
    }
    let wants_grad = c.tens.iter().any(|t| t.grad != 0) && c.outs.iter().any(|o| o.cot);
    let pass = |by_f64: bool| if by_f64 { Outcome::PassF64 } else { Outcome::Pass };
    if !wants_grad {
        return pass(by_f64);
    }
    let backward = guarded(|| {
        kiln::enable_grad(|| -> kiln::Result<()> {
            let mut loss: Option<Tensor> = None;
            for (i, o) in outs.iter().enumerate().filter(|(i, _)| c.outs[*i].cot) {
                let cot = fx.tensor(c.id, &format!("cot{i}")).unwrap().to_device(&d)?;
                let term = o.mul(&cot)?.sum_all()?;
                loss = Some(match loss {
                    None => term,
                    Some(l) => l.add(&term)?,
                });
            }
            loss.expect("a differentiable output").backward()
        })
    });
    match backward {
        Err(p) => return Outcome::Fail(format!("backward {p}")),
        Ok(Err(e)) => return Outcome::Fail(format!("backward: kiln error: {e}")),
        Ok(Ok(())) => {}
    }
    for (k, (spec, t)) in c.tens.iter().zip(&ts).enumerate() {
        match (spec.grad, t.grad()) {
            (1, None) => return Outcome::Fail(format!("grad{k}: kiln has no gradient, PyTorch has one")),
            (1, Some(g)) => {
                match close_to(fx, c, &format!("grad{k}"), &g) {
                    Ok(f) => by_f64 |= f,
                    Err(m) => return Outcome::Fail(m),
                }
                *grads_checked += 1;
            }
            // PyTorch: no path from this input to the outputs; kiln may give none or zeros.
            (-1, Some(g)) => {
                if let Some(m) = mismatch(&format!("grad{k}"), &g, &g.zeros_like().unwrap()) {
                    return Outcome::Fail(format!("{m} (PyTorch has no gradient)"));
                }
            }
            _ => {}
        }
    }
    pass(by_f64)
}

/// Whether `got` is close to PyTorch's `name` of case `c`: Ok(false) when it is, Ok(true) when
/// it is not but is close to the same call computed in float64 (stored for float32 cases as
/// `ref_<name>`: where both libraries' f32 rounding errors add up past the tolerance, the one
/// nearer the exact value passes), else the mismatch against PyTorch's result.
fn close_to(fx: &Fixture, c: &Case, name: &str, got: &Tensor) -> Result<bool, String> {
    let Some(m) = mismatch(name, got, &fx.tensor(c.id, name).unwrap()) else { return Ok(false) };
    match fx.tensor(c.id, &format!("ref_{name}")) {
        Some(exact) if mismatch(name, got, &exact).is_none() => Ok(true),
        Some(exact) => Err(format!("{m}; float64 gives {}", first_value(&exact, &m))),
        None => Err(m),
    }
}

/// The value of `t` at the index a mismatch message names (`name[i, j]: ...`).
fn first_value(t: &Tensor, msg: &str) -> String {
    let idx: Option<Vec<usize>> = msg.split_once('[').and_then(|(_, r)| r.split_once(']')).map(|(i, _)| i.split(", ").filter_map(|x| x.parse().ok()).collect());
    let flat = idx.map(|idx| idx.iter().zip(t.shape()).fold(0, |a, (&i, &n)| a * n + i)).unwrap_or(0);
    kiln::no_grad(|| t.to_dtype(DType::F64)?.to_vec::<f64>()).ok().and_then(|v| v.get(flat).copied()).map(|v| format!("{v:e}")).unwrap_or_default()
}

#[derive(Default)]
struct OpStats {
    pass: usize,
    /// Of `pass`: cases close to the float64 computation but not to PyTorch's float32 result.
    by_f64: usize,
    fail: usize,
    /// Not expressible: (reason, count).
    ne: BTreeMap<String, usize>,
}

#[test]
fn opinfo_samples_match_pytorch() {
    install_panic_recorder();
    let start = std::time::Instant::now();
    let fx = Fixture::load(FIXTURE);
    let mut stats: BTreeMap<String, OpStats> = BTreeMap::new();
    for (op, _, why, n) in &fx.ne {
        *stats.entry(op.clone()).or_default().ne.entry(why.clone()).or_default() += n;
    }
    let (mut failures, mut grads_checked) = (Vec::new(), 0);
    for c in &fx.cases {
        let s = stats.entry(c.op.clone()).or_default();
        match guarded(|| run_case(&fx, c, &mut grads_checked)).unwrap_or_else(Outcome::Fail) {
            Outcome::Pass => s.pass += 1,
            Outcome::PassF64 => {
                s.pass += 1;
                s.by_f64 += 1;
            }
            Outcome::Fail(m) => {
                s.fail += 1;
                failures.push(format!("c{:05} {} {} [{}] {}: {m}", c.id, c.op, c.dt, c.src, c.describe()));
            }
        }
    }
    let elapsed = start.elapsed();

    // Per op: passed, failed, not expressible, and the samples the fixture did not store.
    println!("\nOpInfo samples on {:?} (PyTorch's op_db; reasons for 'not expr.' below; not stored: dup = repeated", dev());
    println!("by reference_inputs, large = over the fixture's size limit, capped = beyond the per-op cap):");
    println!("{:<48} {:>5} {:>5} {:>9} {:>5} {:>6} {:>7}", "op", "pass", "fail", "not expr.", "dup", "large", "capped");
    let mut total = [0usize; 6];
    for (op, s) in &stats {
        let ne: usize = s.ne.values().sum();
        let dr = fx.dropped.get(op).copied().unwrap_or_default();
        println!("{op:<48} {:>5} {:>5} {ne:>9} {:>5} {:>6} {:>7}", s.pass, s.fail, dr[0], dr[1], dr[2]);
        for (t, v) in total.iter_mut().zip([s.pass, s.fail, ne, dr[0], dr[1], dr[2]]) {
            *t += v;
        }
    }
    println!("{:<48} {:>5} {:>5} {:>9} {:>5} {:>6} {:>7}", "total", total[0], total[1], total[2], total[3], total[4], total[5]);
    let mut reasons: BTreeMap<&str, (usize, Vec<&str>)> = BTreeMap::new();
    for (op, s) in &stats {
        for (why, n) in &s.ne {
            let r = reasons.entry(why).or_default();
            r.0 += n;
            r.1.push(op);
        }
    }
    println!("\nnot expressible, by reason:");
    for (why, (n, ops)) in &reasons {
        println!("{n:>6}  {why}: {}", ops.join(" "));
    }
    let unchecked = fx.cases.iter().filter(|c| c.note.is_some()).count();
    let by_f64: Vec<String> = stats.iter().filter(|(_, s)| s.by_f64 > 0).map(|(op, s)| format!("{op} {}", s.by_f64)).collect();
    println!("\npassed against the float64 computation, not PyTorch's float32 result: {}", if by_f64.is_empty() { "none".to_string() } else { by_f64.join(", ") });
    println!(
        "\n{} cases in {:.1?}, {grads_checked} input gradients compared; {unchecked} cases with gradients PyTorch does not give (forward checked only); no non-contiguous variant for: {}",
        fx.cases.len(),
        elapsed,
        if fx.no_nc.is_empty() { "-".to_string() } else { fx.no_nc.join(" ") }
    );
    if !failures.is_empty() {
        println!("\n{} failing cases:", failures.len());
        for f in &failures {
            println!("  {f}");
        }
    }
    assert!(failures.is_empty(), "{} of {} expressible OpInfo cases differ from PyTorch (listed above)", failures.len(), total[0] + total[1]);
}
