//! A built-in classification task that needs no download: inputs standard normal, the class
//! the argmax of a fixed random linear map. The map depends only on the sizes, so sets with
//! different seeds are different samples of the same task (a training and a held-out set);
//! every sample is a pure function of (seed, index).

use super::Dataset;
use crate::tensor::random::philox;
use crate::{DType, Device, Error, Result, Tensor};

pub struct SyntheticClassification {
    n: usize,
    features: usize,
    classes: usize,
    seed: u64,
    /// [features, classes], row-major.
    projection: Vec<f32>,
}

impl SyntheticClassification {
    pub fn new(n: usize, features: usize, classes: usize, seed: u64) -> Result<Self> {
        if features == 0 || classes < 2 {
            return Err(Error::arg("SyntheticClassification", format!("needs features > 0 and classes >= 2, got {features} and {classes}")));
        }
        let task = 0x7A5C_0000_0000 ^ ((features as u64) << 16) ^ classes as u64;
        let projection = (0..features * classes).map(|i| normal(task, i as u64) as f32).collect();
        Ok(SyntheticClassification { n, features, classes, seed, projection })
    }
    /// 784 features and 10 classes, like MNIST.
    pub fn mnist_like(n: usize, seed: u64) -> Result<Self> {
        Self::new(n, 784, 10, seed)
    }
}

/// A standard normal draw for counter `ctr` (Box–Muller on one Philox block).
fn normal(key: u64, ctr: u64) -> f64 {
    let w = philox(key, ctr);
    let u1 = 1.0 - ((((w[0] as u64) << 32) | w[1] as u64) >> 11) as f64 / (1u64 << 53) as f64;
    let u2 = ((((w[2] as u64) << 32) | w[3] as u64) >> 11) as f64 / (1u64 << 53) as f64;
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

impl Dataset for SyntheticClassification {
    fn len(&self) -> usize {
        self.n
    }
    fn get(&self, index: usize) -> Result<(Tensor, Tensor)> {
        if index >= self.n {
            return Err(Error::Index { op: "SyntheticClassification::get", index: index as i64, size: self.n });
        }
        let base = (index * self.features) as u64;
        let x: Vec<f32> = (0..self.features).map(|j| normal(self.seed, base + j as u64) as f32).collect();
        let label = (0..self.classes)
            .map(|c| (0..self.features).map(|j| x[j] * self.projection[j * self.classes + c]).sum::<f32>())
            .enumerate()
            .fold((0, f32::NEG_INFINITY), |best, (c, v)| if v > best.1 { (c, v) } else { best })
            .0;
        Ok((Tensor::from_vec(x, &[self.features], &Device::Cpu)?, Tensor::scalar(label as f64, DType::I64, &Device::Cpu)?))
    }
}
