//! Custom ops: the CPU function and the CUDA kernel against plain kiln ops, gradients (gradcheck
//! in f64, eager and compiled), the op inside compiled functions, the in-place form, and the
//! errors for bad definitions and bad inputs. The CUDA-only checks (NVRTC errors, kernel
//! parameters, launch counts) run when the suite runs on a GPU.

use crate::common::{assert_close, dev, host_rand, t, vals};
use kiln::compile::{compile, compile_with, Backend, CompileOptions, Graph};
use kiln::{gradcheck, CustomOp, DType, Device, Error, GradcheckOptions, LaunchSpec, Result, Tensor};
use std::sync::{Arc, Mutex};

const BIAS_RELU: &str = r#"
extern "C" __global__ void bias_relu_kernel(const scalar_t* x, const scalar_t* bias, out_t* out, long long n, long long c) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        scalar_t v = x[i] + bias[i % c];
        out[i] = v > (scalar_t)0 ? v : (scalar_t)0;
    }
}
"#;

/// relu(x + bias) with bias over the last dim of x.
fn bias_relu() -> CustomOp {
    CustomOp::new("fused_bias_relu")
        .inputs(2)
        .cuda_source(BIAS_RELU, "bias_relu_kernel")
        .launch(|inputs| LaunchSpec::elementwise(inputs[0].numel()).arg_i64(inputs[1].numel() as i64))
        .output_like(0)
        .check(|inputs| {
            let (x, b) = (inputs[0].shape(), inputs[1].shape());
            match x.last() {
                Some(&c) if b == [c] => Ok(()),
                _ => Err(format!("bias of shape {b:?} for input of shape {x:?}: the bias has the input's last dim")),
            }
        })
        .cpu(|inputs, out| {
            let (x, b) = (&inputs[0], &inputs[1]);
            for (i, o) in out.iter_mut().enumerate() {
                *o = (x[i] + b[i % b.len()]).max(0.0);
            }
            Ok(())
        })
        .backward(|ctx, grad| {
            let gx = grad.mul(&ctx.output().gt_scalar(0.0)?.to_dtype(grad.dtype())?)?;
            let c = ctx.input(1).numel() as i64;
            let gb = gx.reshape(&[-1, c])?.sum(&[0], false)?;
            Ok(vec![Some(gx), Some(gb)])
        })
        .inplace_safe()
        .build()
        .unwrap()
}

fn reference(x: &Tensor, b: &Tensor) -> Result<Tensor> {
    (x + b)?.relu()
}

fn randn(shape: &[usize], seed: u64, dtype: DType) -> Tensor {
    t(&host_rand(shape.iter().product(), seed), shape, dtype)
}

fn gpu() -> Option<Device> {
    dev().is_cuda().then(dev)
}

#[test]
fn custom_op_matches_plain_ops_on_the_test_device() -> Result<()> {
    let op = bias_relu();
    for dtype in [DType::F32, DType::F64] {
        let (x, b) = (randn(&[37, 19], 1, dtype), randn(&[19], 2, dtype));
        let y = op.call(&[&x, &b])?;
        assert_eq!((y.shape(), y.dtype(), y.device()), (x.shape(), dtype, x.device()));
        assert_close(&vals(&y), &vals(&reference(&x, &b)?), 0.0, 0.0);
        // A non-contiguous input is made contiguous first.
        let xt = randn(&[19, 37], 3, dtype).transpose(0, 1)?;
        assert_close(&vals(&op.call(&[&xt, &b])?), &vals(&reference(&xt, &b)?), 0.0, 0.0);
    }
    // Empty inputs give an empty output (an empty grid launches nothing).
    let (x, b) = (randn(&[0, 4], 1, DType::F32), randn(&[4], 2, DType::F32));
    assert_eq!(op.call(&[&x, &b])?.shape(), &[0, 4]);
    Ok(())
}

