//! Tensor creation, host data in and out, dtype conversion, views, printing and threads.
//! Device-generic: every tensor is made on `dev()` unless a test is about the host.

use crate::common::*;
use half::{bf16, f16};
use kiln::{DType, Device, Tensor, WithDType};

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];
const NUMERIC: [DType; 7] = [DType::F32, DType::F64, DType::F16, DType::BF16, DType::I64, DType::I32, DType::U8];

// ---------------------------------------------------------------- host-side references

/// A tensor of `dtype` built from host values converted on the host (not by kiln's casts).
fn make(values: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    let d = &dev();
    match dtype {
        DType::F32 => Tensor::from_vec(values.iter().map(|&v| v as f32).collect(), shape, d),
        DType::F64 => Tensor::from_vec(values.to_vec(), shape, d),
        DType::F16 => Tensor::from_vec(values.iter().map(|&v| f16::from_f32(v as f32)).collect(), shape, d),
        DType::BF16 => Tensor::from_vec(values.iter().map(|&v| bf16::from_f32(v as f32)).collect(), shape, d),
        DType::I64 => Tensor::from_vec(values.iter().map(|&v| v as i64).collect(), shape, d),
        DType::I32 => Tensor::from_vec(values.iter().map(|&v| v as i64 as i32).collect(), shape, d),
        DType::U8 => Tensor::from_vec(values.iter().map(|&v| v as i64 as u8).collect(), shape, d),
        DType::Bool => Tensor::from_vec(values.iter().map(|&v| v != 0.0).collect(), shape, d),
    }
    .unwrap()
}

/// The tensor's values read in its own element type (no kiln conversion), widened on the host.
fn read(x: &Tensor) -> Vec<f64> {
    match x.dtype() {
        DType::F32 => x.to_vec::<f32>().unwrap().into_iter().map(|v| v as f64).collect(),
        DType::F64 => x.to_vec::<f64>().unwrap(),
        DType::F16 => x.to_vec::<f16>().unwrap().into_iter().map(|v| v.to_f64()).collect(),
        DType::BF16 => x.to_vec::<bf16>().unwrap().into_iter().map(|v| v.to_f64()).collect(),
        DType::I64 => x.to_vec::<i64>().unwrap().into_iter().map(|v| v as f64).collect(),
        DType::I32 => x.to_vec::<i32>().unwrap().into_iter().map(|v| v as f64).collect(),
        DType::U8 => x.to_vec::<u8>().unwrap().into_iter().map(|v| v as f64).collect(),
        DType::Bool => x.to_vec::<bool>().unwrap().into_iter().map(|v| v as u8 as f64).collect(),
    }
}

/// PyTorch's conversion of one value to `to`: round to nearest for floats, truncation toward
/// zero for integers (through int64, so -1.5 -> uint8 is 255 and 300 -> uint8 is 44, as c10's
/// `static_cast_with_inter_type`), nonzero for bool.
fn host_cast(v: f64, to: DType) -> f64 {
    match to {
        DType::F32 => v as f32 as f64,
        DType::F64 => v,
        DType::F16 => f16::from_f32(v as f32).to_f64(),
        DType::BF16 => bf16::from_f32(v as f32).to_f64(),
        DType::I64 => v as i64 as f64,
        DType::I32 => v as i64 as i32 as f64,
        DType::U8 => v as i64 as u8 as f64,
        DType::Bool => (v != 0.0) as u8 as f64,
    }
}

fn mean_std(v: &[f64]) -> (f64, f64) {
    let n = v.len() as f64;
    let m = v.iter().sum::<f64>() / n;
    let var = v.iter().map(|x| (x - m) * (x - m)).sum::<f64>() / (n - 1.0);
    (m, var.sqrt())
}

/// Row-major values of `[0, 1, ..., n)` viewed with `shape` then permuted by `perm`.
fn host_permute(shape: &[usize], perm: &[usize]) -> Vec<f64> {
    let strides: Vec<usize> = (0..shape.len()).map(|d| shape[d + 1..].iter().product()).collect();
    let out_shape: Vec<usize> = perm.iter().map(|&p| shape[p]).collect();
    let n: usize = shape.iter().product();
    (0..n)
        .map(|mut i| {
            let mut off = 0;
            for d in (0..out_shape.len()).rev() {
                off += (i % out_shape[d]) * strides[perm[d]];
                i /= out_shape[d];
            }
            off as f64
        })
        .collect()
}

fn iota(n: usize, shape: &[usize]) -> Tensor {
    t(&(0..n).map(|i| i as f64).collect::<Vec<_>>(), shape, DType::F32)
}

// ---------------------------------------------------------------- constants

#[test]
fn zeros_ones_full_every_dtype() {
    for dt in DType::ALL {
        let z = Tensor::zeros(&[2, 3], dt, &dev()).unwrap();
        assert_eq!((z.shape(), z.dtype(), z.device()), (&[2usize, 3][..], dt, dev()), "{dt:?}");
        assert_eq!(z.strides(), &[3, 1]);
        assert!(z.is_contiguous());
        assert_eq!(read(&z), vec![0.0; 6], "zeros {dt:?}");

        let o = Tensor::ones(&[4], dt, &dev()).unwrap();
        assert_eq!(o.dtype(), dt);
        assert_eq!(read(&o), vec![1.0; 4], "ones {dt:?}");

        let f = Tensor::full(&[2, 2], 2.5, dt, &dev()).unwrap();
        assert_eq!(f.dtype(), dt);
        assert_eq!(read(&f), vec![host_cast(2.5, dt); 4], "full 2.5 {dt:?}");
        let f = Tensor::full(&[3], -7.0, dt, &dev()).unwrap();
        assert_eq!(read(&f), vec![host_cast(-7.0, dt); 3], "full -7 {dt:?}");

        // 0-dim and empty shapes
        let s = Tensor::full(&[], 3.0, dt, &dev()).unwrap();
        assert_eq!((s.ndim(), s.numel()), (0, 1));
        assert_eq!(read(&s), vec![host_cast(3.0, dt)]);
        let s = Tensor::scalar(3.0, dt, &dev()).unwrap();
        assert_eq!((s.shape(), s.numel()), (&[][..], 1));
        let e = Tensor::zeros(&[0, 3], dt, &dev()).unwrap();
        assert_eq!((e.shape(), e.numel()), (&[0usize, 3][..], 0));
        assert!(read(&e).is_empty());
    }
    // Values as torch: full of 300 in uint8 wraps like a C++ int64 -> uint8 cast, bool is nonzero.
    assert_eq!(read(&Tensor::full(&[1], 300.0, DType::U8, &dev()).unwrap()), vec![44.0]);
    assert_eq!(read(&Tensor::full(&[1], 0.5, DType::Bool, &dev()).unwrap()), vec![1.0]);
    assert_eq!(read(&Tensor::full(&[1], -2.9, DType::I32, &dev()).unwrap()), vec![-2.0]);
}

