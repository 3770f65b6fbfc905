//! The "Tensors on a device" and "Autograd" examples of the API guide, as written there.
//!
//!     cargo run --release --example api_tour

use kiln::prelude::*;

/// A stand-in for `nn` modules (they come with the models issue): anything with `forward`.
struct Model {
    w: Tensor,
}
impl Model {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        x.matmul(&self.w)?.relu()
    }
}

// A custom differentiable function (ScaledReLU):
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

fn main() -> Result<()> {
    // ## Tensors on a device
    let dev = Device::cuda_if_available(0); // Device::Cpu, Device::Cuda(0)
    let a = Tensor::randn(&[1_000_000], DType::F32, &dev)?;
    let b = Tensor::randn(&[1_000_000], DType::F32, &dev)?;
    let c = (&a + &b)?.relu()?; // eager: two kernels
    let c2 = a.add(&b)?.relu()?; // same thing, method form
    let host: Vec<f32> = c.to_vec()?; // explicit host read (synchronises)
    let x = Tensor::from_vec(vec![1.0f32, 2.0, 3.0], &[3], &Device::Cpu)?.to_device(&dev)?;
    let y = x.to_dtype(DType::BF16)?; // F32, F64, F16, BF16, I64, I32, U8, Bool
    let v = x.reshape(&[3, 1])?.expand(&[3, 4])?.transpose(0, 1)?; // views, no copy
    assert!(c.allclose(&c2, 0.0, 0.0)? && host.iter().all(|&h| h >= 0.0));
    assert!(v.shares_storage_with(&x));
    println!("y = {y}\nv = {v}");

    // ## Autograd
    let x = Tensor::randn(&[32, 784], DType::F32, &dev)?;
    let w = Tensor::randn(&[784, 256], DType::F32, &dev)?.requires_grad();
    let loss = x.matmul(&w)?.relu()?.sum_all()?;
    loss.backward()?;
    let g: Tensor = w.grad().expect("w has a gradient");
    let model = Model { w: w.clone() };
    let y = no_grad(|| model.forward(&x))?; // inference: no tape, no saved tensors
    assert!(!y.is_requires_grad());
    println!("|dL/dw| = {}", g.abs()?.sum_all()?);

    let x = Tensor::randn(&[5], DType::F32, &dev)?.requires_grad();
    let y = ScaledRelu { alpha: 2.0 }.apply(&[&x])?;
    y.sum_all()?.backward()?;
    println!("ScaledRelu: x = {x}\n  y = {y}\n  dy/dx = {}", x.grad().expect("x has a gradient"));
    Ok(())
}