#[test]
fn cpu_function_matches_a_hand_computed_reference() -> Result<()> {
    let op = bias_relu();
    let x = Tensor::from_vec(vec![-1.0f32, 0.5, 2.0, -3.0, 1.0, 0.25], &[2, 3], &Device::Cpu)?;
    let b = Tensor::from_vec(vec![0.5f32, -1.0, 1.0], &[3], &Device::Cpu)?;
    let y = op.call(&[&x, &b])?;
    assert_eq!(y.to_vec::<f32>()?, vec![0.0, 0.0, 3.0, 0.0, 0.0, 1.25]);
    // The f64 computation is rounded once to the output dtype.
    let third = Tensor::from_vec(vec![1.0f32 / 3.0], &[1, 1], &Device::Cpu)?;
    let tiny = Tensor::from_vec(vec![1e-9f32], &[1], &Device::Cpu)?;
    assert_eq!(op.call(&[&third, &tiny])?.to_vec::<f32>()?, vec![((1.0f32 / 3.0) as f64 + 1e-9f32 as f64) as f32]);
    Ok(())
}

#[test]
fn gradcheck_through_custom_ops() -> Result<()> {
    let op = bias_relu();
    // Values away from the kink of relu, where finite differences are exact enough.
    let shift = |v: Vec<f64>| v.into_iter().map(|a| if a.abs() < 0.1 { a + 0.3 } else { a }).collect::<Vec<_>>();
    let x = t(&shift(host_rand(24, 5)), &[4, 6], DType::F64);
    let b = t(&[0.0; 6], &[6], DType::F64);
    gradcheck(|xs| op.call(&[&xs[0], &xs[1]]), &[x.clone(), b.clone()], GradcheckOptions::default())?;
    // Composed with ordinary ops on both sides, and a custom op inside another's backward.
    let scale = scaled_relu(1.5);
    gradcheck(|xs| scale.call(&[&op.call(&[&xs[0].mul_scalar(2.0)?, &xs[1]])?])?.exp()?.sum_all(), &[x, b], GradcheckOptions::default())
}

/// ScaledReLU as a custom op: its backward calls another custom op.
fn scaled_relu(alpha: f64) -> CustomOp {
    const SRC: &str = r#"
extern "C" __global__ void scaled_relu_kernel(const scalar_t* x, out_t* out, long long n, double alpha) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] > (scalar_t)0 ? (out_t)(alpha * x[i]) : (out_t)0;
}
"#;
    const GRAD: &str = r#"
extern "C" __global__ void scaled_relu_grad(const scalar_t* x, const scalar_t* g, out_t* out, long long n, double alpha) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] > (scalar_t)0 ? (out_t)(alpha * g[i]) : (out_t)0;
}
"#;
    let grad_op = CustomOp::new("scaled_relu_grad")
        .inputs(2)
        .cuda_source(GRAD, "scaled_relu_grad")
        .launch(move |inputs| LaunchSpec::elementwise(inputs[0].numel()).arg_f64(alpha))
        .cpu(move |inputs, out| {
            for (i, o) in out.iter_mut().enumerate() {
                *o = if inputs[0][i] > 0.0 { alpha * inputs[1][i] } else { 0.0 };
            }
            Ok(())
        })
        .build()
        .unwrap();
    CustomOp::new("scaled_relu")
        .inputs(1)
        .cuda_source(SRC, "scaled_relu_kernel")
        .launch(move |inputs| LaunchSpec::elementwise(inputs[0].numel()).arg_f64(alpha))
        .cpu(move |inputs, out| {
            for (o, &x) in out.iter_mut().zip(inputs[0].iter()) {
                *o = if x > 0.0 { alpha * x } else { 0.0 };
            }
            Ok(())
        })
        .backward(move |ctx, grad| Ok(vec![Some(grad_op.call(&[ctx.input(0), grad])?)]))
        .build()
        .unwrap()
}

