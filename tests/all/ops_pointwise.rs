//! Pointwise ops against f64 reference loops: every unary and binary op (tensor, scalar and
//! reversed-scalar forms), clamp, where, masked_fill, in F32/F64/F16/BF16 on contiguous,
//! broadcast and non-contiguous inputs; NaN propagation; integer arithmetic.

use crate::common::*;
use crate::ops::*;
use kiln::prelude::*;
use kiln::Error;

// ---- reference functions ----

/// erf by its Maclaurin series (accurate to ~1e-15 for |x| <= 3; the tests stay within that).
fn erf_ref(x: f64) -> f64 {
    assert!(x.abs() <= 4.0, "erf_ref is only used for |x| <= 4");
    let (mut sum, mut term) = (0.0f64, x);
    for n in 0..400 {
        let add = term / (2 * n + 1) as f64;
        sum += add;
        if add.abs() < 1e-18 * sum.abs().max(1e-300) {
            break;
        }
        term *= -x * x / (n + 1) as f64;
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

fn sigmoid_ref(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Un {
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
    Gelu,
    GeluTanh,
    Silu,
    Sqrt,
    Rsqrt,
    Erf,
    Not,
}
use Un::*;
const UNARY: [Un; 18] =
    [Neg, Abs, Sign, Exp, Log, Log1p, Sin, Cos, Tanh, Sigmoid, Relu, Gelu, GeluTanh, Silu, Sqrt, Rsqrt, Erf, Not];

impl Un {
    fn run(self, x: &Tensor) -> kiln::Result<Tensor> {
        match self {
            Neg => x.neg(),
            Abs => x.abs(),
            Sign => x.sign(),
            Exp => x.exp(),
            Log => x.log(),
            Log1p => x.log1p(),
            Sin => x.sin(),
            Cos => x.cos(),
            Tanh => x.tanh(),
            Sigmoid => x.sigmoid(),
            Relu => x.relu(),
            Gelu => x.gelu(),
            GeluTanh => x.gelu_tanh(),
            Silu => x.silu(),
            Sqrt => x.sqrt(),
            Rsqrt => x.rsqrt(),
            Erf => x.erf(),
            Not => x.logical_not(),
        }
    }
    fn host(self, x: f64) -> f64 {
        match self {
            Neg => -x,
            Abs => x.abs(),
            Sign => {
                if x > 0.0 {
                    1.0
                } else if x < 0.0 {
                    -1.0
                } else {
                    x
                }
            }
            Exp => x.exp(),
            Log => x.ln(),
            Log1p => x.ln_1p(),
            Sin => x.sin(),
            Cos => x.cos(),
            Tanh => x.tanh(),
            Sigmoid => sigmoid_ref(x),
            Relu => {
                if x > 0.0 {
                    x
                } else {
                    0.0
                }
            }
            Gelu => 0.5 * x * (1.0 + erf_ref(x / std::f64::consts::SQRT_2)),
            GeluTanh => {
                let k = (2.0 / std::f64::consts::PI).sqrt();
                0.5 * x * (1.0 + (k * (x + 0.044715 * x * x * x)).tanh())
            }
            Silu => x * sigmoid_ref(x),
            Sqrt => x.sqrt(),
            Rsqrt => 1.0 / x.sqrt(),
            Erf => erf_ref(x),
            Not => (x == 0.0) as u8 as f64,
        }
    }
    /// Maps a value in [-2, 2) into the op's domain (and makes zeros where they matter).
    fn domain(self, r: f64) -> f64 {
        match self {
            Log | Sqrt | Rsqrt => r.abs() + 0.1,
            Log1p => r * 0.45,
            Sign | Relu => (r * 2.0).round() / 2.0,
            Not => {
                if r < -0.5 {
                    0.0
                } else {
                    r
                }
            }
            _ => r,
        }
    }
    fn trans(self) -> bool {
        !matches!(self, Neg | Abs | Sign | Relu | Not)
    }
    fn out(self, dt: DType) -> DType {
        if self == Not {
            DType::Bool
        } else {
            dt
        }
    }
}

#[test]
fn unary_ops_all_float_dtypes_and_layouts() {
    for dt in FLOATS {
        for op in UNARY {
            for lay in LAYOUTS {
                let (x, xv) = make2(3, 4, lay, dt, 7, |r| op.domain(r));
                let want: Vec<f64> = xv.iter().map(|&v| op.host(v)).collect();
                let (rtol, atol) = tol(op.out(dt), op.trans());
                let ctx = format!("{op:?} {dt:?} {lay:?}");
                check(&ctx, &op.run(&x).unwrap(), &[3, 4], op.out(dt), &want, rtol, atol);
            }
            // 0-dim and empty inputs keep their shapes
            let s = op.run(&t0(op.domain(0.7), dt)).unwrap();
            check(&format!("{op:?} {dt:?} 0-dim"), &s, &[], op.out(dt), &[op.host(round_to(dt, op.domain(0.7)))], tol(dt, true).0, tol(dt, true).1);
            let e = op.run(&t(&[], &[2, 0], dt)).unwrap();
            assert_eq!((e.shape(), e.dtype()), (&[2usize, 0][..], op.out(dt)), "{op:?} {dt:?} empty");
        }
    }
}

#[test]
fn unary_ops_on_a_larger_tensor() {
    // Large enough for the parallel loops (> 2^15 elements), with a strided view.
    for dt in FLOATS {
        for op in UNARY {
            let (b, bv) = inputs(&[300, 250], 3, dt, |r| op.domain(r));
            let x = b.slice(1, 0, 250, 2).unwrap();
            let want: Vec<f64> = (0..300).flat_map(|i| (0..125).map(move |j| (i, j))).map(|(i, j)| op.host(bv[i * 250 + 2 * j])).collect();
            let (rtol, atol) = tol(op.out(dt), op.trans());
            check(&format!("{op:?} {dt:?} large"), &op.run(&x).unwrap(), &[300, 125], op.out(dt), &want, rtol, atol);
        }
    }
}

#[test]
fn unary_special_values() {
    let inf = f64::INFINITY;
    let nan = f64::NAN;
    for dt in FLOATS {
        let x = t(&[0.0, -1.0, inf, -inf, nan], &[5], dt);
        let ctx = |s: &str| format!("{s} {dt:?}");
        close(&ctx("log"), &vals(&x.log().unwrap()), &[-inf, nan, inf, nan, nan], 0.0, 0.0);
        close(&ctx("sqrt"), &vals(&x.sqrt().unwrap()), &[0.0, nan, inf, nan, nan], 0.0, 0.0);
        close(&ctx("rsqrt"), &vals(&x.rsqrt().unwrap()), &[inf, nan, 0.0, nan, nan], 0.0, 0.0);
        close(&ctx("exp"), &vals(&x.exp().unwrap()), &[1.0, round_to(dt, (-1.0f64).exp()), inf, 0.0, nan], tol(dt, true).0, 0.0);
        close(&ctx("log1p"), &vals(&x.log1p().unwrap()), &[0.0, -inf, inf, nan, nan], 0.0, 0.0);
        close(&ctx("tanh"), &vals(&x.tanh().unwrap()), &[0.0, round_to(dt, (-1.0f64).tanh()), 1.0, -1.0, nan], tol(dt, true).0, 0.0);
        close(&ctx("sigmoid"), &vals(&x.sigmoid().unwrap()), &[0.5, round_to(dt, sigmoid_ref(-1.0)), 1.0, 0.0, nan], tol(dt, true).0, 0.0);
        close(&ctx("erf"), &vals(&x.erf().unwrap()), &[0.0, round_to(dt, erf_ref(-1.0)), 1.0, -1.0, nan], tol(dt, true).0, 0.0);
        close(&ctx("relu"), &vals(&x.relu().unwrap()), &[0.0, 0.0, inf, 0.0, nan], 0.0, 0.0);
        close(&ctx("abs"), &vals(&x.abs().unwrap()), &[0.0, 1.0, inf, inf, nan], 0.0, 0.0);
        close(&ctx("neg"), &vals(&x.neg().unwrap()), &[0.0, 1.0, -inf, inf, nan], 0.0, 0.0);
        close(&ctx("sign"), &vals(&x.sign().unwrap())[..4], &[0.0, -1.0, 1.0, -1.0], 0.0, 0.0);
        close(&ctx("logical_not"), &vals(&x.logical_not().unwrap()), &[1.0, 0.0, 0.0, 0.0, 0.0], 0.0, 0.0);
    }
    // saturation far out in the tails, F32 and F64
    for dt in [DType::F32, DType::F64] {
        let x = t(&[-100.0, 100.0, -30.0, 30.0], &[4], dt);
        let (rtol, atol) = (tol(dt, true).0, 0.0);
        let want = |f: fn(f64) -> f64| [-100.0, 100.0, -30.0, 30.0].map(f).to_vec();
        close(&format!("sigmoid tails {dt:?}"), &vals(&x.sigmoid().unwrap()), &want(sigmoid_ref), rtol, 1e-30);
        close(&format!("silu tails {dt:?}"), &vals(&x.silu().unwrap()), &want(|v| v * sigmoid_ref(v)), rtol, 1e-30);
        close(&format!("gelu_tanh tails {dt:?}"), &vals(&x.gelu_tanh().unwrap()), &[0.0, 100.0, 0.0, 30.0], rtol, 1e-30);
        close(&format!("tanh tails {dt:?}"), &vals(&x.tanh().unwrap()), &[-1.0, 1.0, -1.0, 1.0], rtol, atol);
    }
}

// ---- binary ops ----

#[derive(Clone, Copy, Debug, PartialEq)]
enum Bin {
    Add,
    Sub,
    Mul,
    Div,
    Pow,
    Max,
    Min,
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
    And,
    Or,
    Xor,
}
const BINARY: [Bin; 16] = [
    Bin::Add, Bin::Sub, Bin::Mul, Bin::Div, Bin::Pow, Bin::Max, Bin::Min, Bin::Eq, Bin::Ne, Bin::Lt, Bin::Le, Bin::Gt,
    Bin::Ge, Bin::And, Bin::Or, Bin::Xor,
];

impl Bin {
    fn run(self, a: &Tensor, b: &Tensor) -> kiln::Result<Tensor> {
        match self {
            Bin::Add => a.add(b),
            Bin::Sub => a.sub(b),
            Bin::Mul => a.mul(b),
            Bin::Div => a.div(b),
            Bin::Pow => a.pow(b),
            Bin::Max => a.maximum(b),
            Bin::Min => a.minimum(b),
            Bin::Eq => a.eq(b),
            Bin::Ne => a.ne(b),
            Bin::Lt => a.lt(b),
            Bin::Le => a.le(b),
            Bin::Gt => a.gt(b),
            Bin::Ge => a.ge(b),
            Bin::And => a.logical_and(b),
            Bin::Or => a.logical_or(b),
            Bin::Xor => a.logical_xor(b),
        }
    }
    fn run_scalar(self, a: &Tensor, s: f64) -> kiln::Result<Tensor> {
        match self {
            Bin::Add => a.add_scalar(s),
            Bin::Sub => a.sub_scalar(s),
            Bin::Mul => a.mul_scalar(s),
            Bin::Div => a.div_scalar(s),
            Bin::Pow => a.pow_scalar(s),
            Bin::Max => a.maximum_scalar(s),
            Bin::Min => a.minimum_scalar(s),
            Bin::Eq => a.eq_scalar(s),
            Bin::Ne => a.ne_scalar(s),
            Bin::Lt => a.lt_scalar(s),
            Bin::Le => a.le_scalar(s),
            Bin::Gt => a.gt_scalar(s),
            Bin::Ge => a.ge_scalar(s),
            Bin::And => a.logical_and_scalar(s),
            Bin::Or => a.logical_or_scalar(s),
            Bin::Xor => a.logical_xor_scalar(s),
        }
    }
    fn host(self, a: f64, b: f64) -> f64 {
        let bit = |c: bool| c as u8 as f64;
        match self {
            Bin::Add => a + b,
            Bin::Sub => a - b,
            Bin::Mul => a * b,
            Bin::Div => a / b,
            Bin::Pow => a.powf(b),
            Bin::Max => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.max(b)
                }
            }
            Bin::Min => {
                if a.is_nan() || b.is_nan() {
                    f64::NAN
                } else {
                    a.min(b)
                }
            }
            Bin::Eq => bit(a == b),
            Bin::Ne => bit(a != b),
            Bin::Lt => bit(a < b),
            Bin::Le => bit(a <= b),
            Bin::Gt => bit(a > b),
            Bin::Ge => bit(a >= b),
            Bin::And => bit(a != 0.0 && b != 0.0),
            Bin::Or => bit(a != 0.0 || b != 0.0),
            Bin::Xor => bit((a != 0.0) != (b != 0.0)),
        }
    }
    fn bool_out(self) -> bool {
        !matches!(self, Bin::Add | Bin::Sub | Bin::Mul | Bin::Div | Bin::Pow | Bin::Max | Bin::Min)
    }
    fn out(self, dt: DType) -> DType {
        if self.bool_out() {
            DType::Bool
        } else {
            dt
        }
    }
    /// Domains of the left and right operands.
    fn dom_a(self, r: f64) -> f64 {
        match self {
            Bin::Pow => r.abs() + 0.2,
            Bin::Eq | Bin::Ne | Bin::Lt | Bin::Le | Bin::Gt | Bin::Ge | Bin::Max | Bin::Min => r.round(),
            Bin::And | Bin::Or | Bin::Xor => {
                if r < 0.0 {
                    0.0
                } else {
                    r
                }
            }
            _ => r,
        }
    }
    fn dom_b(self, r: f64) -> f64 {
        match self {
            Bin::Div => r.signum() * (0.5 + r.abs()),
            _ => self.dom_a(r),
        }
    }
    /// The number used in the `*_scalar` form (exact in every float dtype).
    fn scalars(self) -> &'static [f64] {
        match self {
            Bin::Pow => &[2.0, 0.5, -1.5, 3.0],
            Bin::Div => &[-1.25, 4.0],
            Bin::Eq | Bin::Ne | Bin::Lt | Bin::Le | Bin::Gt | Bin::Ge | Bin::Max | Bin::Min => &[1.0, -0.5],
            Bin::And | Bin::Or | Bin::Xor => &[0.0, 1.5],
            _ => &[0.75, -2.5],
        }
    }
    fn trans(self) -> bool {
        self == Bin::Pow
    }
}

