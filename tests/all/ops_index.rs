//! Indexing and joining against host loops: index_select, gather, scatter_add, cat, stack,
//! split, chunk, pad, tril/triu, one_hot, narrow, slice; and which results are views.

use crate::common::*;
use crate::ops::*;
use kiln::prelude::*;
use kiln::Error;

const DTS: [DType; 6] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::U8];

fn dom(dt: DType) -> impl Fn(f64) -> f64 {
    move |r| if dt.is_float() { r } else { (r * 20.0).round().abs() }
}

#[test]
fn index_select_values() {
    for dt in DTS {
        for lay in [Lay::Contig, Lay::Transposed, Lay::Strided] {
            let (x, xv) = make2(4, 5, lay, dt, 1, dom(dt));
            let idx = [3i64, 0, 3, 1, 2];
            let i = ti64(&idx, &[5]);
            let want: Vec<f64> = idx.iter().flat_map(|&r| xv[r as usize * 5..r as usize * 5 + 5].to_vec()).collect();
            check(&format!("index_select dim 0 {dt:?} {lay:?}"), &x.index_select(0, &i).unwrap(), &[5, 5], dt, &want, 0.0, 0.0);
            let idx = [4i64, 0, 2];
            let want: Vec<f64> = (0..4).flat_map(|r| idx.iter().map(move |&c| (r, c as usize))).map(|(r, c)| xv[r * 5 + c]).collect();
            check(&format!("index_select dim -1 {dt:?} {lay:?}"), &x.index_select(-1, &ti32(&[4, 0, 2], &[3])).unwrap(), &[4, 3], dt, &want, 0.0, 0.0);
            check(&format!("index_select empty {dt:?}"), &x.index_select(1, &ti64(&[], &[0])).unwrap(), &[4, 0], dt, &[], 0.0, 0.0);
        }
    }
    // 3-D, middle dim
    let (x, xv) = inputs(&[2, 3, 4], 2, DType::F32, |r| r);
    let want: Vec<f64> = (0..2).flat_map(|a| [2usize, 2, 0].into_iter().flat_map(move |b| (0..4).map(move |c| (a, b, c)))).map(|(a, b, c)| xv[(a * 3 + b) * 4 + c]).collect();
    check("index_select 3-D", &x.index_select(1, &ti64(&[2, 2, 0], &[3])).unwrap(), &[2, 3, 4], DType::F32, &want, 0.0, 0.0);
    assert!(matches!(x.index_select(1, &ti64(&[3], &[1])).and_then(|y| y.to_device(&kiln::Device::Cpu)), Err(Error::Index { .. })));
    assert!(matches!(x.index_select(1, &t(&[0.0], &[1], DType::F32)), Err(Error::DType { .. })));
    assert!(x.index_select(1, &ti64(&[0, 1], &[1, 2])).is_err());
}

#[test]
fn gather_values() {
    for dt in DTS {
        for lay in [Lay::Contig, Lay::Transposed, Lay::Strided] {
            let (x, xv) = make2(3, 4, lay, dt, 3, dom(dt));
            // dim 1: out[i][j] = x[i][idx[i][j]]
            let idx = [3i64, 0, 1, 1, 2, 2, 0, 3, 3];
            let want: Vec<f64> = (0..9).map(|f| xv[(f / 3) * 4 + idx[f] as usize]).collect();
            check(&format!("gather dim 1 {dt:?} {lay:?}"), &x.gather(1, &ti64(&idx, &[3, 3])).unwrap(), &[3, 3], dt, &want, 0.0, 0.0);
            // dim 0 with an index smaller in dim 1: out[i][j] = x[idx[i][j]][j]
            let idx = [2i64, 0, 1, 1, 0, 0];
            let want: Vec<f64> = (0..6).map(|f| xv[idx[f] as usize * 4 + f % 3]).collect();
            check(&format!("gather dim 0 {dt:?} {lay:?}"), &x.gather(0, &ti64(&idx, &[2, 3])).unwrap(), &[2, 3], dt, &want, 0.0, 0.0);
        }
    }
    // non-contiguous index
    let (x, xv) = inputs(&[3, 4], 4, DType::F64, |r| r);
    let it = ti64(&[1, 0, 2, 3, 3, 0, 1, 1, 2, 0, 0, 0], &[4, 3]).t().unwrap(); // [3, 4]
    let iv = [1usize, 3, 1, 0, 0, 3, 1, 0, 2, 0, 2, 0];
    let want: Vec<f64> = (0..12).map(|f| xv[(f / 4) * 4 + iv[f]]).collect();
    check("gather transposed index", &x.gather(1, &it).unwrap(), &[3, 4], DType::F64, &want, 0.0, 0.0);
    assert!(matches!(x.gather(1, &ti64(&[4], &[1, 1])).and_then(|y| y.to_device(&kiln::Device::Cpu)), Err(Error::Index { .. })));
    assert!(x.gather(1, &ti64(&[0; 5], &[5, 1])).is_err(), "index larger than input in a non-gather dim");
    assert!(x.gather(1, &ti64(&[0; 3], &[3])).is_err(), "rank mismatch");
}

