//! ScaledReLU two ways: the API guide's autograd `Function` (forward and backward written with
//! kiln ops) and a `CustomOp` (a CUDA C kernel with `alpha` as a launch argument, a CPU function,
//! and a backward that calls another custom op), each compared with plain kiln ops, values and
//! gradients, eager and compiled.
//!
//!     cargo run --release --example scaled_relu

use kiln::compile::compile;
use kiln::prelude::*;

struct ScaledRelu {
    alpha: f64,
}
impl Function for ScaledRelu {
    fn forward(&self, ctx: &mut Ctx, xs: &[&Tensor]) -> Result<Tensor> {
        ctx.save_for_backward(&[xs[0]]);
        xs[0].relu()?.mul_scalar(self.alpha)
    }
    fn backward(&self, ctx: &Ctx, grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let x = &ctx.saved()[0];
        Ok(vec![Some(grad.mul(&x.gt_scalar(0.0)?.to_dtype(grad.dtype())?)?.mul_scalar(self.alpha)?)])
    }
}

/// Forward and gradient kernels in one source (each is compiled under its own name).
const SCALED_RELU_CU: &str = r#"
extern "C" __global__ void scaled_relu_fwd(const scalar_t* x, out_t* out, long long n, double alpha) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] > (scalar_t)0 ? (out_t)(alpha * x[i]) : (out_t)0;
}
extern "C" __global__ void scaled_relu_bwd(const scalar_t* x, const scalar_t* g, out_t* out, long long n, double alpha) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] > (scalar_t)0 ? (out_t)(alpha * g[i]) : (out_t)0;
}
"#;

/// d(input) of ScaledReLU from (x, d(output)): a custom op used inside the other's backward.
fn scaled_relu_grad(alpha: f64) -> Result<CustomOp> {
    CustomOp::new("scaled_relu_grad")
        .inputs(2)
        .cuda_source(SCALED_RELU_CU, "scaled_relu_bwd")
        .launch(move |inputs| LaunchSpec::elementwise(inputs[0].numel()).arg_f64(alpha))
        .check(|inputs| if inputs[0].shape() == inputs[1].shape() { Ok(()) } else { Err(format!("{:?} and {:?} differ", inputs[0].shape(), inputs[1].shape())) })
        .cpu(move |inputs, out| {
            for (i, o) in out.iter_mut().enumerate() {
                *o = if inputs[0][i] > 0.0 { alpha * inputs[1][i] } else { 0.0 };
            }
            Ok(())
        })
        .build()
}

fn scaled_relu_op(alpha: f64) -> Result<CustomOp> {
    let grad_op = scaled_relu_grad(alpha)?;
    CustomOp::new("scaled_relu")
        .inputs(1)
        .cuda_source(SCALED_RELU_CU, "scaled_relu_fwd")
        .launch(move |inputs| LaunchSpec::elementwise(inputs[0].numel()).arg_f64(alpha))
        .cpu(move |inputs, out| {
            for (o, &x) in out.iter_mut().zip(inputs[0].iter()) {
                *o = if x > 0.0 { alpha * x } else { 0.0 };
            }
            Ok(())
        })
        .backward(move |ctx, grad| Ok(vec![Some(grad_op.call(&[ctx.input(0), grad])?)]))
        .build()
}

fn max_diff(a: &Tensor, b: &Tensor) -> Result<f64> {
    a.sub(b)?.abs()?.max_all()?.to_dtype(DType::F64)?.item::<f64>()
}

fn main() -> Result<()> {
    let dev = Device::cuda_if_available(0);
    let alpha = 2.0;
    let x = Tensor::randn(&[4096], DType::F32, &dev)?.requires_grad();
    let plain_y = x.relu()?.mul_scalar(alpha)?;
    plain_y.sum_all()?.backward()?;
    let plain_g = x.grad().expect("x has a gradient");
    let x = x.detach().requires_grad();

    let y = ScaledRelu { alpha }.apply(&[&x])?;
    y.sum_all()?.backward()?;
    println!("Function on {dev}:  max diff y {:e}, dy/dx {:e}", max_diff(&y, &plain_y)?, max_diff(&x.grad().unwrap(), &plain_g)?);

    let op = scaled_relu_op(alpha)?;
    let x = x.detach().requires_grad();
    let y = op.call(&[&x])?;
    y.sum_all()?.backward()?;
    println!("CustomOp on {dev}: max diff y {:e}, dy/dx {:e}", max_diff(&y, &plain_y)?, max_diff(&x.grad().unwrap(), &plain_g)?);

    let f = compile(move |x: &Tensor| op.call(&[&x.mul_scalar(1.0)?])?.sum_all());
    let x = x.detach().requires_grad();
    let s = f.call(&x)?;
    s.backward()?;
    println!(
        "compiled CustomOp:  |sum - plain sum| {:e}, dy/dx {:e}",
        max_diff(&s, &plain_y.sum_all()?)?,
        max_diff(&x.grad().unwrap(), &plain_g)?
    );
    Ok(())
}
