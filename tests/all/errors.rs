//! Bad input: every kind of `kiln::Error`, with a message that names the op and what was wrong,
//! and no panics on any of it.

use crate::common::*;
use kiln::nn::functional as F;
use kiln::{BackwardOptions, DType, Device, Error, Tensor};

fn m23() -> Tensor {
    t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F32)
}

/// Asserts the message mentions each of `parts`.
#[track_caller]
fn says(e: &Error, parts: &[&str]) {
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "message {msg:?} does not mention {p:?}");
    }
}

// ---------------------------------------------------------------- shapes

#[test]
fn shape_mismatch_in_add() {
    let a = m23();
    let b = t(&[1.0, 2.0, 3.0, 4.0], &[4], DType::F32);
    let e = (&a + &b).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "add", .. }), "{e:?}");
    says(&e, &["add", "[2, 3]", "[4]"]);
    let e = a.mul(&b).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "mul", .. }), "{e:?}");
    says(&e, &["mul", "[2, 3]", "[4]"]);
    let e = a.add_(&t(&[1.0, 2.0], &[2, 1, 1], DType::F32)).unwrap_err(); // in place cannot grow
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    says(&e, &["add_", "[2, 3]"]);
}

#[test]
fn matmul_inner_dim_mismatch() {
    let a = m23();
    let b = Tensor::zeros(&[4, 5], DType::F32, &dev()).unwrap();
    let e = a.matmul(&b).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "matmul", .. }), "{e:?}");
    says(&e, &["matmul", "[2, 3]", "[4, 5]"]);
    let v = Tensor::zeros(&[2], DType::F32, &dev()).unwrap();
    let e = a.matmul(&v).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "matmul", .. }), "{e:?}");
    says(&e, &["matmul", "[2, 3]", "[2]"]);
    // batch dims that do not broadcast
    let x = Tensor::zeros(&[2, 2, 3], DType::F32, &dev()).unwrap();
    let y = Tensor::zeros(&[3, 3, 4], DType::F32, &dev()).unwrap();
    let e = x.matmul(&y).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "matmul", .. }), "{e:?}");
    says(&e, &["matmul", "[2]", "[3]"]);
    let e = Tensor::scalar(1.0, DType::F32, &dev()).unwrap().matmul(&v).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "matmul", .. }), "{e:?}");
}

#[test]
fn bad_dims() {
    let a = m23();
    let e = a.sum(&[5], false).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "sum", dim: 5, ndim: 2 }), "{e:?}");
    says(&e, &["sum", "5", "2 dimensions", "[-2, 1]"]);
    let e = a.transpose(0, 3).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "transpose", dim: 3, ndim: 2 }), "{e:?}");
    says(&e, &["transpose", "3"]);
    // negative out of range
    let e = a.sum(&[-3], false).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "sum", dim: -3, ndim: 2 }), "{e:?}");
    says(&e, &["sum", "-3", "[-2, 1]"]);
    let e = a.softmax(-3).unwrap_err();
    assert!(matches!(e, Error::Dim { dim: -3, ndim: 2, .. }), "{e:?}");
    says(&e, &["-3"]);
    let e = a.squeeze(2).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "squeeze", dim: 2, .. }), "{e:?}");
    let e = a.size(-3).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "size", dim: -3, .. }), "{e:?}");
    let e = a.narrow(2, 0, 1).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "narrow", dim: 2, .. }), "{e:?}");
    let e = a.permute(&[0, 2]).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "permute", dim: 2, .. }), "{e:?}");
    let e = a.unsqueeze(3).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "unsqueeze", dim: 3, .. }), "{e:?}");
    // a 0-dim tensor accepts dims 0 and -1 only
    let s = Tensor::scalar(1.0, DType::F32, &dev()).unwrap();
    assert!(s.sum(&[0], false).is_ok() && s.sum(&[-1], false).is_ok());
    let e = s.sum(&[1], false).unwrap_err();
    assert!(matches!(e, Error::Dim { op: "sum", dim: 1, ndim: 0 }), "{e:?}");
    says(&e, &["[-1, 0]"]);
}

// ---------------------------------------------------------------- dtypes