#[test]
fn scatter_add_with_repeated_indices() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64] {
        let d = dom(dt);
        let (base, bv) = inputs(&[3, 5], 5, dt, &d);
        let idx = [0i64, 1, 0, 4, 2, 2, 2, 2, 4, 3, 1, 0];
        for lay in [Lay::Contig, Lay::Transposed] {
            let (src, sv) = make2(3, 4, lay, dt, 6, &d);
            // dim 1: out[i][idx[i][j]] += src[i][j]
            let mut want = bv.clone();
            for f in 0..12 {
                want[(f / 4) * 5 + idx[f] as usize] += sv[f];
            }
            let want: Vec<f64> = want.into_iter().map(|v| round_to(dt, v)).collect();
            let (rt, at) = tol(dt, false);
            check(&format!("scatter_add dim 1 {dt:?} {lay:?}"), &base.scatter_add(1, &ti64(&idx, &[3, 4]), &src).unwrap(), &[3, 5], dt, &want, rt * 2.0, at);
        }
        // dim 0, src larger than the index: only the index-shaped corner takes part
        let (src, sv) = inputs(&[3, 5], 7, dt, &d);
        let idx0 = [2i64, 2, 0, 1, 2, 2, 2, 0];
        let mut want = bv.clone();
        for f in 0..8 {
            let (i, j) = (f / 4, f % 4);
            want[idx0[f] as usize * 5 + j] += sv[i * 5 + j];
        }
        let want: Vec<f64> = want.into_iter().map(|v| round_to(dt, v)).collect();
        let (rt, at) = tol(dt, false);
        check(&format!("scatter_add dim 0 {dt:?}"), &base.scatter_add(0, &ti64(&idx0, &[2, 4]), &src).unwrap(), &[3, 5], dt, &want, rt * 2.0, at);
        // the base is not modified
        close("scatter_add leaves base", &vals(&base), &bv, 0.0, 0.0);
    }
    // all into one slot
    let z = Tensor::zeros(&[4], DType::F32, &dev()).unwrap();
    let r = z.scatter_add(0, &ti64(&[2; 6], &[6]), &t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[6], DType::F32)).unwrap();
    assert_eq!(vals(&r), vec![0.0, 0.0, 21.0, 0.0]);
    assert!(z.scatter_add(0, &ti64(&[0], &[1]), &t(&[1.0], &[1], DType::F64)).is_err(), "src dtype must match");
    assert!(matches!(z.scatter_add(0, &ti64(&[4], &[1]), &t(&[1.0], &[1], DType::F32)).and_then(|y| y.to_device(&kiln::Device::Cpu)), Err(Error::Index { .. })));
}

