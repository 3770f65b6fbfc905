//! Reductions: the primitive `Reduce` op and the public reductions built on it.

use super::{apply, Op};
use crate::layout::norm_dim;
use crate::dtype::CType;
use crate::{DType, Error, Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    Prod,
    /// Values of the maximum (`amax`); ties share the gradient.
    Max,
    Min,
    /// Index of the first maximum along one dim.
    ArgMax,
    ArgMin,
}

impl ReduceOp {
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Prod => "prod",
            ReduceOp::Max => "amax",
            ReduceOp::Min => "amin",
            ReduceOp::ArgMax => "argmax",
            ReduceOp::ArgMin => "argmin",
        }
    }
    pub(crate) fn out_dtype(self, x: DType) -> DType {
        match self {
            ReduceOp::Sum | ReduceOp::Prod if !x.is_float() => DType::I64,
            ReduceOp::ArgMax | ReduceOp::ArgMin => DType::I64,
            _ => x,
        }
    }
    pub(crate) fn differentiable(self) -> bool {
        !self.is_arg()
    }

    pub(crate) fn backward(
        self,
        x: Option<&Tensor>,
        y: Option<&Tensor>,
        g: &Tensor,
        in_shape: &[usize],
        dims: &[usize],
        keepdim: bool,
    ) -> Result<Tensor> {
        // Bring a reduced-shape tensor back to the input's rank, then broadcast.
        let unreduce = |t: &Tensor| -> Result<Tensor> {
            let kept = if keepdim { t.clone() } else { t.reshape_usize(&reduced_shape(in_shape, dims, true))? };
            kept.broadcast_to(in_shape)
        };
        let gx = unreduce(g)?;
        match self {
            ReduceOp::Sum => Ok(gx),
            ReduceOp::Prod => {
                // d/dx_i prod = prod of the others; computed without dividing by zero.
                let x = x.expect("input saved");
                let is_zero = x.eq_scalar(0.0)?;
                let x_nz = x.masked_fill(&is_zero, 1.0)?;
                let prod_nz = unreduce(&apply(Op::Reduce(ReduceOp::Prod, dims.to_vec(), keepdim), &[&x_nz])?)?;
                let zeros = unreduce(&is_zero.to_dtype(DType::I64)?.sum_dims_usize(dims, keepdim)?)?;
                let no_zero = prod_nz.div(&x_nz)?.masked_fill(&zeros.ne_scalar(0)?, 0.0)?;
                let one_zero = prod_nz.masked_fill(&zeros.ne_scalar(1)?.logical_or(&is_zero.logical_not()?)?, 0.0)?;
                gx.mul(&no_zero.add(&one_zero)?)
            }
            ReduceOp::Max | ReduceOp::Min => {
                let x = x.expect("input saved");
                let hit = x.eq(&unreduce(y.expect("output saved"))?)?.to_dtype(g.dtype())?;
                let count = unreduce(&hit.sum_dims_usize(dims, keepdim)?)?;
                gx.mul(&hit)?.div(&count)
            }
            ReduceOp::ArgMax | ReduceOp::ArgMin => unreachable!("not differentiable"),
        }
    }
}

/// What a reduction is, in one place (as the pointwise ops are): its identity, how partial
/// results combine (in Rust for the CPU loops and the CPU interpreter of fused kernels, in CUDA
/// C for the eager and the fused generators), the type it accumulates in, and its gradient
/// (`backward`). NaN wins max and min, the earlier index ties of argmax and argmin, as in PyTorch.
impl ReduceOp {
    /// Whether it gives an index (argmax, argmin) rather than a value.
    pub(crate) fn is_arg(self) -> bool {
        matches!(self, ReduceOp::ArgMax | ReduceOp::ArgMin)
    }

    /// Max-like (max, argmax) rather than min-like; meaningless for sum and prod.
    fn max_like(self) -> bool {
        matches!(self, ReduceOp::Max | ReduceOp::ArgMax)
    }