#[test]
fn binary_ops_same_shape_all_layouts() {
    let pairs = [(Lay::Contig, Lay::Contig), (Lay::Transposed, Lay::Strided), (Lay::Strided, Lay::Transposed), (Lay::Expanded, Lay::Contig), (Lay::Contig, Lay::Expanded)];
    for dt in FLOATS {
        for op in BINARY {
            for (la, lb) in pairs {
                let (a, av) = make2(3, 4, la, dt, 11, |r| op.dom_a(r));
                let (b, bv) = make2(3, 4, lb, dt, 12, |r| op.dom_b(r));
                let want: Vec<f64> = av.iter().zip(&bv).map(|(&x, &y)| op.host(x, y)).collect();
                let (rtol, atol) = tol(op.out(dt), op.trans());
                check(&format!("{op:?} {dt:?} {la:?},{lb:?}"), &op.run(&a, &b).unwrap(), &[3, 4], op.out(dt), &want, rtol, atol);
            }
        }
    }
}

#[test]
fn binary_ops_broadcast() {
    #[rustfmt::skip]
    let shapes: [(&[usize], &[usize], &[usize]); 5] = [
        (&[3, 1], &[4], &[3, 4]),
        (&[4], &[3, 1], &[3, 4]),
        (&[2, 1, 4], &[3, 1], &[2, 3, 4]),
        (&[3, 1], &[2, 1, 4], &[2, 3, 4]),
        (&[3, 4], &[], &[3, 4]),
    ];
    for dt in FLOATS {
        for op in BINARY {
            for (sa, sb, so) in shapes {
                let (a, av) = inputs(sa, 21, dt, |r| op.dom_a(r));
                let (b, bv) = inputs(sb, 22, dt, |r| op.dom_b(r));
                let (ea, eb) = (bcast(&av, sa, so), bcast(&bv, sb, so));
                let want: Vec<f64> = ea.iter().zip(&eb).map(|(&x, &y)| op.host(x, y)).collect();
                let (rtol, atol) = tol(op.out(dt), op.trans());
                check(&format!("{op:?} {dt:?} {sa:?} with {sb:?}"), &op.run(&a, &b).unwrap(), so, op.out(dt), &want, rtol, atol);
            }
            // a non-contiguous operand broadcast against a contiguous one
            let (a, av) = make2(3, 4, Lay::Transposed, dt, 23, |r| op.dom_a(r));
            let (b, bv) = inputs(&[2, 1, 4], 24, dt, |r| op.dom_b(r));
            let so = [2, 3, 4];
            let (ea, eb) = (bcast(&av, &[3, 4], &so), bcast(&bv, &[2, 1, 4], &so));
            let want: Vec<f64> = ea.iter().zip(&eb).map(|(&x, &y)| op.host(x, y)).collect();
            let (rtol, atol) = tol(op.out(dt), op.trans());
            check(&format!("{op:?} {dt:?} transposed with [2,1,4]"), &op.run(&a, &b).unwrap(), &so, op.out(dt), &want, rtol, atol);
        }
    }
}