#[test]
fn scatter_writes_src_at_the_index_and_scatter_in_place_too() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64] {
        let d = dom(dt);
        let (base, bv) = inputs(&[3, 5], 5, dt, &d);
        let idx = [0i64, 1, 4, 2, 3, 2, 0, 4, 4, 3, 1, 0];
        for lay in [Lay::Contig, Lay::Transposed] {
            let (src, sv) = make2(3, 4, lay, dt, 6, &d);
            // dim 1: out[i][idx[i][j]] = src[i][j]
            let mut want = bv.clone();
            for f in 0..12 {
                want[(f / 4) * 5 + idx[f] as usize] = sv[f];
            }
            check(&format!("scatter dim 1 {dt:?} {lay:?}"), &base.scatter(1, &ti64(&idx, &[3, 4]), &src).unwrap(), &[3, 5], dt, &want, 0.0, 0.0);
            let inplace = base.copy_contiguous().unwrap();
            inplace.scatter_(1, &ti64(&idx, &[3, 4]), &src).unwrap();
            check(&format!("scatter_ dim 1 {dt:?} {lay:?}"), &inplace, &[3, 5], dt, &want, 0.0, 0.0);
        }
        // dim 0 with a broadcast (expanded) index and src larger than the index.
        let (src, sv) = inputs(&[3, 5], 7, dt, &d);
        let row = ti64(&[2], &[1, 1]).broadcast_to(&[2, 5]).unwrap();
        let mut want = bv.clone();
        for j in 0..5 {
            want[2 * 5 + j] = sv[5 + j]; // the second of the two writes to row 2, as a loop over the index does
        }
        let got = base.scatter(0, &row.narrow(0, 1, 1).unwrap(), &src.narrow(0, 1, 1).unwrap()).unwrap();
        check(&format!("scatter dim 0 broadcast index {dt:?}"), &got, &[3, 5], dt, &want, 0.0, 0.0);
        close("scatter leaves base", &vals(&base), &bv, 0.0, 0.0);
    }
    let z = Tensor::zeros(&[4], DType::F32, &dev()).unwrap();
    assert!(z.scatter(0, &ti64(&[0], &[1]), &t(&[1.0], &[1], DType::F64)).is_err(), "src dtype must match");
    assert!(z.scatter(0, &ti64(&[0, 1], &[2]), &t(&[1.0], &[1], DType::F32)).is_err(), "src smaller than the index");
    assert!(matches!(z.scatter(0, &ti64(&[4], &[1]), &t(&[1.0], &[1], DType::F32)).and_then(|y| y.to_device(&kiln::Device::Cpu)), Err(Error::Index { .. })));
}

#[test]
fn cat_values_and_promotion() {
    let (a, av) = inputs(&[2, 3], 1, DType::F32, |r| r);
    let (b, bv) = make2(4, 3, Lay::Transposed, DType::F32, 2, |r| r);
    let (c, cv) = make2(1, 3, Lay::Strided, DType::F32, 3, |r| r);
    let want: Vec<f64> = av.iter().chain(&bv).chain(&cv).copied().collect();
    check("cat dim 0", &kiln::cat(&[&a, &b, &c], 0).unwrap(), &[7, 3], DType::F32, &want, 0.0, 0.0);
    // dim 1 / -1
    let (d, dv) = make2(2, 2, Lay::Transposed, DType::F32, 4, |r| r);
    let want: Vec<f64> = (0..2).flat_map(|i| av[i * 3..i * 3 + 3].iter().chain(&dv[i * 2..i * 2 + 2]).copied().collect::<Vec<_>>()).collect();
    check("cat dim 1", &kiln::cat(&[&a, &d], 1).unwrap(), &[2, 5], DType::F32, &want, 0.0, 0.0);
    check("cat dim -1", &kiln::cat(&[&a, &d], -1).unwrap(), &[2, 5], DType::F32, &want, 0.0, 0.0);
    // empty pieces
    let e = t(&[], &[0, 3], DType::F32);
    check("cat with empty", &kiln::cat(&[&e, &a, &e], 0).unwrap(), &[2, 3], DType::F32, &av, 0.0, 0.0);
    // mixed dtypes promote
    let v = [1.0, 2.0];
    for (da, db, want) in [
        (DType::F32, DType::F64, DType::F64),
        (DType::I32, DType::F16, DType::F16),
        (DType::F16, DType::BF16, DType::F32),
        (DType::Bool, DType::U8, DType::U8),
        (DType::I64, DType::I32, DType::I64),
        (DType::U8, DType::F32, DType::F32),
    ] {
        let r = kiln::cat(&[&t(&v, &[2], da), &t(&[0.0, 1.0, 3.0], &[3], db)], 0).unwrap();
        let first: Vec<f64> = v.iter().map(|&x| round_to(da, x)).collect();
        check(&format!("cat {da:?} {db:?}"), &r, &[5], want, &[first, vec![0.0, 1.0, 3.0]].concat(), 0.0, 0.0);
    }
    // 3-D, middle dim, three pieces of different sizes
    let (p, pv) = inputs(&[2, 1, 2], 5, DType::F64, |r| r);
    let (q, qv) = inputs(&[2, 3, 2], 6, DType::F64, |r| r);
    let want: Vec<f64> = (0..2).flat_map(|o| [&pv[o * 2..o * 2 + 2], &qv[o * 6..o * 6 + 6], &pv[o * 2..o * 2 + 2]].concat()).collect();
    check("cat 3-D dim 1", &kiln::cat(&[&p, &q, &p], 1).unwrap(), &[2, 5, 2], DType::F64, &want, 0.0, 0.0);
    // errors
    assert!(matches!(kiln::cat(&[&a, &d], 0), Err(Error::Shape { .. })));
    assert!(kiln::cat(&[], 0).is_err());
    assert!(kiln::cat(&[&t0(1.0, DType::F32), &t0(1.0, DType::F32)], 0).is_err());
    assert!(kiln::cat(&[&a, &a], 2).is_err());
}