    /// The type it accumulates in for inputs of dtype `input`: sums and products of floats in
    /// f64, of integers and bools in i64 (wrapping); the rest in the input's compute type, bools
    /// as i64.
    pub(crate) fn acc_type(self, input: DType) -> CType {
        match (self, CType::of(input)) {
            (ReduceOp::Sum | ReduceOp::Prod, CType::F32 | CType::F64) => CType::F64,
            (_, CType::Bool) => CType::I64,
            (ReduceOp::Sum | ReduceOp::Prod, _) => CType::I64,
            (_, t) => t,
        }
    }

    /// The identity: 0, 1, or the far end of the type for max and min. For sum and prod it is
    /// also the result over no elements (max, min and the arg reductions of nothing are errors
    /// before any backend runs).
    pub(crate) fn identity<T: Accumulate>(self) -> T {
        match self {
            ReduceOp::Sum => T::ZERO,
            ReduceOp::Prod => T::ONE,
            _ if self.max_like() => T::LOWEST,
            _ => T::HIGHEST,
        }
    }

    /// Two partial results combined (not for the arg reductions, which carry an index).
    pub(crate) fn combine<T: Accumulate>(self, a: T, b: T) -> T {
        match self {
            ReduceOp::Sum => a.add(b),
            ReduceOp::Prod => a.mul(b),
            _ => if beats(b, a, self.max_like()) { b } else { a },
        }
    }

    /// The identity in CUDA C, of type `t`.
    pub(crate) fn cuda_identity(self, t: CType) -> String {
        let inf = |neg: bool| match t {
            CType::F32 => format!("({}__int_as_float(0x7f800000))", if neg { "-" } else { "" }),
            CType::F64 => format!("({}__longlong_as_double(0x7ff0000000000000ll))", if neg { "-" } else { "" }),
            CType::I64 => (if neg { "(-9223372036854775807ll - 1)" } else { "9223372036854775807ll" }).into(),
            CType::Bool => (if neg { "false" } else { "true" }).into(),
        };
        match self {
            ReduceOp::Sum => format!("(({})0)", t.name()),
            ReduceOp::Prod => format!("(({})1)", t.name()),
            _ => inf(self.max_like()),
        }
    }

    /// `combine` in CUDA C, of variables `a` and `b`.
    pub(crate) fn cuda_combine(self) -> &'static str {
        match self {
            ReduceOp::Sum => "a + b",
            ReduceOp::Prod => "a * b",
            ReduceOp::Max => "(a > b || a != a) ? a : b",
            ReduceOp::Min => "(a < b || a != a) ? a : b",
            _ => unreachable!("arg reductions combine with an index (cuda_step)"),
        }
    }

    /// (initial value, statement folding value `v` at index `k` into `acc` and its index `ai`)
    /// in CUDA C, accumulating in `t`.
    pub(crate) fn cuda_step(self, t: CType) -> (String, String) {
        // "v beats acc" for max/min; NaN beats everything, ties keep the earlier index.
        let beats = format!("(acc == acc) && (v != v || v {} acc)", if self.max_like() { ">" } else { "<" });
        let init = self.cuda_identity(t);
        let step = match self {
            ReduceOp::Sum => "acc = acc + v;".into(),
            ReduceOp::Prod => "acc = acc * v;".into(),
            ReduceOp::Max | ReduceOp::Min => format!("if ({beats}) acc = v;"),
            ReduceOp::ArgMax | ReduceOp::ArgMin => format!("if (({beats}) || ((v == acc || (v != v && acc != acc)) && k < ai)) {{ acc = v; ai = k; }}"),
        };
        (init, step)
    }
}

/// Whether `a` beats `b` for max (min when `!max`): NaN beats everything, as in PyTorch.
#[inline(always)]
pub(crate) fn beats<T: PartialOrd + Copy>(a: T, b: T, max: bool) -> bool {
    #[allow(clippy::eq_op)]
    let (a_nan, b_nan) = (a != a, b != b);
    !b_nan && (a_nan || if max { a > b } else { a < b })
}