#[test]
fn compiled_equals_eager_and_the_op_is_one_printed_node() -> Result<()> {
    let op = bias_relu();
    let (x, b) = (randn(&[64, 33], 7, DType::F32), randn(&[33], 8, DType::F32));
    let eager = op.call(&[&x.mul_scalar(2.0)?, &b])?.exp()?;
    let f = {
        let op = op.clone();
        compile(move |x: &Tensor, b: &Tensor| op.call(&[&x.mul_scalar(2.0)?, b])?.exp())
    };
    assert_close(&vals(&f.call(&x, &b)?), &vals(&eager), 1e-6, 1e-6);
    assert_close(&vals(&f.call(&x, &b)?), &vals(&eager), 1e-6, 1e-6);
    // mul, the custom op, exp: fusion stops at the custom node's edges.
    assert_eq!(f.kernels_per_call(), Some(3));

    let seen: Arc<Mutex<String>> = Arc::default();
    let s = seen.clone();
    let backend = Backend::custom(move |g: &Graph, _| {
        *s.lock().unwrap() = g.to_string();
        Ok(g.eager_runner())
    });
    let op2 = op.clone();
    let g = compile_with(CompileOptions::new().backend(backend), move |x: &Tensor, b: &Tensor| op2.call(&[x, b]));
    assert_close(&vals(&g.call(&x, &b)?), &vals(&op.call(&[&x, &b])?), 0.0, 0.0);
    let text = seen.lock().unwrap().clone();
    assert!(text.contains("= fused_bias_relu[custom](%0, %1)"), "{text}");
    Ok(())
}

#[test]
fn compiled_gradients_use_the_custom_backward() -> Result<()> {
    let op = bias_relu();
    let scale = scaled_relu(0.5);
    let body = move |x: &Tensor, b: &Tensor| scale.call(&[&op.call(&[&x.sin()?, b])?])?.mul_scalar(3.0)?.sum_all();
    let (xv, bv) = (host_rand(40, 11), host_rand(8, 12));
    let leaves = || (t(&xv, &[5, 8], DType::F32).requires_grad(), t(&bv, &[8], DType::F32).requires_grad());
    let (x, b) = leaves();
    let y = body(&x, &b)?;
    y.backward()?;
    let f = compile(body);
    for _ in 0..2 {
        let (xc, bc) = leaves();
        let yc = f.call(&xc, &bc)?;
        assert_close(&vals(&yc), &vals(&y), 1e-5, 1e-6);
        yc.backward()?;
        assert_close(&vals(&xc.grad().unwrap()), &vals(&x.grad().unwrap()), 1e-5, 1e-6);
        assert_close(&vals(&bc.grad().unwrap()), &vals(&b.grad().unwrap()), 1e-5, 1e-6);
    }
    Ok(())
}

#[test]
fn in_place_form_writes_input_zero_and_bumps_its_version() -> Result<()> {
    let op = bias_relu();
    let (x, b) = (randn(&[16, 12], 21, DType::F32), randn(&[12], 22, DType::F32));
    let want = reference(&x, &b)?;
    let v0 = x.version();
    op.call_(&[&x, &b])?;
    assert!(x.version() > v0);
    assert_close(&vals(&x), &vals(&want), 0.0, 0.0);
    // With history: the gradient flows through the in-place result.
    let leaf = randn(&[16, 12], 23, DType::F32).requires_grad();
    let h = leaf.mul_scalar(1.0)?;
    op.call_(&[&h, &b])?;
    h.sum_all()?.backward()?;
    let mask: Vec<f64> = vals(&reference(&leaf.detach(), &b)?).iter().map(|&v| if v > 0.0 { 1.0 } else { 0.0 }).collect();
    assert_close(&vals(&leaf.grad().unwrap()), &mask, 0.0, 0.0);
    // A leaf that requires grad cannot be written in place.
    let e = op.call_(&[&leaf, &b]).unwrap_err();
    assert!(matches!(e, Error::Autograd(_)), "{e}");
    // Inside a compiled function the write is functionalised.
    let op2 = op.clone();
    let f = compile(move |x: &Tensor, b: &Tensor| {
        let y = x.mul_scalar(1.0)?;
        op2.call_(&[&y, b])?;
        Ok(y)
    });
    assert_close(&vals(&f.call(&want, &b)?), &vals(&reference(&want, &b)?), 0.0, 0.0);
    Ok(())
}

fn err(r: Result<Tensor>) -> String {
    r.expect_err("an error").to_string()
}