#[test]
fn stack_values() {
    let (a, av) = inputs(&[2, 3], 1, DType::F32, |r| r);
    let (b, bv) = make2(2, 3, Lay::Transposed, DType::F32, 2, |r| r);
    check("stack 0", &kiln::stack(&[&a, &b], 0).unwrap(), &[2, 2, 3], DType::F32, &[av.clone(), bv.clone()].concat(), 0.0, 0.0);
    let want1: Vec<f64> = (0..2).flat_map(|i| [&av[i * 3..i * 3 + 3], &bv[i * 3..i * 3 + 3]].concat()).collect();
    check("stack 1", &kiln::stack(&[&a, &b], 1).unwrap(), &[2, 2, 3], DType::F32, &want1, 0.0, 0.0);
    let want2: Vec<f64> = (0..6).flat_map(|f| [av[f], bv[f]]).collect();
    check("stack 2", &kiln::stack(&[&a, &b], 2).unwrap(), &[2, 3, 2], DType::F32, &want2, 0.0, 0.0);
    check("stack -1", &kiln::stack(&[&a, &b], -1).unwrap(), &[2, 3, 2], DType::F32, &want2, 0.0, 0.0);
    check("stack of 0-dim", &kiln::stack(&[&t0(1.0, DType::I64), &t0(2.0, DType::I64)], 0).unwrap(), &[2], DType::I64, &[1.0, 2.0], 0.0, 0.0);
    check("stack mixed", &kiln::stack(&[&a, &t(&[0.0; 6], &[2, 3], DType::F64)], 0).unwrap(), &[2, 2, 3], DType::F64, &[av.clone(), vec![0.0; 6]].concat(), 0.0, 0.0);
    assert!(kiln::stack(&[&a, &t(&[0.0; 3], &[3], DType::F32)], 0).is_err());
    assert!(kiln::stack(&[&a, &b], 3).is_err());
}