/// Values a reduction accumulates: the CPU's accumulator types (integers wrap).
pub(crate) trait Accumulate: Copy + PartialOrd {
    const ZERO: Self;
    const ONE: Self;
    const LOWEST: Self;
    const HIGHEST: Self;
    fn add(self, b: Self) -> Self;
    fn mul(self, b: Self) -> Self;
}
macro_rules! accumulate_float {
    ($t:ty) => {
        impl Accumulate for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const LOWEST: Self = <$t>::NEG_INFINITY;
            const HIGHEST: Self = <$t>::INFINITY;
            #[inline(always)] fn add(self, b: Self) -> Self { self + b }
            #[inline(always)] fn mul(self, b: Self) -> Self { self * b }
        }
    };
}
accumulate_float!(f32);
accumulate_float!(f64);
impl Accumulate for i64 {
    const ZERO: Self = 0;
    const ONE: Self = 1;
    const LOWEST: Self = i64::MIN;
    const HIGHEST: Self = i64::MAX;
    #[inline(always)] fn add(self, b: Self) -> Self { self.wrapping_add(b) }
    #[inline(always)] fn mul(self, b: Self) -> Self { self.wrapping_mul(b) }
}
/// Bools reduce by max (any) and min (all); their sums and products accumulate in i64.
impl Accumulate for bool {
    const ZERO: Self = false;
    const ONE: Self = true;
    const LOWEST: Self = false;
    const HIGHEST: Self = true;
    #[inline(always)] fn add(self, b: Self) -> Self { self || b }
    #[inline(always)] fn mul(self, b: Self) -> Self { self && b }
}

/// The shape after reducing `dims` (kept as 1 with `keepdim`).
pub(crate) fn reduced_shape(shape: &[usize], dims: &[usize], keepdim: bool) -> Vec<usize> {
    shape
        .iter()
        .enumerate()
        .filter_map(|(i, &d)| if dims.contains(&i) { keepdim.then_some(1) } else { Some(d) })
        .collect()
}

/// Sorted, de-duplicated, normalised dims; an empty list means every dim, as in PyTorch.
fn norm_dims(op: &'static str, dims: &[i64], ndim: usize) -> Result<Vec<usize>> {
    if dims.is_empty() {
        return Ok((0..ndim).collect());
    }
    let mut out = Vec::with_capacity(dims.len());
    for &d in dims {
        let d = norm_dim(op, d, ndim)?;
        if out.contains(&d) {
            return Err(Error::arg(op, format!("dim {d} appears more than once in {dims:?}")));
        }
        out.push(d);
    }
    out.sort_unstable();
    // A 0-dim tensor reduces over nothing.
    out.retain(|&d| d < ndim);
    Ok(out)
}

impl Tensor {
    fn reduce(&self, op: ReduceOp, mut dims: Vec<usize>, keepdim: bool) -> Result<Tensor> {
        // A 0-dim tensor accepts dim 0 (or -1) and reduces over nothing, as in PyTorch.
        dims.retain(|&d| d < self.ndim());
        if matches!(op, ReduceOp::Max | ReduceOp::Min | ReduceOp::ArgMax | ReduceOp::ArgMin)
            && dims.iter().any(|&d| self.shape()[d] == 0)
        {
            return Err(Error::shape(op.name(), format!("cannot reduce over an empty dimension (shape {:?}, dims {dims:?})", self.shape())));
        }
        if (op == ReduceOp::Sum || op == ReduceOp::Prod)
            && self.dtype() == DType::Bool {
                return self.to_dtype(DType::I64)?.reduce(op, dims, keepdim);
            }
        apply(Op::Reduce(op, dims, keepdim), &[self])
    }

    pub(crate) fn sum_dims_usize(&self, dims: &[usize], keepdim: bool) -> Result<Tensor> {
        self.reduce(ReduceOp::Sum, dims.to_vec(), keepdim)
    }

