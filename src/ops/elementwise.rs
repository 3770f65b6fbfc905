//! Public pointwise API: unary functions, binary ops with broadcasting and type promotion (tensor
//! and scalar forms), comparisons, logical ops, `where`, `clamp`, casts, and Rust's operators.

use super::pointwise::{BinaryOp, UnaryOp};
use super::{apply, Op};
use crate::dtype::{result_type, Tier};
use crate::layout::broadcast_shapes;
use crate::{DType, Error, MemoryFormat, Result, Tensor};

/// A plain number in an op with a tensor. Its kind (bool, integer, float) takes part in type
/// promotion, its width does not: `int_tensor + 2.5` is F32, `f16_tensor * 2.0` stays F16.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Scalar {
    Bool(bool),
    Int(i64),
    Float(f64),
}

impl Scalar {
    fn dtype(self) -> DType {
        match self {
            Scalar::Bool(_) => DType::Bool,
            Scalar::Int(_) => DType::I64,
            Scalar::Float(_) => DType::F64,
        }
    }
    pub fn to_f64(self) -> f64 {
        match self {
            Scalar::Bool(b) => b as u8 as f64,
            Scalar::Int(i) => i as f64,
            Scalar::Float(f) => f,
        }
    }
    /// A 0-dim tensor of this value in `dtype`; integers reach integer dtypes exactly (not
    /// through f64, which rounds beyond 2^53).
    fn to_tensor(self, dtype: DType, device: &crate::Device) -> Result<Tensor> {
        match self {
            // Exact through f64 below 2^53: a constant fill (no host copy; a graph constant).
            Scalar::Int(i) if dtype.is_int() && i.unsigned_abs() > (1u64 << 53) => Tensor::from_vec(vec![i], &[], device)?.to_dtype(dtype),
            s => Tensor::scalar(s.to_f64(), dtype, device),
        }
    }
}
impl From<f64> for Scalar {
    fn from(v: f64) -> Self {
        Scalar::Float(v)
    }
}
impl From<f32> for Scalar {
    fn from(v: f32) -> Self {
        Scalar::Float(v as f64)
    }
}
impl From<i64> for Scalar {
    fn from(v: i64) -> Self {
        Scalar::Int(v)
    }
}
impl From<i32> for Scalar {
    fn from(v: i32) -> Self {
        Scalar::Int(v as i64)
    }
}
impl From<usize> for Scalar {
    fn from(v: usize) -> Self {
        Scalar::Int(v as i64)
    }
}
impl From<bool> for Scalar {
    fn from(v: bool) -> Self {
        Scalar::Bool(v)
    }
}

fn tier(t: &Tensor) -> Tier {
    if t.ndim() == 0 {
        Tier::ZeroDim
    } else {
        Tier::Dim
    }
}

