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
    /// Whether a run may be folded in `LANES` interleaved partial results combined at its end
    /// (value reductions, which are associative; not arg reductions, whose ties need order).
    lanes: bool,
}

/// Interleaved partial results per run of a value reduction: independent chains the compiler
/// vectorises, instead of one chain of dependent steps.
const LANES: usize = 8;

impl<A: Copy, S, M: Fn(A, A) -> A> Reducer<A, S, M> {
    /// `a` stepped over `run` (element `j` at index `at + j`; in lanes, which only value
    /// reductions use, the index is not passed on).
    fn fold<C: Copy>(&self, a: A, run: &[C], at: usize) -> A
    where
        S: Fn(A, usize, C) -> A,
    {
        if !self.lanes || run.len() < 2 * LANES {
            return run.iter().enumerate().fold(a, |a, (j, &v)| (self.step)(a, at + j, v));
        }
        let mut l = [self.init; LANES];
        let chunks = run.chunks_exact(LANES);
        let rest = chunks.remainder();
        for c in chunks {
            for (x, &v) in l.iter_mut().zip(c) {
                *x = (self.step)(*x, at, v);
            }
        }
        let a = l.into_iter().fold(a, |a, b| (self.combine)(a, b));
        rest.iter().fold(a, |a, &v| (self.step)(a, at, v))
    }
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
    if op == ReduceOp::Sum {
        // Its own loops, free of the per-element choice of op, so that they vectorise.
        let r = Reducer { init: op.identity::<A>(), step: |a: A, _, v: C| a.add(v.into()), combine: |a: A, b: A| a.add(b), lanes: true };
        return run::<C, A, _>(x, dims, r, |v| v);
    }
    let r = Reducer { init: op.identity::<A>(), step: move |a: A, _, v: C| op.combine(a, v.into()), combine: move |a: A, b: A| op.combine(a, b), lanes: true };
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
        lanes: false,
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
    // Kept dims in one run between reduced ones of a contiguous tensor (batch norm's per-channel
    // sums over N, H, W): read in place, a run of the inner dims at a time.
    let one_run = kept.last().zip(kept.first()).is_some_and(|(&b, &a)| b - a + 1 == kept.len());
    if let (true, true, Some(sl)) = (one_run && !leading && !kept.is_empty() && kept[0] > 0 && kept[kept.len() - 1] + 1 < l.ndim(), l.is_contiguous(), C::slice(s)) {
        let (a, b) = (kept[0], kept[kept.len() - 1]);
        let outer: usize = l.shape[..a].iter().product();
        let inner: usize = l.shape[b + 1..].iter().product();
        // Short runs are better gathered into rows first.
        if inner >= MIN_MID_RUN {
            let data = &sl[l.offset..l.offset + l.numel()];
            return reduce_mid(data, outer, m, inner, &r).iter().map(|&a| finish(a)).collect();
        }
    }
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
    let row = |i: usize, lo: usize, hi: usize| r.fold(r.init, &data[i * k + lo..i * k + hi], lo);
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

/// Rows per part when a reduction's reduced rows are split across threads: the parts depend on
/// the sizes alone, so the result does not depend on the thread count.
const ROWS_PER_PART: usize = 1024;
/// Shortest run of inner elements a reduction over dims around a kept run reads in place.
const MIN_MID_RUN: usize = 256;
/// Most parts a reduction is split into.
const MAX_PARTS: usize = 64;

/// Partial results of `parts` consecutive ranges of `0..n`, combined in order.
fn in_parts<A: Copy + Send + Sync>(n: usize, parts: usize, r: &Reducer<A, impl Sync, impl Fn(A, A) -> A + Sync>, part: impl Fn(usize, usize) -> Vec<A> + Sync) -> Vec<A> {
    let partials: Vec<Vec<A>> = (0..parts).into_par_iter().map(|p| part(p * n / parts, (p + 1) * n / parts)).collect();
    let mut it = partials.into_iter();
    let first = it.next().expect("at least one part");
    it.fold(first, |acc, p| acc.into_iter().zip(p).map(|(a, b)| (r.combine)(a, b)).collect())
}

/// `data` is `outer` blocks of `rows` rows of `inner`: one result per row, over the blocks and
/// the inner elements (element index `o * inner + j` within a row's reduction).
fn reduce_mid<C: Copy + Sync, A: Copy + Send + Sync>(
    data: &[C],
    outer: usize,
    rows: usize,
    inner: usize,
    r: &Reducer<A, impl Fn(A, usize, C) -> A + Sync, impl Fn(A, A) -> A + Sync>,
) -> Vec<A> {
    let block = |o0: usize, o1: usize| {
        let mut acc = vec![r.init; rows];
        for o in o0..o1 {
            for (row, a) in acc.iter_mut().enumerate() {
                let base = (o * rows + row) * inner;
                *a = r.fold(*a, &data[base..base + inner], o * inner);
            }
        }
        acc
    };
    if outer * rows * inner < PAR_THRESHOLD {
        return block(0, outer);
    }
    in_parts(outer, outer.clamp(1, MAX_PARTS), r, block)
}

/// `data` is k rows of m: one result per column.
fn reduce_cols<C: Copy + Sync, A: Copy + Send + Sync + 'static>(
    data: &[C],
    k: usize,
    m: usize,
    r: &Reducer<A, impl Fn(A, usize, C) -> A + Sync, impl Fn(A, A) -> A + Sync>,
) -> HostBuf<A> {
    const COLS: usize = 1024;
    // Few columns over many rows (batch norm's sums over an NHWC tensor): the rows are split.
    if m <= COLS && k >= 2 * ROWS_PER_PART && m * k >= PAR_THRESHOLD {
        let acc = in_parts(k, (k / ROWS_PER_PART).clamp(1, MAX_PARTS), r, |i0, i1| {
            let mut acc = vec![r.init; m];
            for i in i0..i1 {
                for (a, &v) in acc.iter_mut().zip(&data[i * m..(i + 1) * m]) {
                    *a = (r.step)(*a, i, v);
                }
            }
            acc
        });
        return acc.into();
    }
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
