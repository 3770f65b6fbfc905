//! Pointwise primitives, each defined once: name, dtype rule, scalar semantics (the closures the
//! backends' loops are instantiated with) and gradient (written with other ops).

use crate::backend::cpu::HostBuf;
use crate::dtype::DEFAULT_FLOAT;
use crate::{DType, Error, Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    Neg,
    Abs,
    Sign,
    Exp,
    Log,
    Log1p,
    Sin,
    Cos,
    Tanh,
    Sigmoid,
    Relu,
    GeluErf,
    GeluTanh,
    Silu,
    Sqrt,
    Rsqrt,
    Erf,
    Expm1,
    Tan,
    Floor,
    Ceil,
    /// Half to even, as `torch.round`.
    Round,
    Trunc,
    LogicalNot,
}

/// A loop over one operand that a backend provides; the op supplies the scalar function.
pub(crate) trait MapUnary<A, B> {
    fn run(self, f: impl Fn(A) -> B + Sync) -> HostBuf<B>;
    /// `fast` over every value (a loop without branches, which vectorises), then `exact` again
    /// for the few values `fast` does not cover (`covered` false).
    fn run_covered(self, fast: impl Fn(A) -> B + Sync, covered: impl Fn(A) -> bool + Sync, exact: impl Fn(A) -> B + Sync) -> HostBuf<B>;
}
/// A loop over two operands of the same shape.
pub(crate) trait MapBinary<A, B> {
    fn run(self, f: impl Fn(A, A) -> B + Sync) -> HostBuf<B>;
}

/// Floating-point compute types (f32, f64): the scalar functions pointwise ops are written in.
pub(crate) trait Real: Copy + PartialOrd + Send + Sync + 'static + std::ops::Add<Output = Self> + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self> + std::ops::Div<Output = Self> + std::ops::Neg<Output = Self>
    + std::ops::Rem<Output = Self>
{
    fn c(v: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn ln_1p(self) -> Self;
    fn sin(self) -> Self;
    fn cos(self) -> Self;
    /// sin and cos without branches where `trig_covered` holds (exact where it does not).
    fn sin_fast(self) -> Self;
    fn cos_fast(self) -> Self;
    fn trig_covered(self) -> bool;
    fn tanh(self) -> Self;
    fn sqrt(self) -> Self;
    fn abs(self) -> Self;
    fn erf(self) -> Self;
    fn powf(self, e: Self) -> Self;
    fn is_nan(self) -> bool;
    fn signum0(self) -> Self;
    fn exp_m1(self) -> Self;
    fn tan(self) -> Self;
    fn floor(self) -> Self;
    fn ceil(self) -> Self;
    fn round_ties_even(self) -> Self;
    fn trunc(self) -> Self;
    /// Zero with this value's sign.
    fn copysign0(self) -> Self;
}
macro_rules! real {
    ($t:ty, $erf:path, $tanh:path, $exp:path, $ln:path, $sin:path, $cos:path, $covered:path) => {
        impl Real for $t {
            #[inline(always)] fn c(v: f64) -> Self { v as $t }
            #[inline(always)] fn exp(self) -> Self { $exp(self) }
            #[inline(always)] fn ln(self) -> Self { $ln(self) }
            #[inline(always)] fn ln_1p(self) -> Self { <$t>::ln_1p(self) }
            #[inline(always)] fn sin(self) -> Self { <$t>::sin(self) }
            #[inline(always)] fn cos(self) -> Self { <$t>::cos(self) }
            #[inline(always)] fn sin_fast(self) -> Self { $sin(self) }
            #[inline(always)] fn cos_fast(self) -> Self { $cos(self) }
            #[inline(always)] fn trig_covered(self) -> bool { $covered(self) }
            #[inline(always)] fn tanh(self) -> Self { $tanh(self) }
            #[inline(always)] fn sqrt(self) -> Self { <$t>::sqrt(self) }
            #[inline(always)] fn abs(self) -> Self { <$t>::abs(self) }
            #[inline(always)] fn erf(self) -> Self { $erf(self) }
            #[inline(always)] fn powf(self, e: Self) -> Self { <$t>::powf(self, e) }
            #[inline(always)] fn is_nan(self) -> bool { <$t>::is_nan(self) }
            // NaN and both zeros give 0, as PyTorch's sign.
            #[inline(always)] fn signum0(self) -> Self {
                if self > 0.0 { 1.0 } else if self < 0.0 { -1.0 } else { 0.0 }
            }
            #[inline(always)] fn exp_m1(self) -> Self { <$t>::exp_m1(self) }
            #[inline(always)] fn tan(self) -> Self { <$t>::tan(self) }
            #[inline(always)] fn floor(self) -> Self { <$t>::floor(self) }
            #[inline(always)] fn ceil(self) -> Self { <$t>::ceil(self) }
            #[inline(always)] fn round_ties_even(self) -> Self { <$t>::round_ties_even(self) }
            #[inline(always)] fn trunc(self) -> Self { <$t>::trunc(self) }
            #[inline(always)] fn copysign0(self) -> Self { <$t>::copysign(0.0, self) }
        }
    };
}
real!(f32, libm::erff, tanh_f32, exp_f32, ln_f32, sin_f32, cos_f32, trig_f32_covered);
real!(f64, libm::erf, f64::tanh, f64::exp, f64::ln, f64::sin, f64::cos, everywhere);