macro_rules! unary_methods {
    ($($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {
        impl Tensor {$(
            $(#[$doc])*
            #[track_caller]
            pub fn $name(&self) -> Result<Tensor> {
                let _site = crate::profiler::call_site();
                self.unary(UnaryOp::$op)
            }
        )*}
    };
}
unary_methods! {
    neg => Neg, abs => Abs, sign => Sign, exp => Exp, log => Log, log1p => Log1p, sin => Sin,
    cos => Cos, tanh => Tanh, sigmoid => Sigmoid, relu => Relu,
    /// GELU with the exact erf form (PyTorch's default `approximate='none'`).
    gelu => GeluErf,
    /// GELU with the tanh approximation (`approximate='tanh'`).
    gelu_tanh => GeluTanh,
    silu => Silu, sqrt => Sqrt, rsqrt => Rsqrt, erf => Erf, logical_not => LogicalNot,
    /// `exp(x) - 1`, exact near 0.
    expm1 => Expm1, tan => Tan,
    /// Rounds down; integers stay as they are (and keep their dtype), as in PyTorch; so do
    /// `ceil`, `round` and `trunc`. Their gradient is zero.
    floor => Floor, ceil => Ceil,
    /// Rounds half to even (`torch.round`).
    round => Round, trunc => Trunc,
}

/// How `div_mode` rounds its quotient (`torch.div`'s `rounding_mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RoundingMode {
    /// Toward zero, as C's integer division.
    Trunc,
    /// Down, as Python's `//`.
    Floor,
}

macro_rules! binary_methods {
    ($($name:ident, $scalar:ident => $op:ident),* $(,)?) => {
        impl Tensor {$(
            #[track_caller]
            pub fn $name(&self, other: &Tensor) -> Result<Tensor> {
                let _site = crate::profiler::call_site();
                self.binary(BinaryOp::$op, other)
            }
            #[track_caller]
            pub fn $scalar(&self, other: impl Into<Scalar>) -> Result<Tensor> {
                let _site = crate::profiler::call_site();
                self.binary_scalar(BinaryOp::$op, other.into(), false)
            }
        )*}
    };
}
binary_methods! {
    add, add_scalar => Add, sub, sub_scalar => Sub, mul, mul_scalar => Mul, div, div_scalar => Div,
    pow, pow_scalar => Pow, maximum, maximum_scalar => Maximum, minimum, minimum_scalar => Minimum,
    eq, eq_scalar => Eq, ne, ne_scalar => Ne, lt, lt_scalar => Lt, le, le_scalar => Le,
    gt, gt_scalar => Gt, ge, ge_scalar => Ge,
    logical_and, logical_and_scalar => LogicalAnd, logical_or, logical_or_scalar => LogicalOr,
    logical_xor, logical_xor_scalar => LogicalXor,
    remainder, remainder_scalar => Remainder, fmod, fmod_scalar => Fmod,
}

impl Tensor {
    pub(crate) fn unary(&self, op: UnaryOp) -> Result<Tensor> {
        if op == UnaryOp::Sign && self.dtype() == DType::Bool {
            // The sign of a bool is itself (PyTorch returns a bool tensor).
            return self.copy_contiguous();
        }
        op.out_dtype(self.dtype())?;
        apply(Op::Unary(op), &[self])
    }

    /// Rounds half to even at `decimals` digits after the point (before it when negative), as
    /// `torch.round(x, decimals=d)`: `round(x * 10^d) / 10^d`.
    #[track_caller]
    pub fn round_decimals(&self, decimals: i64) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if decimals == 0 || !self.dtype().is_float() {
            return self.round();
        }
        let scale = 10f64.powi(decimals.unsigned_abs().min(400) as i32);
        if decimals > 0 {
            self.mul_scalar(scale)?.round()?.div_scalar(scale)
        } else {
            self.div_scalar(scale)?.round()?.mul_scalar(scale)
        }
    }

    /// The quotient rounded as `mode` says (`torch.div(a, b, rounding_mode=...)`); integer
    /// operands give integers, and an integer division by zero is an error on the CPU.
    #[track_caller]
    pub fn div_mode(&self, other: &Tensor, mode: RoundingMode) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.binary(rounding_op(mode), other)
    }
    #[track_caller]
    pub fn div_mode_scalar(&self, other: impl Into<Scalar>, mode: RoundingMode) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.binary_scalar(rounding_op(mode), other.into(), false)
    }

    fn binary(&self, op: BinaryOp, other: &Tensor) -> Result<Tensor> {
        let promoted = result_type(&[(self.dtype(), tier(self)), (other.dtype(), tier(other))]);
        binary_promoted(op, self, other, promoted)
    }

    /// `self op s`, or `s op self` when `reversed`.
    fn binary_scalar(&self, op: BinaryOp, s: Scalar, reversed: bool) -> Result<Tensor> {
        let promoted = result_type(&[(self.dtype(), tier(self)), (s.dtype(), Tier::Scalar)]);
        // The scalar is held in the dtype arithmetic runs in (f32 for half types), as PyTorch does.
        let st = s.to_tensor(op.compute_dtype(promoted)?.compute_dtype(), &self.device())?;
        if reversed {
            binary_promoted(op, &st, self, promoted)
        } else {
            binary_promoted(op, self, &st, promoted)
        }
    }

    /// `s - self`.
    #[track_caller]
    pub fn rsub_scalar(&self, s: impl Into<Scalar>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.binary_scalar(BinaryOp::Sub, s.into(), true)
    }
    /// `s / self`.
    #[track_caller]
    pub fn rdiv_scalar(&self, s: impl Into<Scalar>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.binary_scalar(BinaryOp::Div, s.into(), true)
    }
    /// `1 / self`.
    #[track_caller]
    pub fn reciprocal(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.rdiv_scalar(1.0)
    }
    /// `self * self`; bools square in I64, as in PyTorch.
    #[track_caller]
    pub fn square(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if self.dtype() == DType::Bool {
            return self.to_dtype(DType::I64)?.square();
        }
        self.mul(self)
    }

    /// Limits values to `[min, max]` (either bound optional). The gradient passes where the input
    /// is within the bounds, inclusive, as in PyTorch; NaN stays NaN.
    #[track_caller]
    pub fn clamp(&self, min: Option<f64>, max: Option<f64>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if min.is_none() && max.is_none() {
            return Err(Error::arg("clamp", "at least one of min and max must be given"));
        }
        // A fractional or infinite bound promotes an integer tensor to the default float, as
        // PyTorch's clamp does with a float bound (instead of truncating the bound).
        let fractional = |b: Option<f64>| b.is_some_and(|v| v.fract() != 0.0 || !v.is_finite());
        if !self.dtype().is_float() && (fractional(min) || fractional(max)) {
            return self.to_dtype(crate::dtype::DEFAULT_FLOAT)?.clamp(min, max);
        }
        let mut r = self.clone();
        if let Some(lo) = min {
            r = self.lt_scalar(lo)?.where_(&self.full_scalar_like(lo)?, &r)?;
        }
        if let Some(hi) = max {
            // Compares the lower-clamped value: min(max(x, lo), hi), so lo > hi gives hi everywhere.
            r = r.gt_scalar(hi)?.where_(&self.full_scalar_like(hi)?, &r)?;
        }
        nan_without_gradient(r)
    }

    /// `clamp` with tensor bounds (either optional), broadcast together with the input
    /// (`torch.clamp(x, min_tensor, max_tensor)`): `min(max(x, lo), hi)`, a NaN bound gives NaN.
    /// The gradient goes to the input within the bounds (inclusive), else to the bound that won.
    #[track_caller]
    pub fn clamp_tensor(&self, min: Option<&Tensor>, max: Option<&Tensor>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if min.is_none() && max.is_none() {
            return Err(Error::arg("clamp", "at least one of min and max must be given"));
        }
        let value = |x: &Tensor| -> Result<Tensor> {
            let mut r = x.clone();
            if let Some(lo) = min {
                r = x.lt(lo)?.logical_or(&lo.ne(lo)?)?.where_(lo, &r)?;
            }
            if let Some(hi) = max {
                r = r.gt(hi)?.logical_or(&hi.ne(hi)?)?.where_(hi, &r)?;
            }
            Ok(r)
        };
        let tracked = crate::is_grad_enabled() && [Some(self), min, max].iter().flatten().any(|t| t.is_requires_grad());
        if !tracked {
            return value(self);
        }
        // PyTorch's gradients, whatever the value (a NaN bound's included): to the input where
        // lo <= x <= hi; to lo where x < lo (and lo < hi, given hi); to hi where x > hi (or
        // lo > hi, given lo). Where one of them gets it, it is the value; where the value is NaN
        // (a NaN input or bound), the NaN is added to it without history.
        let v = crate::no_grad(|| value(self))?;
        let inside = match (min, max) {
            (Some(lo), Some(hi)) => self.ge(lo)?.logical_and(&self.le(hi)?)?,
            (Some(lo), None) => self.ge(lo)?,
            (None, Some(hi)) => self.le(hi)?,
            (None, None) => unreachable!("a bound was checked for"),
        };
        let mut r = v.clone();
        if let Some(hi) = max {
            let wins = match min {
                Some(lo) => self.gt(hi)?.logical_or(&lo.gt(hi)?)?,
                None => self.gt(hi)?,
            };
            r = wins.where_(hi, &r)?;
        }
        if let Some(lo) = min {
            let wins = match max {
                Some(hi) => self.lt(lo)?.logical_and(&lo.lt(hi)?)?,
                None => self.lt(lo)?,
            };
            r = wins.where_(lo, &r)?;
        }
        let r = inside.where_(self, &r)?;
        if !r.dtype().is_float() {
            return Ok(r);
        }
        r.add(&v.ne(&v)?.where_(&v, &v.zeros_like()?)?)
    }

    /// A broadcastable 0-dim tensor of `v` in this tensor's dtype and device.
    fn full_scalar_like(&self, v: f64) -> Result<Tensor> {
        Tensor::scalar(v, self.dtype(), &self.device())
    }

    /// `self ? a : b` elementwise, with broadcasting and promotion of `a` and `b`
    /// (`torch.where(self, a, b)`).
    #[track_caller]
    pub fn where_(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if self.dtype() != DType::Bool {
            return Err(Error::dtype("where", self.dtype(), "the condition must be a Bool tensor"));
        }
        let dt = result_type(&[(a.dtype(), tier(a)), (b.dtype(), tier(b))]);
        let shape = broadcast_shapes("where", self.shape(), &broadcast_shapes("where", a.shape(), b.shape())?)?;
        let (c, a, b) = (self.broadcast_to(&shape)?, a.broadcast_to(&shape)?, b.broadcast_to(&shape)?);
        apply(Op::Where(dt), &[&c, &a, &b])
    }

    /// `value` where `mask` is true (`masked_fill`); the tensor and the mask broadcast together,
    /// and the result takes their broadcast shape. A value the dtype cannot hold is an error.
    #[track_caller]
    pub fn masked_fill(&self, mask: &Tensor, value: impl Into<Scalar>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if mask.dtype() != DType::Bool {
            return Err(Error::dtype("masked_fill", mask.dtype(), "the mask must be a Bool tensor"));
        }
        broadcast_shapes("masked_fill", self.shape(), mask.shape())?;
        let value = value.into();
        check_fits("masked_fill", value, self.dtype())?;
        mask.where_(&value.to_tensor(self.dtype(), &self.device())?, self)
    }

    /// Converts to `dtype` (no copy when it already is).
    #[track_caller]
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if dtype == self.dtype() {
            return Ok(self.clone());
        }
        apply(Op::Cast(dtype), &[self])
    }

    /// A contiguous tensor with the same values: the tensor itself when it already is.
    #[track_caller]
    pub fn contiguous(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        if self.is_contiguous() {
            return Ok(self.clone());
        }
        self.copy_contiguous()
    }

    /// The same values stored in `format`'s order: the tensor itself when it already is, else
    /// a differentiable copy (`x.to(memory_format=...)`; `contiguous()` for
    /// `MemoryFormat::Contiguous`). Channels-last needs a 4-D `[N, C, H, W]` tensor.
    #[track_caller]
    pub fn to_memory_format(&self, format: MemoryFormat) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        match format {
            MemoryFormat::Contiguous => self.contiguous(),
            MemoryFormat::ChannelsLast => {
                if self.ndim() != 4 {
                    return Err(Error::shape("to_memory_format", format!("channels-last needs a 4-D [N, C, H, W] tensor, got shape {:?}", self.shape())));
                }
                if self.is_contiguous_for(format) {
                    return Ok(self.clone());
                }
                self.copy_in(format)
            }
        }
    }

    /// Always a new copy stored densely in `format`'s order (differentiable).
    pub(crate) fn copy_in(&self, format: MemoryFormat) -> Result<Tensor> {
        match format {
            MemoryFormat::Contiguous => self.copy_contiguous(),
            MemoryFormat::ChannelsLast => apply(Op::Relayout(format), &[self]),
        }
    }

    /// Always a new contiguous copy (differentiable, like `clone()` in PyTorch).
    #[track_caller]
    pub fn copy_contiguous(&self) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        apply(Op::Cast(self.dtype()), &[self])
    }

    /// Whether every element is within `atol + rtol * |other|` of `other` (`torch.allclose`).
    #[track_caller]
    pub fn allclose(&self, other: &Tensor, rtol: f64, atol: f64) -> Result<bool> {
        let _site = crate::profiler::call_site();
        let shape = broadcast_shapes("allclose", self.shape(), other.shape())?;
        let a = crate::no_grad(|| self.broadcast_to(&shape)?.to_dtype(DType::F64)?.to_vec::<f64>())?;
        let b = crate::no_grad(|| other.broadcast_to(&shape)?.to_dtype(DType::F64)?.to_vec::<f64>())?;
        Ok(a.iter().zip(&b).all(|(x, y)| {
            if x.is_nan() || y.is_nan() {
                return false;
            }
            x == y || (x - y).abs() <= atol + rtol * y.abs()
        }))
    }
}