#[test]
fn like_constructors_keep_shape_dtype_device() {
    for dt in DType::ALL {
        let x = make(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2], dt);
        let xt = x.t().unwrap(); // a non-contiguous source
        for (name, y, want) in [
            ("zeros_like", xt.zeros_like().unwrap(), 0.0),
            ("ones_like", xt.ones_like().unwrap(), 1.0),
            ("full_like", xt.full_like(4.0).unwrap(), 4.0),
        ] {
            assert_eq!(y.shape(), &[2, 3], "{name} {dt:?}");
            assert_eq!(y.dtype(), dt, "{name} {dt:?}");
            assert_eq!(y.device(), dev());
            assert!(!y.shares_storage_with(&x), "{name} must allocate");
            assert_eq!(read(&y), vec![host_cast(want, dt); 6], "{name} {dt:?}");
        }
    }
}

// ---------------------------------------------------------------- ranges

#[test]
fn arange_float_and_int() {
    for dt in NUMERIC {
        let a = Tensor::arange(0.0, 5.0, 1.0, dt, &dev()).unwrap();
        assert_eq!((a.shape(), a.dtype()), (&[5usize][..], dt));
        assert_eq!(read(&a), vec![0.0, 1.0, 2.0, 3.0, 4.0], "{dt:?}");
        // Negative step.
        let a = Tensor::arange(10.0, 0.0, -3.0, dt, &dev()).unwrap();
        assert_eq!(read(&a), vec![10.0, 7.0, 4.0, 1.0], "{dt:?}");
        // Empty range.
        let a = Tensor::arange(2.0, 2.0, 1.0, dt, &dev()).unwrap();
        assert_eq!(a.shape(), &[0]);
    }
    for dt in FLOATS {
        let a = Tensor::arange(1.0, 2.5, 0.5, dt, &dev()).unwrap();
        assert_eq!(read(&a), vec![1.0, 1.5, 2.0], "{dt:?}");
        let a = Tensor::arange(5.0, 0.0, -1.5, dt, &dev()).unwrap();
        assert_eq!(read(&a), vec![5.0, 3.5, 2.0, 0.5], "{dt:?}");
    }
    // The element count is ceil((end - start) / step), as torch: arange(0, 1, 0.3) has 4.
    let a = Tensor::arange(0.0, 1.0, 0.3, DType::F64, &dev()).unwrap();
    assert_eq!(a.shape(), &[4]);
    assert_close(&read(&a), &[0.0, 0.3, 0.6, 0.9], 0.0, 1e-12);
    let a = Tensor::arange(0.0, 1.0, 0.25, DType::F32, &dev()).unwrap();
    assert_eq!(read(&a), vec![0.0, 0.25, 0.5, 0.75]);
    let a = Tensor::arange(-1.0, 1.0, 0.3, DType::F32, &dev()).unwrap();
    assert_eq!(a.shape(), &[7]);
    assert_close(&read(&a), &[-1.0, -0.7, -0.4, -0.1, 0.2, 0.5, 0.8], 0.0, 1e-6);
    // Default-int style: I64 arange of larger counts stays exact.
    let a = Tensor::arange(0.0, 100_000.0, 1.0, DType::I64, &dev()).unwrap();
    let v = a.to_vec::<i64>().unwrap();
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as i64));
}

#[test]
fn linspace_endpoints_and_steps() {
    for dt in FLOATS {
        let l = Tensor::linspace(0.0, 1.0, 5, dt, &dev()).unwrap();
        assert_eq!((l.shape(), l.dtype()), (&[5usize][..], dt));
        assert_eq!(read(&l), vec![0.0, 0.25, 0.5, 0.75, 1.0], "{dt:?}");
        let l = Tensor::linspace(2.0, -2.0, 3, dt, &dev()).unwrap();
        assert_eq!(read(&l), vec![2.0, 0.0, -2.0], "{dt:?}");
    }
    // Both ends are exact even where start + step * (n - 1) would not be.
    for n in [2usize, 3, 7, 10, 11, 100, 1001] {
        let l = read(&Tensor::linspace(-1.3, 7.9, n, DType::F64, &dev()).unwrap());
        assert_eq!(l.len(), n);
        assert_eq!(l[0], -1.3, "n={n}");
        assert_eq!(l[n - 1], 7.9, "n={n}");
        let step = 9.2 / (n - 1) as f64;
        let want: Vec<f64> = (0..n).map(|i| -1.3 + step * i as f64).collect();
        assert_close(&l, &want, 0.0, 1e-12);
        let l = read(&Tensor::linspace(0.1, 0.7, n, DType::F32, &dev()).unwrap());
        assert_eq!((l[0], l[n - 1]), (0.1f32 as f64, 0.7f32 as f64), "n={n}");
    }
    // steps = 0 is empty; steps = 1 is [start], as torch.linspace(2, 5, 1) == tensor([2.]).
    for dt in NUMERIC {
        let l = Tensor::linspace(2.0, 5.0, 0, dt, &dev()).unwrap();
        assert_eq!((l.shape(), l.dtype()), (&[0usize][..], dt));
        let l = Tensor::linspace(2.0, 5.0, 1, dt, &dev()).unwrap();
        assert_eq!(l.shape(), &[1]);
        assert_eq!(read(&l), vec![2.0], "linspace(2, 5, 1) {dt:?}");
    }
    // Integer dtypes truncate: torch.linspace(0, 10, 5, dtype=torch.int64) == [0, 2, 5, 7, 10].
    for dt in [DType::I64, DType::I32, DType::U8] {
        let l = Tensor::linspace(0.0, 10.0, 5, dt, &dev()).unwrap();
        assert_eq!(read(&l), vec![0.0, 2.0, 5.0, 7.0, 10.0], "{dt:?}");
    }
}

#[test]
fn eye_every_dtype() {
    for dt in DType::ALL {
        let e = Tensor::eye(3, dt, &dev()).unwrap();
        assert_eq!((e.shape(), e.dtype()), (&[3usize, 3][..], dt));
        assert_eq!(read(&e), vec![1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0], "{dt:?}");
    }
    assert_eq!(Tensor::eye(0, DType::F32, &dev()).unwrap().shape(), &[0, 0]);
    assert_eq!(read(&Tensor::eye(1, DType::I64, &dev()).unwrap()), vec![1.0]);
}

// ---------------------------------------------------------------- random

#[test]
fn rand_is_uniform_in_unit_interval() {
    for dt in FLOATS {
        let r = Tensor::rand(&[100_000], dt, &dev()).unwrap();
        assert_eq!((r.shape(), r.dtype(), r.device()), (&[100_000usize][..], dt, dev()));
        let v = read(&r);
        let lo = v.iter().cloned().fold(f64::INFINITY, f64::min);
        let hi = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let ones = v.iter().filter(|&&x| x >= 1.0).count();
        assert!(lo >= 0.0 && ones == 0, "{dt:?}: rand must be in [0, 1): min {lo}, {ones} values >= 1");
        assert!(lo < 0.01 && hi > 0.99, "{dt:?}: range [{lo}, {hi}] does not cover [0, 1)");
        let (m, s) = mean_std(&v);
        assert!((m - 0.5).abs() < 0.01, "{dt:?}: mean {m}");
        assert!((s - (1.0f64 / 12.0).sqrt()).abs() < 0.01, "{dt:?}: std {s}");
        // Not all the same value in a small draw either.
        let small = read(&Tensor::rand(&[2, 3], dt, &dev()).unwrap());
        assert!(small.iter().any(|&x| x != small[0]));
    }
}

