//! PyTorch-compatible tensor printing.
//!
//! This module reproduces `repr(tensor)` of PyTorch 2.x (`torch/_tensor_str.py`) with the
//! default print options: precision 4, threshold 1000, edgeitems 3, linewidth 80 and
//! automatic scientific notation (`sci_mode=None`).
//!
//! The algorithm follows PyTorch step by step:
//!
//! * A single `_Formatter` is built for the whole tensor (or, when the tensor has more than
//!   `threshold` elements, for the summarised elements only: first/last `edgeitems` entries
//!   along every dimension). For floating point values it looks at the nonzero finite values
//!   and picks one of three modes:
//!   - *int mode* (every nonzero finite value is integral): values print as `1.`, `-2.`;
//!     scientific notation is used when `max/min > 1000` or `max > 1e8`;
//!   - otherwise scientific notation when `max/min > 1000`, `max > 1e8` or `min < 1e-4`;
//!   - otherwise fixed notation with 4 decimals.
//!
//!   Every element is right-aligned to the widest formatted nonzero finite value.
//! * 1-D rows are wrapped so that a line holds `floor((80 - indent) / (width + 2))`
//!   elements; nested dimensions are joined with `,` + `dim - 1` newlines + indentation.
//! * Summarised dimensions show `...` between the leading and trailing `edgeitems` items.

/// Element values of a tensor, widened for printing.
pub(crate) enum Values {
    Float(Vec<f64>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
}

impl Values {
    fn len(&self) -> usize {
        match self {
            Values::Float(v) => v.len(),
            Values::Int(v) => v.len(),
            Values::Bool(v) => v.len(),
        }
    }
}

/// `torch._tensor_str.PRINT_OPTS.precision`
const PRECISION: usize = 4;
/// `torch._tensor_str.PRINT_OPTS.threshold`
const THRESHOLD: usize = 1000;
/// `torch._tensor_str.PRINT_OPTS.edgeitems`
const EDGEITEMS: usize = 3;
/// `torch._tensor_str.PRINT_OPTS.linewidth`
const LINEWIDTH: usize = 80;
/// Prefix of a plain tensor's repr; its length is the indentation of continuation lines.
const PREFIX: &str = "tensor(";

/// Formats `values` (row-major, product of `shape` elements; shape may be empty = 0-dim scalar)
/// as PyTorch prints it: `tensor(<body><suffix>)`. `suffix` is appended after the body inside the
/// parentheses, verbatim (the caller passes e.g. ", dtype=kiln.float64" or "" ).
#[cfg(test)]
fn format_tensor(values: &Values, shape: &[usize], suffix: &str) -> String {
    let body = tensor_str(values, shape, PREFIX.len());
    let mut out = String::with_capacity(PREFIX.len() + body.len() + suffix.len() + 1);
    out.push_str(PREFIX);
    out.push_str(&body);
    out.push_str(suffix);
    out.push(')');
    out
}

/// Like [`format_tensor`], but takes the suffixes as separate items (without the leading
/// `", "`, e.g. `["size=(0, 3)", "dtype=kiln.int32"]`) and places them exactly as PyTorch's
/// `_add_suffixes` does: each suffix goes on the current line after `", "` unless that would
/// exceed the line width, in which case it starts a new line indented by 7 spaces.
pub(crate) fn format_tensor_with_suffixes(
    values: &Values,
    shape: &[usize],
    suffixes: &[&str],
) -> String {
    let mut s = String::from(PREFIX);
    s.push_str(&tensor_str(values, shape, PREFIX.len()));
    add_suffixes(s, suffixes, PREFIX.len())
}

/// `torch._tensor_str._add_suffixes` (with `force_newline=False`).
fn add_suffixes(tensor_str: String, suffixes: &[&str], indent: usize) -> String {
    let chars: Vec<char> = tensor_str.chars().collect();
    // Python: len(s) - s.rfind("\n") + 1, where rfind returns -1 when absent.
    let rfind: isize = chars
        .iter()
        .rposition(|&c| c == '\n')
        .map(|p| p as isize)
        .unwrap_or(-1);
    let mut last_line_len = chars.len() as isize - rfind + 1;
    let mut out = tensor_str;
    for suffix in suffixes {
        let suffix_len = suffix.chars().count() as isize;
        if last_line_len + suffix_len + 2 > LINEWIDTH as isize {
            out.push_str(",\n");
            out.push_str(&" ".repeat(indent));
            out.push_str(suffix);
            last_line_len = indent as isize + suffix_len;
        } else {
            out.push_str(", ");
            out.push_str(suffix);
            last_line_len += suffix_len + 2;
        }
    }
    out.push(')');
    out
}

/// `torch._tensor_str._tensor_str`: the body of the repr (without `tensor(` and `)`).
fn tensor_str(values: &Values, shape: &[usize], indent: usize) -> String {
    let numel: usize = shape.iter().product();
    if numel == 0 {
        return "[]".to_string();
    }
    debug_assert_eq!(
        values.len(),
        numel,
        "format_tensor: {} values for shape {:?}",
        values.len(),
        shape
    );
    let summarize = numel > THRESHOLD;
    let strides = contiguous_strides(shape);
    let formatter = if summarize {
        let mut idx = Vec::new();
        summarized_indices(shape, &strides, 0, &mut idx);
        Formatter::new(values, idx.into_iter())
    } else {
        Formatter::new(values, 0..numel)
    };
    let printer = Printer {
        values,
        formatter: &formatter,
        summarize,
    };
    printer.tensor_str_with_formatter(shape, &strides, 0, indent)
}

fn contiguous_strides(shape: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * shape[d + 1];
    }
    strides
}