/// `clamped` with its NaNs (from a NaN input or bound) taking no gradient: PyTorch's clamp
/// sends the gradient to the input where `lo <= x <= hi` and to a bound where it won, and no
/// comparison with a NaN holds.
fn nan_without_gradient(clamped: Tensor) -> Result<Tensor> {
    if !(clamped.dtype().is_float() && crate::is_grad_enabled() && clamped.is_requires_grad()) {
        return Ok(clamped);
    }
    clamped.ne(&clamped)?.where_(&clamped.detach(), &clamped)
}

/// An error when `value` is outside the range of the integer dtype `dtype` (PyTorch: "value
/// cannot be converted to type uint8_t without overflow"); floats are truncated toward zero first.
pub(crate) fn check_fits(op: &'static str, value: Scalar, dtype: DType) -> Result<()> {
    let (lo, hi) = match dtype {
        DType::U8 => (0.0, 255.0),
        DType::I32 => (i32::MIN as f64, i32::MAX as f64),
        DType::I64 => (i64::MIN as f64, i64::MAX as f64),
        _ => return Ok(()),
    };
    let fits = match value {
        Scalar::Int(i) => dtype == DType::I64 || (i as f64 >= lo && i as f64 <= hi),
        Scalar::Float(f) => f.is_finite() && f.trunc() >= lo && f.trunc() <= hi,
        Scalar::Bool(_) => true,
    };
    if !fits {
        return Err(Error::arg(op, format!("value {} cannot be converted to {dtype:?} without overflow", value.to_f64())));
    }
    Ok(())
}