#[test]
fn dtype_not_supported() {
    let i = t(&[1.0, 2.0], &[2], DType::I64);
    let e = i.mean_all().unwrap_err();
    assert!(matches!(e, Error::DType { op: "mean", dtype: DType::I64, .. }), "{e:?}");
    says(&e, &["mean", "I64"]);

    let b = t(&[1.0, 0.0], &[2], DType::Bool);
    let e = b.sub(&b).unwrap_err();
    assert!(matches!(e, Error::DType { op: "sub", dtype: DType::Bool, .. }), "{e:?}");
    says(&e, &["sub", "Bool"]);
    // torch allows exp of bool (the result is float): so does kiln.
    assert_eq!(b.exp().unwrap().dtype(), DType::F32);
    // neg of bool is an error in torch too
    let e = b.neg().unwrap_err();
    assert!(matches!(e, Error::DType { op: "neg", dtype: DType::Bool, .. }), "{e:?}");

    let f = Tensor::zeros(&[2, 2], DType::F32, &dev()).unwrap();
    let d = Tensor::zeros(&[2, 2], DType::F64, &dev()).unwrap();
    let e = f.matmul(&d).unwrap_err();
    assert!(matches!(e, Error::DType { op: "matmul", .. }), "{e:?}");
    says(&e, &["matmul", "F32", "F64"]);

    let e = i.set_requires_grad(true).unwrap_err();
    assert!(matches!(e, Error::DType { op: "requires_grad", dtype: DType::I64, .. }), "{e:?}");
    says(&e, &["requires_grad", "I64"]);
    assert!(!i.is_requires_grad());

    let e = Tensor::randn(&[3], DType::I64, &dev()).unwrap_err();
    assert!(matches!(e, Error::DType { op: "randn", dtype: DType::I64, .. }), "{e:?}");
    says(&e, &["randn", "I64"]);
    let e = Tensor::rand(&[3], DType::Bool, &dev()).unwrap_err();
    assert!(matches!(e, Error::DType { op: "rand", dtype: DType::Bool, .. }), "{e:?}");

    let e = f.to_vec::<f64>().unwrap_err();
    assert!(matches!(e, Error::DType { op: "to_vec", dtype: DType::F32, .. }), "{e:?}");
    says(&e, &["to_vec", "F32", "F64"]);
    let e = Tensor::scalar(1.0, DType::I32, &dev()).unwrap().item::<i64>().unwrap_err();
    assert!(matches!(e, Error::DType { op: "item", dtype: DType::I32, .. }), "{e:?}");
    says(&e, &["item", "I32", "I64"]);

    // index tensors must be integers; masks and conditions must be bool
    let e = f.index_select(0, &t(&[0.0], &[1], DType::F32)).unwrap_err();
    assert!(matches!(e, Error::DType { op: "index_select", dtype: DType::F32, .. }), "{e:?}");
    let e = f.masked_fill(&f, 1.0).unwrap_err();
    assert!(matches!(e, Error::DType { op: "masked_fill", dtype: DType::F32, .. }), "{e:?}");
    let e = f.where_(&f, &f).unwrap_err();
    assert!(matches!(e, Error::DType { op: "where", dtype: DType::F32, .. }), "{e:?}");
}

// ---------------------------------------------------------------- indices

/// The error of an indexing op: from the call itself (CPU), or, as with CUDA's asynchronous
/// errors, from the next read of its result (GPU kernels report bad indices without a sync).
fn index_error(r: kiln::Result<Tensor>) -> Error {
    r.and_then(|y| y.to_device(&Device::Cpu)).unwrap_err()
}

#[test]
fn index_out_of_range() {
    let x = t(&[1.0, 2.0, 3.0], &[3], DType::F32);
    let idx = Tensor::from_vec(vec![0i64, 5], &[2], &dev()).unwrap();
    let e = index_error(x.index_select(0, &idx));
    assert!(matches!(e, Error::Index { op: "index_select", index: 5, size: 3 }), "{e:?}");
    says(&e, &["index_select", "5", "3"]);
    let neg = Tensor::from_vec(vec![-4i64], &[1], &dev()).unwrap();
    let e = index_error(x.index_select(0, &neg));
    assert!(matches!(e, Error::Index { op: "index_select", index: -4, size: 3 }), "{e:?}");
    // Negative indices are out of range, as in torch's index_select ("index out of range in self").
    let e = index_error(x.index_select(0, &Tensor::from_vec(vec![-3i64], &[1], &dev()).unwrap()));
    assert!(matches!(e, Error::Index { op: "index_select", index: -3, size: 3 }), "{e:?}");

    let m = m23();
    let gi = Tensor::from_vec(vec![0i64, 3, 1, 2], &[2, 2], &dev()).unwrap();
    let e = index_error(m.gather(1, &gi));
    assert!(matches!(e, Error::Index { op: "gather", index: 3, size: 3 }), "{e:?}");
    says(&e, &["gather", "3"]);
    let si = Tensor::from_vec(vec![2i64, 0, 0], &[1, 3], &dev()).unwrap();
    let e = index_error(m.scatter_add(0, &si, &m));
    assert!(matches!(e, Error::Index { op: "scatter_add", index: 2, size: 2 }), "{e:?}");

    let classes = Tensor::from_vec(vec![0i64, 3, 1], &[3], &dev()).unwrap();
    let e = classes.one_hot(Some(3)).unwrap_err();
    assert!(matches!(e, Error::Index { op: "one_hot", index: 3, size: 3 }), "{e:?}");
    says(&e, &["one_hot", "3"]);
    let e = Tensor::from_vec(vec![-1i64], &[1], &dev()).unwrap().one_hot(Some(3)).unwrap_err();
    assert!(matches!(e, Error::Index { op: "one_hot", index: -1, .. }), "{e:?}");
}