#[test]
fn split_chunk_narrow() {
    let (x, xv) = inputs(&[7, 3], 1, DType::F32, |r| r);
    let rows = |lo: usize, hi: usize| xv[lo * 3..hi * 3].to_vec();
    let parts = x.split(3, 0).unwrap();
    assert_eq!(parts.len(), 3);
    for (p, (lo, hi)) in parts.iter().zip([(0, 3), (3, 6), (6, 7)]) {
        check(&format!("split rows {lo}..{hi}"), p, &[hi - lo, 3], DType::F32, &rows(lo, hi), 0.0, 0.0);
        assert!(p.shares_storage_with(&x));
    }
    let parts = x.split(2, -1).unwrap();
    assert_eq!(parts.iter().map(|p| p.shape().to_vec()).collect::<Vec<_>>(), vec![vec![7, 2], vec![7, 1]]);
    check("split cols", &parts[1], &[7, 1], DType::F32, &(0..7).map(|i| xv[i * 3 + 2]).collect::<Vec<_>>(), 0.0, 0.0);
    // torch.chunk: chunk size ceil(n / chunks), so 7 rows in 4 chunks are 2, 2, 2, 1; 6 in 4 are 2, 2, 2
    let sizes = |v: Vec<Tensor>| v.iter().map(|p| p.shape()[0]).collect::<Vec<_>>();
    assert_eq!(sizes(x.chunk(4, 0).unwrap()), vec![2, 2, 2, 1]);
    assert_eq!(sizes(x.chunk(3, 0).unwrap()), vec![3, 3, 1]);
    assert_eq!(sizes(x.narrow(0, 0, 6).unwrap().chunk(4, 0).unwrap()), vec![2, 2, 2]);
    assert_eq!(sizes(x.chunk(10, 0).unwrap()), vec![1; 7]);
    let ch = x.chunk(2, 0).unwrap();
    check("chunk 2nd", &ch[1], &[3, 3], DType::F32, &rows(4, 7), 0.0, 0.0);
    assert!(x.split(0, 0).is_err() && x.chunk(0, 0).is_err());
    // narrow
    let n = x.narrow(1, 1, 2).unwrap();
    check("narrow", &n, &[7, 2], DType::F32, &(0..7).flat_map(|i| [xv[i * 3 + 1], xv[i * 3 + 2]]).collect::<Vec<_>>(), 0.0, 0.0);
    assert!(n.shares_storage_with(&x));
    check("narrow -2", &x.narrow(-2, 5, 2).unwrap(), &[2, 3], DType::F32, &rows(5, 7), 0.0, 0.0);
    check("narrow empty", &x.narrow(0, 7, 0).unwrap(), &[0, 3], DType::F32, &[], 0.0, 0.0);
    assert!(x.narrow(0, 6, 2).is_err());
    assert!(x.narrow(2, 0, 1).is_err());
}

#[test]
fn slice_python_semantics() {
    let (x, xv) = inputs(&[10], 1, DType::F64, |r| r);
    let py = |start: i64, end: i64, step: usize| -> Vec<f64> {
        let n = 10i64;
        let c = |i: i64| (if i < 0 { i + n } else { i }).clamp(0, n) as usize;
        let (s, e) = (c(start), c(end));
        (s..e.max(s)).step_by(step).map(|i| xv[i]).collect()
    };
    for (s, e, st) in [(0, 10, 1), (2, 8, 3), (-3, -1, 1), (-100, 100, 4), (-1, 10, 2), (5, 2, 1), (3, 3, 1), (0, -1, 2), (7, 100, 5), (-4, 10, 3)] {
        let want = py(s, e, st);
        let r = x.slice(0, s, e, st).unwrap();
        check(&format!("x[{s}:{e}:{st}]"), &r, &[want.len()], DType::F64, &want, 0.0, 0.0);
        assert!(r.shares_storage_with(&x));
    }
    // 2-D, negative dim, slice of a slice
    let (m, mv) = inputs(&[4, 9], 2, DType::F32, |r| r);
    let r = m.slice(-1, -8, 9, 3).unwrap().slice(0, -3, 4, 2).unwrap();
    let want: Vec<f64> = [1usize, 3].iter().flat_map(|&i| [1usize, 4, 7].map(|j| mv[i * 9 + j])).collect();
    check("2-D slice of slice", &r, &[2, 3], DType::F32, &want, 0.0, 0.0);
    // then an op on it
    check("slice then add", &r.add_scalar(1.0).unwrap(), &[2, 3], DType::F32, &want.iter().map(|v| round_to(DType::F32, v + 1.0)).collect::<Vec<_>>(), 0.0, 0.0);
    assert!(x.slice(0, 0, 5, 0).is_err());
    assert!(x.slice(1, 0, 5, 1).is_err());
}