fn rounding_op(mode: RoundingMode) -> BinaryOp {
    match mode {
        RoundingMode::Trunc => BinaryOp::DivTrunc,
        RoundingMode::Floor => BinaryOp::DivFloor,
    }
}

/// Broadcasts `a` and `b` and runs `op` with arithmetic in the dtype `promoted` implies.
fn binary_promoted(op: BinaryOp, a: &Tensor, b: &Tensor, promoted: DType) -> Result<Tensor> {
    let compute = op.compute_dtype(promoted)?;
    if a.device() != b.device() {
        return Err(Error::DeviceMismatch { op: op.name(), a: a.device(), b: b.device() });
    }
    if op.divides() && !compute.is_float() && b.device() == crate::Device::Cpu && !crate::compile::trace::active() {
        // PyTorch's "ZeroDivisionError" on the CPU; the values are on the host already.
        let zero = crate::no_grad(|| b.eq_scalar(0)?.to_vec::<bool>())?.contains(&true);
        if zero {
            return Err(Error::arg(op.name(), "integer division by zero"));
        }
    }
    let shape = broadcast_shapes(op.name(), a.shape(), b.shape())?;
    // Comparisons in a half type compare half values, as PyTorch does: the other operand (a
    // number held in F32, a wider tensor) is rounded to the half type first.
    let (a, b) = if op.is_comparison() && compute.compute_dtype() != compute {
        (&a.to_dtype(compute)?, &b.to_dtype(compute)?)
    } else {
        (a, b)
    };
    apply(Op::Binary(op, compute), &[&a.broadcast_to(&shape)?, &b.broadcast_to(&shape)?])
}

