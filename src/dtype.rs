//! Element types as runtime values (DESIGN principle 7), PyTorch's promotion rules, and the
//! `Elem` trait that the CPU kernels are generic over.

use half::{bf16, f16};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    F64,
    F16,
    BF16,
    I64,
    I32,
    U8,
    Bool,
}

/// Bool < integer < floating point: the order type promotion compares first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Category {
    Bool,
    Int,
    Float,
}

impl DType {
    pub const ALL: [DType; 8] =
        [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::I32, DType::U8, DType::Bool];

    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 => 2,
            DType::U8 | DType::Bool => 1,
        }
    }
    pub fn category(self) -> Category {
        match self {
            DType::Bool => Category::Bool,
            DType::U8 | DType::I32 | DType::I64 => Category::Int,
            _ => Category::Float,
        }
    }
    pub fn is_float(self) -> bool {
        self.category() == Category::Float
    }
    pub fn is_int(self) -> bool {
        self.category() == Category::Int
    }
    /// The dtype arithmetic is carried out in ("opmath"): half types compute in F32.
    pub fn compute_dtype(self) -> DType {
        match self {
            DType::F16 | DType::BF16 => DType::F32,
            d => d,
        }
    }
    /// PyTorch's name for the dtype, as printed after a tensor.
    pub fn torch_name(self) -> &'static str {
        match self {
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::I64 => "int64",
            DType::I32 => "int32",
            DType::U8 => "uint8",
            DType::Bool => "bool",
        }
    }
    fn rank(self) -> u8 {
        match self {
            DType::Bool => 0,
            DType::U8 => 1,
            DType::I32 => 2,
            DType::I64 => 3,
            DType::F16 => 4,
            DType::BF16 => 4,
            DType::F32 => 5,
            DType::F64 => 6,
        }
    }
}

/// The default floating-point dtype (`torch.get_default_dtype()`).
pub const DEFAULT_FLOAT: DType = DType::F32;

/// `torch.promote_types`: the smallest dtype both values fit in.
pub fn promote_types(a: DType, b: DType) -> DType {
    use DType::*;
    if a == b {
        return a;
    }
    match (a, b) {
        (F16, BF16) | (BF16, F16) => F32,
        _ => {
            if a.rank() >= b.rank() {
                a
            } else {
                b
            }
        }
    }
}

/// How an operand takes part in type promotion (PyTorch's three priority tiers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// A tensor with at least one dimension.
    Dim,
    /// A 0-dimensional tensor.
    ZeroDim,
    /// A plain number (Rust f64 / i64 / bool literal): its category counts, its width does not.
    Scalar,
}

fn combine_categories(higher: Option<DType>, lower: Option<DType>) -> Option<DType> {
    let Some(h) = higher else { return lower };
    let Some(l) = lower else { return Some(h) };
    if h.is_float() {
        return Some(h);
    }
    if h == DType::Bool || l.is_float() {
        return Some(promote_types(h, l));
    }
    Some(h)
}

/// `torch.result_type` over several operands.
pub fn result_type(operands: &[(DType, Tier)]) -> DType {
    let fold = |tier: Tier| {
        operands.iter().filter(|(_, t)| *t == tier).fold(None, |acc: Option<DType>, &(d, _)| {
            let d = if tier == Tier::Scalar && d.is_float() { DEFAULT_FLOAT } else { d };
            Some(match acc {
                None => d,
                Some(a) => promote_types(a, d),
            })
        })
    };
    let r = combine_categories(fold(Tier::Dim), fold(Tier::ZeroDim));
    combine_categories(r, fold(Tier::Scalar)).unwrap_or(DEFAULT_FLOAT)
}

/// The kind of arithmetic a CPU kernel's compute type does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Float,
    Int,
    Bool,
}

/// A storage element type. Conversions go through f64 (floats) or i64 (integers), which is exact
/// for every pair of dtypes kiln has except i64 values beyond 2^53 becoming floats.
pub trait Elem: Copy + Send + Sync + PartialOrd + Default + std::fmt::Debug + 'static {
    const DTYPE: DType;
    const KIND: Kind;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn to_i64(self) -> i64;
    fn from_i64(v: i64) -> Self;
    fn is_nonzero(self) -> bool;
    fn from_bool(v: bool) -> Self;
    #[inline(always)]
    fn cast<C: Elem>(self) -> C {
        match C::KIND {
            Kind::Float => C::from_f64(self.to_f64()),
            Kind::Int => C::from_i64(self.to_i64()),
            Kind::Bool => C::from_bool(self.is_nonzero()),
        }
    }
}

macro_rules! float_elem {
    ($t:ty, $d:ident, $to:expr, $from:expr) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
            const KIND: Kind = Kind::Float;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                ($to)(self)
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                ($from)(v)
            }
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self.to_f64() as i64
            }
            #[inline(always)]
            fn from_i64(v: i64) -> Self {
                Self::from_f64(v as f64)
            }
            #[inline(always)]
            fn is_nonzero(self) -> bool {
                self.to_f64() != 0.0
            }
            #[inline(always)]
            fn from_bool(v: bool) -> Self {
                Self::from_f64(v as u8 as f64)
            }
        }
    };
}
float_elem!(f32, F32, |x: f32| x as f64, |v: f64| v as f32);
float_elem!(f64, F64, |x: f64| x, |v: f64| v);
// Through f32, as PyTorch's Half and BFloat16 are made from a double: correctly rounded from
// every f32 value (`half`'s from_f64 drops the low mantissa bits first, so an f32 value just
// above a halfway point rounded down).
float_elem!(f16, F16, |x: f16| x.to_f64(), |v: f64| f16::from_f32(v as f32));
float_elem!(bf16, BF16, |x: bf16| x.to_f64(), |v: f64| bf16::from_f32(v as f32));