#[inline(always)]
fn everywhere(_: f64) -> bool {
    true
}

/// Where `sin_f32` and `cos_f32` are accurate: |x| <= 8192 (three-part reduction by pi/4).
#[inline(always)]
fn trig_f32_covered(x: f32) -> bool {
    x.abs() <= 8192.0
}

/// sin or cos of |x| <= 8192 in F32 without branches (Cephes' `sinf`/`cosf`): |x| reduced by
/// pi/4 in three parts to z in [-pi/4, pi/4] and its quadrant, then sin's or cos's
/// polynomial in z; within 2 ulp of the correctly rounded value.
#[inline(always)]
fn sincos_f32(x: f32) -> (f32, f32, i32) {
    // (Values beyond are computed exactly instead; clamped, their octant fits in an i32.)
    let a = x.abs().min(8192.0);
    let mut j = (a * std::f32::consts::FRAC_2_PI * 2.0) as i32;
    j += j & 1;
    let y = j as f32;
    let z = ((a - y * 0.785_156_25) - y * 2.418_756_5e-4) - y * 3.774_895e-8;
    let zz = z * z;
    let s = z + z * zz * ((-1.951_529_6e-4 * zz + 8.332_161e-3) * zz - 0.166_666_55);
    let c = 1.0 - 0.5 * zz + zz * zz * ((2.443_315_7e-5 * zz - 1.388_731_6e-3) * zz + 4.166_664_6e-2);
    (s, c, (j >> 1) & 3)
}

#[inline(always)]
fn sin_f32(x: f32) -> f32 {
    let (s, c, q) = sincos_f32(x);
    let v = if q & 1 == 1 { c } else { s };
    let v = if q & 2 != 0 { -v } else { v };
    // Odd: x's sign (sin(-0) = -0).
    f32::from_bits(v.to_bits() ^ (x.to_bits() & 0x8000_0000))
}

#[inline(always)]
fn cos_f32(x: f32) -> f32 {
    let (s, c, q) = sincos_f32(x);
    let v = if q & 1 == 1 { s } else { c };
    if q == 1 || q == 2 { -v } else { v }
}

/// e^x in F32 without branches, so that loops over many values vectorise (the C library's
/// `expf` is a call per value); within 2 ulp of the correctly rounded value, with
/// overflow to infinity, gradual underflow and NaN as `expf`. x = n ln2 + r with |r| <= ln2/2
/// (n rounded by the 1.5 * 2^23 trick, ln2 in two parts), e^r by a degree-7 polynomial
/// (Cephes' `expf` coefficients), and 2^n applied as two powers of two so that results below
/// the normal range round once. Products and sums are fused (`mul_add`, as the generated C's
/// `fmaf`; one instruction where `cpu::wide` runs the loops): half the instructions of the
/// polynomial. Beyond [-104, 89] the result is 0 or infinity, chosen after the polynomial
/// rather than by clamping x before it, which costs the vectorised loop fewer selects. The
/// integer n is read from the bits of the rounded sum (in [2^23, 2^24), one unit apart) rather
/// than converted: no select has to guard it against NaN, since a power of two built from any
/// integer is 0, a normal number or infinity, never NaN, so a NaN x gives p's NaN.
#[inline(always)]
fn exp_f32(x: f32) -> f32 {
    const ROUND: f32 = 12_582_912.0;
    let t = x.mul_add(std::f32::consts::LOG2_E, ROUND);
    let n = t - ROUND;
    let r = n.mul_add(2.121_944_4e-4, n.mul_add(-0.693_359_4, x));
    let poly = [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5].iter().fold(1.987_569_1e-4f32, |p, &c| p.mul_add(r, c));
    let p = poly.mul_add(r * r, r) + 1.0;
    let ni = t.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let half = ni >> 1;
    let pow2 = |k: i32| f32::from_bits((k.wrapping_add(127) as u32) << 23);
    let y = p * pow2(half) * pow2(ni.wrapping_sub(half));
    if x < -104.0 {
        0.0
    } else if x > 89.0 {
        f32::INFINITY
    } else {
        y
    }
}

/// ln x in F32 without branches (see `exp_f32`); within 2 ulp of the correctly rounded value,
/// with ln 0 = -inf, ln of a negative number NaN and ln inf = inf. x = m 2^e with m in
/// [sqrt(1/2), sqrt(2)) (subnormal x scaled by 2^23 first), ln(1 + f) for f = m - 1 by Cephes'
/// `logf` polynomial, e ln2 added in two parts.
#[inline(always)]
fn ln_f32(x: f32) -> f32 {
    let tiny = x < f32::MIN_POSITIVE;
    let xs = if tiny { x * 8_388_608.0 } else { x };
    let bits = xs.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127 - if tiny { 23 } else { 0 };
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000);
    let big = m > std::f32::consts::SQRT_2;
    m = if big { m * 0.5 } else { m };
    e += big as i32;
    let f = m - 1.0;
    let z = f * f;
    let p = ((((((((7.037_683_6e-2 * f - 0.115_146_1) * f + 0.116_769_98) * f - 0.124_201_41) * f + 0.142_493_23) * f - 0.166_680_57) * f + 0.200_007_15) * f - 0.249_999_94) * f + 0.333_333_3) * f * z;
    let ef = e as f32;
    let y = (p + ef * -2.121_944_4e-4 - 0.5 * z) + f + ef * 0.693_359_4;
    let y = if x == 0.0 { f32::NEG_INFINITY } else { y };
    let y = if x == f32::INFINITY { x } else { y };
    if x < 0.0 || x.is_nan() { f32::NAN } else { y }
}