#[test]
fn binary_ops_large_broadcast_and_strided() {
    // > 2^15 elements: the parallel loops, a step-sliced left operand and a broadcast right one.
    for dt in [DType::F32, DType::F16] {
        for op in BINARY {
            let (base, bv) = inputs(&[300, 500], 81, dt, |r| op.dom_a(r));
            let a = base.slice(1, 1, 500, 2).unwrap(); // [300, 250]
            let (b, bvv) = inputs(&[250], 82, dt, |r| op.dom_b(r));
            let want: Vec<f64> = (0..300 * 250).map(|f| op.host(bv[(f / 250) * 500 + 1 + 2 * (f % 250)], bvv[f % 250])).collect();
            let (rtol, atol) = tol(op.out(dt), op.trans());
            check(&format!("{op:?} {dt:?} large"), &op.run(&a, &b).unwrap(), &[300, 250], op.out(dt), &want, rtol, atol);
        }
    }
}

#[test]
fn binary_ops_scalar_forms() {
    for dt in FLOATS {
        for op in BINARY {
            for lay in [Lay::Contig, Lay::Strided] {
                let (a, av) = make2(3, 4, lay, dt, 31, |r| op.dom_a(r));
                for &s in op.scalars() {
                    let want: Vec<f64> = av.iter().map(|&x| op.host(x, s)).collect();
                    let (rtol, atol) = tol(op.out(dt), op.trans());
                    check(&format!("{op:?}_scalar({s}) {dt:?} {lay:?}"), &op.run_scalar(&a, s).unwrap(), &[3, 4], op.out(dt), &want, rtol, atol);
                }
            }
        }
        // reversed forms: s - x and s / x
        for lay in [Lay::Contig, Lay::Transposed] {
            let (a, av) = make2(3, 4, lay, dt, 32, |r| r.signum() * (0.5 + r.abs()));
            let (rtol, atol) = tol(dt, false);
            let want: Vec<f64> = av.iter().map(|&x| 1.5 - x).collect();
            check(&format!("rsub_scalar {dt:?} {lay:?}"), &a.rsub_scalar(1.5).unwrap(), &[3, 4], dt, &want, rtol, atol);
            let want: Vec<f64> = av.iter().map(|&x| -3.0 / x).collect();
            check(&format!("rdiv_scalar {dt:?} {lay:?}"), &a.rdiv_scalar(-3.0).unwrap(), &[3, 4], dt, &want, rtol, atol);
            let want: Vec<f64> = av.iter().map(|&x| 1.0 / x).collect();
            check(&format!("reciprocal {dt:?} {lay:?}"), &a.reciprocal().unwrap(), &[3, 4], dt, &want, rtol, atol);
        }
        // operators
        let (a, av) = inputs(&[5], 33, dt, |r| r);
        let (b, bv) = inputs(&[5], 34, dt, |r| r.signum() * (0.5 + r.abs()));
        let (rtol, atol) = tol(dt, false);
        let ab = |f: fn(f64, f64) -> f64| av.iter().zip(&bv).map(|(&x, &y)| f(x, y)).collect::<Vec<_>>();
        close("a + b", &vals(&(&a + &b).unwrap()), &ab(|x, y| x + y), rtol, atol);
        close("a - b", &vals(&(&a - &b).unwrap()), &ab(|x, y| x - y), rtol, atol);
        close("a * b", &vals(&(&a * &b).unwrap()), &ab(|x, y| x * y), rtol, atol);
        close("a / b", &vals(&(&a / &b).unwrap()), &ab(|x, y| x / y), rtol, atol);
        close("a * 2", &vals(&(&a * 2.0).unwrap()), &ab(|x, _| x * 2.0), rtol, atol);
        close("-a", &vals(&(-&a).unwrap()), &ab(|x, _| -x), rtol, atol);
    }
}