macro_rules! int_elem {
    ($t:ty, $d:ident) => {
        impl Elem for $t {
            const DTYPE: DType = DType::$d;
            const KIND: Kind = Kind::Int;
            #[inline(always)]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline(always)]
            fn from_f64(v: f64) -> Self {
                v as i64 as $t
            }
            #[inline(always)]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline(always)]
            fn from_i64(v: i64) -> Self {
                v as $t
            }
            #[inline(always)]
            fn is_nonzero(self) -> bool {
                self != 0
            }
            #[inline(always)]
            fn from_bool(v: bool) -> Self {
                v as $t
            }
        }
    };
}
int_elem!(i64, I64);
int_elem!(i32, I32);
int_elem!(u8, U8);

impl Elem for bool {
    const DTYPE: DType = DType::Bool;
    const KIND: Kind = Kind::Bool;
    fn to_f64(self) -> f64 {
        self as u8 as f64
    }
    fn from_f64(v: f64) -> Self {
        v != 0.0
    }
    fn to_i64(self) -> i64 {
        self as i64
    }
    fn from_i64(v: i64) -> Self {
        v != 0
    }
    fn is_nonzero(self) -> bool {
        self
    }
    fn from_bool(v: bool) -> Self {
        v
    }
}

/// Rust element types users can build tensors from and read tensors into: f32, f64, f16, bf16,
/// i64, i32, u8 and bool.
pub trait WithDType: crate::backend::cpu::HostElem + private::Sealed {}
mod private {
    pub trait Sealed {}
}
macro_rules! with_dtype {
    ($($t:ty),*) => {$(
        impl private::Sealed for $t {}
        impl WithDType for $t {}
    )*};
}
with_dtype!(f32, f64, f16, bf16, i64, i32, u8, bool);

#[cfg(test)]
mod tests {
    use super::*;
    use DType::*;

    #[test]
    fn promotion_table_matches_torch() {
        // torch.promote_types on every pair kiln has.
        let cases = [
            (Bool, U8, U8), (Bool, I32, I32), (U8, I32, I32), (U8, I64, I64), (I32, I64, I64),
            (I64, F16, F16), (I32, BF16, BF16), (F16, BF16, F32), (F16, F32, F32), (BF16, F64, F64),
            (F32, F64, F64), (Bool, F32, F32), (U8, F64, F64), (Bool, Bool, Bool),
        ];
        for (a, b, want) in cases {
            assert_eq!(promote_types(a, b), want, "{a:?} {b:?}");
            assert_eq!(promote_types(b, a), want, "{b:?} {a:?}");
        }
    }

    #[test]
    fn result_type_tiers_match_torch() {
        // int tensor + 2.5 -> float32; f16 tensor + 2.5 -> f16; u8 tensor + 300 -> u8
        assert_eq!(result_type(&[(I64, Tier::Dim), (F64, Tier::Scalar)]), F32);
        assert_eq!(result_type(&[(F16, Tier::Dim), (F64, Tier::Scalar)]), F16);
        assert_eq!(result_type(&[(U8, Tier::Dim), (I64, Tier::Scalar)]), U8);
        assert_eq!(result_type(&[(Bool, Tier::Dim), (I64, Tier::Scalar)]), I64);
        // f32 tensor + f64 0-dim tensor -> f32; i32 tensor + f64 0-dim -> f64
        assert_eq!(result_type(&[(F32, Tier::Dim), (F64, Tier::ZeroDim)]), F32);
        assert_eq!(result_type(&[(I32, Tier::Dim), (F64, Tier::ZeroDim)]), F64);
        // two 0-dim tensors promote normally
        assert_eq!(result_type(&[(I32, Tier::ZeroDim), (I64, Tier::ZeroDim)]), I64);
        assert_eq!(result_type(&[(F16, Tier::Dim), (F32, Tier::Dim)]), F32);
    }
}

/// The type arithmetic runs in inside a kernel, on either backend: half types compute in f32,
/// integers in i64. `name` is its C spelling, for the CUDA generators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum CType {
    F32,
    F64,
    I64,
    Bool,
}

impl CType {
    /// Half types compute in f32, integers in i64, as on the CPU.
    pub(crate) fn of(d: DType) -> CType {
        match d {
            DType::F32 | DType::F16 | DType::BF16 => CType::F32,
            DType::F64 => CType::F64,
            DType::I64 | DType::I32 | DType::U8 => CType::I64,
            DType::Bool => CType::Bool,
        }
    }
    pub(crate) fn name(self) -> &'static str {
        match self {
            CType::F32 => "float",
            CType::F64 => "double",
            CType::I64 => "long long",
            CType::Bool => "bool",
        }
    }
    /// The storage dtype that holds values of this type exactly.
    pub(crate) fn dtype(self) -> DType {
        match self {
            CType::F32 => DType::F32,
            CType::F64 => DType::F64,
            CType::I64 => DType::I64,
            CType::Bool => DType::Bool,
        }
    }
}