/// `torch.where(cond, a, b)`.
#[track_caller]
pub fn where_(cond: &Tensor, a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let _site = crate::profiler::call_site();
    cond.where_(a, b)
}

macro_rules! operator {
    ($tr:ident, $f:ident, $method:ident, $scalar:ident) => {
        impl std::ops::$tr<&Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$method(&self, &rhs)
            }
        }
        impl std::ops::$tr<Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$method(&self, &rhs)
            }
        }
        impl std::ops::$tr<&Tensor> for Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: &Tensor) -> Result<Tensor> {
                Tensor::$method(&self, &rhs)
            }
        }
        impl std::ops::$tr<Tensor> for &Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: Tensor) -> Result<Tensor> {
                Tensor::$method(&self, &rhs)
            }
        }
        impl std::ops::$tr<f64> for &Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: f64) -> Result<Tensor> {
                Tensor::$scalar(&self, rhs)
            }
        }
        impl std::ops::$tr<f64> for Tensor {
            type Output = Result<Tensor>;
            fn $f(self, rhs: f64) -> Result<Tensor> {
                Tensor::$scalar(&self, rhs)
            }
        }
    };
}
operator!(Add, add, add, add_scalar);
operator!(Sub, sub, sub, sub_scalar);
operator!(Mul, mul, mul, mul_scalar);
operator!(Div, div, div, div_scalar);

impl std::ops::Neg for &Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(self)
    }
}
impl std::ops::Neg for Tensor {
    type Output = Result<Tensor>;
    fn neg(self) -> Result<Tensor> {
        Tensor::neg(&self)
    }
}