#[test]
fn half_comparisons_round_the_other_operand_to_half() {
    // PyTorch compares in the common dtype: the number (or wider operand) is rounded to the half
    // type first, so a half tensor holding 0.1 equals 0.1.
    for dt in [DType::F16, DType::BF16] {
        let x = t(&[0.1, 0.2, 0.3], &[3], dt);
        let ctx = |s: &str| format!("{s} {dt:?}");
        check(&ctx("eq_scalar(0.1)"), &x.eq_scalar(0.1).unwrap(), &[3], DType::Bool, &[1.0, 0.0, 0.0], 0.0, 0.0);
        check(&ctx("ne_scalar(0.3)"), &x.ne_scalar(0.3).unwrap(), &[3], DType::Bool, &[1.0, 1.0, 0.0], 0.0, 0.0);
        check(&ctx("le_scalar(0.1)"), &x.le_scalar(0.1).unwrap(), &[3], DType::Bool, &[1.0, 0.0, 0.0], 0.0, 0.0);
        check(&ctx("lt_scalar(0.2)"), &x.lt_scalar(0.2).unwrap(), &[3], DType::Bool, &[1.0, 0.0, 0.0], 0.0, 0.0);
        check(&ctx("ge_scalar(0.2)"), &x.ge_scalar(0.2).unwrap(), &[3], DType::Bool, &[0.0, 1.0, 1.0], 0.0, 0.0);
        check(&ctx("gt_scalar(0.3)"), &x.gt_scalar(0.3).unwrap(), &[3], DType::Bool, &[0.0, 0.0, 0.0], 0.0, 0.0);
        check(&ctx("eq F64 0-dim"), &x.eq(&t0(0.2, DType::F64)).unwrap(), &[3], DType::Bool, &[0.0, 1.0, 0.0], 0.0, 0.0);
        check(&ctx("eq F32 0-dim"), &t0(0.3, DType::F32).eq(&x).unwrap(), &[3], DType::Bool, &[0.0, 0.0, 1.0], 0.0, 0.0);
        // an integer tensor promotes to the half type: 2049 rounds to 2048 in F16 (and BF16)
        check(&ctx("eq I64 tensor"), &t(&[2048.0], &[1], dt).eq(&t(&[2049.0], &[1], DType::I64)).unwrap(), &[1], DType::Bool, &[1.0], 0.0, 0.0);
    }
}

