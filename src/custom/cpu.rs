//! The CPU side of custom ops: the user's function over f64 host values.

use crate::backend::cpu::{self, CpuStorage};
use crate::layout::Layout;
use crate::storage::Storage;
use crate::{DType, Result, Tensor};
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

/// Contiguous row-major values of one tensor on the host, as f64, with its shape. Reads and
/// writes go through the slice it dereferences to.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    data: cpu::HostBuf<f64>,
    shape: Vec<usize>,
}

impl HostTensor {
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
}

impl Deref for HostTensor {
    type Target = [f64];
    fn deref(&self) -> &[f64] {
        &self.data
    }
}

impl DerefMut for HostTensor {
    fn deref_mut(&mut self) -> &mut [f64] {
        &mut self.data
    }
}

/// Runs `f` on CPU `inputs` and returns its output of `shape`, rounded to `dtype`.
pub(super) fn run(name: &str, f: &super::CpuFn, inputs: &[&Tensor], shape: &[usize], dtype: DType) -> Result<Tensor> {
    let _rec = crate::profiler::record::cpu_kernel(name);
    let hosts: Vec<HostTensor> = inputs.iter().map(|t| HostTensor { data: cpu::to_vec_as::<f64>(t), shape: t.shape().to_vec() }).collect();
    let mut out = HostTensor { data: vec![0.0; shape.iter().product()].into(), shape: shape.to_vec() };
    f(&hosts, &mut out)?;
    let storage = CpuStorage::from_vec_as(out.data, dtype);
    Ok(Tensor::from_parts(Arc::new(Storage::cpu(storage)), Layout::contiguous(shape), dtype, false))
}
