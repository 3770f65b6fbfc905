//! Finite-difference gradient checking in f64 (`torch.autograd.gradcheck`).

use super::{no_grad, BackwardOptions};
use crate::{DType, Error, Result, Tensor};

#[derive(Clone, Copy, Debug)]
pub struct GradcheckOptions {
    /// Perturbation for central differences.
    pub eps: f64,
    pub atol: f64,
    pub rtol: f64,
}

impl Default for GradcheckOptions {
    /// PyTorch's defaults.
    fn default() -> Self {
        GradcheckOptions { eps: 1e-6, atol: 1e-5, rtol: 1e-3 }
    }
}

/// Compares the Jacobian from backward with central finite differences, in f64, for every
/// floating-point input of `f`. Inputs are copied to contiguous f64 leaves first; other inputs
/// (indices, masks) are passed as they are. Returns an error naming the first mismatch.
pub fn gradcheck(f: impl Fn(&[Tensor]) -> Result<Tensor>, inputs: &[Tensor], opts: GradcheckOptions) -> Result<()> {
    let xs: Vec<Tensor> = inputs
        .iter()
        // Fresh leaves, also for inputs that already require grad (detached from their history).
        .map(|t| if t.dtype().is_float() { Ok(t.detach().to_dtype(DType::F64)?.copy_contiguous()?.requires_grad()) } else { Ok(t.clone()) })
        .collect::<Result<_>>()?;
    let out = f(&xs)?;
    if out.dtype() != DType::F64 {
        return Err(Error::Autograd(format!("gradcheck: the function returned {:?} for f64 inputs", out.dtype())));
    }
    let n_out = out.numel();
    // analytic[i][j][k] = d out_j / d x_i[k], one backward per output element.
    let mut analytic: Vec<Vec<Vec<f64>>> = xs.iter().map(|x| vec![vec![0.0; x.numel()]; n_out]).collect();
    if out.is_requires_grad() {
        for j in 0..n_out {
            let mut onehot = vec![0.0f64; n_out];
            onehot[j] = 1.0;
            for x in &xs {
                x.clear_grad();
            }
            out.backward_with(BackwardOptions {
                gradient: Some(Tensor::from_vec(onehot, out.shape(), &out.device())?),
                retain_graph: true,
            })?;
            for (i, x) in xs.iter().enumerate() {
                if let Some(g) = x.grad() {
                    analytic[i][j] = g.to_vec::<f64>()?;
                }
            }
        }
    }
    for (i, x) in xs.iter().enumerate() {
        if !x.dtype().is_float() {
            continue;
        }
        let base = x.to_vec::<f64>()?;
        for k in 0..base.len() {
            let eval = |delta: f64| -> Result<Vec<f64>> {
                let mut v = base.clone();
                v[k] += delta;
                let mut args = xs.clone();
                args[i] = Tensor::from_vec(v, x.shape(), &x.device())?;
                no_grad(|| f(&args))?.to_vec::<f64>()
            };
            let (plus, minus) = (eval(opts.eps)?, eval(-opts.eps)?);
            for j in 0..n_out {
                let numeric = (plus[j] - minus[j]) / (2.0 * opts.eps);
                let a = analytic[i][j][k];
                // Written so that a NaN on either side fails.
                let close = (a - numeric).abs() <= opts.atol + opts.rtol * numeric.abs();
                if !close {
                    return Err(Error::Autograd(format!(
                        "gradcheck: Jacobian mismatch for output {j} with respect to input {i} element {k}: \
                         analytic {a:.10}, numeric {numeric:.10}"
                    )));
                }
            }
        }
    }
    Ok(())
}