#[test]
fn pow_edge_cases() {
    for dt in [DType::F32, DType::F64] {
        let a = t(&[-2.0, -2.0, 0.0, 0.0, 4.0, 1.0, -8.0], &[7], dt);
        let b = t(&[3.0, 0.5, 0.0, -1.0, -0.5, f64::NAN, 1.0 / 3.0], &[7], dt);
        let want = [-8.0, f64::NAN, 1.0, f64::INFINITY, 0.5, 1.0, f64::NAN];
        close(&format!("pow edges {dt:?}"), &vals(&a.pow(&b).unwrap()), &want, 1e-6, 0.0);
        close(&format!("square {dt:?}"), &vals(&a.square().unwrap()), &[4.0, 4.0, 0.0, 0.0, 16.0, 1.0, 64.0], 0.0, 0.0);
    }
}

#[test]
fn nan_propagation() {
    let nan = f64::NAN;
    for dt in FLOATS {
        let a = t(&[nan, 1.0, nan, -3.0], &[4], dt);
        let b = t(&[2.0, nan, nan, -4.0], &[4], dt);
        let ctx = |s: &str| format!("{s} {dt:?}");
        close(&ctx("maximum"), &vals(&a.maximum(&b).unwrap()), &[nan, nan, nan, -3.0], 0.0, 0.0);
        close(&ctx("maximum rev"), &vals(&b.maximum(&a).unwrap()), &[nan, nan, nan, -3.0], 0.0, 0.0);
        close(&ctx("minimum"), &vals(&a.minimum(&b).unwrap()), &[nan, nan, nan, -4.0], 0.0, 0.0);
        close(&ctx("minimum rev"), &vals(&b.minimum(&a).unwrap()), &[nan, nan, nan, -4.0], 0.0, 0.0);
        close(&ctx("maximum_scalar"), &vals(&a.maximum_scalar(0.0).unwrap()), &[nan, 1.0, nan, 0.0], 0.0, 0.0);
        close(&ctx("minimum_scalar"), &vals(&a.minimum_scalar(0.0).unwrap()), &[nan, 0.0, nan, -3.0], 0.0, 0.0);
        close(&ctx("maximum_scalar(nan)"), &vals(&a.maximum_scalar(nan).unwrap()), &[nan; 4], 0.0, 0.0);
        close(&ctx("relu"), &vals(&a.relu().unwrap()), &[nan, 1.0, nan, 0.0], 0.0, 0.0);
        close(&ctx("clamp min"), &vals(&a.clamp(Some(0.0), None).unwrap()), &[nan, 1.0, nan, 0.0], 0.0, 0.0);
        close(&ctx("clamp max"), &vals(&a.clamp(None, Some(0.0)).unwrap()), &[nan, 0.0, nan, -3.0], 0.0, 0.0);
        close(&ctx("clamp both"), &vals(&a.clamp(Some(-1.0), Some(0.5)).unwrap()), &[nan, 0.5, nan, -1.0], 0.0, 0.0);
        // comparisons with NaN are false, except ne
        close(&ctx("eq"), &vals(&a.eq(&a).unwrap()), &[0.0, 1.0, 0.0, 1.0], 0.0, 0.0);
        close(&ctx("ne"), &vals(&a.ne(&a).unwrap()), &[1.0, 0.0, 1.0, 0.0], 0.0, 0.0);
        close(&ctx("lt"), &vals(&a.lt(&b).unwrap()), &[0.0, 0.0, 0.0, 0.0], 0.0, 0.0);
        close(&ctx("ge"), &vals(&a.ge(&b).unwrap()), &[0.0, 0.0, 0.0, 1.0], 0.0, 0.0);
        // arithmetic propagates
        close(&ctx("add"), &vals(&a.add(&b).unwrap()), &[nan, nan, nan, -7.0], 0.0, 0.0);
        // NaN is "true" for logical ops
        close(&ctx("logical_and"), &vals(&a.logical_and(&b).unwrap()), &[1.0; 4], 0.0, 0.0);
    }
}

#[test]
fn clamp_all_forms() {
    for dt in FLOATS {
        for lay in LAYOUTS {
            let (x, xv) = make2(3, 4, lay, dt, 41, |r| r);
            let (rtol, atol) = tol(dt, false);
            let cases: [(Option<f64>, Option<f64>); 3] = [(Some(-0.5), None), (None, Some(0.75)), (Some(-0.5), Some(0.75))];
            for (lo, hi) in cases {
                let want: Vec<f64> = xv.iter().map(|&v| {
                    let v = lo.map_or(v, |l| v.max(l));
                    hi.map_or(v, |h| v.min(h))
                }).collect();
                check(&format!("clamp {lo:?} {hi:?} {dt:?} {lay:?}"), &x.clamp(lo, hi).unwrap(), &[3, 4], dt, &want, rtol, atol);
            }
        }
    }
    assert!(matches!(t(&[1.0], &[1], DType::F32).clamp(None, None), Err(Error::Arg { .. })));
    // integer tensors with integral bounds stay integer
    let x = t(&[-5.0, 0.0, 3.0, 9.0], &[4], DType::I64);
    check("clamp I64", &x.clamp(Some(-1.0), Some(4.0)).unwrap(), &[4], DType::I64, &[-1.0, 0.0, 3.0, 4.0], 0.0, 0.0);
    check("clamp U8", &t(&[0.0, 7.0, 200.0], &[3], DType::U8).clamp(Some(5.0), Some(100.0)).unwrap(), &[3], DType::U8, &[5.0, 7.0, 100.0], 0.0, 0.0);
}

