//! Reductions over some dims: the kept dims become rows, the reduced dims columns.

use super::{fill_new, gather, with_storage, CpuStorage, HostBuf, HostElem, PAR_THRESHOLD};
use crate::layout::Layout;
use crate::dtype::CType;
use crate::ops::reduce::{beats, Accumulate, ReduceOp};
use crate::storage::BackendStorage;
use crate::{DType, Tensor};
use rayon::prelude::*;

/// A reduction in accumulator `A` over elements `C`: start value, one step (with the element's
/// position in its row), and how two partial results combine.
struct Reducer<A, S, M> {
    init: A,
    step: S,
    combine: M,
}

/// Reduces the `dims` of `x` into a row-major storage of `out` dtype.
pub(crate) fn reduce(op: ReduceOp, x: &Tensor, dims: &[usize], out: DType) -> CpuStorage {
    let compute = x.dtype();
    match op {
        _ if op.is_arg() => {
            let max = op == ReduceOp::ArgMax;
            let v = match compute {
                DType::F64 => run_arg::<f64>(x, dims, max),
                DType::F32 | DType::F16 | DType::BF16 => run_arg::<f32>(x, dims, max),
                _ => run_arg::<i64>(x, dims, max),
            };
            CpuStorage::I64(v.into())
        }
        // Elements of `C` accumulate in the op's accumulator type `A` (`ReduceOp::acc_type`).
        _ => match (compute, op.acc_type(compute)) {
            (DType::F64, _) => CpuStorage::from_vec_as(run_op::<f64, f64>(op, x, dims), out),
            (_, CType::F64) => CpuStorage::from_vec_as(run_op::<f32, f64>(op, x, dims), out),
            (_, CType::F32) => CpuStorage::from_vec_as(run_op::<f32, f32>(op, x, dims), out),
            _ => CpuStorage::from_vec_as(run_op::<i64, i64>(op, x, dims), out),
        },
    }
}

/// A value reduction (`ReduceOp::combine` from `ReduceOp::identity`), elements of `C` into `A`.
fn run_op<C: HostElem + Into<A>, A: Accumulate + Send + Sync + 'static>(op: ReduceOp, x: &Tensor, dims: &[usize]) -> Vec<A> {
    let r = Reducer { init: op.identity::<A>(), step: move |a: A, _, v: C| op.combine(a, v.into()), combine: move |a: A, b: A| op.combine(a, b) };
    run::<C, A, _>(x, dims, r, |v| v)
}

fn run_arg<C: HostElem>(x: &Tensor, dims: &[usize], max: bool) -> Vec<i64> {
    let r = Reducer {
        init: None::<(C, usize)>,
        step: move |a: Option<(C, usize)>, i, v: C| match a {
            Some(a) if !beats(v, a.0, max) => Some(a),
            _ => Some((v, i)),
        },
        // The earlier index wins ties: partials combine in order.
        combine: move |a: Option<(C, usize)>, b: Option<(C, usize)>| match (a, b) {
            (Some(a), Some(b)) => Some(if beats(b.0, a.0, max) { b } else { a }),
            (a, None) => a,
            (None, b) => b,
        },
    };
    run::<C, Option<(C, usize)>, _>(x, dims, r, |v| v.expect("reduction over a non-empty dim").1 as i64)
}

/// Runs a reducer: picks the loop order from where the reduced dims sit in memory.
fn run<C: HostElem, A: Copy + Send + Sync + 'static, O: Send + Sync>(
    x: &Tensor,
    dims: &[usize],
    r: Reducer<A, impl Fn(A, usize, C) -> A + Sync, impl Fn(A, A) -> A + Sync>,
    finish: impl Fn(A) -> O + Sync,
) -> Vec<O> {
    let l = x.layout();
    let kept: Vec<usize> = (0..l.ndim()).filter(|d| !dims.contains(d)).collect();
    let m: usize = kept.iter().map(|&d| l.shape[d]).product();
    let k: usize = dims.iter().map(|&d| l.shape[d]).product();
    // Reducing the leading dims of a contiguous tensor: accumulate whole rows (no transpose).
    let leading = dims.iter().enumerate().all(|(i, &d)| d == i) && dims.len() < l.ndim();
    let perm: Vec<usize> = if leading { (0..l.ndim()).collect() } else { kept.iter().chain(dims).copied().collect() };
    let pl = Layout {
        shape: perm.iter().map(|&d| l.shape[d]).collect(),
        strides: perm.iter().map(|&d| l.strides[d]).collect(),
        offset: l.offset,
    };
    let guard = x.storage().data.read_recursive();
    let BackendStorage::Cpu(s) = &*guard else { unreachable!("CPU kernel on a CUDA tensor") };
    let owned: HostBuf<C>;
    let data: &[C] = match C::slice(s) {
        Some(sl) if pl.is_contiguous() => &sl[pl.offset..pl.offset + pl.numel()],
        _ => {
            owned = with_storage!(s, v => gather(v, &pl));
            &owned
        }
    };
    let acc = if leading { reduce_cols(data, k, m, &r) } else { reduce_rows(data, m, k, &r).into() };
    acc.iter().map(|&a| finish(a)).collect()
}

/// `data` is m rows of k: one result per row.
fn reduce_rows<C: Copy + Sync, A: Copy + Send + Sync>(
    data: &[C],
    m: usize,
    k: usize,
    r: &Reducer<A, impl Fn(A, usize, C) -> A + Sync, impl Fn(A, A) -> A + Sync>,
) -> Vec<A> {
    let row = |i: usize, lo: usize, hi: usize| {
        let mut a = r.init;
        for (j, &v) in data[i * k + lo..i * k + hi].iter().enumerate() {
            a = (r.step)(a, lo + j, v);
        }
        a
    };
    if m * k < PAR_THRESHOLD {
        return (0..m).map(|i| row(i, 0, k)).collect();
    }
    if m >= rayon::current_num_threads() * 4 {
        return (0..m).into_par_iter().map(|i| row(i, 0, k)).collect();
    }
    // Few long rows: split each row, then combine the parts in order.
    let parts = (k / 4096).clamp(1, 256);
    (0..m)
        .map(|i| {
            (0..parts)
                .into_par_iter()
                .map(|p| row(i, p * k / parts, (p + 1) * k / parts))
                .collect::<Vec<A>>()
                .into_iter()
                .fold(r.init, |a, b| (r.combine)(a, b))
        })
        .collect()
}

/// `data` is k rows of m: one result per column.
fn reduce_cols<C: Copy + Sync, A: Copy + Send + Sync + 'static>(
    data: &[C],
    k: usize,
    m: usize,
    r: &Reducer<A, impl Fn(A, usize, C) -> A + Sync, impl Fn(A, A) -> A + Sync>,
) -> HostBuf<A> {
    const COLS: usize = 1024;
    fill_new(m, |start, out| {
        // Blocks of columns keep the accumulators in cache while rows stream past.
        for c0 in (0..out.len()).step_by(COLS) {
            let c1 = (c0 + COLS).min(out.len());
            let mut acc = vec![r.init; c1 - c0];
            for i in 0..k {
                let rowd = &data[i * m + start + c0..i * m + start + c1];
                for (a, &v) in acc.iter_mut().zip(rowd) {
                    *a = (r.step)(*a, i, v);
                }
            }
            for (o, a) in out[c0..c1].iter_mut().zip(acc) {
                o.write(a);
            }
        }
    })
}