    /// Sum over `dims` (all when empty); integer and bool inputs sum to I64. F32 under autocast.
    #[track_caller]
    pub fn sum(&self, dims: &[i64], keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        crate::amp::fp32(self)?.reduce(ReduceOp::Sum, norm_dims("sum", dims, self.ndim())?, keepdim)
    }
    #[track_caller]
    pub fn sum_all(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.sum(&[], false)
    }
    /// Mean over `dims` (all when empty); floating-point only, as in PyTorch. F32 under autocast.
    #[track_caller]
    pub fn mean(&self, dims: &[i64], keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if !self.dtype().is_float() {
            return Err(Error::dtype("mean", self.dtype(), "mean needs a floating-point input; convert with to_dtype"));
        }
        let dims = norm_dims("mean", dims, self.ndim())?;
        let n: usize = dims.iter().map(|&d| self.shape()[d]).product();
        crate::amp::fp32(self)?.reduce(ReduceOp::Sum, dims, keepdim)?.div_scalar(n as f64)
    }
    #[track_caller]
    pub fn mean_all(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.mean(&[], false)
    }
    #[track_caller]
    pub fn prod(&self, dim: i64, keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.reduce(ReduceOp::Prod, vec![norm_dim("prod", dim, self.ndim())?], keepdim)
    }
    #[track_caller]
    pub fn prod_all(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.reduce(ReduceOp::Prod, (0..self.ndim()).collect(), false)
    }
    /// Maximum values over `dims` (all when empty); ties share the gradient (`torch.amax`).
    #[track_caller]
    pub fn amax(&self, dims: &[i64], keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.reduce(ReduceOp::Max, norm_dims("amax", dims, self.ndim())?, keepdim)
    }
    #[track_caller]
    pub fn amin(&self, dims: &[i64], keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.reduce(ReduceOp::Min, norm_dims("amin", dims, self.ndim())?, keepdim)
    }
    /// The largest element (`torch.max(x)`).
    #[track_caller]
    pub fn max_all(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.amax(&[], false)
    }
    #[track_caller]
    pub fn min_all(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.amin(&[], false)
    }
    /// Values and indices of the maximum along `dim` (`torch.max(x, dim)`); the gradient goes
    /// to the returned index only.
    #[track_caller]
    pub fn max(&self, dim: i64, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let _site = crate::profiler::call_site();
        self.extreme_along(dim, keepdim, ReduceOp::ArgMax)
    }
    #[track_caller]
    pub fn min(&self, dim: i64, keepdim: bool) -> Result<(Tensor, Tensor)> {
        let _site = crate::profiler::call_site();
        self.extreme_along(dim, keepdim, ReduceOp::ArgMin)
    }
    fn extreme_along(&self, dim: i64, keepdim: bool, op: ReduceOp) -> Result<(Tensor, Tensor)> {
        let d = norm_dim(op.name(), dim, self.ndim())?;
        if self.ndim() == 0 {
            return Ok((self.clone(), Tensor::zeros(&[], DType::I64, &self.device())?));
        }
        let idx = self.reduce(op, vec![d], true)?;
        let values = self.gather(d as i64, &idx)?;
        if keepdim {
            Ok((values, idx))
        } else {
            Ok((values.squeeze(d as i64)?, idx.squeeze(d as i64)?))
        }
    }
    /// Index of the first maximum along `dim`.
    #[track_caller]
    pub fn argmax(&self, dim: i64, keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.reduce(ReduceOp::ArgMax, vec![norm_dim("argmax", dim, self.ndim())?], keepdim)
    }
    #[track_caller]
    pub fn argmin(&self, dim: i64, keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.reduce(ReduceOp::ArgMin, vec![norm_dim("argmin", dim, self.ndim())?], keepdim)
    }
    /// Index of the first maximum of the flattened tensor.
    #[track_caller]
    pub fn argmax_all(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.flatten(0, -1)?.argmax(0, false)
    }
    #[track_caller]
    pub fn argmin_all(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.flatten(0, -1)?.argmin(0, false)
    }
    /// Running sums along `dim` (`torch.cumsum`); integer and bool inputs sum to I64.
    #[track_caller]
    pub fn cumsum(&self, dim: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.scan("cumsum", dim, false)
    }
    /// Running products along `dim` (`torch.cumprod`); integer and bool inputs multiply in I64.
    #[track_caller]
    pub fn cumprod(&self, dim: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.scan("cumprod", dim, true)
    }
    /// An inclusive scan as a decomposition (Hillis-Steele: log2(n) steps, each combining the
    /// running values with themselves shifted by 1, 2, 4, ... along `dim`), so autograd and the
    /// compiler see only pads, slices and pointwise ops, and zeros in a product need no care.
    fn scan(&self, op: &'static str, dim: i64, product: bool) -> Result<Tensor> {
        let d = norm_dim(op, dim, self.ndim())?;
        let x = if self.dtype().is_float() { self.copy_contiguous()? } else { self.to_dtype(DType::I64)? };
        if self.ndim() == 0 {
            return Ok(x);
        }
        let n = x.shape()[d];
        let identity = if product { 1.0 } else { 0.0 };
        let mut y = x;
        let mut k = 1;
        while k < n {
            let mut pads = vec![(0, 0); y.ndim()];
            pads[d] = (k, 0);
            let shifted = apply(Op::Pad(pads, identity), &[&y.narrow(d as i64, 0, n - k)?])?;
            y = if product { y.mul(&shifted)? } else { y.add(&shifted)? };
            k *= 2;
        }
        Ok(y)
    }