/// tanh in F32 from `exp`, a few times faster than the C library's `tanhf` (which also costs
/// GELU-tanh and its gradient) and as accurate: within 2 ulp of the correctly rounded value
/// over every fourth-or-so normal float below 16 (a test checks a sample). Below |x| = 0.4 the
/// odd Taylor polynomial to x^13 (its remainder there is under 1e-8 of the value); above,
/// 1 - 2 / (e^{2|x|} + 1) with x's sign, which loses at most a factor 1.6 to cancellation.
#[inline(always)]
fn tanh_f32(x: f32) -> f32 {
    let a = x.abs();
    if a < 0.4 {
        let x2 = x * x;
        x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 + x2 * (-17.0 / 315.0 + x2 * (62.0 / 2835.0 + x2 * (-1382.0 / 155925.0 + x2 * (21844.0 / 6081075.0)))))))
    } else {
        (1.0 - 2.0 / ((2.0 * a).exp() + 1.0)).copysign(x)
    }
}

const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;
const FRAC_1_SQRT_2: f64 = std::f64::consts::FRAC_1_SQRT_2;
const FRAC_2_SQRT_PI: f64 = std::f64::consts::FRAC_2_SQRT_PI;

impl UnaryOp {
    pub fn name(self) -> &'static str {
        use UnaryOp::*;
        match self {
            Neg => "neg",
            Abs => "abs",
            Sign => "sign",
            Exp => "exp",
            Log => "log",
            Log1p => "log1p",
            Sin => "sin",
            Cos => "cos",
            Tanh => "tanh",
            Sigmoid => "sigmoid",
            Relu => "relu",
            GeluErf => "gelu",
            GeluTanh => "gelu_tanh",
            Silu => "silu",
            Sqrt => "sqrt",
            Rsqrt => "rsqrt",
            Erf => "erf",
            Expm1 => "expm1",
            Tan => "tan",
            Floor => "floor",
            Ceil => "ceil",
            Round => "round",
            Trunc => "trunc",
            LogicalNot => "logical_not",
        }
    }

    /// Ops that keep integer inputs integer; the rest compute in floating point.
    fn keeps_ints(self) -> bool {
        use UnaryOp::*;
        matches!(self, Neg | Abs | Sign | Relu | Floor | Ceil | Round | Trunc)
    }

    pub(crate) fn out_dtype(self, x: DType) -> Result<DType> {
        if self == UnaryOp::LogicalNot {
            return Ok(DType::Bool);
        }
        if x == DType::Bool && self.keeps_ints() {
            return Err(Error::dtype(self.name(), x, "not defined for bool tensors"));
        }
        Ok(if x.is_float() || self.keeps_ints() { x } else { DEFAULT_FLOAT })
    }

    /// Whether the backward needs the input (`true, _`) and/or the output (`_, true`).
    pub(crate) fn saves(self) -> (bool, bool) {
        use UnaryOp::*;
        match self {
            Neg | Sign | LogicalNot | Floor | Ceil | Round | Trunc => (false, false),
            Exp | Expm1 | Tan | Tanh | Sigmoid | Relu | Sqrt | Rsqrt => (false, true),
            _ => (true, false),
        }
    }

    pub(crate) fn differentiable(self) -> bool {
        self != UnaryOp::LogicalNot
    }

    /// The scalar function in floating point.
    pub(crate) fn real<F: Real>(self, m: impl MapUnary<F, F>) -> HostBuf<F> {
        use UnaryOp::*;
        let c = F::c;
        match self {
            Neg => m.run(|x| -x),
            Abs => m.run(|x| x.abs()),
            Sign => m.run(|x| x.signum0()),
            Exp => m.run(|x| x.exp()),
            Log => m.run(|x| x.ln()),
            Log1p => m.run(|x| x.ln_1p()),
            Sin => m.run_covered(|x| x.sin_fast(), |x| x.trig_covered(), |x| x.sin()),
            Cos => m.run_covered(|x| x.cos_fast(), |x| x.trig_covered(), |x| x.cos()),
            Tanh => m.run(|x| x.tanh()),
            Sigmoid => m.run(|x| c(1.0) / (c(1.0) + (-x).exp())),
            // NaN stays NaN, as in PyTorch.
            Relu => m.run(|x| if x > c(0.0) || x.is_nan() { x } else { c(0.0) }),
            GeluErf => m.run(|x| c(0.5) * x * (c(1.0) + (x * c(FRAC_1_SQRT_2)).erf())),
            GeluTanh => m.run(|x| {
                c(0.5) * x * (c(1.0) + (c(SQRT_2_OVER_PI) * (x + c(0.044715) * x * x * x)).tanh())
            }),
            Silu => m.run(|x| x / (c(1.0) + (-x).exp())),
            Sqrt => m.run(|x| x.sqrt()),
            Rsqrt => m.run(|x| c(1.0) / x.sqrt()),
            Erf => m.run(|x| x.erf()),
            Expm1 => m.run(|x| x.exp_m1()),
            Tan => m.run(|x| x.tan()),
            Floor => m.run(|x| x.floor()),
            Ceil => m.run(|x| x.ceil()),
            Round => m.run(|x| x.round_ties_even()),
            Trunc => m.run(|x| x.trunc()),
            LogicalNot => unreachable!("logical_not is evaluated by `logical`"),
        }
    }

    /// The scalar function on integers (only for ops that keep integers).
    pub(crate) fn int(self, m: impl MapUnary<i64, i64>) -> HostBuf<i64> {
        match self {
            UnaryOp::Neg => m.run(|x| x.wrapping_neg()),
            UnaryOp::Abs => m.run(|x| x.wrapping_abs()),
            UnaryOp::Sign => m.run(|x| x.signum()),
            UnaryOp::Relu => m.run(|x| x.max(0)),
            UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Trunc => m.run(|x| x),
            _ => unreachable!("{} computes in floating point", self.name()),
        }
    }

    pub(crate) fn logical(self, m: impl MapUnary<bool, bool>) -> HostBuf<bool> {
        debug_assert_eq!(self, UnaryOp::LogicalNot);
        m.run(|x| !x)
    }

    /// d(input) from the incoming gradient `g`, the input `x` and the output `y` (each present
    /// when `saves` asked for it).
    pub(crate) fn backward(self, x: Option<&Tensor>, y: Option<&Tensor>, g: &Tensor) -> Result<Tensor> {
        use UnaryOp::*;
        // PyTorch's CUDA backward kernels of GELU and SiLU compute a 16-bit gradient in F32 and
        // round once (a chain of 16-bit ops would round at each step, hundreds of units in the
        // last place apart); its tanh and sigmoid ones round after each op, as the chains below.
        if matches!(self, GeluErf | GeluTanh | Silu) && matches!(g.dtype(), DType::F16 | DType::BF16) {
            let wide = |t: Option<&Tensor>| t.map(|t| t.to_dtype(DType::F32)).transpose();
            let (xw, yw) = (wide(x)?, wide(y)?);
            return self.backward(xw.as_ref(), yw.as_ref(), &g.to_dtype(DType::F32)?)?.to_dtype(g.dtype());
        }
        let x = || x.expect("input saved");
        let y = || y.expect("output saved");
        match self {
            Neg => g.neg(),
            Abs => g.mul(&x().sign()?),
            Exp => g.mul(y()),
            Log => g.div(x()),
            Log1p => g.div(&x().add_scalar(1.0)?),
            Sin => g.mul(&x().cos()?),
            Cos => g.mul(&x().sin()?)?.neg(),
            Tanh => g.mul(&y().mul(y())?.rsub_scalar(1.0)?),
            // (g (1 - y)) y, in PyTorch's order (16-bit dtypes round after each op).
            Sigmoid => g.mul(&y().rsub_scalar(1.0)?)?.mul(y()),
            // Where the output is not above zero; NaN passes its gradient, as in PyTorch.
            Relu => g.masked_fill(&y().le_scalar(0.0)?, 0.0),
            GeluErf => {
                // Φ(x) + x φ(x)
                let x = x();
                let cdf = x.mul_scalar(FRAC_1_SQRT_2)?.erf()?.add_scalar(1.0)?.mul_scalar(0.5)?;
                let pdf = x.mul(x)?.mul_scalar(-0.5)?.exp()?.mul_scalar(FRAC_2_SQRT_PI * FRAC_1_SQRT_2 * 0.5)?;
                g.mul(&cdf.add(&x.mul(&pdf)?)?)
            }
            GeluTanh => {
                let x = x();
                let x2 = x.mul(x)?;
                let inner = x.add(&x2.mul(x)?.mul_scalar(0.044715)?)?.mul_scalar(SQRT_2_OVER_PI)?;
                let t = inner.tanh()?;
                let dinner = x2.mul_scalar(3.0 * 0.044715)?.add_scalar(1.0)?.mul_scalar(SQRT_2_OVER_PI)?;
                let left = t.add_scalar(1.0)?.mul_scalar(0.5)?;
                let right = x.mul(&t.mul(&t)?.rsub_scalar(1.0)?)?.mul(&dinner)?.mul_scalar(0.5)?;
                g.mul(&left.add(&right)?)
            }
            Silu => {
                let x = x();
                let s = x.sigmoid()?;
                g.mul(&s.mul(&x.mul(&s.rsub_scalar(1.0)?)?.add_scalar(1.0)?)?)
            }
            Sqrt => g.div(&y().mul_scalar(2.0)?),
            Rsqrt => g.mul(&y().mul(y())?.mul(y())?.mul_scalar(-0.5)?),
            Erf => g.mul(&x().mul(x())?.neg()?.exp()?.mul_scalar(FRAC_2_SQRT_PI)?),
            Expm1 => g.mul(&y().add_scalar(1.0)?),
            Tan => g.mul(&y().mul(y())?.add_scalar(1.0)?),
            // Piecewise constant: a zero gradient, as PyTorch defines it.
            Sign | Floor | Ceil | Round | Trunc => Tensor::zeros(g.shape(), g.dtype(), &g.device()),
            LogicalNot => unreachable!("not differentiable"),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Maximum,
    Minimum,
    /// Division rounded toward zero (`div(rounding_mode="trunc")`).
    DivTrunc,
    /// Division rounded down (`div(rounding_mode="floor")`, `//`).
    DivFloor,
    /// The remainder of a floor division: the divisor's sign (`torch.remainder`, Python's `%`).
    Remainder,
    /// The remainder of a truncating division: the dividend's sign (`torch.fmod`, C's `fmod`).
    Fmod,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    LogicalAnd,
    LogicalOr,
    LogicalXor,
}

impl BinaryOp {
    pub fn name(self) -> &'static str {
        use BinaryOp::*;
        match self {
            Add => "add",
            Sub => "sub",
            Mul => "mul",
            Div => "div",
            Pow => "pow",
            Maximum => "maximum",
            Minimum => "minimum",
            DivTrunc => "div_trunc",
            DivFloor => "div_floor",
            Remainder => "remainder",
            Fmod => "fmod",
            Eq => "eq",
            Ne => "ne",
            Lt => "lt",
            Le => "le",
            Gt => "gt",
            Ge => "ge",
            LogicalAnd => "logical_and",
            LogicalOr => "logical_or",
            LogicalXor => "logical_xor",
        }
    }
    pub(crate) fn is_comparison(self) -> bool {
        use BinaryOp::*;
        matches!(self, Eq | Ne | Lt | Le | Gt | Ge)
    }
    pub(crate) fn is_logical(self) -> bool {
        matches!(self, BinaryOp::LogicalAnd | BinaryOp::LogicalOr | BinaryOp::LogicalXor)
    }
    pub(crate) fn differentiable(self) -> bool {
        !self.is_comparison() && !self.is_logical()
    }
    /// Integer ops whose divisor must not be zero.
    pub(crate) fn divides(self) -> bool {
        use BinaryOp::*;
        matches!(self, DivTrunc | DivFloor | Remainder | Fmod)
    }

    /// The dtype the arithmetic runs in, from the operands' promoted dtype.
    pub(crate) fn compute_dtype(self, promoted: DType) -> Result<DType> {
        if self.is_logical() {
            return Ok(DType::Bool);
        }
        if self == BinaryOp::Sub && promoted == DType::Bool {
            return Err(Error::dtype("sub", promoted, "subtracting bool tensors is not supported; use logical_xor"));
        }
        Ok(if self == BinaryOp::Div && !promoted.is_float() { DEFAULT_FLOAT } else { promoted })
    }

    pub(crate) fn out_dtype(self, compute: DType) -> DType {
        if self.is_comparison() || self.is_logical() {
            DType::Bool
        } else {
            compute
        }
    }

    /// Whether backward needs the inputs and/or the output.
    pub(crate) fn saves(self) -> (bool, bool) {
        use BinaryOp::*;
        match self {
            Add | Sub | DivTrunc | DivFloor => (false, false),
            Pow => (true, true),
            _ => (true, false),
        }
    }

    pub(crate) fn real<F: Real>(self, m: impl MapBinary<F, F>) -> HostBuf<F> {
        use BinaryOp::*;
        match self {
            Add => m.run(|a, b| a + b),
            Sub => m.run(|a, b| a - b),
            Mul => m.run(|a, b| a * b),
            Div => m.run(|a, b| a / b),
            Pow => m.run(|a, b| a.powf(b)),
            Maximum => m.run(|a, b| if a > b || a.is_nan() { a } else { b }),
            Minimum => m.run(|a, b| if a < b || a.is_nan() { a } else { b }),
            DivTrunc => m.run(|a, b| (a / b).trunc()),
            DivFloor => m.run(floor_div),
            Remainder => m.run(|a, b| {
                let r = a % b;
                if r != F::c(0.0) && ((b < F::c(0.0)) != (r < F::c(0.0))) { r + b } else { r }
            }),
            Fmod => m.run(|a, b| a % b),
            _ => unreachable!("{} does not produce numbers", self.name()),
        }
    }

    pub(crate) fn int(self, m: impl MapBinary<i64, i64>) -> HostBuf<i64> {
        use BinaryOp::*;
        match self {
            Add => m.run(|a, b| a.wrapping_add(b)),
            Sub => m.run(|a, b| a.wrapping_sub(b)),
            Mul => m.run(|a, b| a.wrapping_mul(b)),
            // Negative integer powers are 0 except of ±1, as in PyTorch.
            Pow => m.run(|a, b| {
                if b >= 0 {
                    a.wrapping_pow(b.min(u32::MAX as i64) as u32)
                } else if a == 1 {
                    1
                } else if a == -1 {
                    if b % 2 == 0 { 1 } else { -1 }
                } else {
                    0
                }
            }),
            Maximum => m.run(|a, b| a.max(b)),
            Minimum => m.run(|a, b| a.min(b)),
            // A zero divisor gives 0 here; eager CPU calls report it first (`divides`).
            DivTrunc => m.run(|a, b| if b == 0 { 0 } else { a.wrapping_div(b) }),
            DivFloor => m.run(|a, b| {
                if b == 0 {
                    return 0;
                }
                let (q, r) = (a.wrapping_div(b), a.wrapping_rem(b));
                if r != 0 && ((r < 0) != (b < 0)) { q.wrapping_sub(1) } else { q }
            }),
            Remainder => m.run(|a, b| {
                if b == 0 {
                    return 0;
                }
                let r = a.wrapping_rem(b);
                if r != 0 && ((r < 0) != (b < 0)) { r.wrapping_add(b) } else { r }
            }),
            Fmod => m.run(|a, b| if b == 0 { 0 } else { a.wrapping_rem(b) }),
            _ => unreachable!("{} does not produce integers", self.name()),
        }
    }

    pub(crate) fn compare<T: PartialOrd>(self, m: impl MapBinary<T, bool>) -> HostBuf<bool> {
        use BinaryOp::*;
        match self {
            Eq => m.run(|a, b| a == b),
            Ne => m.run(|a, b| a != b),
            Lt => m.run(|a, b| a < b),
            Le => m.run(|a, b| a <= b),
            Gt => m.run(|a, b| a > b),
            Ge => m.run(|a, b| a >= b),
            _ => unreachable!("{} is not a comparison", self.name()),
        }
    }

    pub(crate) fn logical(self, m: impl MapBinary<bool, bool>) -> HostBuf<bool> {
        use BinaryOp::*;
        match self {
            LogicalAnd => m.run(|a, b| a && b),
            LogicalOr => m.run(|a, b| a || b),
            LogicalXor => m.run(|a, b| a != b),
            _ => unreachable!("{} is not logical", self.name()),
        }
    }

    /// Gradients for (a, b); `want` says which are needed.
    pub(crate) fn backward(
        self,
        a: Option<&Tensor>,
        b: Option<&Tensor>,
        y: Option<&Tensor>,
        g: &Tensor,
        want: [bool; 2],
    ) -> Result<[Option<Tensor>; 2]> {
        use BinaryOp::*;
        let a = || a.expect("input saved");
        let b = || b.expect("input saved");
        let (ga, gb): (Option<Tensor>, Option<Tensor>) = match self {
            Add => (Some(g.clone()), want[1].then(|| g.clone())),
            Sub => (Some(g.clone()), if want[1] { Some(g.neg()?) } else { None }),
            Mul => (
                if want[0] { Some(g.mul(b())?) } else { None },
                if want[1] { Some(g.mul(a())?) } else { None },
            ),
            Div => (
                if want[0] { Some(g.div(b())?) } else { None },
                if want[1] { Some(g.mul(a())?.div(&b().mul(b())?)?.neg()?) } else { None },
            ),
            Pow => {
                let ga = if want[0] {
                    // b * a^(b-1), and 0 where b == 0 (PyTorch's pow_backward_self)
                    let d = b().mul(&a().pow(&b().sub_scalar(1.0)?)?)?;
                    Some(g.mul(&d.masked_fill(&b().eq_scalar(0.0)?, 0.0)?)?)
                } else {
                    None
                };
                let gb = if want[1] {
                    // y * ln(a), and 0 where a == 0 and b >= 0 (PyTorch's pow_backward_exponent)
                    let d = y.expect("output saved").mul(&a().log()?)?;
                    let mask = a().eq_scalar(0.0)?.logical_and(&b().ge_scalar(0.0)?)?;
                    Some(g.mul(&d.masked_fill(&mask, 0.0)?)?)
                } else {
                    None
                };
                (ga, gb)
            }
            Maximum | Minimum => {
                // Ties split the gradient in half, as in PyTorch.
                let half = a().eq(b())?.where_(&g.mul_scalar(0.5)?, g)?;
                let a_loses = if self == Maximum { a().lt(b())? } else { a().gt(b())? };
                let b_loses = if self == Maximum { a().gt(b())? } else { a().lt(b())? };
                (
                    if want[0] { Some(half.masked_fill(&a_loses, 0.0)?) } else { None },
                    if want[1] { Some(half.masked_fill(&b_loses, 0.0)?) } else { None },
                )
            }
            // Piecewise constant in both operands, as PyTorch defines them.
            DivTrunc | DivFloor => {
                let zeros = || Tensor::zeros(g.shape(), g.dtype(), &g.device());
                (if want[0] { Some(zeros()?) } else { None }, if want[1] { Some(zeros()?) } else { None })
            }
            // a - q b with q piecewise constant: d/da = 1, d/db = -q.
            Remainder | Fmod => {
                let q = if self == Remainder { a().div_mode(b(), crate::RoundingMode::Floor)? } else { a().div_mode(b(), crate::RoundingMode::Trunc)? };
                (Some(g.clone()), if want[1] { Some(g.mul(&q)?.neg()?) } else { None })
            }
            _ => unreachable!("{} is not differentiable", self.name()),
        };
        Ok([ga.filter(|_| want[0]), gb])
    }
}