/// A bad index a thread never read about (it ended first) does not surface in another thread
/// (on a GPU the ended thread's error word goes to the next thread that needs one).
#[test]
fn an_unread_index_error_does_not_reach_another_thread() {
    let x = t(&[1.0, 2.0, 3.0], &[3], DType::F32);
    std::thread::scope(|s| {
        s.spawn(|| {
            let bad = Tensor::from_vec(vec![7i64], &[1], &dev()).unwrap();
            let _ = x.index_select(0, &bad);
        });
    });
    let got = std::thread::scope(|s| {
        s.spawn(|| {
            let ok = Tensor::from_vec(vec![2i64, 0], &[2], &dev()).unwrap();
            x.index_select(0, &ok).and_then(|y| y.to_device(&Device::Cpu))
        })
        .join()
        .unwrap()
    });
    assert_eq!(vals(&got.expect("no error of the ended thread")), vec![3.0, 1.0]);
}

/// A bad index inside a replayed CUDA graph (a reduce-overhead function) reaches the thread
/// that replayed it, not the thread that captured the graph.
#[test]
fn a_bad_index_in_a_replay_reaches_the_replaying_thread() {
    use kiln::compile::{compile_with, CompileOptions, Mode};
    let x = t(&[1.0, 2.0, 3.0], &[3], DType::F32);
    let f = compile_with(CompileOptions::new().mode(Mode::ReduceOverhead), move |i: &Tensor| x.index_select(0, i));
    let idx = |v: Vec<i64>| Tensor::from_vec(v, &[2], &dev()).unwrap();
    let read = |r: kiln::Result<Tensor>| r.and_then(|y| y.to_device(&Device::Cpu));
    // The first call compiles, the second captures the graph, here.
    for _ in 0..2 {
        assert_eq!(vals(&read(f.call(&idx(vec![2, 0]))).unwrap()), vec![3.0, 1.0]);
    }
    let got = std::thread::scope(|s| s.spawn(|| read(f.call(&idx(vec![1, 7])))).join().unwrap());
    let e = got.expect_err("the replaying thread gets the error");
    assert!(matches!(e, Error::Index { op: "index_select", index: 7, size: 3 }), "{e:?}");
    assert_eq!(vals(&read(f.call(&idx(vec![0, 1]))).expect("no error for the capturing thread")), vec![1.0, 2.0]);
}

// ---------------------------------------------------------------- arguments

#[test]
fn invalid_arguments() {
    let e = Tensor::arange(0.0, 5.0, 0.0, DType::F32, &dev()).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "arange", .. }), "{e:?}");
    says(&e, &["arange", "step"]);
    let e = Tensor::arange(0.0, 5.0, -1.0, DType::F32, &dev()).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "arange", .. }), "{e:?}");
    let e = Tensor::arange(0.0, f64::INFINITY, 1.0, DType::F32, &dev()).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "arange", .. }), "{e:?}");

    let x = t(&[1.0, 2.0, 3.0, 4.0], &[4], DType::F32);
    let e = x.split(0, 0).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "split", .. }), "{e:?}");
    says(&e, &["split", "size"]);
    let e = x.chunk(0, 0).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "chunk", .. }), "{e:?}");
    let e = x.slice(0, 0, 4, 0).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "slice", .. }), "{e:?}");
    says(&e, &["slice", "step"]);
    let e = x.clamp(None, None).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "clamp", .. }), "{e:?}");
    says(&e, &["clamp", "min", "max"]);
    let e = F::dropout(&x, 1.5, true).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "dropout", .. }), "{e:?}");
    says(&e, &["dropout", "1.5"]);
    assert!(matches!(F::dropout(&x, -0.1, true), Err(Error::Arg { op: "dropout", .. })));
    assert!(matches!(F::dropout(&x, f64::NAN, false), Err(Error::Arg { op: "dropout", .. })));
    let e = Tensor::randint(3, 3, &[2], &dev()).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "randint", .. }), "{e:?}");
    says(&e, &["randint", "3"]);
    let e = m23().permute(&[1, 1]).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "permute", .. }), "{e:?}");
    let e = kiln::cat(&[], 0).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "cat", .. }), "{e:?}");
    let e = m23().flatten(1, 0).unwrap_err();
    assert!(matches!(e, Error::Arg { op: "flatten", .. }), "{e:?}");
}

