//! PyTorch's initialisations (`torch.nn.init`), drawn from the global generator so that
//! `manual_seed` fixes them. Each returns a fresh F32 tensor; layers mark it as a parameter.

use crate::{DType, Device, Error, Result, Tensor};

/// (fan_in, fan_out) of a weight shaped `[out, in, k...]`, as `_calculate_fan_in_and_fan_out`.
pub fn fans(op: &'static str, shape: &[usize]) -> Result<(usize, usize)> {
    if shape.len() < 2 {
        return Err(Error::shape(op, format!("fan in and fan out need at least 2 dims, got {shape:?}")));
    }
    let receptive: usize = shape[2..].iter().product();
    Ok((shape[1] * receptive, shape[0] * receptive))
}

/// Uniform in [-bound, bound).
pub fn uniform(shape: &[usize], bound: f64, dev: &Device) -> Result<Tensor> {
    Tensor::rand(shape, DType::F32, dev)?.mul_scalar(2.0 * bound)?.sub_scalar(bound)
}

/// Normal with mean 0 and standard deviation `std`.
pub fn normal(shape: &[usize], std: f64, dev: &Device) -> Result<Tensor> {
    Tensor::randn(shape, DType::F32, dev)?.mul_scalar(std)
}

/// `kaiming_uniform_(w, a)` with fan_in: bound = sqrt(6 / ((1 + a²) fan_in)). With a = sqrt(5)
/// (Linear's and Conv's default) the bound is 1/sqrt(fan_in).
pub fn kaiming_uniform(shape: &[usize], a: f64, dev: &Device) -> Result<Tensor> {
    let (fan_in, _) = fans("kaiming_uniform", shape)?;
    let gain = (2.0 / (1.0 + a * a)).sqrt();
    uniform(shape, gain * (3.0 / fan_in.max(1) as f64).sqrt(), dev)
}

/// `kaiming_normal_(w, mode='fan_out', nonlinearity='relu')` (torchvision's ResNet convs):
/// std = sqrt(2 / fan_out).
pub fn kaiming_normal_fan_out(shape: &[usize], dev: &Device) -> Result<Tensor> {
    let (_, fan_out) = fans("kaiming_normal", shape)?;
    normal(shape, (2.0 / fan_out.max(1) as f64).sqrt(), dev)
}

/// `xavier_uniform_(w)`: bound = sqrt(6 / (fan_in + fan_out)).
pub fn xavier_uniform(shape: &[usize], dev: &Device) -> Result<Tensor> {
    let (fan_in, fan_out) = fans("xavier_uniform", shape)?;
    uniform(shape, (6.0 / (fan_in + fan_out).max(1) as f64).sqrt(), dev)
}

/// The bias of a Linear or Conv layer: uniform in ±1/sqrt(fan_in) of its weight.
pub fn bias_uniform(weight_shape: &[usize], dev: &Device) -> Result<Tensor> {
    let (fan_in, _) = fans("bias_uniform", weight_shape)?;
    let bound = if fan_in > 0 { 1.0 / (fan_in as f64).sqrt() } else { 0.0 };
    uniform(&[weight_shape[0]], bound, dev)
}