/// Floor division of floats as PyTorch computes it (`div_floor_floating`): from `fmod`, so that
/// `a == b * floor_div(a, b) + remainder(a, b)` holds where it can, and the quotient is exact
/// where `floor(a / b)` would round up.
fn floor_div<F: Real>(a: F, b: F) -> F {
    let zero = F::c(0.0);
    if b == zero {
        return a / b;
    }
    let m = a % b;
    let mut div = (a - m) / b;
    if m != zero && ((b < zero) != (m < zero)) {
        div = div - F::c(1.0);
    }
    if div != zero {
        let f = div.floor();
        if div - f > F::c(0.5) { f + F::c(1.0) } else { f }
    } else {
        (a / b).copysign0()
    }
}

/// The CUDA C expression of each op, over variables of compute type `t` (the generator in
/// backend::cuda::kernels::codegen declares them). One table per op kind, beside the scalar functions
/// above, so an op's semantics stay in this file.
mod cuda {
    use super::{BinaryOp, UnaryOp};
    use crate::dtype::CType;
    use crate::DType;

    /// `name` with the float suffix (`expf`) when computing in f32.
    fn m(name: &str, t: CType) -> String {
        if t == CType::F32 { format!("{name}f") } else { name.to_string() }
    }

    impl UnaryOp {
        /// The type the op computes in for a result of dtype `out`, on either backend's
        /// generated code: logical not in bool, the rest in the result's compute type.
        pub(crate) fn compute_type(self, out: DType) -> CType {
            if self == UnaryOp::LogicalNot { CType::Bool } else { CType::of(out) }
        }