/// Indices that end up in `torch._tensor_str.get_summarized_data(tensor)`.
fn summarized_indices(shape: &[usize], strides: &[usize], offset: usize, out: &mut Vec<usize>) {
    if shape.is_empty() {
        out.push(offset);
        return;
    }
    let n = shape[0];
    let rows: Vec<usize> = if n > 2 * EDGEITEMS {
        (0..EDGEITEMS).chain(n - EDGEITEMS..n).collect()
    } else {
        (0..n).collect()
    };
    for i in rows {
        let off = offset + i * strides[0];
        if shape.len() == 1 {
            out.push(off);
        } else {
            summarized_indices(&shape[1..], &strides[1..], off, out);
        }
    }
}

/// Python's `"{:.{p}f}".format(v)`.
fn py_fixed(v: f64, precision: usize) -> String {
    if v.is_nan() {
        // Python ignores the sign of a NaN.
        "nan".to_string()
    } else if v.is_infinite() {
        if v > 0.0 { "inf" } else { "-inf" }.to_string()
    } else {
        format!("{:.*}", precision, v)
    }
}

/// Python's `"{:.{p}e}".format(v)`: mantissa with `p` decimals, exponent with a sign and
/// at least two digits (`1.0000e-05`, `1.2346e+100`).
fn py_sci(v: f64, precision: usize) -> String {
    if !v.is_finite() {
        return py_fixed(v, precision);
    }
    let s = format!("{:.*e}", precision, v);
    match s.split_once('e') {
        Some((mantissa, exp)) => {
            let exp: i32 = exp.parse().unwrap_or(0);
            let sign = if exp < 0 { '-' } else { '+' };
            format!("{}e{}{:02}", mantissa, sign, exp.unsigned_abs())
        }
        None => s,
    }
}

/// `torch._tensor_str._Formatter` with the default print options.
struct Formatter {
    floating_dtype: bool,
    int_mode: bool,
    sci_mode: bool,
    max_width: usize,
}