#[test]
fn clamp_int_tensor_with_fractional_bound_promotes() {
    // torch.clamp(torch.tensor([1, 2, 3]), min=1.5) -> tensor([1.5, 2., 3.]): the bound is not truncated.
    let x = t(&[1.0, 2.0, 3.0], &[3], DType::I64);
    check("clamp I64 min 1.5", &x.clamp(Some(1.5), None).unwrap(), &[3], DType::F32, &[1.5, 2.0, 3.0], 0.0, 0.0);
    check("clamp I32 max 2.5", &t(&[1.0, 2.0, 3.0], &[3], DType::I32).clamp(None, Some(2.5)).unwrap(), &[3], DType::F32, &[1.0, 2.0, 2.5], 0.0, 0.0);
    check("clamp I64 -inf..2.5", &x.clamp(Some(f64::NEG_INFINITY), Some(2.5)).unwrap(), &[3], DType::F32, &[1.0, 2.0, 2.5], 0.0, 0.0);
}

#[test]
fn clamp_min_greater_than_max_gives_max() {
    // torch.clamp(x, min, max) is min(max(x, min), max): with min > max every element is max.
    for dt in [DType::F32, DType::F64] {
        let x = t(&[-3.0, 0.0, 1.5, 2.5, 7.0], &[5], dt);
        check(&format!("clamp(2, 1) {dt:?}"), &x.clamp(Some(2.0), Some(1.0)).unwrap(), &[5], dt, &[1.0; 5], 0.0, 0.0);
    }
}

#[test]
fn where_and_masked_fill() {
    for dt in FLOATS {
        // cond [3,4] (transposed), a [4], b [3,1]
        let (cf, cv) = make2(3, 4, Lay::Transposed, DType::F64, 51, |r| r);
        let c = cf.gt_scalar(0.0).unwrap();
        let (a, av) = inputs(&[4], 52, dt, |r| r);
        let (b, bv) = inputs(&[3, 1], 53, dt, |r| r);
        let so = [3, 4];
        let (ea, eb) = (bcast(&av, &[4], &so), bcast(&bv, &[3, 1], &so));
        let want: Vec<f64> = (0..12).map(|i| if cv[i] > 0.0 { ea[i] } else { eb[i] }).collect();
        check(&format!("where {dt:?}"), &c.where_(&a, &b).unwrap(), &so, dt, &want, 0.0, 0.0);
        check(&format!("kiln::where_ {dt:?}"), &kiln::where_(&c, &a, &b).unwrap(), &so, dt, &want, 0.0, 0.0);
        // strided input, broadcast mask
        let (x, xv) = make2(3, 4, Lay::Strided, dt, 54, |r| r);
        let m = t(&[1.0, 0.0, 1.0], &[3, 1], DType::Bool);
        let want: Vec<f64> = (0..12).map(|i| if i / 4 != 1 { round_to(dt, -0.3) } else { xv[i] }).collect();
        check(&format!("masked_fill {dt:?}"), &x.masked_fill(&m, -0.3).unwrap(), &so, dt, &want, 0.0, 0.0);
        // the input is unchanged
        close("masked_fill leaves input", &vals(&x), &xv, 0.0, 0.0);
    }
    let x = t(&[1.0, 2.0], &[2], DType::F32);
    assert!(matches!(x.where_(&x, &x), Err(Error::DType { .. })), "non-bool condition");
    assert!(matches!(x.masked_fill(&x, 0.0), Err(Error::DType { .. })), "non-bool mask");
    // integer tensors
    let xi = ti64(&[1 << 60, 2, 3], &[3]);
    let m = t(&[0.0, 1.0, 0.0], &[3], DType::Bool);
    assert_eq!(i64s(&xi.masked_fill(&m, -9i64).unwrap()), vec![1 << 60, -9, 3]);
    assert_eq!(i64s(&m.where_(&xi, &ti64(&[7, 8, 9], &[3])).unwrap()), vec![7, 2, 9]);
}

// ---- integers ----

#[test]
fn integer_arithmetic_wraps() {
    // I64
    let a = ti64(&[i64::MAX, -5, 7, i64::MIN], &[4]);
    let b = ti64(&[1, 3, -10, -1], &[4]);
    assert_eq!(i64s(&a.add(&b).unwrap()), vec![i64::MIN, -2, -3, i64::MAX]);
    assert_eq!(i64s(&a.sub(&b).unwrap()), vec![i64::MAX - 1, -8, 17, i64::MIN + 1]);
    assert_eq!(i64s(&a.mul(&b).unwrap()), vec![i64::MAX, -15, -70, i64::MIN]);
    // I32
    let a = ti32(&[i32::MAX, -5, 100_000, i32::MIN], &[4]);
    let b = ti32(&[1, 3, 100_000, -1], &[4]);
    let r = a.add(&b).unwrap();
    assert_eq!(r.dtype(), DType::I32);
    assert_eq!(r.to_vec::<i32>().unwrap(), vec![i32::MIN, -2, 200_000, i32::MAX]);
    assert_eq!(a.mul(&b).unwrap().to_vec::<i32>().unwrap(), vec![i32::MAX, -15, 100_000i32.wrapping_mul(100_000), i32::MIN]);
    assert_eq!(a.sub(&b).unwrap().to_vec::<i32>().unwrap(), vec![i32::MAX - 1, -8, 0, i32::MIN + 1]);
    // U8
    let a = tu8(&[250, 3, 7, 0], &[4]);
    let b = tu8(&[10, 4, 255, 1], &[4]);
    let r = a.add(&b).unwrap();
    assert_eq!(r.dtype(), DType::U8);
    assert_eq!(r.to_vec::<u8>().unwrap(), vec![4, 7, 6, 1]);
    assert_eq!(a.sub(&b).unwrap().to_vec::<u8>().unwrap(), vec![240, 255, 8, 255]);
    assert_eq!(a.mul(&b).unwrap().to_vec::<u8>().unwrap(), vec![250u8.wrapping_mul(10), 12, 7u8.wrapping_mul(255), 0]);
    // broadcast, non-contiguous integer operands
    let m = ti64(&[1, 2, 3, 4, 5, 6], &[2, 3]).t().unwrap();
    let r = m.mul(&ti64(&[10, 100], &[2])).unwrap();
    assert_eq!(i64s(&r), vec![10, 400, 20, 500, 30, 600]);
}

