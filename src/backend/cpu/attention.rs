//! Scaled dot-product attention on the host, in f64: the reference the CUDA kernels are tested
//! against. Layouts as `Op::Attention`: q `[L, B, H, D]`, k and v `[S, B, H, D]`, the additive
//! mask `[B, H, L, S]` (any strides), the output `[L, B, H, D]`.

use super::{to_vec_as, CpuStorage, HostBuf};
use crate::ops::AttnDims;
use crate::Tensor;
use rayon::prelude::*;

struct Inputs {
    q: HostBuf<f64>,
    k: HostBuf<f64>,
    v: HostBuf<f64>,
    mask: Option<HostBuf<f64>>,
    n: AttnDims,
    scale: f64,
    causal: bool,
}

impl Inputs {
    fn new(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool) -> Inputs {
        Inputs { q: to_vec_as(q), k: to_vec_as(k), v: to_vec_as(v), mask: mask.map(to_vec_as), n: AttnDims::of(q.shape(), k.shape()), scale, causal }
    }

    /// Scores of row `l` of head (b, h): scale q k^T + mask, -inf above the diagonal when causal.
    fn scores(&self, b: usize, h: usize, l: usize) -> Vec<f64> {
        let AttnDims { l: nl, s: ns, b: nb, h: nh, d } = self.n;
        let qrow = &self.q[((l * nb + b) * nh + h) * d..][..d];
        (0..ns)
            .map(|s| {
                if self.causal && s > l {
                    return f64::NEG_INFINITY;
                }
                let krow = &self.k[((s * nb + b) * nh + h) * d..][..d];
                let dot: f64 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>() * self.scale;
                dot + self.mask.as_ref().map_or(0.0, |m| m[((b * nh + h) * nl + l) * ns + s])
            })
            .collect()
    }

    /// Softmax of the scores of row `l` of head (b, h), and their log-sum-exp. NaN
    /// probabilities (and -inf) when every key is masked, as the composite softmax gives.
    fn probs(&self, b: usize, h: usize, l: usize) -> (Vec<f64>, f64) {
        let mut p = self.scores(b, h, l);
        let m = p.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        for x in p.iter_mut() {
            *x = (*x - m).exp();
        }
        let den: f64 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= den);
        (p, m + den.ln())
    }
}

/// The attention output, in q's dtype.
pub(crate) fn attention(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool) -> CpuStorage {
    let x = Inputs::new(q, k, v, mask, scale, causal);
    let AttnDims { l: nl, b: nb, h: nh, d, .. } = x.n;
    let mut out = vec![0f64; nl * nb * nh * d];
    out.par_chunks_mut(d.max(1)).enumerate().for_each(|(r, o)| {
        let (h, b, l) = (r % nh, (r / nh) % nb, r / (nh * nb));
        for (s, p) in x.probs(b, h, l).0.into_iter().enumerate() {
            let vrow = &x.v[((s * nb + b) * nh + h) * d..][..d];
            for (o, vv) in o.iter_mut().zip(vrow) {
                *o += p * vv;
            }
        }
    });
    CpuStorage::from_vec_as(out, q.dtype())
}