#[test]
fn bad_inputs_are_errors_naming_the_op() -> Result<()> {
    let op = bias_relu();
    let (x, b) = (randn(&[4, 3], 1, DType::F32), randn(&[3], 2, DType::F32));
    let m = err(op.call(&[&x]));
    assert!(m.contains("fused_bias_relu") && m.contains("expected 2 input tensor(s), got 1"), "{m}");
    let m = err(op.call(&[&x, &b.to_dtype(DType::F64)?]));
    assert!(m.contains("input 1 is F64 but input 0 is F32"), "{m}");
    let m = err(op.call(&[&x.to_dtype(DType::I64)?, &b.to_dtype(DType::I64)?]));
    assert!(m.contains("dtype I64 is not supported") && m.contains("[F32, F64]"), "{m}");
    let m = err(op.call(&[&x, &randn(&[4], 3, DType::F32)]));
    assert!(m.contains("shape mismatch") && m.contains("bias of shape [4]"), "{m}");
    let m = err(op.call(&[]));
    assert!(m.contains("expected 2"), "{m}");
    // A gradient without a backward is an error, not a silent zero.
    let plain = CustomOp::new("no_grad_op").cpu(|i, o| {
        o.copy_from_slice(&i[0]);
        Ok(())
    });
    let plain = plain.cuda_source(BIAS_RELU, "bias_relu_kernel").launch(|i| LaunchSpec::elementwise(i[0].numel())).build()?;
    let m = err(plain.call(&[&x.detach().requires_grad()]));
    assert!(m.contains("no_grad_op") && m.contains("no backward"), "{m}");
    // A backward returning the wrong number or shapes of gradients.
    let bad = CustomOp::new("bad_backward")
        .cpu(|i, o| {
            o.copy_from_slice(&i[0]);
            Ok(())
        })
        .backward(|_, g| Ok(vec![Some(g.sum_all()?)]))
        .build()?;
    let xs = Tensor::ones(&[3], DType::F32, &Device::Cpu)?.requires_grad();
    let e = bad.call(&[&xs])?.sum_all()?.backward().unwrap_err().to_string();
    assert!(e.contains("bad_backward") && e.contains("shape []"), "{e}");
    if let Device::Cuda(n) = dev() {
        // Tensors on two devices; an op with no kernel for the device.
        let m = err(op.call(&[&x, &b.to_device(&Device::Cpu)?]));
        assert!(m.contains("expected all tensors on one device"), "{m}");
        let cpu_only = CustomOp::new("cpu_only").cpu(|_, _| Ok(())).build()?;
        let m = err(cpu_only.call(&[&x]));
        assert!(m.contains("no CUDA kernel") && m.contains(&format!("cuda:{n}")), "{m}");
    } else {
        let gpu_only = CustomOp::new("gpu_only").cuda_source(BIAS_RELU, "bias_relu_kernel").launch(|i| LaunchSpec::elementwise(i[0].numel())).build()?;
        let m = err(gpu_only.call(&[&x]));
        assert!(m.contains("gpu_only") && m.contains("no CPU implementation"), "{m}");
    }
    Ok(())
}

#[test]
fn incomplete_definitions_are_build_errors() {
    let m = CustomOp::new("nothing").build().unwrap_err().to_string();
    assert!(m.contains("nothing") && m.contains("give a CUDA kernel"), "{m}");
    let m = CustomOp::new("no_launch").cuda_source(BIAS_RELU, "bias_relu_kernel").build().unwrap_err().to_string();
    assert!(m.contains("needs a launch spec"), "{m}");
    let m = CustomOp::new("k").cpu(|_, _| Ok(())).inputs(1).output_like(1).build().unwrap_err().to_string();
    assert!(m.contains("output_like(1)"), "{m}");
    let m = CustomOp::new("bad name").cpu(|_, _| Ok(())).build().unwrap_err().to_string();
    assert!(m.contains("without spaces"), "{m}");
}