#[test]
fn integer_ops_against_reference() {
    for dt in INTS {
        // values valid in every integer dtype (non-negative for U8)
        let lo = if dt == DType::U8 { 0.0 } else { -9.0 };
        let av: Vec<f64> = host_rand(12, 61).iter().map(|r| (r * 5.0).round().max(lo)).collect();
        let bv: Vec<f64> = host_rand(12, 62).iter().map(|r| (r * 5.0).round().max(lo)).collect();
        let (a, b) = (t(&av, &[3, 4], dt), t(&bv, &[3, 4], dt));
        let wrap = |v: f64| round_to(dt, v);
        let ab = |f: &dyn Fn(f64, f64) -> f64| av.iter().zip(&bv).map(|(&x, &y)| f(x, y)).collect::<Vec<f64>>();
        let ctx = |s: &str| format!("{s} {dt:?}");
        check(&ctx("add"), &a.add(&b).unwrap(), &[3, 4], dt, &ab(&|x, y| wrap(x + y)), 0.0, 0.0);
        check(&ctx("sub"), &a.sub(&b).unwrap(), &[3, 4], dt, &ab(&|x, y| wrap(x - y)), 0.0, 0.0);
        check(&ctx("mul"), &a.mul(&b).unwrap(), &[3, 4], dt, &ab(&|x, y| wrap(x * y)), 0.0, 0.0);
        check(&ctx("maximum"), &a.maximum(&b).unwrap(), &[3, 4], dt, &ab(&|x, y| x.max(y)), 0.0, 0.0);
        check(&ctx("minimum"), &a.minimum(&b).unwrap(), &[3, 4], dt, &ab(&|x, y| x.min(y)), 0.0, 0.0);
        // int / int is true division in F32
        let bnz: Vec<f64> = bv.iter().map(|&y| if y == 0.0 { 3.0 } else { y }).collect();
        let bz = t(&bnz, &[3, 4], dt);
        let want: Vec<f64> = av.iter().zip(&bnz).map(|(&x, &y)| x / y).collect();
        check(&ctx("div"), &a.div(&bz).unwrap(), &[3, 4], DType::F32, &want, F32_RTOL, F32_ATOL);
        check(&ctx("div_scalar"), &a.div_scalar(4i64).unwrap(), &[3, 4], DType::F32, &av.iter().map(|x| x / 4.0).collect::<Vec<_>>(), F32_RTOL, F32_ATOL);
        // comparisons
        for (name, f, g) in [
            ("eq", Tensor::eq as fn(&Tensor, &Tensor) -> kiln::Result<Tensor>, (|x, y| x == y) as fn(f64, f64) -> bool),
            ("ne", Tensor::ne, |x, y| x != y),
            ("lt", Tensor::lt, |x, y| x < y),
            ("le", Tensor::le, |x, y| x <= y),
            ("gt", Tensor::gt, |x, y| x > y),
            ("ge", Tensor::ge, |x, y| x >= y),
        ] {
            check(&ctx(name), &f(&a, &b).unwrap(), &[3, 4], DType::Bool, &ab(&|x, y| g(x, y) as u8 as f64), 0.0, 0.0);
        }
        check(&ctx("gt_scalar int"), &a.gt_scalar(2i64).unwrap(), &[3, 4], DType::Bool, &av.iter().map(|&x| (x > 2.0) as u8 as f64).collect::<Vec<_>>(), 0.0, 0.0);
        check(&ctx("lt_scalar float"), &a.lt_scalar(2.5).unwrap(), &[3, 4], DType::Bool, &av.iter().map(|&x| (x < 2.5) as u8 as f64).collect::<Vec<_>>(), 0.0, 0.0);
        // scalar arithmetic keeps the dtype
        check(&ctx("add_scalar"), &a.add_scalar(3i64).unwrap(), &[3, 4], dt, &av.iter().map(|&x| wrap(x + 3.0)).collect::<Vec<_>>(), 0.0, 0.0);
        check(&ctx("mul_scalar"), &a.mul_scalar(-2i64).unwrap(), &[3, 4], dt, &av.iter().map(|&x| round_to(dt, ((x as i64) * -2) as f64)).collect::<Vec<_>>(), 0.0, 0.0);
        // unary ops that keep integers
        if dt != DType::U8 {
            check(&ctx("neg"), &a.neg().unwrap(), &[3, 4], dt, &av.iter().map(|&x| -x).collect::<Vec<_>>(), 0.0, 0.0);
            check(&ctx("abs"), &a.abs().unwrap(), &[3, 4], dt, &av.iter().map(|&x| x.abs()).collect::<Vec<_>>(), 0.0, 0.0);
            check(&ctx("sign"), &a.sign().unwrap(), &[3, 4], dt, &av.iter().map(|&x| if x > 0.0 { 1.0 } else if x < 0.0 { -1.0 } else { 0.0 }).collect::<Vec<_>>(), 0.0, 0.0);
            check(&ctx("relu"), &a.relu().unwrap(), &[3, 4], dt, &av.iter().map(|&x| x.max(0.0)).collect::<Vec<_>>(), 0.0, 0.0);
        }
    }
}

#[test]
fn integer_pow() {
    // torch: 0^0 = 1, negative powers are 0 except for bases ±1; results wrap.
    let a = ti64(&[2, 3, -2, 1, -1, -1, 0, 5, 2], &[9]);
    let b = ti64(&[3, 2, 3, -2, -3, -4, 0, -1, 62], &[9]);
    let r = a.pow(&b).unwrap();
    assert_eq!(i64s(&r), vec![8, 9, -8, 1, -1, 1, 1, 0, 1 << 62]);
    let a32 = ti32(&[2, -3, 7], &[3]);
    let r = a32.pow(&ti32(&[31, 3, 2], &[3])).unwrap();
    assert_eq!(r.dtype(), DType::I32);
    assert_eq!(r.to_vec::<i32>().unwrap(), vec![i32::MIN, -27, 49]);
    let u = tu8(&[2, 3, 16], &[3]);
    let r = u.pow(&tu8(&[3, 2, 2], &[3])).unwrap();
    assert_eq!(r.to_vec::<u8>().unwrap(), vec![8, 9, 0]);
    // scalar exponents: int keeps the dtype, float gives F32
    assert_eq!(i64s(&ti64(&[2, -3], &[2]).pow_scalar(3i64).unwrap()), vec![8, -27]);
    check("int pow 0.5", &ti64(&[4, 2], &[2]).pow_scalar(0.5).unwrap(), &[2], DType::F32, &[2.0, 2f64.sqrt()], F32_RTOL, 0.0);
}