    /// Variance over `dims` (all when empty) with `correction` (1 = unbiased, as PyTorch's default).
    #[track_caller]
    pub fn var(&self, dims: &[i64], correction: f64, keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if !self.dtype().is_float() {
            return Err(Error::dtype("var", self.dtype(), "var needs a floating-point input"));
        }
        let dt = self.dtype();
        if dt.compute_dtype() != dt {
            // Half types: every intermediate in F32, one rounding at the end (as PyTorch).
            return self.to_dtype(dt.compute_dtype())?.var(dims, correction, keepdim)?.to_dtype(dt);
        }
        let dims = norm_dims("var", dims, self.ndim())?;
        let n: usize = dims.iter().map(|&d| self.shape()[d]).product();
        let dims_i: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        let centered = self.sub(&self.mean(&dims_i, true)?)?;
        centered.mul(&centered)?.sum(&dims_i, keepdim)?.div_scalar((n as f64 - correction).max(0.0))
    }
    #[track_caller]
    pub fn std(&self, dims: &[i64], correction: f64, keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let dt = self.dtype();
        if !dt.is_float() {
            return Err(Error::dtype("std", dt, "std needs a floating-point input"));
        }
        norm_dims("std", dims, self.ndim())?;
        if dt.is_float() && dt.compute_dtype() != dt {
            return self.to_dtype(dt.compute_dtype())?.std(dims, correction, keepdim)?.to_dtype(dt);
        }
        self.var(dims, correction, keepdim)?.sqrt()
    }
    /// `log(sum(exp(x)))` over `dims`, computed stably (the max is subtracted first).
    #[track_caller]
    pub fn logsumexp(&self, dims: &[i64], keepdim: bool) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        let x = if self.dtype().is_float() { self.clone() } else { self.to_dtype(crate::dtype::DEFAULT_FLOAT)? };
        let dims = norm_dims("logsumexp", dims, x.ndim())?;
        let dims_i: Vec<i64> = dims.iter().map(|&d| d as i64).collect();
        // An infinite max would give inf - inf = nan; shift by 0 there instead.
        let m = crate::no_grad(|| -> Result<Tensor> {
            if x.numel() == 0 {
                // amax refuses empty dims; a sum over nothing is -inf after the log, as in PyTorch.
                return x.sum(&dims_i, true);
            }
            let m = x.amax(&dims_i, true)?;
            m.masked_fill(&m.abs()?.eq_scalar(f64::INFINITY)?, 0.0)
        })?;
        let s = x.sub(&m)?.exp()?.sum(&dims_i, true)?.log()?.add(&m)?;
        if keepdim {
            Ok(s)
        } else {
            s.reshape_usize(&reduced_shape(x.shape(), &dims, false))
        }
    }
}