        pub(crate) fn cuda(self, x: &str, t: CType) -> String {
            use UnaryOp::*;
            let ty = t.name();
            if t == CType::I64 {
                return match self {
                    Neg => format!("(long long)(0ull - (unsigned long long){x})"),
                    Abs => format!("({x} < 0 ? (long long)(0ull - (unsigned long long){x}) : {x})"),
                    Sign => format!("(long long)(({x} > 0) - ({x} < 0))"),
                    Relu => format!("({x} > 0 ? {x} : 0ll)"),
                    Floor | Ceil | Round | Trunc => x.to_string(),
                    _ => unreachable!("{} computes in floating point", self.name()),
                };
            }
            match self {
                Neg => format!("(-{x})"),
                Abs => format!("{}({x})", m("fabs", t)),
                Sign => format!("({x} > ({ty})0 ? ({ty})1 : ({x} < ({ty})0 ? ({ty})-1 : ({ty})0))"),
                Exp => format!("{}({x})", m("exp", t)),
                Log => format!("{}({x})", m("log", t)),
                Log1p => format!("{}({x})", m("log1p", t)),
                Sin => format!("{}({x})", m("sin", t)),
                Cos => format!("{}({x})", m("cos", t)),
                Tanh => format!("{}({x})", m("tanh", t)),
                Sigmoid => format!("(({ty})1 / (({ty})1 + {}(-{x})))", m("exp", t)),
                Relu => format!("(({x} > ({ty})0 || {x} != {x}) ? {x} : ({ty})0)"),
                GeluErf => format!("(({ty})0.5 * {x} * (({ty})1 + {}({x} * ({ty})0.7071067811865476)))", m("erf", t)),
                GeluTanh => format!(
                    "(({ty})0.5 * {x} * (({ty})1 + {}(({ty})0.7978845608028654 * ({x} + ({ty})0.044715 * {x} * {x} * {x}))))",
                    m("tanh", t)
                ),
                Silu => format!("({x} / (({ty})1 + {}(-{x})))", m("exp", t)),
                Sqrt => format!("{}({x})", m("sqrt", t)),
                Rsqrt => format!("(({ty})1 / {}({x}))", m("sqrt", t)),
                Erf => format!("{}({x})", m("erf", t)),
                Expm1 => format!("{}({x})", m("expm1", t)),
                Tan => format!("{}({x})", m("tan", t)),
                Floor => format!("{}({x})", m("floor", t)),
                Ceil => format!("{}({x})", m("ceil", t)),
                Round => format!("{}({x})", m("rint", t)),
                Trunc => format!("{}({x})", m("trunc", t)),
                LogicalNot => format!("(!{x})"),
            }
        }
    }

