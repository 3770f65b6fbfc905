//! The API guide's custom GPU kernel: relu(x + bias) as one CUDA C kernel compiled at run time,
//! with a CPU function and a gradient, out of place and in place, compared with the same
//! computation in plain kiln ops. On a GPU it also times it against `(x + b).relu()` eager and
//! compiled on 1e8 elements (median of 30 event-timed calls after 5 warm-ups).
//!
//!     cargo run --release --example fused_bias_relu
//!
//! Departs from the guide's text in one place: the kernel needs the bias length, so the launch
//! spec passes it after `n` (`.arg_i64(..)`); the kernel's signature says so.

use kiln::compile::compile;
use kiln::cuda::Event;
use kiln::prelude::*;

/// Grid-stride loop; 32-bit index arithmetic when the sizes allow (64-bit `%` is slow).
const FUSED_BIAS_RELU_CU: &str = r#"
extern "C" __global__ void bias_relu_kernel(const scalar_t* x, const scalar_t* bias, out_t* out, long long n, long long c) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        long long j = n <= 0xffffffffLL ? (long long)((unsigned)i % (unsigned)c) : i % c;
        scalar_t v = x[i] + bias[j];
        out[i] = v > (scalar_t)0 ? v : (scalar_t)0;
    }
}
"#;

fn fused_bias_relu() -> Result<CustomOp> {
    CustomOp::new("fused_bias_relu")
        .inputs(2)
        .cuda_source(FUSED_BIAS_RELU_CU, "bias_relu_kernel")
        .launch(|inputs| LaunchSpec::elementwise(inputs[0].numel()).arg_i64(inputs[1].numel() as i64))
        .output_like(0)
        .check(|inputs| match inputs[0].shape().last() {
            Some(&c) if inputs[1].shape() == [c] => Ok(()),
            _ => Err(format!("bias {:?} for input {:?}: the bias has the input's last dim", inputs[1].shape(), inputs[0].shape())),
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
            let gb = gx.reshape(&[-1, ctx.input(1).numel() as i64])?.sum(&[0], false)?;
            Ok(vec![Some(gx), Some(gb)])
        })
        .inplace_safe()
        .build()
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    a.sub(b)?.abs()?.max_all()?.to_dtype(DType::F64)?.item::<f64>()
}
fn main() -> Result<()> {
    let dev = Device::cuda_if_available(0);
    let op = fused_bias_relu()?;

    let x = Tensor::randn(&[1000, 256], DType::F32, &dev)?.requires_grad();
    let bias = Tensor::randn(&[256], DType::F32, &dev)?.requires_grad();
    let y = op.call(&[&x, &bias])?;
    let plain = (&x + &bias)?.relu()?;
    println!("fused_bias_relu on {dev}: max |fused - plain| = {:e}", max_diff(&y, &plain)?);

    y.sum_all()?.backward()?;
    let (gx, gb) = (x.grad().expect("x has a gradient"), bias.grad().expect("bias has a gradient"));
    let (xp, bp) = (x.detach().requires_grad(), bias.detach().requires_grad());
    (&xp + &bp)?.relu()?.sum_all()?.backward()?;
    println!("  gradients: max diff x {:e}, bias {:e}", max_diff(&gx, &xp.grad().unwrap())?, max_diff(&gb, &bp.grad().unwrap())?);

    let z = x.detach().copy_contiguous()?;
    no_grad(|| op.call_(&[&z, &bias.detach()]))?;
    println!("  in place: max |fused_ - plain| = {:e}", max_diff(&z, &plain)?);

    if !dev.is_cuda() {
        println!("(no GPU: timings skipped)");
        return Ok(());
    }
    let (rows, cols) = (390_625, 256); // 1e8 elements
    let x = Tensor::randn(&[rows, cols], DType::F32, &dev)?;
    let b = Tensor::randn(&[cols], DType::F32, &dev)?;
    let compiled = compile(|x: &Tensor, b: &Tensor| (x + b)?.relu());
    let inplace = x.copy_contiguous()?;
    let rows_ms: [(&str, f64); 4] = [
        ("fused_bias_relu", event_ms(&dev, &mut || op.call(&[&x, &b]).map(drop))?),
        ("fused_bias_relu in place", event_ms(&dev, &mut || op.call_(&[&inplace, &b]))?),
        ("(x + b).relu() eager", event_ms(&dev, &mut || (&x + &b)?.relu().map(drop))?),
        ("(x + b).relu() compiled", event_ms(&dev, &mut || compiled.call(&x, &b).map(drop))?),
    ];
    println!("1e8 f32 elements on {} (median of 30 after 5 warm-ups):", kiln::cuda::device_name(&dev)?);
    for (name, ms) in rows_ms {
        // Bytes moved: read x, write the output (the bias stays in cache).
        let gbs = 2.0 * 4e8 / (ms * 1e-3) / 1e9;
        println!("  {name:<26} {ms:8.3} ms  {gbs:7.0} GB/s");
    }
    Ok(())
}

/// Median device time of 30 event-timed calls after 5 warm-ups (the shared bench's rule).
fn event_ms<T>(dev: &Device, f: &mut dyn FnMut() -> Result<T>) -> Result<f64> {
    Event::median_ms(dev, 5, 30, f)
}