#[test]
fn pad_values() {
    let (x, xv) = inputs(&[2, 3], 1, DType::F32, |r| r);
    // F.pad(x, (1, 2)): last dim
    let r = x.pad(&[1, 2], 9.0).unwrap();
    let want: Vec<f64> = (0..2).flat_map(|i| [vec![9.0], xv[i * 3..i * 3 + 3].to_vec(), vec![9.0, 9.0]].concat()).collect();
    check("pad (1, 2)", &r, &[2, 6], DType::F32, &want, 0.0, 0.0);
    // multi-dim: (0, 1) on the last, (2, 1) on the first
    let r = x.pad(&[0, 1, 2, 1], -1.0).unwrap();
    let mut want = vec![-1.0; 5 * 4];
    for i in 0..2 {
        for j in 0..3 {
            want[(i + 2) * 4 + j] = xv[i * 3 + j];
        }
    }
    check("pad (0,1,2,1)", &r, &[5, 4], DType::F32, &want, 0.0, 0.0);
    // negative amounts crop; mixed with padding
    let r = x.pad(&[-1, 1], 0.0).unwrap();
    let want: Vec<f64> = (0..2).flat_map(|i| [xv[i * 3 + 1], xv[i * 3 + 2], 0.0]).collect();
    check("pad (-1, 1)", &r, &[2, 3], DType::F32, &want, 0.0, 0.0);
    let r = x.pad(&[-1, -1, 1, -1], 5.0).unwrap();
    check("pad (-1,-1,1,-1)", &r, &[2, 1], DType::F32, &[5.0, xv[1]], 0.0, 0.0);
    // non-contiguous input, integer dtype
    let (y, yv) = make2(3, 4, Lay::Transposed, DType::I64, 2, |r| (r * 10.0).round());
    let r = y.pad(&[2, 0], 7.0).unwrap();
    let want: Vec<f64> = (0..3).flat_map(|i| [vec![7.0, 7.0], yv[i * 4..i * 4 + 4].to_vec()].concat()).collect();
    check("pad I64 transposed", &r, &[3, 6], DType::I64, &want, 0.0, 0.0);
    // 3-D, pad only the middle dim
    let (z, zv) = inputs(&[2, 2, 2], 3, DType::F64, |r| r);
    let r = z.pad(&[0, 0, 1, 0], 0.5).unwrap();
    let want: Vec<f64> = (0..2).flat_map(|a| [vec![0.5, 0.5], zv[a * 4..a * 4 + 4].to_vec()].concat()).collect();
    check("pad 3-D middle", &r, &[2, 3, 2], DType::F64, &want, 0.0, 0.0);
    assert!(x.pad(&[1], 0.0).is_err());
    assert!(x.pad(&[0, 0, 0, 0, 1, 1], 0.0).is_err());
    assert!(x.pad(&[-2, -2], 0.0).is_err());
}

#[test]
fn tril_triu() {
    for dt in [DType::F32, DType::I64, DType::BF16] {
        for lay in [Lay::Contig, Lay::Transposed] {
            let (x, xv) = make2(4, 5, lay, dt, 1, |r| (r * 4.0).round() + 5.0);
            for k in [-1i64, 0, 2] {
                let lower: Vec<f64> = (0..20).map(|f| if (f % 5) as i64 - (f / 5) as i64 <= k { xv[f] } else { 0.0 }).collect();
                let upper: Vec<f64> = (0..20).map(|f| if (f % 5) as i64 - (f / 5) as i64 >= k { xv[f] } else { 0.0 }).collect();
                check(&format!("tril {k} {dt:?} {lay:?}"), &x.tril(k).unwrap(), &[4, 5], dt, &lower, 0.0, 0.0);
                check(&format!("triu {k} {dt:?} {lay:?}"), &x.triu(k).unwrap(), &[4, 5], dt, &upper, 0.0, 0.0);
            }
        }
    }
    // batched: applies to the last two dims
    let (x, xv) = inputs(&[2, 3, 3], 2, DType::F32, |r| r);
    let want: Vec<f64> = (0..18).map(|f| if (f % 3) >= (f / 3) % 3 { xv[f] } else { 0.0 }).collect();
    check("triu batched", &x.triu(0).unwrap(), &[2, 3, 3], DType::F32, &want, 0.0, 0.0);
    assert!(t(&[1.0; 3], &[3], DType::F32).tril(0).is_err());
}