#[test]
fn randn_is_standard_normal() {
    for dt in FLOATS {
        let r = Tensor::randn(&[100_000], dt, &dev()).unwrap();
        assert_eq!((r.shape(), r.dtype()), (&[100_000usize][..], dt));
        let v = read(&r);
        assert!(v.iter().all(|x| x.is_finite()), "{dt:?}: non-finite sample");
        let (m, s) = mean_std(&v);
        assert!(m.abs() < 0.02, "{dt:?}: mean {m}");
        assert!((s - 1.0).abs() < 0.02, "{dt:?}: std {s}");
        // Tails: about 4.55% beyond 2 sigma.
        let beyond = v.iter().filter(|x| x.abs() > 2.0).count() as f64 / v.len() as f64;
        assert!((beyond - 0.0455).abs() < 0.005, "{dt:?}: {beyond} beyond 2 sigma");
    }
}

#[test]
fn randint_range_and_dtype() {
    let r = Tensor::randint(-3, 7, &[10_000], &dev()).unwrap();
    assert_eq!((r.shape(), r.dtype(), r.device()), (&[10_000usize][..], DType::I64, dev()));
    let v = r.to_vec::<i64>().unwrap();
    assert!(v.iter().all(|&x| (-3..7).contains(&x)), "randint out of [-3, 7)");
    for k in -3..7 {
        let c = v.iter().filter(|&&x| x == k).count();
        assert!((800..1200).contains(&c), "value {k} drawn {c} times of 10000");
    }
    // Ranges near the ends of i64 are exact (not rounded through f64) and do not overflow.
    let top = Tensor::randint(i64::MAX - 10, i64::MAX, &[1000], &dev()).unwrap().to_vec::<i64>().unwrap();
    assert!(top.iter().all(|&x| (i64::MAX - 10..i64::MAX).contains(&x)), "randint near i64::MAX out of range");
    for k in i64::MAX - 10..i64::MAX {
        assert!(top.contains(&k), "randint near i64::MAX never drew {k}");
    }
    let all = Tensor::randint(i64::MIN, i64::MAX, &[1000], &dev()).unwrap().to_vec::<i64>().unwrap();
    assert!(all.iter().all(|&x| x != i64::MAX));
    assert!(all.iter().any(|&x| x < i64::MIN / 2) && all.iter().any(|&x| x > i64::MAX / 2));
    let r = Tensor::randint(5, 6, &[2, 3], &dev()).unwrap();
    assert_eq!(r.to_vec::<i64>().unwrap(), vec![5; 6]);
    let big = Tensor::randint(0, 1 << 40, &[1000], &dev()).unwrap().to_vec::<i64>().unwrap();
    assert!(big.iter().all(|&x| (0..1 << 40).contains(&x)));
    assert!(big.iter().any(|&x| x > 1 << 39), "large ranges are covered");
}

/// Runs `draw` after seeding with `seed`. Other tests in this binary may draw from the global
/// generator concurrently, so a mismatch is retried a few times before it counts.
fn repeats(draw: impl Fn() -> Vec<f64>) -> bool {
    (0..20).any(|_| {
        kiln::manual_seed(1234);
        let a = draw();
        kiln::manual_seed(1234);
        let b = draw();
        a == b
    })
}

#[test]
fn manual_seed_repeats_streams_and_seeds_differ() {
    let rand = || read(&Tensor::rand(&[1000], DType::F32, &dev()).unwrap());
    let rand_big = || read(&Tensor::rand(&[40_000], DType::F64, &dev()).unwrap()); // parallel fill
    let randn = || read(&Tensor::randn(&[3, 100], DType::F32, &dev()).unwrap());
    let randint = || read(&Tensor::randint(0, 1000, &[500], &dev()).unwrap());
    let two = || {
        let mut a = read(&Tensor::rand(&[10], DType::F32, &dev()).unwrap());
        a.extend(read(&Tensor::randn(&[10], DType::F64, &dev()).unwrap()));
        a
    };
    assert!(repeats(rand), "rand does not repeat after manual_seed");
    assert!(repeats(rand_big), "large rand does not repeat after manual_seed");
    assert!(repeats(randn), "randn does not repeat after manual_seed");
    assert!(repeats(randint), "randint does not repeat after manual_seed");
    assert!(repeats(two), "a sequence of draws does not repeat after manual_seed");

    for draw in [&rand as &dyn Fn() -> Vec<f64>, &randn, &randint] {
        kiln::manual_seed(1);
        let a = draw();
        kiln::manual_seed(2);
        let b = draw();
        assert_ne!(a, b, "different seeds give the same stream");
        // Successive draws without reseeding differ too.
        assert_ne!(draw(), draw());
    }
}

// ---------------------------------------------------------------- host data

fn roundtrip<T: WithDType + PartialEq + std::fmt::Debug + Copy>(data: [T; 6], dtype: DType) {
    let d = dev();
    let x = Tensor::from_vec(data.to_vec(), &[2, 3], &d).unwrap();
    assert_eq!((x.shape(), x.dtype(), x.device()), (&[2usize, 3][..], dtype, d));
    assert_eq!(x.to_vec::<T>().unwrap(), data.to_vec(), "{dtype:?}");
    let y = Tensor::from_slice(&data, &[6], &d).unwrap();
    assert_eq!((y.shape(), y.dtype()), (&[6usize][..], dtype));
    assert_eq!(y.to_vec::<T>().unwrap(), data.to_vec());
    // Reading a strided view gives row-major order of the view.
    let xt = x.t().unwrap();
    assert_eq!(xt.to_vec::<T>().unwrap(), vec![data[0], data[3], data[1], data[4], data[2], data[5]]);
    // item on 0-dim, [1] and [1, 1] tensors, and on a one-element view.
    assert_eq!(Tensor::from_slice(&data[4..5], &[], &d).unwrap().item::<T>().unwrap(), data[4]);
    assert_eq!(Tensor::from_slice(&data[1..2], &[1], &d).unwrap().item::<T>().unwrap(), data[1]);
    assert_eq!(Tensor::from_slice(&data[5..6], &[1, 1], &d).unwrap().item::<T>().unwrap(), data[5]);
    assert_eq!(x.narrow(0, 1, 1).unwrap().narrow(1, 2, 1).unwrap().item::<T>().unwrap(), data[5]);
    // Empty.
    let e = Tensor::from_vec(Vec::<T>::new(), &[0, 4], &d).unwrap();
    assert_eq!((e.shape(), e.dtype()), (&[0usize, 4][..], dtype));
    assert!(e.to_vec::<T>().unwrap().is_empty());
}