impl Formatter {
    fn new(values: &Values, indices: impl Iterator<Item = usize>) -> Formatter {
        let mut f = Formatter {
            floating_dtype: matches!(values, Values::Float(_)),
            int_mode: true,
            sci_mode: false,
            max_width: 1,
        };
        match values {
            Values::Int(v) => {
                for i in indices {
                    if let Some(x) = v.get(i) {
                        f.max_width = f.max_width.max(x.to_string().len());
                    }
                }
            }
            Values::Bool(v) => {
                for i in indices {
                    if let Some(&b) = v.get(i) {
                        f.max_width = f.max_width.max(if b { 4 } else { 5 });
                    }
                }
            }
            Values::Float(v) => {
                let nonzero_finite: Vec<f64> = indices
                    .filter_map(|i| v.get(i).copied())
                    .filter(|x| x.is_finite() && *x != 0.0)
                    .collect();
                if nonzero_finite.is_empty() {
                    // no valid number, do nothing
                    return f;
                }
                let mut min = f64::INFINITY;
                let mut max = 0.0f64;
                for x in &nonzero_finite {
                    let a = x.abs();
                    min = min.min(a);
                    max = max.max(a);
                }
                f.int_mode = nonzero_finite.iter().all(|x| *x == x.ceil());
                let ratio_or_big = max / min > 1000.0 || max > 1.0e8;
                if f.int_mode {
                    // in int_mode for floats, all numbers are integers, and a decimal point is
                    // appended to finite values: add 1 to the length to account for this.
                    if ratio_or_big {
                        f.sci_mode = true;
                        for x in &nonzero_finite {
                            f.max_width = f.max_width.max(py_sci(*x, PRECISION).len());
                        }
                    } else {
                        for x in &nonzero_finite {
                            f.max_width = f.max_width.max(py_fixed(*x, 0).len() + 1);
                        }
                    }
                } else if ratio_or_big || min < 1.0e-4 {
                    f.sci_mode = true;
                    for x in &nonzero_finite {
                        f.max_width = f.max_width.max(py_sci(*x, PRECISION).len());
                    }
                } else {
                    for x in &nonzero_finite {
                        f.max_width = f.max_width.max(py_fixed(*x, PRECISION).len());
                    }
                }
            }
        }
        f
    }

    fn width(&self) -> usize {
        self.max_width
    }

    /// `_Formatter.format` applied to the element at flat index `i`.
    fn format(&self, values: &Values, i: usize) -> String {
        let ret = match values {
            Values::Float(v) => {
                let x = match v.get(i) {
                    Some(x) => *x,
                    None => return "?".to_string(),
                };
                debug_assert!(self.floating_dtype);
                if self.sci_mode {
                    py_sci(x, PRECISION)
                } else if self.int_mode {
                    let mut s = py_fixed(x, 0);
                    if x.is_finite() {
                        s.push('.');
                    }
                    s
                } else {
                    py_fixed(x, PRECISION)
                }
            }
            Values::Int(v) => match v.get(i) {
                Some(x) => x.to_string(),
                None => "?".to_string(),
            },
            Values::Bool(v) => match v.get(i) {
                Some(true) => "True".to_string(),
                Some(false) => "False".to_string(),
                None => "?".to_string(),
            },
        };
        let len = ret.chars().count();
        if len >= self.max_width {
            ret
        } else {
            let mut s = " ".repeat(self.max_width - len);
            s.push_str(&ret);
            s
        }
    }
}

struct Printer<'a> {
    values: &'a Values,
    formatter: &'a Formatter,
    summarize: bool,
}