#[test]
fn from_vec_length_mismatch() {
    let e = Tensor::from_vec(vec![1.0f32; 5], &[2, 3], &dev()).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "from_vec", .. }), "{e:?}");
    says(&e, &["from_vec", "5", "[2, 3]", "6"]);
    let e = Tensor::from_slice(&[1i64, 2], &[], &dev()).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e:?}");
    says(&e, &["2", "[]"]);
    assert!(Tensor::from_vec(Vec::<u8>::new(), &[1], &dev()).is_err());
}

#[test]
fn reshape_to_wrong_element_count() {
    let a = m23();
    let e = a.reshape(&[4, 2]).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "reshape", .. }), "{e:?}");
    says(&e, &["reshape", "[4, 2]", "[2, 3]", "6"]);
    let e = a.reshape(&[-1, 4]).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "reshape", .. }), "{e:?}");
    says(&e, &["[-1, 4]", "[2, 3]"]);
    let e = a.reshape(&[-1, -1]).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "reshape", .. }), "{e:?}");
    let e = a.reshape(&[-2, -3]).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "reshape", .. }), "{e:?}");
    let e = a.view(&[7]).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "view", .. }), "{e:?}");
    says(&e, &["view", "[7]", "[2, 3]"]);
}

#[test]
fn item_of_many_elements() {
    let x = t(&[1.0, 2.0, 3.0], &[3], DType::F32);
    let e = x.item::<f32>().unwrap_err();
    assert!(matches!(e, Error::Shape { op: "item", .. }), "{e:?}");
    says(&e, &["item", "3 elements", "[3]"]);
    let e = Tensor::zeros(&[0], DType::F32, &dev()).unwrap().item::<f32>().unwrap_err();
    assert!(matches!(e, Error::Shape { op: "item", .. }), "{e:?}");
    says(&e, &["0 elements"]);
}

#[test]
fn backward_of_non_scalar() {
    let x = t(&[1.0, 2.0, 3.0], &[3], DType::F32).requires_grad();
    let y = x.mul(&x).unwrap();
    let e = y.backward().unwrap_err();
    assert!(matches!(e, Error::Autograd(_)), "{e:?}");
    says(&e, &["autograd", "scalar", "[3]"]);
    // A gradient of the wrong shape.
    let g = Tensor::ones(&[2], DType::F32, &dev()).unwrap();
    let e = y.backward_with(BackwardOptions { gradient: Some(g), retain_graph: false }).unwrap_err();
    assert!(matches!(e, Error::Shape { op: "backward", .. }), "{e:?}");
    says(&e, &["backward", "[2]", "[3]"]);
    // A tensor with no history at all.
    let e = t(&[1.0], &[], DType::F32).backward().unwrap_err();
    assert!(matches!(e, Error::Autograd(_)), "{e:?}");
    says(&e, &["require"]);
    // With a gradient the non-scalar backward works.
    let g = Tensor::ones(&[3], DType::F32, &dev()).unwrap();
    y.backward_with(BackwardOptions { gradient: Some(g), retain_graph: false }).unwrap();
    assert_eq!(vals(&x.grad().unwrap()), vec![2.0, 4.0, 6.0]);
}

#[test]
fn device_unavailable_without_cuda() {
    if !dev().is_cpu() {
        // On a GPU machine creation on Cuda(0) works; the mismatch with a CPU tensor is an error.
        let g = Tensor::zeros(&[2], DType::F32, &dev()).unwrap();
        let c = Tensor::zeros(&[2], DType::F32, &Device::Cpu).unwrap();
        let e = g.add(&c).unwrap_err();
        assert!(matches!(e, Error::DeviceMismatch { .. }), "{e:?}");
        says(&e, &["add", "cpu", "cuda"]);
        return;
    }
    let cuda = Device::Cuda(0);
    let check = |r: kiln::Result<Tensor>, op: &str| {
        let e = r.unwrap_err();
        assert!(matches!(e, Error::DeviceUnavailable { device: Device::Cuda(0), .. }), "{op}: {e:?}");
        says(&e, &[op, "cuda:0"]);
    };
    check(Tensor::zeros(&[2], DType::F32, &cuda), "zeros");
    check(Tensor::ones(&[2], DType::F32, &cuda), "full");
    check(Tensor::full(&[2], 1.0, DType::I64, &cuda), "full");
    check(Tensor::arange(0.0, 3.0, 1.0, DType::F32, &cuda), "arange");
    check(Tensor::linspace(0.0, 1.0, 3, DType::F32, &cuda), "linspace");
    check(Tensor::eye(2, DType::F32, &cuda), "eye");
    check(Tensor::rand(&[2], DType::F32, &cuda), "rand");
    check(Tensor::randn(&[2], DType::F32, &cuda), "randn");
    check(Tensor::randint(0, 5, &[2], &cuda), "randint");
    check(Tensor::from_vec(vec![1.0f32, 2.0], &[2], &cuda), "from_vec");
    check(Tensor::from_slice(&[1u8], &[1], &cuda), "from_vec");
    check(m23().to_device(&cuda), "to_device");
    assert_eq!(Device::cuda_if_available(0), Device::Cpu);
}