/// The gradients of q, k and v from the output gradient `g` (`[L, B, H, D]`), packed as one
/// vector `[dq | dk | dv | lse | delta]` (see `Op::AttentionBackward`).
pub(crate) fn attention_backward(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, mask: Option<&Tensor>, scale: f64, causal: bool) -> CpuStorage {
    let x = Inputs::new(q, k, v, mask, scale, causal);
    let g: HostBuf<f64> = to_vec_as(g);
    let n = x.n;
    let AttnDims { l: nl, s: ns, b: nb, h: nh, d } = n;
    // Where row t of head (b, h) starts in a [T, B, H, D] tensor.
    let at = |t: usize, b: usize, h: usize| ((t * nb + b) * nh + h) * d;
    // Per head: (dq rows, dk rows, dv rows, lse, delta), then scattered into the packed layout.
    let heads: Vec<_> = (0..nb * nh)
        .into_par_iter()
        .map(|bh| {
            let (b, h) = (bh / nh, bh % nh);
            let (mut dq, mut dk, mut dv) = (vec![0f64; nl * d], vec![0f64; ns * d], vec![0f64; ns * d]);
            let (mut lse, mut delta) = (vec![0f64; nl], vec![0f64; nl]);
            for l in 0..nl {
                let (p, ls) = x.probs(b, h, l);
                let grow = &g[at(l, b, h)..][..d];
                let dp: Vec<f64> = (0..ns).map(|s| grow.iter().zip(&x.v[at(s, b, h)..][..d]).map(|(a, b)| a * b).sum()).collect();
                let dl: f64 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
                delta[l] = dl;
                lse[l] = ls;
                let qrow = &x.q[at(l, b, h)..][..d];
                for s in 0..ns {
                    let ds = p[s] * (dp[s] - dl);
                    let krow = &x.k[at(s, b, h)..][..d];
                    for i in 0..d {
                        dq[l * d + i] += scale * ds * krow[i];
                        dk[s * d + i] += scale * ds * qrow[i];
                        dv[s * d + i] += p[s] * grow[i];
                    }
                }
            }
            (dq, dk, dv, lse, delta)
        })
        .collect();
    let (nq, nk) = (nl * nb * nh * d, ns * nb * nh * d);
    let mut out = vec![0f64; n.packed_len()];
    for (bh, (dq, dk, dv, lse, delta)) in heads.into_iter().enumerate() {
        let (b, h) = (bh / nh, bh % nh);
        for l in 0..nl {
            for i in 0..d {
                out[at(l, b, h) + i] = dq[l * d + i];
            }
            out[nq + 2 * nk + bh * nl + l] = lse[l];
            out[nq + 2 * nk + nb * nh * nl + bh * nl + l] = delta[l];
        }
        for s in 0..ns {
            for i in 0..d {
                out[nq + at(s, b, h) + i] = dk[s * d + i];
                out[nq + nk + at(s, b, h) + i] = dv[s * d + i];
            }
        }
    }
    CpuStorage::from_vec_as(out, q.dtype())
}

#[cfg(test)]
mod tests {
    use crate::ops::{apply, Op};
    use crate::{DType, Device, Tensor};

    /// The op (this f64 reference, forward and backward) against matmul + softmax, which the
    /// CPU runs for attention: the GPU kernels are tested against the same composite.
    #[test]
    fn the_reference_matches_matmul_softmax_with_gradients() {
        crate::manual_seed(7);
        let dev = Device::Cpu;
        let (l, s, b, h, d) = (5, 7, 2, 3, 4);
        let r = |shape: &[usize]| Tensor::randn(shape, DType::F64, &dev).unwrap();
        let (q, k, v, mask, g) = (r(&[l, b, h, d]), r(&[s, b, h, d]), r(&[s, b, h, d]), r(&[b, h, l, s]), r(&[l, b, h, d]));
        for causal in [false, true] {
            let run = |fused: bool| {
                let (q, k, v) = (q.detach().requires_grad(), k.detach().requires_grad(), v.detach().requires_grad());
                let y = if fused {
                    apply(Op::Attention { scale: 0.6, causal, batch_first: false }, &[&q, &k, &v, &mask]).unwrap()
                } else {
                    crate::nn::functional::attention_lbhd(&q, &k, &v, Some(&mask), 0.6, causal, 0.0, false).unwrap()
                };
                y.mul(&g).unwrap().sum_all().unwrap().backward().unwrap();
                [y, q.grad().unwrap(), k.grad().unwrap(), v.grad().unwrap()].map(|t| t.contiguous().unwrap().to_vec::<f64>().unwrap())
            };
            for (a, e) in run(true).iter().zip(run(false).iter()) {
                for (x, y) in a.iter().zip(e) {
                    assert!((x - y).abs() <= 1e-12 + 1e-10 * y.abs(), "{x} vs {y} (causal {causal})");
                }
            }
        }
    }
}