#[test]
fn explicit_output_rule_and_profiler_name() -> Result<()> {
    // Row sums: an output of another shape and dtype.
    const SRC: &str = r#"
extern "C" __global__ void row_sum(const scalar_t* x, out_t* out, long long rows, long long cols) {
    long long r = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    out_t acc = 0;
    for (long long j = 0; j < cols; j++) acc += (out_t)x[r * cols + j];
    out[r] = acc;
}
"#;
    let op = CustomOp::new("row_sum")
        .inputs(1)
        .dtypes(&[DType::F32, DType::I32])
        .cuda_source(SRC, "row_sum")
        .launch(|i| LaunchSpec::elementwise(i[0].shape()[0]).arg_i64(i[0].shape()[1] as i64))
        .output(|i| Ok((vec![i[0].shape()[0]], DType::F64)))
        .cpu(|i, out| {
            let cols = i[0].shape()[1];
            for (r, o) in out.iter_mut().enumerate() {
                *o = i[0][r * cols..(r + 1) * cols].iter().sum();
            }
            Ok(())
        })
        .build()?;
    let x = randn(&[10, 7], 31, DType::F32);
    let (y, prof) = kiln::profiler::profile_value(|| op.call(&[&x]))?;
    assert_eq!(y.dtype(), DType::F64);
    assert_close(&vals(&y), &vals(&x.to_dtype(DType::F64)?.sum(&[1], false)?), 1e-12, 1e-12);
    let xi = x.mul_scalar(10.0)?.to_dtype(DType::I32)?;
    assert_close(&vals(&op.call(&[&xi])?), &vals(&xi.to_dtype(DType::F64)?.sum(&[1], false)?), 0.0, 0.0);
    assert!(prof.kernel_names().contains(&"row_sum"), "{:?}", prof.kernel_names());
    Ok(())
}

#[test]
fn cuda_kernels_are_compiled_checked_and_counted() -> Result<()> {
    let Some(d) = gpu() else { return Ok(()) };
    let (x, b) = (randn(&[300, 5], 41, DType::F32), randn(&[5], 42, DType::F32));
    let op = bias_relu();
    op.call(&[&x, &b])?;
    let before = kiln::cuda::launch_count();
    op.call(&[&x, &b])?;
    assert_eq!(kiln::cuda::launch_count() - before, 1, "one launch per call");
    // In place on the GPU: the kernel runs over the input, nothing else.
    let y = x.copy_contiguous()?;
    let before = kiln::cuda::launch_count();
    op.call_(&[&y, &b])?;
    assert_eq!(kiln::cuda::launch_count() - before, 1);
    assert_close(&vals(&y), &vals(&reference(&x, &b)?), 0.0, 0.0);

    // A syntax error: the error quotes the offending line with its number.
    let broken = "extern \"C\" __global__ void k(const scalar_t* x, out_t* out, long long n) {\n    long long i = threadIdx.x;\n    if (i < n) out[i] = no_such_function(x[i]);\n}\n";
    let op = CustomOp::new("broken").cuda_source(broken, "k").launch(|i| LaunchSpec::elementwise(i[0].numel())).build()?;
    let m = err(op.call(&[&x]));
    assert!(m.contains("line 3:") && m.contains("out[i] = no_such_function(x[i]);") && m.contains(&d.to_string()), "{m}");
    // A name the source does not define.
    let op = CustomOp::new("misnamed").cuda_source(BIAS_RELU, "bias_relu").launch(|i| LaunchSpec::elementwise(i[0].numel())).build()?;
    let m = err(op.call(&[&x, &b]));
    assert!(m.contains("no kernel named `bias_relu`") && m.contains("extern \"C\""), "{m}");
    // Too few launch arguments for the kernel's parameters (the `c` of bias_relu_kernel).
    let op = CustomOp::new("short").cuda_source(BIAS_RELU, "bias_relu_kernel").launch(|i| LaunchSpec::elementwise(i[0].numel())).build()?;
    let m = err(op.call(&[&x, &b]));
    assert!(m.contains("has 5 parameters") && m.contains("passes 4"), "{m}");
    // A block of more than 1024 threads.
    let op = CustomOp::new("wide").cuda_source(BIAS_RELU, "bias_relu_kernel").launch(|_| LaunchSpec::new((1, 1, 1), (2048, 1, 1))).build()?;
    let m = err(op.call(&[&x, &b]));
    assert!(m.contains("1 to 1024 threads"), "{m}");
    Ok(())
}
