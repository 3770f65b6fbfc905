//! Row ops (softmax, log_softmax, layer norm over the last dim) in one kernel when eager: their
//! decomposition is traced once per shape and run as the compiler's row kernel, so the eager
//! and the compiled forms come from one generator (`backend::cuda::kernels::fused`).

use crate::compile::runtime::Program;
use crate::{DType, Device, Result, Tensor};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// The row ops with a one-kernel eager form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum RowKind {
    Softmax,
    LogSoftmax,
    LayerNorm,
}

impl RowKind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            RowKind::Softmax => "softmax",
            RowKind::LogSoftmax => "log_softmax",
            RowKind::LayerNorm => "layer_norm",
        }
    }
}

/// What a row op's program depends on.
#[derive(Clone, PartialEq, Eq, Hash)]
struct Key {
    kind: RowKind,
    shape: Vec<usize>,
    dtype: DType,
    device: Device,
    weight: bool,
    bias: bool,
    eps: u64,
}

/// Programs kept at most: a model has a few row shapes; a sweep over many starts over.
const MAX_PROGRAMS: usize = 256;

/// `kind` over the last dim of `x` (with `w` and `b` for layer norm) as one kernel (on the CPU,
/// the interpreter of fused kernels), when nothing needs its history (inference, `no_grad`);
/// else None, and the caller runs `decompose`, which remains the op's definition (what
/// autograd and the compiler see).
pub(crate) fn fused(x: &Tensor, dim: i64, kind: RowKind, w: Option<&Tensor>, b: Option<&Tensor>, eps: f64, decompose: impl Fn(&[Tensor]) -> Result<Tensor>) -> Result<Option<Tensor>> {
    let tracked = crate::is_grad_enabled() && [Some(x), w, b].iter().flatten().any(|t| t.is_requires_grad());
    // F64 keeps its own precision through the decomposition; the kernel's statistics are f32.
    if tracked || crate::compile::trace::active() || x.ndim() == 0 || x.dtype() == DType::F64 {
        return Ok(None);
    }
    if crate::layout::norm_dim(kind.name(), dim, x.ndim())? != x.ndim() - 1 {
        return Ok(None);
    }
    let k = x.shape()[x.ndim() - 1];
    if k == 0 || k > crate::kir::MAX_LOOPED_ROW || [w, b].iter().flatten().any(|p| p.dtype() != x.dtype() || p.device() != x.device()) {
        return Ok(None);
    }
    let args: Vec<Tensor> = [Some(x), w, b].into_iter().flatten().map(|t| t.contiguous()).collect::<Result<_>>()?;
    let key = Key { kind, shape: x.shape().to_vec(), dtype: x.dtype(), device: x.device(), weight: w.is_some(), bias: b.is_some(), eps: eps.to_bits() };
    static PROGRAMS: OnceLock<Mutex<HashMap<Key, Arc<Program>>>> = OnceLock::new();
    let programs = PROGRAMS.get_or_init(Default::default);
    let found = programs.lock().get(&key).cloned();
    let program = match found {
        Some(p) => p,
        None => {
            let p = Arc::new(crate::compile::program_of(&args, &mut |xs| Ok(vec![decompose(xs)?]))?);
            let mut all = programs.lock();
            if all.len() >= MAX_PROGRAMS {
                all.clear();
            }
            all.insert(key, p.clone());
            p
        }
    };
    Ok(program.run(&args)?.pop())
}

#[cfg(test)]
mod tests {
    use crate::nn::functional as F;
    use crate::{DType, Device, Result, Tensor};

    /// The program an eager row op runs (built on the CPU here; the schedule does not depend on
    /// the device) is one kernel and computes what the decomposition computes.
    #[test]
    fn a_row_program_is_one_kernel_of_its_decomposition() -> Result<()> {
        let cpu = Device::Cpu;
        let x = Tensor::randn(&[6, 40], DType::F32, &cpu)?;
        let (w, b) = (Tensor::randn(&[40], DType::F32, &cpu)?, Tensor::randn(&[40], DType::F32, &cpu)?);
        type Decompose = fn(&[Tensor]) -> Result<Tensor>;
        let cases: [(Vec<Tensor>, Decompose); 4] = [
            (vec![x.clone()], |xs| F::softmax(&xs[0], -1)),
            (vec![x.clone()], |xs| F::log_softmax(&xs[0], -1)),
            (vec![x.clone(), w.clone(), b.clone()], |xs| F::layer_norm(&xs[0], &[40], Some(&xs[1]), Some(&xs[2]), 1e-5)),
            (vec![x.clone()], |xs| F::layer_norm(&xs[0], &[40], None, None, 1e-5)),
        ];
        for (args, decompose) in cases {
            let program = crate::compile::program_of(&args, &mut |xs| Ok(vec![decompose(xs)?]))?;
            assert_eq!(program.kernel_count(), 1, "{}", program.graph);
            let got = program.run(&args)?.pop().unwrap().to_vec::<f32>()?;
            let want = decompose(&args)?.to_vec::<f32>()?;
            assert!(got.iter().zip(&want).all(|(a, b)| (a - b).abs() <= 1e-5 + 1.3e-6 * b.abs()), "{got:?} vs {want:?}");
        }
        Ok(())
    }
}