#[test]
fn from_vec_to_vec_item_every_element_type() {
    roundtrip([1.5f32, -2.25, 0.0, f32::MAX, f32::MIN_POSITIVE, -0.0], DType::F32);
    roundtrip([1.5f64, -2.25, 0.0, 1e300, 1e-300, std::f64::consts::PI], DType::F64);
    roundtrip([1.5, -2.25, 0.0, 65504.0, 6.1e-5, 0.1].map(f16::from_f64), DType::F16);
    roundtrip([1.5, -2.25, 0.0, 3.0e38, 1e-30, 0.1].map(bf16::from_f64), DType::BF16);
    roundtrip([1i64, -2, 0, i64::MAX, i64::MIN, 1 << 53 | 1], DType::I64);
    roundtrip([1i32, -2, 0, i32::MAX, i32::MIN, 7], DType::I32);
    roundtrip([1u8, 2, 0, 255, 128, 7], DType::U8);
    roundtrip([true, false, false, true, true, false], DType::Bool);
    // NaN survives the trip (compared bitwise).
    let n = Tensor::from_vec(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY], &[3], &dev()).unwrap().to_vec::<f32>().unwrap();
    assert!(n[0].is_nan() && n[1] == f32::INFINITY && n[2] == f32::NEG_INFINITY);
    // from_vec copies nothing back: the host Vec and the tensor are independent.
    let mut host = vec![1.0f32, 2.0];
    let x = Tensor::from_slice(&host, &[2], &dev()).unwrap();
    host[0] = 9.0;
    assert_eq!(x.to_vec::<f32>().unwrap(), vec![1.0, 2.0]);
}

// ---------------------------------------------------------------- dtype conversion

#[test]
fn to_dtype_every_pair() {
    let values = [2.7, -1.5, 0.0, 300.0, 1.0, -7.9, 0.49];
    for src in DType::ALL {
        let start: Vec<f64> = values.iter().map(|&v| host_cast(v, src)).collect();
        let x = make(&start, &[values.len()], src);
        assert_eq!(read(&x), start, "building {src:?}");
        for dst in DType::ALL {
            let y = x.to_dtype(dst).unwrap();
            assert_eq!((y.dtype(), y.shape(), y.device()), (dst, x.shape(), dev()), "{src:?} -> {dst:?}");
            let want: Vec<f64> = start.iter().map(|&v| host_cast(v, dst)).collect();
            assert_eq!(read(&y), want, "{src:?} -> {dst:?} of {start:?}");
            // The same through a strided view (reversed pairs via a transposed [2, n/2] block).
            let xs = x.narrow(0, 0, 6).unwrap().reshape(&[2, 3]).unwrap().t().unwrap();
            let ys = xs.to_dtype(dst).unwrap();
            let w: Vec<f64> = [0, 3, 1, 4, 2, 5].iter().map(|&i| want[i]).collect();
            assert_eq!(read(&ys), w, "strided {src:?} -> {dst:?}");
        }
    }
}

#[test]
fn to_dtype_values_like_torch() {
    let x = t(&[2.7, -1.5, 0.0, 300.0, -0.0, 0.999], &[6], DType::F32);
    // float -> int truncates toward zero
    assert_eq!(x.to_dtype(DType::I64).unwrap().to_vec::<i64>().unwrap(), vec![2, -1, 0, 300, 0, 0]);
    assert_eq!(x.to_dtype(DType::I32).unwrap().to_vec::<i32>().unwrap(), vec![2, -1, 0, 300, 0, 0]);
    // float -> uint8 goes through int64 (torch: -1.5 -> 255, 300 -> 44)
    assert_eq!(x.to_dtype(DType::U8).unwrap().to_vec::<u8>().unwrap(), vec![2, 255, 0, 44, 0, 0]);
    // float -> bool is "nonzero" (-0.0 is zero)
    assert_eq!(x.to_dtype(DType::Bool).unwrap().to_vec::<bool>().unwrap(), vec![true, true, false, true, false, true]);
    // int -> bool is nonzero; bool -> int/float is 0/1
    let i = Tensor::from_vec(vec![0i64, 5, -3], &[3], &dev()).unwrap();
    assert_eq!(i.to_dtype(DType::Bool).unwrap().to_vec::<bool>().unwrap(), vec![false, true, true]);
    let b = Tensor::from_vec(vec![true, false], &[2], &dev()).unwrap();
    assert_eq!(b.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![1.0, 0.0]);
    assert_eq!(b.to_dtype(DType::U8).unwrap().to_vec::<u8>().unwrap(), vec![1, 0]);
    // int -> int wraps (torch: int64 300 -> uint8 44, -1 -> 255)
    let i = Tensor::from_vec(vec![300i64, -1, 70000], &[3], &dev()).unwrap();
    assert_eq!(i.to_dtype(DType::U8).unwrap().to_vec::<u8>().unwrap(), vec![44, 255, 112]);
    // f32 -> f16 rounds to nearest, ties to even, overflows to inf, underflows to 0.
    let h = t(&[2.7, 1.0 + 1.0 / 2048.0, 1.0 + 3.0 / 2048.0, 65520.0, 65519.0, 1e-8, -2.7], &[7], DType::F32);
    let got: Vec<f64> = h.to_dtype(DType::F16).unwrap().to_vec::<f16>().unwrap().iter().map(|v| v.to_f64()).collect();
    assert_eq!(got, vec![2.69921875, 1.0, 1.001953125, f64::INFINITY, 65504.0, 0.0, -2.69921875]);
    // f32 -> bf16 keeps 8 significant bits
    let got: Vec<f64> = h.to_dtype(DType::BF16).unwrap().to_vec::<bf16>().unwrap().iter().map(|v| v.to_f64()).collect();
    assert_eq!(got[0], 2.703125);
    assert_eq!(got[3], 65536.0);
    // f64 -> f32 rounds
    let d = t(&[0.1], &[1], DType::F64);
    assert_eq!(d.to_dtype(DType::F32).unwrap().to_vec::<f32>().unwrap(), vec![0.1f32]);
    // NaN -> bool is true (nonzero), inf -> f16 stays inf
    let n = Tensor::from_vec(vec![f32::NAN, f32::INFINITY], &[2], &dev()).unwrap();
    assert_eq!(n.to_dtype(DType::Bool).unwrap().to_vec::<bool>().unwrap(), vec![true, true]);
    assert!(n.to_dtype(DType::F16).unwrap().to_vec::<f16>().unwrap()[1].is_infinite());
    // 0-dim
    let s = Tensor::scalar(-3.99, DType::F64, &dev()).unwrap().to_dtype(DType::I32).unwrap();
    assert_eq!((s.ndim(), s.item::<i32>().unwrap()), (0, -3));
}