// ---------------------------------------------------------------- no panics

/// A named bad call; `true` when it must return Err (not just not panic).
type Case<'a> = (&'static str, bool, Box<dyn Fn() -> kiln::Result<()> + 'a>);

/// Runs each case under `catch_unwind`; returns the names of those that panicked, and of those
/// that returned Ok although `must_fail`.
fn run_cases(cases: Vec<Case<'_>>) -> (Vec<&'static str>, Vec<&'static str>) {
    let mut panicked = Vec::new();
    let mut accepted = Vec::new();
    for (name, must_fail, f) in cases {
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
            Err(_) => panicked.push(name),
            Ok(Ok(())) if must_fail => accepted.push(name),
            Ok(_) => {}
        }
    }
    (panicked, accepted)
}

macro_rules! case {
    ($name:expr, $e:expr) => {
        ($name, true, Box::new(|| -> kiln::Result<()> { $e.map(|_| ()) }) as Box<dyn Fn() -> kiln::Result<()> + '_>)
    };
    (ok_or_err $name:expr, $e:expr) => {
        ($name, false, Box::new(|| -> kiln::Result<()> { $e.map(|_| ()) }) as Box<dyn Fn() -> kiln::Result<()> + '_>)
    };
}

#[test]
fn bad_input_never_panics() {
    let d = dev();
    let a = m23();
    let v = t(&[1.0, 2.0, 3.0], &[3], DType::F32);
    let i64s = Tensor::from_vec(vec![0i64, 1, 2], &[3], &d).unwrap();
    let s = Tensor::scalar(1.0, DType::F32, &d).unwrap();
    let e0 = Tensor::zeros(&[0, 3], DType::F32, &d).unwrap();
    let idx = |v: Vec<i64>, shape: &[usize]| Tensor::from_vec(v, shape, &dev()).unwrap();
    let cases = vec![
        // shapes
        case!("add broadcast", { let (a, v) = (a.clone(), t(&[1.0; 4], &[4], DType::F32)); a.add(&v) }),
        case!("matmul inner", { let a = a.clone(); a.matmul(&a) }),
        case!("matmul 0-dim", { let (s, v) = (s.clone(), v.clone()); s.matmul(&v) }),
        case!("reshape count", { let a = a.clone(); a.reshape(&[4, 2]) }),
        case!("reshape two -1", { let a = a.clone(); a.reshape(&[-1, -1]) }),
        case!("reshape -1 with 0", { let a = a.clone(); a.reshape(&[-1, 0]) }),
        case!("reshape negative", { let a = a.clone(); a.reshape(&[-6]) }),
        case!("reshape overflowing shape", { let a = a.clone(); a.reshape(&[i64::MAX, i64::MAX]) }),
        case!("reshape overflowing with -1", { let a = a.clone(); a.reshape(&[-1, i64::MAX, 4]) }),
        case!("view needs copy", { let a = a.clone(); a.t()?.view(&[6]) }),
        case!("permute length", { let a = a.clone(); a.permute(&[0]) }),
        case!("permute repeated", { let a = a.clone(); a.permute(&[0, 0]) }),
        case!("expand fewer dims", { let a = a.clone(); a.expand(&[3]) }),
        case!("expand bad size", { let a = a.clone(); a.expand(&[4, 3]) }),
        case!("expand -1 in new dim", { let a = a.clone(); a.expand(&[-1, 2, 3]) }),
        case!("expand -2", { let a = a.clone(); a.expand(&[2, -2]) }),
        case!("broadcast_to", { let a = a.clone(); a.broadcast_to(&[3, 3]) }),
        case!("narrow past end", { let a = a.clone(); a.narrow(1, 2, 5) }),
        case!("narrow overflowing start", { let a = a.clone(); a.narrow(1, usize::MAX, 2) }),
        case!("narrow overflowing length", { let a = a.clone(); a.narrow(1, 1, usize::MAX) }),
        case!("narrow 0-dim", { let s = s.clone(); s.narrow(0, 0, 1) }),
        case!("slice 0-dim", { let s = s.clone(); s.slice(0, 0, 1, 1) }),
        case!("t of 3-D", { Tensor::zeros(&[2, 2, 2], DType::F32, &dev())?.t() }),
        case!("cat shapes", { let (a, v) = (a.clone(), v.clone()); kiln::cat(&[&a, &v], 0) }),
        case!("cat 0-dim", { let s = s.clone(); kiln::cat(&[&s, &s], 0) }),
        case!("cat empty", kiln::cat(&[], 0)),
        case!("stack shapes", { let (a, v) = (a.clone(), v.clone()); kiln::stack(&[&a, &v], 0) }),
        case!("stack empty", kiln::stack(&[], 0)),
        case!("pad odd", { let a = a.clone(); a.pad(&[1], 0.0) }),
        case!("pad too many", { let v = v.clone(); v.pad(&[1, 1, 1, 1], 0.0) }),
        case!("pad crops too much", { let v = v.clone(); v.pad(&[-2, -2], 0.0) }),
        case!("tril 1-D", { let v = v.clone(); v.tril(0) }),
        case!("from_vec count", Tensor::from_vec(vec![1.0f32; 5], &[2, 3], &dev())),
        case!("from_vec overflowing shape", Tensor::from_vec(vec![1.0f32], &[usize::MAX, 2], &dev())),
        case!("zeros overflowing shape", Tensor::zeros(&[usize::MAX, 2], DType::F32, &dev())),
        case!("full overflowing shape", Tensor::full(&[1 << 40, 1 << 40], 1.0, DType::F32, &dev())),
        case!("rand overflowing shape", Tensor::rand(&[usize::MAX, 3], DType::F32, &dev())),
        case!("eye overflowing", Tensor::eye(usize::MAX, DType::F32, &dev())),
        case!("item of 3", { let v = v.clone(); v.item::<f32>() }),
        case!("item of empty", { let e = e0.clone(); e.item::<f32>() }),
        case!("masked_fill shape", { let a = a.clone(); let m = Tensor::ones(&[2, 2], DType::Bool, &dev())?; a.masked_fill(&m, 0.0) }),
        case!("where shapes", { let (a, v) = (a.clone(), t(&[1.0; 4], &[4], DType::F32)); a.gt_scalar(0.0)?.where_(&a, &v) }),
        case!("gather rank", { let a = a.clone(); a.gather(0, &idx(vec![0], &[1])) }),
        case!("gather too big", { let a = a.clone(); a.gather(0, &idx(vec![0; 8], &[2, 4])) }),
        case!("scatter_add src dtype", { let a = a.clone(); a.scatter_add(0, &idx(vec![0; 3], &[1, 3]), &a.to_dtype(DType::F64)?) }),
        case!("index_select 2-D index", { let a = a.clone(); a.index_select(0, &idx(vec![0; 4], &[2, 2])) }),
        case!("index_select 0-dim with two indices", { let s = s.clone(); s.index_select(0, &idx(vec![0, 0], &[2])) }),
        case!("cross_entropy shapes", { let a = a.clone(); F::cross_entropy(&a, &idx(vec![0, 1, 2], &[3])) }),
        case!("cross_entropy class out of range", { let a = a.clone(); F::cross_entropy(&a, &idx(vec![0, 7], &[2])).and_then(|y| y.to_device(&Device::Cpu)) }),
        case!("cross_entropy negative class", { let a = a.clone(); F::cross_entropy(&a, &idx(vec![0, -5], &[2])).and_then(|y| y.to_device(&Device::Cpu)) }),
        case!("linear shapes", { let a = a.clone(); F::linear(&a, &t(&[1.0; 4], &[2, 2], DType::F32), None) }),
        case!("layer_norm shape", { let a = a.clone(); F::layer_norm(&a, &[4], None, None, 1e-5) }),
        case!("allclose shapes", { let (a, v) = (a.clone(), t(&[1.0; 4], &[4], DType::F32)); a.allclose(&v, 1e-5, 1e-8) }),
        case!("backward gradient shape", {
            let x = t(&[1.0, 2.0], &[2], DType::F32).requires_grad();
            x.mul(&x)?.backward_with(BackwardOptions { gradient: Some(t(&[1.0], &[1], DType::F32)), retain_graph: false })
        }),
        case!("max over empty dim", { let e = e0.clone(); e.max(0, false).map(|p| p.0) }),
        case!("argmax over empty dim", { let e = e0.clone(); e.argmax(0, false) }),
        case!("split dim", { let v = v.clone(); v.split(1, 1) }),
        // dims
        case!("sum dim", { let a = a.clone(); a.sum(&[5], false) }),
        case!("sum repeated dim", { let a = a.clone(); a.sum(&[1, -1], false) }),
        case!("sum i64::MIN dim", { let a = a.clone(); a.sum(&[i64::MIN], false) }),
        case!("transpose", { let a = a.clone(); a.transpose(0, 3) }),
        case!("transpose i64::MAX", { let a = a.clone(); a.transpose(i64::MAX, 0) }),
        case!("softmax dim", { let a = a.clone(); a.softmax(2) }),
        case!("squeeze dim", { let a = a.clone(); a.squeeze(-3) }),
        case!("unsqueeze dim", { let a = a.clone(); a.unsqueeze(-4) }),
        case!("flatten order", { let a = a.clone(); a.flatten(1, 0) }),
        case!("size dim", { let a = a.clone(); a.size(2) }),
        case!("cat dim", { let a = a.clone(); kiln::cat(&[&a, &a], 2) }),
        case!("index_select dim", { let (a, i) = (a.clone(), i64s.clone()); a.index_select(2, &i) }),
        case!("prod dim", { let a = a.clone(); a.prod(-3, false) }),
        case!("argmax dim", { let a = a.clone(); a.argmax(4, false) }),
        // dtypes
        case!("mean I64", { let i = i64s.clone(); i.mean_all() }),
        case!("var I64", { let i = i64s.clone(); i.var(&[], 1.0, false) }),
        case!("sub Bool", { let b = Tensor::ones(&[2], DType::Bool, &dev())?; b.sub(&b) }),
        case!("rsub Bool", { let b = Tensor::ones(&[2], DType::Bool, &dev())?; b.rsub_scalar(true) }),
        case!("neg Bool", { Tensor::ones(&[2], DType::Bool, &dev())?.neg() }),
        case!("matmul dtypes", { let a = a.clone(); a.matmul(&a.t()?.to_dtype(DType::F64)?) }),
        case!("requires_grad I64", { let i = i64s.clone(); i.set_requires_grad(true) }),
        case!("requires_grad Bool", { Tensor::ones(&[1], DType::Bool, &dev())?.set_requires_grad(true) }),
        case!("randn I64", Tensor::randn(&[2], DType::I64, &dev())),
        case!("rand U8", Tensor::rand(&[2], DType::U8, &dev())),
        case!("to_vec f64 of F32", { let v = v.clone(); v.to_vec::<f64>() }),
        case!("to_vec bool of I64", { let i = i64s.clone(); i.to_vec::<bool>() }),
        case!("item i32 of F32", { let s = s.clone(); s.item::<i32>() }),
        case!("index float", { let (a, v) = (a.clone(), v.clone()); a.index_select(0, &v) }),
        case!("mask float", { let (a, b) = (a.clone(), a.clone()); a.masked_fill(&b, 1.0) }),
        case!("one_hot float", { let v = v.clone(); v.one_hot(Some(4)) }),
        case!("cross_entropy float target", { let (a, v) = (a.clone(), t(&[0.0, 1.0], &[2], DType::F32)); F::cross_entropy(&a, &v) }),
        case!("softmax of I64", { let i = i64s.clone(); i.softmax(0) }),
        case!("mse_loss of I64", { let i = i64s.clone(); F::mse_loss(&i, &i, F::Reduction::Mean) }),
        case!("add_ F32 into I64", { let (i, v) = (i64s.clone(), v.clone()); i.add_(&v) }),
        // indices
        case!("index_select 5 of 3", { let v = v.clone(); v.index_select(0, &idx(vec![5], &[1])).and_then(|y| y.to_device(&Device::Cpu)) }),
        case!("index_select i64::MIN", { let v = v.clone(); v.index_select(0, &idx(vec![i64::MIN], &[1])).and_then(|y| y.to_device(&Device::Cpu)) }),
        case!("index_select i64::MAX", { let v = v.clone(); v.index_select(0, &idx(vec![i64::MAX], &[1])).and_then(|y| y.to_device(&Device::Cpu)) }),
        case!("gather out of range", { let a = a.clone(); a.gather(1, &idx(vec![0, 9], &[1, 2])).and_then(|y| y.to_device(&Device::Cpu)) }),
        case!("scatter_add out of range", { let a = a.clone(); a.scatter_add(1, &idx(vec![-9], &[1, 1]), &a).and_then(|y| y.to_device(&Device::Cpu)) }),
        case!("one_hot too small", { let i = i64s.clone(); i.one_hot(Some(2)) }),
        case!("one_hot negative", { idx(vec![-1], &[1]).one_hot(None) }),
        case!("one_hot of empty without classes", { idx(vec![], &[0]).one_hot(None) }),
        // arguments
        case!("arange step 0", Tensor::arange(0.0, 1.0, 0.0, DType::F32, &dev())),
        case!("arange NaN", Tensor::arange(f64::NAN, 1.0, 1.0, DType::F32, &dev())),
        case!("arange wrong sign", Tensor::arange(0.0, 1.0, -1.0, DType::F32, &dev())),
        case!("arange infinite", Tensor::arange(0.0, f64::INFINITY, 1.0, DType::F32, &dev())),
        case!("arange too many elements", Tensor::arange(0.0, 1e300, 1.0, DType::F32, &dev())),
        case!("randint empty range", Tensor::randint(1, 0, &[2], &dev())),
        case!("split 0", { let v = v.clone(); v.split(0, 0) }),
        case!("chunk 0", { let v = v.clone(); v.chunk(0, 0) }),
        case!("slice step 0", { let v = v.clone(); v.slice(0, 0, 3, 0) }),
        case!("clamp no bounds", { let v = v.clone(); v.clamp(None, None) }),
        case!("dropout 1.5", { let v = v.clone(); F::dropout(&v, 1.5, true) }),
        case!("dropout NaN", { let v = v.clone(); F::dropout(&v, f64::NAN, true) }),
        case!("cross_entropy label_smoothing", {
            let a = a.clone();
            F::cross_entropy_with(&a, &idx(vec![0, 1], &[2]), &F::CrossEntropyOptions { label_smoothing: 2.0, ..Default::default() })
        }),
        // autograd
        case!("backward non-scalar", { let x = t(&[1.0, 2.0], &[2], DType::F32).requires_grad(); x.mul(&x)?.backward() }),
        case!("backward without grad", { let v = v.clone(); v.sum_all()?.backward() }),
        case!("backward twice", {
            let x = t(&[1.0, 2.0], &[2], DType::F32).requires_grad();
            let y = x.exp()?.sum_all()?;
            y.backward()?;
            y.backward()
        }),
        case!("in-place on a leaf that requires grad", {
            let x = t(&[1.0, 2.0], &[2], DType::F32).requires_grad();
            x.add_scalar_(1.0)
        }),
        case!("modified saved tensor", {
            let x = t(&[1.0, 2.0], &[2], DType::F32).requires_grad();
            let y = x.mul_scalar(1.0)?;
            let z = y.sin()?; // saves its input y
            y.add_scalar_(1.0)?;
            z.sum_all()?.backward()
        }),
        // devices
        case!("zeros on a missing GPU", Tensor::zeros(&[2], DType::F32, &Device::Cuda(1000))),
        case!("to_device of a missing GPU", { let v = v.clone(); v.to_device(&Device::Cuda(1000)) }),
        // fine input at the extremes: it may work, it must not panic
        case!(ok_or_err "randint full i64 range", Tensor::randint(i64::MIN, i64::MAX, &[4], &dev())),
        case!(ok_or_err "randint wide range", Tensor::randint(-5, i64::MAX, &[4], &dev())),
        case!(ok_or_err "slice extreme bounds", { let v = v.clone(); v.slice(0, i64::MIN, i64::MAX, usize::MAX) }),
        case!(ok_or_err "slice huge step on a strided dim", { let a = a.clone(); a.slice(0, 0, 2, usize::MAX) }),
        case!(ok_or_err "slice huge step backward", {
            let x = t(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &[2, 3], DType::F32).requires_grad();
            x.slice(1, 1, 3, usize::MAX / 2)?.sum_all()?.backward()
        }),
        case!(ok_or_err "index_select empty index", { let v = v.clone(); v.index_select(0, &idx(vec![], &[0])) }),
        case!(ok_or_err "one_hot of empty", { idx(vec![], &[0]).one_hot(Some(3)) }),
        case!(ok_or_err "full NaN into I64", Tensor::full(&[2], f64::NAN, DType::I64, &dev())),
        case!(ok_or_err "full inf into U8", Tensor::full(&[2], f64::INFINITY, DType::U8, &dev())),
        case!(ok_or_err "linspace NaN", Tensor::linspace(f64::NAN, 1.0, 4, DType::F32, &dev())),
        case!(ok_or_err "sum of empty", { let e = e0.clone(); e.sum_all() }),
        case!(ok_or_err "mean of empty", { let e = e0.clone(); e.mean(&[0], false) }),
        case!(ok_or_err "split empty", { let e = e0.clone(); e.split(2, 0) }),
        case!(ok_or_err "chunk empty", { let e = e0.clone(); e.chunk(3, 0) }),
        case!(ok_or_err "reshape empty -1", { let e = e0.clone(); e.reshape(&[-1]) }),
        case!(ok_or_err "pad large", { let v = v.clone(); v.pad(&[1000, 0], 0.0) }),
        case!(ok_or_err "int pow negative", { let i = i64s.clone(); i.pow_scalar(-2i64) }),
        case!(ok_or_err "int div by zero", { let i = i64s.clone(); i.div_scalar(0i64) }),
        case!(ok_or_err "display of empty 3-D", Ok::<_, Error>(Tensor::zeros(&[2, 0, 3], DType::I32, &dev())?.to_string())),
    ];
    let (panicked, accepted) = run_cases(cases);
    assert!(panicked.is_empty(), "these bad inputs panicked instead of returning Err: {panicked:?}");
    assert!(accepted.is_empty(), "these bad inputs were accepted: {accepted:?}");
}