    impl BinaryOp {
        /// (operand type, result type) for operands promoted to `compute`: logical ops in
        /// bool, arithmetic on bools in integers (as the CPU loops), comparisons give bools.
        pub(crate) fn compute_types(self, compute: DType) -> (CType, CType) {
            let t = if self.is_logical() {
                CType::Bool
            } else if !self.is_comparison() && compute == DType::Bool {
                CType::I64
            } else {
                CType::of(compute)
            };
            (t, if self.is_comparison() || self.is_logical() { CType::Bool } else { t })
        }

        pub(crate) fn cuda(self, a: &str, b: &str, t: CType) -> String {
            use BinaryOp::*;
            let wrap = |op: &str| format!("(long long)((unsigned long long){a} {op} (unsigned long long){b})");
            match self {
                Add if t == CType::I64 => wrap("+"),
                Sub if t == CType::I64 => wrap("-"),
                Mul if t == CType::I64 => wrap("*"),
                Pow if t == CType::I64 => format!("kipow({a}, {b})"),
                // Overloaded by type in the prelude.
                DivTrunc => format!("kdivtrunc({a}, {b})"),
                DivFloor => format!("kdivfloor({a}, {b})"),
                Remainder => format!("kremainder({a}, {b})"),
                Fmod => format!("kfmod({a}, {b})"),
                Add => format!("({a} + {b})"),
                Sub => format!("({a} - {b})"),
                Mul => format!("({a} * {b})"),
                Div => format!("({a} / {b})"),
                Pow => format!("{}({a}, {b})", m("pow", t)),
                Maximum if t == CType::I64 => format!("({a} > {b} ? {a} : {b})"),
                Minimum if t == CType::I64 => format!("({a} < {b} ? {a} : {b})"),
                Maximum => format!("(({a} > {b} || {a} != {a}) ? {a} : {b})"),
                Minimum => format!("(({a} < {b} || {a} != {a}) ? {a} : {b})"),
                Eq => format!("({a} == {b})"),
                Ne => format!("({a} != {b})"),
                Lt => format!("({a} < {b})"),
                Le => format!("({a} <= {b})"),
                Gt => format!("({a} > {b})"),
                Ge => format!("({a} >= {b})"),
                LogicalAnd => format!("({a} && {b})"),
                LogicalOr => format!("({a} || {b})"),
                LogicalXor => format!("({a} != {b})"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// The largest distance in ulp between `f` and the F64 function rounded to F32, over every
    /// 4099th float of `bits` with both signs when `signs`.
    fn worst_ulp(f: fn(f32) -> f32, want: fn(f64) -> f64, bits: std::ops::Range<u32>, signs: bool) -> u64 {
        let mut worst = 0;
        for b in bits.step_by(4099) {
            let x = f32::from_bits(b);
            for x in if signs { vec![x, -x] } else { vec![x] } {
                let w = want(x as f64) as f32;
                let got = f(x);
                if w.is_nan() {
                    assert!(got.is_nan(), "{x}: got {got}, want NaN");
                    continue;
                }
                worst = worst.max((got.to_bits() as i64 - w.to_bits() as i64).unsigned_abs());
            }
        }
        worst
    }

    #[test]
    fn f32_sin_and_cos_are_within_two_ulp_where_they_cover() {
        // Every 4099th float up to 8192, both signs; beyond, the C library's (run_covered).
        let top = 8192.0f32.to_bits() + 1;
        let w = worst_ulp(super::sin_f32, f64::sin, 1..top, true);
        assert!(w <= 2, "sin: {w} ulp");
        let w = worst_ulp(super::cos_f32, f64::cos, 1..top, true);
        assert!(w <= 2, "cos: {w} ulp");
        assert!(!super::trig_f32_covered(8192.5) && !super::trig_f32_covered(f32::NAN) && !super::trig_f32_covered(f32::INFINITY));
        assert!(super::sin_f32(-0.0).is_sign_negative() && super::sin_f32(0.0) == 0.0 && super::cos_f32(0.0) == 1.0);
    }

    #[test]
    fn f32_exp_and_ln_are_within_two_ulp_of_the_rounded_f64_values() {
        // exp over every float from the smallest subnormal to 104 (both signs: overflow to inf,
        // gradual underflow to 0).
        let w = worst_ulp(super::exp_f32, f64::exp, 1..0x42d0_0000, true);
        assert!(w <= 2, "exp: {w} ulp");
        // ln over every positive float, subnormals included.
        let w = worst_ulp(super::ln_f32, f64::ln, 1..0x7f80_0000, false);
        assert!(w <= 2, "ln: {w} ulp");
        for (x, want) in [(0.0f32, 1.0f32), (-0.0, 1.0), (f32::INFINITY, f32::INFINITY), (f32::NEG_INFINITY, 0.0), (88.8, f32::INFINITY), (-200.0, 0.0)] {
            assert_eq!(super::exp_f32(x), want, "exp({x})");
        }
        for (x, want) in [(1.0f32, 0.0f32), (0.0, f32::NEG_INFINITY), (-0.0, f32::NEG_INFINITY), (f32::INFINITY, f32::INFINITY)] {
            assert_eq!(super::ln_f32(x), want, "ln({x})");
        }
        for x in [f32::NAN, -1.0, f32::NEG_INFINITY, -1e-40] {
            assert!(super::ln_f32(x).is_nan(), "ln({x})");
        }
        assert!(super::exp_f32(f32::NAN).is_nan());
    }

    #[test]
    fn f32_tanh_is_within_two_ulp_of_the_rounded_f64_value() {
        // Every 4099th float from the smallest normal to 16, both signs.
        let worst = worst_ulp(super::tanh_f32, f64::tanh, 0x0080_0000..0x4180_0000, true);
        assert!(worst <= 2, "{worst} ulp");
        for (x, want) in [(0.0f32, 0.0f32), (f32::INFINITY, 1.0), (f32::NEG_INFINITY, -1.0), (30.0, 1.0), (1e-30, 1e-30)] {
            assert_eq!(super::tanh_f32(x), want);
        }
        assert!(super::tanh_f32(-0.0).is_sign_negative() && super::tanh_f32(f32::NAN).is_nan());
    }
}