#[test]
fn to_dtype_same_dtype_shares_storage() {
    for dt in DType::ALL {
        let x = make(&[1.0, 0.0, 3.0], &[3], dt);
        let y = x.to_dtype(dt).unwrap();
        assert!(y.shares_storage_with(&x), "{dt:?}");
        assert_eq!((y.shape(), y.strides()), (x.shape(), x.strides()));
        let other = if dt == DType::F32 { DType::F64 } else { DType::F32 };
        assert!(!x.to_dtype(other).unwrap().shares_storage_with(&x), "{dt:?} -> {other:?} must copy");
    }
}

// ---------------------------------------------------------------- views

#[test]
fn reshape_and_view() {
    let x = iota(24, &[2, 3, 4]);
    let r = x.reshape(&[-1, 4]).unwrap();
    assert_eq!((r.shape(), r.strides()), (&[6usize, 4][..], &[4usize, 1][..]));
    assert!(r.shares_storage_with(&x));
    assert_eq!(vals(&r), vals(&x));
    let r = x.reshape(&[4, -1]).unwrap();
    assert_eq!(r.shape(), &[4, 6]);
    let r = x.reshape(&[24]).unwrap();
    assert_eq!((r.shape(), r.strides()), (&[24usize][..], &[1usize][..]));
    let r = x.reshape(&[2, 1, 12, 1]).unwrap();
    assert_eq!(r.shape(), &[2, 1, 12, 1]);
    assert!(r.shares_storage_with(&x));
    // 0-dim <-> 1 element
    let s = Tensor::scalar(5.0, DType::F32, &dev()).unwrap();
    assert_eq!(s.reshape(&[1, 1]).unwrap().shape(), &[1, 1]);
    assert_eq!(s.reshape(&[1]).unwrap().reshape(&[]).unwrap().shape(), &[] as &[usize]);
    // Empty tensors reshape too.
    let e = Tensor::zeros(&[0, 3], DType::F32, &dev()).unwrap();
    assert_eq!(e.reshape(&[3, 0]).unwrap().shape(), &[3, 0]);

    let v = x.view(&[6, -1]).unwrap();
    assert_eq!(v.shape(), &[6, 4]);
    assert!(v.shares_storage_with(&x));
    // A view of a transposed tensor that keeps dims separable works ...
    let xt = x.transpose(1, 2).unwrap(); // [2, 4, 3]
    let v = xt.view(&[2, 4, 3, 1]).unwrap();
    assert!(v.shares_storage_with(&x));
    let v = x.permute(&[1, 2, 0]).unwrap().view(&[12, 2]).unwrap(); // dims 1, 2 merge
    assert_eq!(v.strides(), &[1, 12]);
    assert!(v.shares_storage_with(&x));
    // ... but one that would need a copy is an error (reshape copies instead).
    let err = xt.view(&[2, 12]).unwrap_err();
    assert!(matches!(err, kiln::Error::Shape { op: "view", .. }), "{err}");
    let err = x.reshape(&[2, 12]).unwrap().t().unwrap().view(&[-1]).unwrap_err();
    assert!(matches!(err, kiln::Error::Shape { op: "view", .. }), "{err}");

    // reshape of a transposed tensor copies, with the right values.
    let m = iota(6, &[2, 3]);
    let mt = m.t().unwrap();
    let r = mt.reshape(&[6]).unwrap();
    assert!(!r.shares_storage_with(&m), "reshape of a transposed tensor must copy");
    assert!(r.is_contiguous());
    assert_eq!(vals(&r), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    let r = mt.reshape(&[3, 2]).unwrap(); // same shape: no copy needed
    assert!(r.shares_storage_with(&m));
    let r = mt.reshape(&[2, 3]).unwrap();
    assert_eq!(vals(&r), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
}

#[test]
fn permute_transpose_t() {
    let x = iota(24, &[2, 3, 4]);
    assert_eq!(x.strides(), &[12, 4, 1]);
    let p = x.permute(&[2, 0, 1]).unwrap();
    assert_eq!((p.shape(), p.strides()), (&[4usize, 2, 3][..], &[1usize, 12, 4][..]));
    assert!(p.shares_storage_with(&x));
    assert!(!p.is_contiguous());
    assert_eq!(vals(&p), host_permute(&[2, 3, 4], &[2, 0, 1]));
    let p = x.permute(&[-1, -3, -2]).unwrap(); // negative dims
    assert_eq!(p.shape(), &[4, 2, 3]);
    assert_eq!(x.permute(&[0, 1, 2]).unwrap().strides(), &[12, 4, 1]);
    // permute back restores the original layout
    let back = p.permute(&[1, 2, 0]).unwrap();
    assert_eq!((back.shape(), back.strides()), (x.shape(), x.strides()));
    assert!(back.is_contiguous());

    let tr = x.transpose(0, 2).unwrap();
    assert_eq!((tr.shape(), tr.strides()), (&[4usize, 3, 2][..], &[1usize, 4, 12][..]));
    assert_eq!(vals(&tr), host_permute(&[2, 3, 4], &[2, 1, 0]));
    let tr = x.transpose(-1, 1).unwrap();
    assert_eq!((tr.shape(), tr.strides()), (&[2usize, 4, 3][..], &[12usize, 1, 4][..]));
    assert!(tr.shares_storage_with(&x));
    assert_eq!(x.transpose(1, 1).unwrap().strides(), x.strides());

    let m = iota(6, &[2, 3]);
    let mt = m.t().unwrap();
    assert_eq!((mt.shape(), mt.strides()), (&[3usize, 2][..], &[1usize, 3][..]));
    assert!(mt.shares_storage_with(&m));
    assert_eq!(vals(&mt), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    assert_eq!(vals(&mt.t().unwrap()), vals(&m));
    // t() of a vector or scalar is itself
    let v = iota(3, &[3]);
    assert_eq!(v.t().unwrap().shape(), &[3]);
    assert_eq!(Tensor::scalar(1.0, DType::F32, &dev()).unwrap().t().unwrap().shape(), &[] as &[usize]);
}

#[test]
fn expand_and_broadcast_to() {
    let c = t(&[1.0, 2.0, 3.0], &[3, 1], DType::F32);
    let e = c.expand(&[-1, 4]).unwrap();
    assert_eq!((e.shape(), e.strides()), (&[3usize, 4][..], &[1usize, 0][..]));
    assert!(e.shares_storage_with(&c));
    assert_eq!(vals(&e), vec![1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 3.0, 3.0, 3.0]);
    // New leading dims have stride 0; -1 keeps an existing dim.
    let e = c.expand(&[2, -1, 2]).unwrap();
    assert_eq!((e.shape(), e.strides()), (&[2usize, 3, 2][..], &[0usize, 1, 0][..]));
    assert_eq!(vals(&e), vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]);
    // Expanding to the same shape is the tensor.
    let same = c.expand(&[3, 1]).unwrap();
    assert_eq!((same.shape(), same.strides()), (c.shape(), c.strides()));

    let r = t(&[1.0, 2.0, 3.0], &[3], DType::I64);
    let b = r.broadcast_to(&[2, 3]).unwrap();
    assert_eq!((b.shape(), b.strides(), b.dtype()), (&[2usize, 3][..], &[0usize, 1][..], DType::I64));
    assert!(b.shares_storage_with(&r));
    assert_eq!(vals(&b), vec![1.0, 2.0, 3.0, 1.0, 2.0, 3.0]);
    let s = Tensor::scalar(7.0, DType::F32, &dev()).unwrap().broadcast_to(&[2, 2]).unwrap();
    assert_eq!((s.shape(), s.strides()), (&[2usize, 2][..], &[0usize, 0][..]));
    assert_eq!(vals(&s), vec![7.0; 4]);
    // An expanded tensor made contiguous gets real storage.
    let cc = e.contiguous().unwrap();
    assert!(cc.is_contiguous() && !cc.shares_storage_with(&c));
    assert_eq!(cc.strides(), &[6, 2, 1]);
    assert_eq!(vals(&cc), vals(&e));
    // Incompatible targets are errors.
    assert!(c.expand(&[3, 4, 2]).is_err());
    assert!(c.expand(&[4]).is_err());
    assert!(r.broadcast_to(&[2, 4]).is_err());
}

#[test]
fn narrow_and_slice() {
    let x = iota(12, &[3, 4]);
    let n = x.narrow(1, 1, 2).unwrap();
    assert_eq!((n.shape(), n.strides(), n.storage_offset()), (&[3usize, 2][..], &[4usize, 1][..], 1));
    assert!(n.shares_storage_with(&x));
    assert_eq!(vals(&n), vec![1.0, 2.0, 5.0, 6.0, 9.0, 10.0]);
    let n = x.narrow(-2, 2, 1).unwrap();
    assert_eq!((n.shape(), n.storage_offset()), (&[1usize, 4][..], 8));
    assert_eq!(vals(&n), vec![8.0, 9.0, 10.0, 11.0]);
    assert_eq!(x.narrow(0, 3, 0).unwrap().shape(), &[0, 4]);
    // narrow of a narrow accumulates the offset
    let nn = x.narrow(1, 1, 3).unwrap().narrow(1, 1, 2).unwrap();
    assert_eq!(nn.storage_offset(), 2);
    assert_eq!(vals(&nn), vec![2.0, 3.0, 6.0, 7.0, 10.0, 11.0]);

    let a = iota(10, &[10]);
    let sl = |s: i64, e: i64, step: usize| a.slice(0, s, e, step).unwrap();
    assert_eq!(vals(&sl(2, 8, 2)), vec![2.0, 4.0, 6.0]);
    assert_eq!(sl(2, 8, 2).strides(), &[2]);
    assert_eq!(sl(2, 8, 2).storage_offset(), 2);
    assert!(sl(2, 8, 2).shares_storage_with(&a));
    assert_eq!(vals(&sl(-3, i64::MAX, 1)), vec![7.0, 8.0, 9.0]); // x[-3:]
    assert_eq!(vals(&sl(-100, 3, 1)), vec![0.0, 1.0, 2.0]); // x[-100:3]
    assert_eq!(vals(&sl(0, -7, 1)), vec![0.0, 1.0, 2.0]); // x[:-7]
    assert_eq!(vals(&sl(1, 100, 3)), vec![1.0, 4.0, 7.0]); // x[1:100:3]
    assert_eq!(vals(&sl(0, 10, 4)), vec![0.0, 4.0, 8.0]); // x[::4]
    assert_eq!(vals(&sl(9, 10, 5)), vec![9.0]);
    assert_eq!(sl(5, 2, 1).shape(), &[0]); // x[5:2]
    assert_eq!(sl(20, 30, 1).shape(), &[0]); // x[20:30]
    assert_eq!(sl(-20, -15, 1).shape(), &[0]); // x[-20:-15]
    assert_eq!(sl(i64::MIN, i64::MAX, 1).shape(), &[10]);
    assert_eq!(vals(&sl(3, 10, usize::MAX)), vec![3.0]); // x[3::huge]
    assert_eq!(vals(&x.slice(0, 1, 3, usize::MAX).unwrap()), vec![4.0, 5.0, 6.0, 7.0]);
    // slice along the last dim of a 2-D tensor, then a view of the slice
    let s = x.slice(-1, 1, 4, 2).unwrap();
    assert_eq!((s.shape(), s.strides(), s.storage_offset()), (&[3usize, 2][..], &[4usize, 2][..], 1));
    assert_eq!(vals(&s), vec![1.0, 3.0, 5.0, 7.0, 9.0, 11.0]);
    assert_eq!(vals(&s.t().unwrap()), vec![1.0, 5.0, 9.0, 3.0, 7.0, 11.0]);
    let s = x.slice(0, 1, 3, 1).unwrap().slice(1, -2, 4, 1).unwrap();
    assert_eq!(vals(&s), vec![6.0, 7.0, 10.0, 11.0]);

    // Writes through a view land in the base.
    let base = Tensor::zeros(&[3, 4], DType::F32, &dev()).unwrap();
    base.narrow(1, 1, 2).unwrap().fill_(5.0).unwrap();
    base.slice(0, 2, 3, 1).unwrap().slice(1, 0, 4, 3).unwrap().fill_(-1.0).unwrap();
    assert_eq!(vals(&base), vec![0.0, 5.0, 5.0, 0.0, 0.0, 5.0, 5.0, 0.0, -1.0, 5.0, 5.0, -1.0]);
}

#[test]
fn squeeze_unsqueeze_flatten() {
    let x = iota(6, &[1, 3, 1, 2]);
    let s = x.squeeze(0).unwrap();
    assert_eq!(s.shape(), &[3, 1, 2]);
    assert!(s.shares_storage_with(&x));
    assert_eq!(x.squeeze(-2).unwrap().shape(), &[1, 3, 2]);
    assert_eq!(x.squeeze(1).unwrap().shape(), &[1, 3, 1, 2]); // size 3: unchanged, as torch
    assert_eq!(x.squeeze_all().unwrap().shape(), &[3, 2]);
    assert_eq!(vals(&x.squeeze_all().unwrap()), vals(&x));
    let one = Tensor::zeros(&[1, 1], DType::F32, &dev()).unwrap();
    assert_eq!(one.squeeze_all().unwrap().shape(), &[] as &[usize]);
    let sc = Tensor::scalar(1.0, DType::F32, &dev()).unwrap();
    assert_eq!(sc.squeeze(0).unwrap().shape(), &[] as &[usize]);
    assert_eq!(sc.unsqueeze(0).unwrap().shape(), &[1]);
    assert_eq!(sc.unsqueeze(-1).unwrap().shape(), &[1]);

    let m = iota(6, &[2, 3]);
    assert_eq!(m.unsqueeze(0).unwrap().shape(), &[1, 2, 3]);
    assert_eq!(m.unsqueeze(1).unwrap().shape(), &[2, 1, 3]);
    assert_eq!(m.unsqueeze(2).unwrap().shape(), &[2, 3, 1]);
    assert_eq!(m.unsqueeze(-1).unwrap().shape(), &[2, 3, 1]);
    assert_eq!(m.unsqueeze(-3).unwrap().shape(), &[1, 2, 3]);
    assert!(m.unsqueeze(1).unwrap().shares_storage_with(&m));
    // unsqueeze of a transposed tensor stays a view with the right values
    let u = m.t().unwrap().unsqueeze(1).unwrap();
    assert_eq!(u.shape(), &[3, 1, 2]);
    assert!(u.shares_storage_with(&m));
    assert_eq!(vals(&u), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);

    let x = iota(24, &[2, 3, 4]);
    assert_eq!(x.flatten(0, -1).unwrap().shape(), &[24]);
    assert_eq!(x.flatten(1, 2).unwrap().shape(), &[2, 12]);
    assert_eq!(x.flatten(0, 1).unwrap().shape(), &[6, 4]);
    assert_eq!(x.flatten(1, 1).unwrap().shape(), &[2, 3, 4]);
    assert!(x.flatten(0, -1).unwrap().shares_storage_with(&x));
    assert_eq!(sc.flatten(0, -1).unwrap().shape(), &[1]);
    // flatten of a permuted tensor copies with the right order
    let f = x.permute(&[2, 0, 1]).unwrap().flatten(0, -1).unwrap();
    assert_eq!(vals(&f), host_permute(&[2, 3, 4], &[2, 0, 1]));
}

#[test]
fn contiguous_copies_only_when_needed() {
    let x = iota(6, &[2, 3]);
    let c = x.contiguous().unwrap();
    assert!(c.shares_storage_with(&x), "contiguous() of a contiguous tensor is the same storage");
    let n = x.narrow(0, 1, 1).unwrap(); // contiguous with an offset
    assert!(n.is_contiguous());
    assert!(n.contiguous().unwrap().shares_storage_with(&x));
    let xt = x.t().unwrap();
    assert!(!xt.is_contiguous());
    let c = xt.contiguous().unwrap();
    assert!(c.is_contiguous());
    assert!(!c.shares_storage_with(&x));
    assert_eq!((c.shape(), c.strides(), c.storage_offset()), (&[3usize, 2][..], &[2usize, 1][..], 0));
    assert_eq!(vals(&c), vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    // A stepped slice is not contiguous.
    let s = iota(10, &[10]).slice(0, 0, 10, 2).unwrap();
    assert!(!s.is_contiguous());
    let sc = s.contiguous().unwrap();
    assert_eq!((sc.strides(), vals(&sc)), (&[1usize][..], vec![0.0, 2.0, 4.0, 6.0, 8.0]));
    // Size-1 dims may have any stride and still count as contiguous.
    let u = iota(3, &[3]).unsqueeze(0).unwrap().t().unwrap(); // [3, 1]
    assert!(u.is_contiguous());
}

#[test]
fn split_and_chunk() {
    let a = iota(10, &[10]);
    let sizes = |v: &[Tensor]| v.iter().map(|t| t.shape()[0]).collect::<Vec<_>>();
    let p = a.split(3, 0).unwrap();
    assert_eq!(sizes(&p), vec![3, 3, 3, 1]);
    assert_eq!(vals(&p[1]), vec![3.0, 4.0, 5.0]);
    assert_eq!(vals(&p[3]), vec![9.0]);
    assert!(p.iter().all(|q| q.shares_storage_with(&a)));
    assert_eq!(sizes(&a.split(5, 0).unwrap()), vec![5, 5]);
    assert_eq!(sizes(&a.split(20, 0).unwrap()), vec![10]);
    // torch.chunk: ceil(n / chunks) per piece, possibly fewer pieces.
    assert_eq!(sizes(&a.chunk(3, 0).unwrap()), vec![4, 4, 2]);
    assert_eq!(sizes(&a.chunk(5, 0).unwrap()), vec![2, 2, 2, 2, 2]);
    assert_eq!(sizes(&iota(6, &[6]).chunk(4, 0).unwrap()), vec![2, 2, 2]);
    assert_eq!(sizes(&iota(3, &[3]).chunk(5, 0).unwrap()), vec![1, 1, 1]);
    let c = a.chunk(3, 0).unwrap();
    assert_eq!(vals(&c[2]), vec![8.0, 9.0]);
    // Along another dim, uneven.
    let m = iota(10, &[2, 5]);
    let p = m.split(2, 1).unwrap();
    assert_eq!(p.iter().map(|t| t.shape().to_vec()).collect::<Vec<_>>(), vec![vec![2, 2], vec![2, 2], vec![2, 1]]);
    assert_eq!(vals(&p[1]), vec![2.0, 3.0, 7.0, 8.0]);
    assert_eq!(vals(&p[2]), vec![4.0, 9.0]);
    let c = m.chunk(2, -1).unwrap();
    assert_eq!(c.iter().map(|t| t.shape().to_vec()).collect::<Vec<_>>(), vec![vec![2, 3], vec![2, 2]]);
    assert_eq!(vals(&c[1]), vec![3.0, 4.0, 8.0, 9.0]);
}

// ---------------------------------------------------------------- printing

/// The suffixes torch prints after a tensor's values: device first, then the given ones.
fn repr(body: &str, suffixes: &[&str]) -> String {
    let mut all: Vec<String> = Vec::new();
    if let Device::Cuda(n) = dev() {
        all.push(format!("device='cuda:{n}'"));
    }
    all.extend(suffixes.iter().map(|s| s.to_string()));
    let mut s = format!("tensor({body}");
    for x in all {
        s.push_str(", ");
        s.push_str(&x);
    }
    s.push(')');
    s
}

#[test]
fn display_matches_pytorch() {
    let f = |v: &[f64], shape: &[usize], dt: DType| make(v, shape, dt).to_string();
    assert_eq!(f(&[1.0, 2.0, 3.0], &[3], DType::F32), repr("[1., 2., 3.]", &[]));
    assert_eq!(f(&[1.0, 2.0, 3.0, 4.0], &[2, 2], DType::I64), repr("[[1, 2],\n        [3, 4]]", &[]));
    assert_eq!(f(&[1.5, 2.0], &[2], DType::F64), repr("[1.5000, 2.0000]", &["dtype=kiln.float64"]));
    assert_eq!(f(&[1.0, 2.0], &[2], DType::F16), repr("[1., 2.]", &["dtype=kiln.float16"]));
    assert_eq!(f(&[1.0, 2.0], &[2], DType::BF16), repr("[1., 2.]", &["dtype=kiln.bfloat16"]));
    assert_eq!(f(&[1.0, -2.0], &[2], DType::I32), repr("[ 1, -2]", &["dtype=kiln.int32"]));
    assert_eq!(f(&[1.0, 255.0], &[2], DType::U8), repr("[  1, 255]", &["dtype=kiln.uint8"]));
    assert_eq!(f(&[1.0, 0.0], &[2], DType::Bool), repr("[ True, False]", &[]));
    assert_eq!(f(&[-1.5, 0.25], &[2], DType::F32), repr("[-1.5000,  0.2500]", &[]));
    // 0-dim
    assert_eq!(f(&[3.5], &[], DType::F32), repr("3.5000", &[]));
    assert_eq!(f(&[3.0], &[], DType::F32), repr("3.", &[]));
    assert_eq!(f(&[7.0], &[], DType::I64), repr("7", &[]));
    assert_eq!(f(&[1.0], &[], DType::Bool), repr("True", &[]));
    assert_eq!(f(&[2.5], &[], DType::F16), repr("2.5000", &["dtype=kiln.float16"]));
    // 3-D nesting: blank line between matrices
    assert_eq!(
        f(&[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], &[2, 2, 2], DType::I64),
        repr("[[[0, 1],\n         [2, 3]],\n\n        [[4, 5],\n         [6, 7]]]", &[])
    );
    // A strided view prints in its logical order.
    let m = make(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::I64);
    assert_eq!(m.t().unwrap().to_string(), repr("[[1, 4],\n        [2, 5],\n        [3, 6]]", &[]));
    assert_eq!(m.broadcast_to(&[2, 2, 3]).unwrap().narrow(2, 1, 1).unwrap().to_string(),
        repr("[[[2],\n         [5]],\n\n        [[2],\n         [5]]]", &[]));
}

#[test]
fn display_autograd_suffixes() {
    let x = make(&[1.0, 2.0], &[2], DType::F32).requires_grad();
    assert_eq!(x.to_string(), repr("[1., 2.]", &["requires_grad=True"]));
    let y = x.mul(&x).unwrap();
    assert_eq!(y.to_string(), repr("[1., 4.]", &["grad_fn=<MulBackward>"]));
    let s = y.sum_all().unwrap();
    assert_eq!(s.to_string(), repr("5.", &["grad_fn=<SumBackward>"]));
    let d = make(&[1.0, 2.0], &[2], DType::F64).requires_grad();
    assert_eq!(d.to_string(), repr("[1., 2.]", &["dtype=kiln.float64", "requires_grad=True"]));
    let e = d.add(&d).unwrap();
    assert_eq!(e.to_string(), repr("[2., 4.]", &["dtype=kiln.float64", "grad_fn=<AddBackward>"]));
    // detach and no_grad drop the suffixes
    assert_eq!(y.detach().to_string(), repr("[1., 4.]", &[]));
    let z = kiln::no_grad(|| x.mul(&x)).unwrap();
    assert_eq!(z.to_string(), repr("[1., 4.]", &[]));
    // set_requires_grad(false) on a leaf removes it
    x.set_requires_grad(false).unwrap();
    assert_eq!(x.to_string(), repr("[1., 2.]", &[]));
}

#[test]
fn display_empty_tensors() {
    let z = |shape: &[usize], dt: DType| Tensor::zeros(shape, dt, &dev()).unwrap().to_string();
    assert_eq!(z(&[0], DType::F32), repr("[]", &[]));
    assert_eq!(z(&[0, 3], DType::F32), repr("[]", &["size=(0, 3)"]));
    assert_eq!(z(&[2, 0, 1], DType::F32), repr("[]", &["size=(2, 0, 1)"]));
    assert_eq!(z(&[2, 0], DType::F64), repr("[]", &["size=(2, 0)", "dtype=kiln.float64"]));
    assert_eq!(z(&[0], DType::I32), repr("[]", &["dtype=kiln.int32"]));
    // torch prints the dtype of every empty non-default-float tensor, int64 and bool included
    // ("there are no elements to infer if the dtype should be int64"):
    // torch.zeros(0, dtype=torch.int64) -> tensor([], dtype=torch.int64)
    assert_eq!(z(&[0], DType::I64), repr("[]", &["dtype=kiln.int64"]));
    assert_eq!(z(&[0], DType::Bool), repr("[]", &["dtype=kiln.bool"]));
    assert_eq!(z(&[3, 0], DType::I64), repr("[]", &["size=(3, 0)", "dtype=kiln.int64"]));
    let g = Tensor::zeros(&[0], DType::F32, &dev()).unwrap().requires_grad();
    assert_eq!(g.to_string(), repr("[]", &["requires_grad=True"]));
}

#[test]
fn display_summarises_large_tensors() {
    let a = Tensor::arange(0.0, 2000.0, 1.0, DType::I64, &dev()).unwrap();
    let s = a.to_string();
    assert_eq!(s, repr("[   0,    1,    2,  ..., 1997, 1998, 1999]", &[]));
    let f = Tensor::arange(0.0, 2000.0, 1.0, DType::F32, &dev()).unwrap().to_string();
    assert!(f.contains("..."), "{f}");
    assert!(f.starts_with("tensor([0.0000e+00, 1.0000e+00, 2.0000e+00,  ..., 1.9970e+03"), "{f}");
    assert!(f.len() < 150, "summary too long: {f}");
    let m = Tensor::ones(&[40, 50], DType::F32, &dev()).unwrap().to_string();
    assert!(m.contains("..."), "{m}");
    assert_eq!(m.lines().count(), 7, "{m}"); // 3 rows, "...", 3 rows
    // 1000 elements is not summarised.
    let k = Tensor::zeros(&[1000], DType::I64, &dev()).unwrap().to_string();
    assert!(!k.contains("..."));
}

#[test]
fn debug_format() {
    let x = Tensor::zeros(&[2, 3], DType::F16, &dev()).unwrap();
    assert_eq!(format!("{x:?}"), format!("Tensor[[2, 3], F16, {}]", dev()));
}

// ---------------------------------------------------------------- threads

#[test]
fn tensor_is_send_and_sync() {
    fn assert_send_sync<T: Send + Sync + 'static>() {}
    assert_send_sync::<Tensor>();
    assert_send_sync::<kiln::Error>();

    // Made here, read there.
    let x = iota(6, &[2, 3]);
    let xt = x.t().unwrap();
    let h = std::thread::spawn(move || (vals(&xt), xt.shares_storage_with(&x)));
    let (v, shared) = h.join().unwrap();
    assert_eq!(v, vec![0.0, 3.0, 1.0, 4.0, 2.0, 5.0]);
    assert!(shared);

    // Made there, read here; and one tensor shared by reference between scoped threads.
    let y = std::thread::spawn(|| Tensor::arange(0.0, 4.0, 1.0, DType::I64, &dev()).unwrap()).join().unwrap();
    assert_eq!(y.to_vec::<i64>().unwrap(), vec![0, 1, 2, 3]);
    let sums: Vec<f64> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4).map(|k| s.spawn({
            let y = &y;
            move || vals(&y.add_scalar(k as i64).unwrap().sum_all().unwrap())[0]
        })).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(sums, vec![6.0, 10.0, 14.0, 18.0]);

    // Autograd across threads: forward on one, backward on another.
    let w = make(&[1.0, 2.0], &[2], DType::F32).requires_grad();
    let loss = w.mul(&w).unwrap().sum_all().unwrap();
    std::thread::spawn(move || loss.backward().unwrap()).join().unwrap();
    assert_eq!(vals(&w.grad().unwrap()), vec![2.0, 4.0]);
}