#[test]
fn per_channel_operands_spread_over_images_match_the_host() {
    // x * scale + shift with [1, C, 1, 1] operands over [N, C, H, W]: on the GPU such operands
    // are read once per vector of the image's values (16-byte vectors over 56 x 56, 8-byte ones
    // over 14 x 14, none over 7 x 7), in eager ops and compiled kernels. Eager ops round as the
    // host does (no contraction), so they must match it exactly; the compiled kernel within
    // one F32 rounding of its fused multiply-add.
    let d = dev();
    for (hw, seed) in [(56usize, 1u64), (14, 2), (7, 3)] {
        let shape = [2usize, 3, hw, hw];
        let n: usize = shape.iter().product();
        let host = |v: &[f64], s: &[usize], dt: DType| Tensor::from_vec(v.to_vec(), s, &Device::Cpu).unwrap().to_dtype(dt).unwrap();
        let (xv, sv, bv) = (host_rand(n, seed), host_rand(3, seed + 1), host_rand(3, seed + 2));
        let (xh, sh, bh) = (host(&xv, &shape, DType::BF16), host(&sv, &[1, 3, 1, 1], DType::F32), host(&bv, &[1, 3, 1, 1], DType::F32));
        let want = xh.mul(&sh).unwrap().add(&bh).unwrap().relu().unwrap().to_dtype(DType::BF16).unwrap();
        let (x, s, b) = (xh.to_device(&d).unwrap(), sh.to_device(&d).unwrap(), bh.to_device(&d).unwrap());
        let got = x.mul(&s).unwrap().add(&b).unwrap().relu().unwrap().to_dtype(DType::BF16).unwrap();
        assert_eq!(vals(&got), vals(&want), "eager, {hw} x {hw}");
        let f = kiln::compile::compile(|x: &Tensor, s: &Tensor| x.mul(s)?.add_scalar(0.5)?.relu()?.to_dtype(DType::BF16));
        let got = f.call(&x, &s).unwrap();
        let want = xh.mul(&sh).unwrap().add_scalar(0.5).unwrap().relu().unwrap();
        let bf16_ulp = |v: f64| v.abs().max(1e-30) * 2f64.powi(-8);
        for (i, (g, w)) in vals(&got).iter().zip(vals(&want)).enumerate() {
            assert!((g - w).abs() <= bf16_ulp(w), "compiled, {hw} x {hw}, element {i}: {g} against {w}");
        }
    }
}

/// Gradients of tanh, sigmoid, GELU (both forms) and SiLU in BF16 and F16 against PyTorch's on
/// CUDA (tests/fixtures/make_half_backward.py; its GELU and SiLU kernels compute in F32 and round
/// once, its tanh and sigmoid ones round after each op): none more than one unit in the last
/// place apart, all but 1% bit for bit (F32 formulas differ in their last bits, which rounding
/// rarely shows).
#[test]
fn half_gradients_of_activations_round_once_as_pytorchs() {
    let f = embedded_safetensors(include_bytes!("../fixtures/half_backward.safetensors"));
    // A 16-bit float's bits as an integer that counts units in the last place.
    let ordered = |b: u16| if b & 0x8000 != 0 { -i32::from(b & 0x7fff) } else { i32::from(b) };
    let bits = |t: &Tensor| -> Vec<i32> {
        match t.dtype() {
            DType::BF16 => t.to_vec::<half::bf16>().unwrap().into_iter().map(|v| ordered(v.to_bits())).collect(),
            _ => t.to_vec::<half::f16>().unwrap().into_iter().map(|v| ordered(v.to_bits())).collect(),
        }
    };
    for name in ["bf16", "f16"].into_iter().filter(|n| f.contains_key(&format!("{n}.x"))) {
        let x = f[&format!("{name}.x")].to_device(&dev()).unwrap();
        let g = f[&format!("{name}.g")].to_device(&dev()).unwrap();
        for op in ["tanh", "sigmoid", "gelu_erf", "gelu_tanh", "silu"] {
            let xr = x.detach().requires_grad();
            let y = match op {
                "tanh" => xr.tanh(),
                "sigmoid" => xr.sigmoid(),
                "gelu_erf" => xr.gelu(),
                "gelu_tanh" => xr.gelu_tanh(),
                _ => xr.silu(),
            }
            .unwrap();
            y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
            let (got, want) = (bits(&xr.grad().unwrap()), bits(&f[&format!("{name}.{op}")]));
            // Values within assert_close's BF16/F16 atol (1e-5) count as equal: in GELU's far
            // tail both sides are F32 cancellation noise (PyTorch's often exactly zero).
            let (gv, wv) = (vals(&xr.grad().unwrap()), vals(&f[&format!("{name}.{op}")]));
            let apart: Vec<i32> = got.iter().zip(&want).zip(gv.iter().zip(&wv)).map(|((a, b), (u, v))| if (u - v).abs() <= 1e-5 { 0 } else { (a - b).abs() }).collect();
            let worst = apart.iter().max().unwrap();
            let inexact = apart.iter().filter(|&&d| d > 0).count();
            assert!(*worst <= 1 && inexact * 100 <= want.len(), "{name} {op}: {inexact} of {} gradients differ, by up to {worst} ulp", want.len());
        }
    }
}