#[test]
fn one_hot_values() {
    let c = ti64(&[2, 0, 3, 2], &[2, 2]);
    let r = c.one_hot(Some(5)).unwrap();
    let mut want = vec![0.0; 20];
    for (i, &k) in [2usize, 0, 3, 2].iter().enumerate() {
        want[i * 5 + k] = 1.0;
    }
    check("one_hot 5", &r, &[2, 2, 5], DType::I64, &want, 0.0, 0.0);
    let r = c.one_hot(None).unwrap();
    assert_eq!(r.shape(), &[2, 2, 4]);
    assert_eq!(i64s(&r.sum(&[-1], false).unwrap()), vec![1; 4]);
    assert_eq!(i64s(&r.argmax(-1, false).unwrap()), vec![2, 0, 3, 2]);
    assert!(matches!(c.one_hot(Some(3)), Err(Error::Index { .. })));
    assert!(ti64(&[-1], &[1]).one_hot(Some(3)).is_err());
    assert!(t(&[1.0], &[1], DType::F32).one_hot(Some(3)).is_err());
    check("one_hot I32 input", &ti32(&[1], &[1]).one_hot(Some(2)).unwrap(), &[1, 2], DType::I64, &[0.0, 1.0], 0.0, 0.0);
    assert_eq!(ti64(&[], &[0]).one_hot(Some(3)).unwrap().shape(), &[0, 3]);
}

#[test]
fn views_share_storage_copies_do_not() {
    let x = t(&host_rand(24, 1), &[2, 3, 4], DType::F32);
    let views: Vec<(&str, Tensor)> = vec![
        ("reshape", x.reshape(&[6, 4]).unwrap()),
        ("view", x.view(&[4, -1]).unwrap()),
        ("flatten", x.flatten(0, -1).unwrap()),
        ("permute", x.permute(&[2, 0, 1]).unwrap()),
        ("transpose", x.transpose(0, 2).unwrap()),
        ("unsqueeze", x.unsqueeze(1).unwrap()),
        ("squeeze", x.unsqueeze(0).unwrap().squeeze(0).unwrap()),
        ("expand", x.unsqueeze(0).unwrap().expand(&[5, -1, -1, -1]).unwrap()),
        ("broadcast_to", x.broadcast_to(&[3, 2, 3, 4]).unwrap()),
        ("narrow", x.narrow(1, 1, 2).unwrap()),
        ("slice", x.slice(2, 0, 4, 3).unwrap()),
        ("split", x.split(1, 1).unwrap()[2].clone()),
        ("chunk", x.chunk(2, -1).unwrap()[1].clone()),
        ("detach", x.detach()),
        ("contiguous of contiguous", x.contiguous().unwrap()),
        ("to_dtype same dtype", x.to_dtype(DType::F32).unwrap()),
    ];
    for (name, v) in &views {
        assert!(v.shares_storage_with(&x), "{name} should be a view");
    }
    let copies: Vec<(&str, Tensor)> = vec![
        ("cat", kiln::cat(&[&x, &x], 0).unwrap()),
        ("cat of one", kiln::cat(&[&x], 0).unwrap()),
        ("stack", kiln::stack(&[&x, &x], 0).unwrap()),
        ("stack of one", kiln::stack(&[&x], 0).unwrap()),
        ("pad", x.pad(&[1, 1], 0.0).unwrap()),
        ("pad crop only", x.pad(&[-1, -1], 0.0).unwrap()),
        ("pad zeros", x.pad(&[0, 0], 0.0).unwrap()),
        ("reshape of transposed", x.transpose(0, 2).unwrap().reshape(&[-1]).unwrap()),
        ("contiguous of transposed", x.transpose(0, 1).unwrap().contiguous().unwrap()),
        ("to_dtype", x.to_dtype(DType::F64).unwrap()),
        ("index_select", x.index_select(0, &ti64(&[0, 1], &[2])).unwrap()),
        ("add", x.add_scalar(0.0).unwrap()),
        ("copy_contiguous", x.copy_contiguous().unwrap()),
        ("tril", x.tril(0).unwrap()),
    ];
    for (name, c) in &copies {
        assert!(!c.shares_storage_with(&x), "{name} must not share storage with its input");
    }
    // a write through a view shows in the base
    let base = t(&[0.0; 6], &[2, 3], DType::F32);
    base.narrow(1, 1, 1).unwrap().fill_(5.0).unwrap();
    assert_eq!(vals(&base), vec![0.0, 5.0, 0.0, 0.0, 5.0, 0.0]);
    // a write into a copy does not
    let c = kiln::cat(&[&base], 0).unwrap();
    c.fill_(1.0).unwrap();
    assert_eq!(vals(&base), vec![0.0, 5.0, 0.0, 0.0, 5.0, 0.0], "writing into cat([x]) changed x");
    assert!(x.transpose(0, 1).unwrap().view(&[-1]).is_err(), "view of a non-viewable layout");
}