impl Printer<'_> {
    /// `torch._tensor_str._tensor_str_with_formatter` for the sub-tensor at `offset`.
    fn tensor_str_with_formatter(
        &self,
        shape: &[usize],
        strides: &[usize],
        offset: usize,
        indent: usize,
    ) -> String {
        let dim = shape.len();
        if dim == 0 {
            return self.formatter.format(self.values, offset);
        }
        if dim == 1 {
            return self.vector_str(shape[0], strides[0], offset, indent);
        }
        let n = shape[0];
        let sub = |i: usize| {
            self.tensor_str_with_formatter(
                &shape[1..],
                &strides[1..],
                offset + i * strides[0],
                indent + 1,
            )
        };
        let slices: Vec<String> = if self.summarize && n > 2 * EDGEITEMS {
            (0..EDGEITEMS)
                .map(sub)
                .chain(std::iter::once("...".to_string()))
                .chain((n - EDGEITEMS..n).map(sub))
                .collect()
        } else {
            (0..n).map(sub).collect()
        };
        let sep = format!(",{}{}", "\n".repeat(dim - 1), " ".repeat(indent + 1));
        format!("[{}]", slices.join(&sep))
    }

    /// `torch._tensor_str._vector_str`.
    fn vector_str(&self, n: usize, stride: usize, offset: usize, indent: usize) -> String {
        // length includes spaces and comma between elements
        let element_length = self.formatter.width() + 2;
        let per_line = ((LINEWIDTH as f64 - indent as f64) / element_length as f64).floor();
        let elements_per_line = if per_line < 1.0 { 1 } else { per_line as usize };

        let fmt = |i: usize| self.formatter.format(self.values, offset + i * stride);
        let data: Vec<String> = if self.summarize && n > 2 * EDGEITEMS {
            (0..EDGEITEMS)
                .map(fmt)
                .chain(std::iter::once(" ...".to_string()))
                .chain((n - EDGEITEMS..n).map(fmt))
                .collect()
        } else {
            (0..n).map(fmt).collect()
        };
        let lines: Vec<String> = data
            .chunks(elements_per_line)
            .map(|line| line.join(", "))
            .collect();
        let sep = format!(",\n{}", " ".repeat(indent + 1));
        format!("[{}]", lines.join(&sep))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NAN: f64 = f64::NAN;
    const INF: f64 = f64::INFINITY;

    fn f(v: &[f64], shape: &[usize]) -> String {
        format_tensor(&Values::Float(v.to_vec()), shape, "")
    }
    fn fs(v: &[f64], shape: &[usize], suffixes: &[&str]) -> String {
        format_tensor_with_suffixes(&Values::Float(v.to_vec()), shape, suffixes)
    }
    fn i(v: &[i64], shape: &[usize]) -> String {
        format_tensor(&Values::Int(v.to_vec()), shape, "")
    }
    fn is(v: &[i64], shape: &[usize], suffixes: &[&str]) -> String {
        format_tensor_with_suffixes(&Values::Int(v.to_vec()), shape, suffixes)
    }
    fn b(v: &[bool], shape: &[usize]) -> String {
        format_tensor(&Values::Bool(v.to_vec()), shape, "")
    }
    fn arange(n: usize) -> Vec<f64> {
        (0..n).map(|x| x as f64).collect()
    }
    fn map(n: usize, g: impl Fn(f64) -> f64) -> Vec<f64> {
        (0..n).map(|x| g(x as f64)).collect()
    }
    fn iarange(n: usize) -> Vec<i64> {
        (0..n as i64).collect()
    }

    #[test]
    fn number_formatting_helpers() {
        assert_eq!(py_sci(1e-5, 4), "1.0000e-05");
        assert_eq!(py_sci(-1234.5678, 4), "-1.2346e+03");
        assert_eq!(py_sci(1e100, 4), "1.0000e+100");
        assert_eq!(py_sci(0.0, 4), "0.0000e+00");
        assert_eq!(py_sci(-0.0, 4), "-0.0000e+00");
        assert_eq!(py_sci(NAN, 4), "nan");
        assert_eq!(py_sci(-INF, 4), "-inf");
        assert_eq!(py_fixed(-0.0, 4), "-0.0000");
        assert_eq!(py_fixed(-NAN, 4), "nan");
        assert_eq!(py_fixed(-NAN, 0), "nan");
        // Python rounds exact decimal ties to even, as Rust's formatter does.
        assert_eq!(py_fixed(0.5, 0), "0");
        assert_eq!(py_fixed(1.5, 0), "2");
        assert_eq!(py_fixed(2.5, 0), "2");
        assert_eq!(py_fixed(1.03125, 4), "1.0312");
        assert_eq!(py_fixed(1.09375, 4), "1.0938");
        assert_eq!(py_sci(1.03125, 4), "1.0312e+00");
    }

    #[test]
    fn add_suffixes_wraps_like_pytorch() {
        assert_eq!(
            format_tensor(&Values::Float(vec![1.0, 2.0]), &[2], ", dtype=kiln.float64"),
            "tensor([1., 2.], dtype=kiln.float64)"
        );
        // the last line is long: the dtype goes onto its own line, indented by 7
        assert_eq!(
            fs(
                &[66594848.0, -243190.0, -61704114176.0, -9047212032.0],
                &[4],
                &["dtype=kiln.float32"]
            ),
            "tensor([ 6.6595e+07, -2.4319e+05, -6.1704e+10, -9.0472e+09],\n       \
             dtype=kiln.float32)"
        );
    }

    #[test]
    fn exactly_threshold_is_not_summarised() {
        // 1000 elements: threshold is numel > 1000
        let s = f(&arange(1000), &[1000]);
        assert!(!s.contains("..."));
        assert!(s.starts_with("tensor([  0.,   1.,   2.,   3.,   4.,"));
        assert!(s.contains(",\n         12.,  13.,"));
        assert!(s.ends_with(",\n        996., 997., 998., 999.])"));
        assert_eq!(s.lines().count(), 84);
    }

    /// Every expected string below is the verbatim `repr()` of the same tensor in PyTorch 2.11
    /// (default dtype float64, so no dtype suffix for float64; `torch.` renamed to `kiln.`).
    #[test]
    fn matches_pytorch_repr() {
        assert_eq!(f(&[3.5], &[]), "tensor(3.5000)");
        assert_eq!(f(&[3.0], &[]), "tensor(3.)");
        assert_eq!(f(&[-2.0], &[]), "tensor(-2.)");
        assert_eq!(f(&[0.0], &[]), "tensor(0.)");
        assert_eq!(f(&[NAN], &[]), "tensor(nan)");
        assert_eq!(f(&[INF], &[]), "tensor(inf)");
        assert_eq!(f(&[-INF], &[]), "tensor(-inf)");
        assert_eq!(f(&[1e-5], &[]), "tensor(1.0000e-05)");
        assert_eq!(f(&[1e10], &[]), "tensor(1.0000e+10)");
        assert_eq!(f(&[0.1], &[]), "tensor(0.1000)");
        assert_eq!(f(&[1.0 / 3.0], &[]), "tensor(0.3333)");
        assert_eq!(i(&[7], &[]), "tensor(7)");
        assert_eq!(i(&[-42], &[]), "tensor(-42)");
        assert_eq!(b(&[true], &[]), "tensor(True)");
        assert_eq!(b(&[false], &[]), "tensor(False)");
        assert_eq!(f(&[1.0, 2.5], &[2]), "tensor([1.0000, 2.5000])");
        assert_eq!(f(&[1.0, 2.0, 3.0], &[3]), "tensor([1., 2., 3.])");
        assert_eq!(f(&[1.0, -2.0, 10.0], &[3]), "tensor([ 1., -2., 10.])");
        assert_eq!(f(&[0.0, 0.0], &[2]), "tensor([0., 0.])");
        assert_eq!(f(&[0.0, -0.0], &[2]), "tensor([0., -0.])");
        assert_eq!(f(&[1e-5, 1.0], &[2]), "tensor([1.0000e-05, 1.0000e+00])");
        assert_eq!(
            f(&[-1.5, 2.25, 100.125], &[3]),
            "tensor([ -1.5000,   2.2500, 100.1250])"
        );
        assert_eq!(
            f(&[0.1, 0.2, 0.3], &[3]),
            "tensor([0.1000, 0.2000, 0.3000])"
        );
        assert_eq!(f(&[0.0, 0.5], &[2]), "tensor([0.0000, 0.5000])");
        assert_eq!(f(&[1.0, 1e4], &[2]), "tensor([1.0000e+00, 1.0000e+04])");
        assert_eq!(f(&[1.0, 1000.0], &[2]), "tensor([   1., 1000.])");
        assert_eq!(f(&[1e9], &[1]), "tensor([1.0000e+09])");
        assert_eq!(f(&[1e8], &[1]), "tensor([100000000.])");
        assert_eq!(
            f(&[-1e-5, 2e-5], &[2]),
            "tensor([-1.0000e-05,  2.0000e-05])"
        );
        assert_eq!(f(&[0.0001], &[1]), "tensor([0.0001])");
        assert_eq!(f(&[0.00011], &[1]), "tensor([0.0001])");
        assert_eq!(
            fs(&[0.0001f32 as f64], &[1], &["dtype=kiln.float32"]),
            "tensor([1.0000e-04], dtype=kiln.float32)"
        );
        assert_eq!(f(&[1.03125, 0.5], &[2]), "tensor([1.0312, 0.5000])");
        assert_eq!(f(&[NAN, 1.0], &[2]), "tensor([nan, 1.])");
        assert_eq!(f(&[NAN, 1.5], &[2]), "tensor([   nan, 1.5000])");
        assert_eq!(f(&[INF, -INF, NAN], &[3]), "tensor([inf, -inf, nan])");
        assert_eq!(f(&[1.0, INF, -2.0], &[3]), "tensor([ 1., inf, -2.])");
        assert_eq!(f(&[0.5, -INF], &[2]), "tensor([0.5000,   -inf])");
        assert_eq!(f(&[1e-5, NAN], &[2]), "tensor([1.0000e-05,        nan])");
        assert_eq!(
            i(&[1, -2, 3, 4], &[2, 2]),
            "tensor([[ 1, -2],\n        \
             [ 3,  4]])"
        );
        assert_eq!(i(&[1, 2, 3], &[3]), "tensor([1, 2, 3])");
        assert_eq!(i(&[0, 100, -5], &[3]), "tensor([  0, 100,  -5])");
        assert_eq!(b(&[true, false], &[2]), "tensor([ True, False])");
        assert_eq!(b(&[true, true], &[2]), "tensor([True, True])");
        assert_eq!(
            b(&[true, false, false, true], &[2, 2]),
            "tensor([[ True, False],\n        \
             [False,  True]])"
        );
        assert_eq!(
            f(&[1.0, 2.0, 3.0, 4.0], &[2, 2]),
            "tensor([[1., 2.],\n        \
             [3., 4.]])"
        );
        assert_eq!(
            f(&[0.5, 1.25, -3.0, 4.0, 5.0, 6.0], &[2, 3]),
            "tensor([[ 0.5000,  1.2500, -3.0000],\n        \
             [ 4.0000,  5.0000,  6.0000]])"
        );
        assert_eq!(
            i(&iarange(8), &[2, 2, 2]),
            "tensor([[[0, 1],\n         \
             [2, 3]],\n\
             \n        \
             [[4, 5],\n         \
             [6, 7]]])"
        );
        assert_eq!(
            i(&iarange(4), &[1, 1, 2, 2]),
            "tensor([[[[0, 1],\n          \
             [2, 3]]]])"
        );
        assert_eq!(
            i(&iarange(4), &[2, 1, 1, 2]),
            "tensor([[[[0, 1]]],\n\
             \n\
             \n        \
             [[[2, 3]]]])"
        );
        assert_eq!(f(&[1.0], &[1, 1]), "tensor([[1.]])");
        assert_eq!(f(&[], &[0]), "tensor([])");
        assert_eq!(
            fs(&[], &[0, 3], &["size=(0, 3)"]),
            "tensor([], size=(0, 3))"
        );
        assert_eq!(
            is(&[], &[2, 0], &["size=(2, 0)", "dtype=kiln.int64"]),
            "tensor([], size=(2, 0), dtype=kiln.int64)"
        );
        assert_eq!(
            is(&[1, 2], &[2], &["dtype=kiln.int32"]),
            "tensor([1, 2], dtype=kiln.int32)"
        );
        assert_eq!(
            is(&(10..30).collect::<Vec<_>>(), &[20], &["dtype=kiln.int32"]),
            "tensor([10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27,\n        \
             28, 29], dtype=kiln.int32)"
        );
        assert_eq!(
            fs(&map(10, |x| x + 0.5), &[10], &["dtype=kiln.float32"]),
            "tensor([0.5000, 1.5000, 2.5000, 3.5000, 4.5000, 5.5000, 6.5000, 7.5000, 8.5000,\n        \
             9.5000], dtype=kiln.float32)"
        );
        assert_eq!(
            f(&arange(20), &[20]),
            "tensor([ 0.,  1.,  2.,  3.,  4.,  5.,  6.,  7.,  8.,  9., 10., 11., 12., 13.,\n        \
             14., 15., 16., 17., 18., 19.])"
        );
        assert_eq!(
            i(&iarange(30), &[30]),
            "tensor([ 0,  1,  2,  3,  4,  5,  6,  7,  8,  9, 10, 11, 12, 13, 14, 15, 16, 17,\n        \
             18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29])"
        );
        assert_eq!(
            f(&map(10, |x| x * 0.5 + 0.25), &[10]),
            "tensor([0.2500, 0.7500, 1.2500, 1.7500, 2.2500, 2.7500, 3.2500, 3.7500, 4.2500,\n        \
             4.7500])"
        );
        assert_eq!(
            f(&map(20, |x| x * 0.5 + 0.25), &[2, 10]),
            "tensor([[0.2500, 0.7500, 1.2500, 1.7500, 2.2500, 2.7500, 3.2500, 3.7500, 4.2500,\n         \
             4.7500],\n        \
             [5.2500, 5.7500, 6.2500, 6.7500, 7.2500, 7.7500, 8.2500, 8.7500, 9.2500,\n         \
             9.7500]])"
        );
        assert_eq!(
            f(&arange(1001), &[1001]),
            "tensor([   0.,    1.,    2.,  ...,  998.,  999., 1000.])"
        );
        assert_eq!(
            i(&iarange(2000), &[2000]),
            "tensor([   0,    1,    2,  ..., 1997, 1998, 1999])"
        );
        assert_eq!(
            f(
                &{
                    let mut v = arange(1001);
                    v[500] = 0.5;
                    v
                },
                &[1001]
            ),
            "tensor([   0.,    1.,    2.,  ...,  998.,  999., 1000.])"
        );
        assert_eq!(
            f(&map(2000, |x| x / 1000.0), &[2000]),
            "tensor([0.0000e+00, 1.0000e-03, 2.0000e-03,  ..., 1.9970e+00, 1.9980e+00,\n        \
             1.9990e+00])"
        );
        assert_eq!(
            i(&iarange(10000), &[100, 100]),
            "tensor([[   0,    1,    2,  ...,   97,   98,   99],\n        \
             [ 100,  101,  102,  ...,  197,  198,  199],\n        \
             [ 200,  201,  202,  ...,  297,  298,  299],\n        \
             ...,\n        \
             [9700, 9701, 9702,  ..., 9797, 9798, 9799],\n        \
             [9800, 9801, 9802,  ..., 9897, 9898, 9899],\n        \
             [9900, 9901, 9902,  ..., 9997, 9998, 9999]])"
        );
        assert_eq!(
            i(&iarange(1002), &[501, 2]),
            "tensor([[   0,    1],\n        \
             [   2,    3],\n        \
             [   4,    5],\n        \
             ...,\n        \
             [ 996,  997],\n        \
             [ 998,  999],\n        \
             [1000, 1001]])"
        );
        assert_eq!(
            f(&arange(2000), &[2, 1000]),
            "tensor([[0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 9.9700e+02, 9.9800e+02,\n         \
             9.9900e+02],\n        \
             [1.0000e+03, 1.0010e+03, 1.0020e+03,  ..., 1.9970e+03, 1.9980e+03,\n         \
             1.9990e+03]])"
        );
        assert_eq!(
            i(&iarange(1100), &[10, 10, 11]),
            "tensor([[[   0,    1,    2,  ...,    8,    9,   10],\n         \
             [  11,   12,   13,  ...,   19,   20,   21],\n         \
             [  22,   23,   24,  ...,   30,   31,   32],\n         \
             ...,\n         \
             [  77,   78,   79,  ...,   85,   86,   87],\n         \
             [  88,   89,   90,  ...,   96,   97,   98],\n         \
             [  99,  100,  101,  ...,  107,  108,  109]],\n\
             \n        \
             [[ 110,  111,  112,  ...,  118,  119,  120],\n         \
             [ 121,  122,  123,  ...,  129,  130,  131],\n         \
             [ 132,  133,  134,  ...,  140,  141,  142],\n         \
             ...,\n         \
             [ 187,  188,  189,  ...,  195,  196,  197],\n         \
             [ 198,  199,  200,  ...,  206,  207,  208],\n         \
             [ 209,  210,  211,  ...,  217,  218,  219]],\n\
             \n        \
             [[ 220,  221,  222,  ...,  228,  229,  230],\n         \
             [ 231,  232,  233,  ...,  239,  240,  241],\n         \
             [ 242,  243,  244,  ...,  250,  251,  252],\n         \
             ...,\n         \
             [ 297,  298,  299,  ...,  305,  306,  307],\n         \
             [ 308,  309,  310,  ...,  316,  317,  318],\n         \
             [ 319,  320,  321,  ...,  327,  328,  329]],\n\
             \n        \
             ...,\n\
             \n        \
             [[ 770,  771,  772,  ...,  778,  779,  780],\n         \
             [ 781,  782,  783,  ...,  789,  790,  791],\n         \
             [ 792,  793,  794,  ...,  800,  801,  802],\n         \
             ...,\n         \
             [ 847,  848,  849,  ...,  855,  856,  857],\n         \
             [ 858,  859,  860,  ...,  866,  867,  868],\n         \
             [ 869,  870,  871,  ...,  877,  878,  879]],\n\
             \n        \
             [[ 880,  881,  882,  ...,  888,  889,  890],\n         \
             [ 891,  892,  893,  ...,  899,  900,  901],\n         \
             [ 902,  903,  904,  ...,  910,  911,  912],\n         \
             ...,\n         \
             [ 957,  958,  959,  ...,  965,  966,  967],\n         \
             [ 968,  969,  970,  ...,  976,  977,  978],\n         \
             [ 979,  980,  981,  ...,  987,  988,  989]],\n\
             \n        \
             [[ 990,  991,  992,  ...,  998,  999, 1000],\n         \
             [1001, 1002, 1003,  ..., 1009, 1010, 1011],\n         \
             [1012, 1013, 1014,  ..., 1020, 1021, 1022],\n         \
             ...,\n         \
             [1067, 1068, 1069,  ..., 1075, 1076, 1077],\n         \
             [1078, 1079, 1080,  ..., 1086, 1087, 1088],\n         \
             [1089, 1090, 1091,  ..., 1097, 1098, 1099]]])"
        );
        assert_eq!(
            b(&(0..1001).map(|x| x % 2 == 0).collect::<Vec<_>>(), &[1001]),
            "tensor([ True, False,  True,  ...,  True, False,  True])"
        );
        assert_eq!(f(&[1e20, 1.0], &[2]), "tensor([1.0000e+20, 1.0000e+00])");
        assert_eq!(
            f(&[123456789.0, 1.0], &[2]),
            "tensor([1.2346e+08, 1.0000e+00])"
        );
        assert_eq!(
            f(&[-0.0001, 5.0], &[2]),
            "tensor([-1.0000e-04,  5.0000e+00])"
        );
        assert_eq!(
            f(&[1e-300, 1e300], &[2]),
            "tensor([1.0000e-300, 1.0000e+300])"
        );
        assert_eq!(
            f(&map(1001, |x| x - 500.5), &[1001]),
            "tensor([-500.5000, -499.5000, -498.5000,  ...,  497.5000,  498.5000,\n         \
             499.5000])"
        );
        assert_eq!(f(&[-0.0], &[]), "tensor(-0.)");
        assert_eq!(f(&[2.5e-5], &[1]), "tensor([2.5000e-05])");
        assert_eq!(
            f(&map(40, |x| x * 1.5), &[2, 2, 10]),
            "tensor([[[ 0.0000,  1.5000,  3.0000,  4.5000,  6.0000,  7.5000,  9.0000,\n          \
             10.5000, 12.0000, 13.5000],\n         \
             [15.0000, 16.5000, 18.0000, 19.5000, 21.0000, 22.5000, 24.0000,\n          \
             25.5000, 27.0000, 28.5000]],\n\
             \n        \
             [[30.0000, 31.5000, 33.0000, 34.5000, 36.0000, 37.5000, 39.0000,\n          \
             40.5000, 42.0000, 43.5000],\n         \
             [45.0000, 46.5000, 48.0000, 49.5000, 51.0000, 52.5000, 54.0000,\n          \
             55.5000, 57.0000, 58.5000]]])"
        );
    }
}
