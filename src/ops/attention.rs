//! What [`Op::AttentionUpTo`](super::Op::AttentionUpTo) is made of where its GPU kernel does not
//! compute it (on the host, on the GPU for more than one query row or in F32, and for its
//! gradient): the masked attention over every key/value head repeated for its query heads. The
//! functional traces these ops in a compiled function wherever the kernel will not run: inside
//! a captured CUDA graph, eager ops that upload host values (`arange`) must not run.

use crate::{DType, Result, Tensor};

/// For q `[L, B, H, D]`, k and v `[S, B, H_kv, D]`, `last` `[B]` (I64) and the new rows
/// `[1, B, H_kv, D]` (when given, in place of row `last[b]`): k and v with each key/value head
/// repeated for the H / H_kv query heads of its group (`[S, B, H, D]`), and the additive mask
/// `[B, H, L, S]` in q's dtype, 0 on the keys up to `last[b]` and -inf after.
pub(crate) fn up_to_operands(q: &Tensor, k: &Tensor, v: &Tensor, last: &Tensor, new: Option<(&Tensor, &Tensor)>) -> Result<(Tensor, Tensor, Tensor)> {
    let (l, b, h) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (s, hkv, d) = (k.shape()[0], k.shape()[2], k.shape()[3]);
    let keys = Tensor::arange(0.0, s as f64, 1.0, DType::I64, &q.device())?.unsqueeze(0)?;
    let (k, v) = match new {
        None => (k.clone(), v.clone()),
        Some((kn, vn)) => {
            let at = new_row(last, s)?;
            (at.where_(&kn.broadcast_to(k.shape())?, k)?, at.where_(&vn.broadcast_to(v.shape())?, v)?)
        }
    };
    let heads = |t: &Tensor| match hkv == h {
        true => Ok(t.clone()),
        false => t.unsqueeze(3)?.broadcast_to(&[s, b, hkv, h / hkv, d])?.reshape_usize(&[s, b, h, d]),
    };
    let unseen = keys.le(&last.unsqueeze(1)?)?.logical_not()?;
    let mask = Tensor::zeros(&[b, s], q.dtype(), &q.device())?.masked_fill(&unseen, f64::NEG_INFINITY)?;
    Ok((heads(&k)?, heads(&v)?, mask.reshape_usize(&[b, 1, 1, s])?.broadcast_to(&[b, h, l, s])?))
}

/// `[S, B, 1, 1]`: true at each batch's row `last[b]`.
fn new_row(last: &Tensor, s: usize) -> Result<Tensor> {
    let keys = Tensor::arange(0.0, s as f64, 1.0, DType::I64, &last.device())?.unsqueeze(1)?;
    keys.eq(&last.unsqueeze(0)?)?.reshape_usize(&[s, last.numel(), 1, 1])
}

/// A key or value gradient `[S, B, H_kv, D]` split into the cache's part (zero at the rows the
/// new key or value stood in for) and the new rows' (`[1, B, H_kv, D]`), where there are new
/// rows.
pub(crate) fn split_new_row(g: &Tensor, last: &Tensor, new: bool) -> Result<(Tensor, Option<Tensor>)> {
    if !new {
        return Ok((g.clone(), None));
    }
    let at = new_row(last, g.shape()[0])?;
    Ok((g.masked_fill(&at, 0.0)?, Some(g.masked_fill(&at.logical_not()?, 0.0)?.sum(&[0], true)?)))
}

/// A gradient `[S, B, H, D]` of the repeated heads of [`up_to_operands`] summed back over each
/// group into the `hkv` key/value heads (`[S, B, H_kv, D]`), in F32 for F16 / BF16.
pub(crate) fn sum_head_groups(t: &Tensor, hkv: usize) -> Result<Tensor> {
    let (s, b, h, d) = (t.shape()[0], t.shape()[1], t.shape()[2], t.shape()[3]);
    if h == hkv {
        return Ok(t.clone());
    }
    t.to_dtype(t.dtype().compute_dtype())?.reshape_usize(&[s, b, hkv, h / hkv, d])?.sum(&[3], false)
}

#[cfg(test)]
mod tests {
    use crate::nn::functional::{scaled_dot_product_attention, SdpaOptions};
    use crate::ops::{apply, Op};
    use crate::{gradcheck, DType, Device, GradcheckOptions, Tensor};

    /// The op itself on the host (the functional sends it only to the GPU's kernel): its
    /// reference forward against the masked attention, and its gradient (each key/value head's
    /// summed over its two query heads) by finite differences.
    #[test]
    fn the_ops_host_reference_and_gradient_are_the_masked_attentions() {
        let rand = crate::ops::host_values;
        // q [L, B, H, D], k and v [S, B, H_kv, D].
        let (q, k, v) = (rand(&[2, 2, 4, 3], 1), rand(&[5, 2, 2, 3], 2), rand(&[5, 2, 2, 3], 3));
        let last = Tensor::from_vec(vec![1i64, 4], &[2], &Device::Cpu).unwrap();
        let got = apply(Op::AttentionUpTo { scale: 0.6 }, &[&q, &k, &v, &last]).unwrap();
        let (kh, vh, mask) = super::up_to_operands(&q, &k, &v, &last, None).unwrap();
        let nhld = |t: &Tensor| t.permute(&[1, 2, 0, 3]).unwrap();
        let opts = SdpaOptions { attn_mask: Some(&mask), scale: Some(0.6), ..Default::default() };
        let want = scaled_dot_product_attention(&nhld(&q), &nhld(&kh), &nhld(&vh), &opts).unwrap().permute(&[2, 0, 1, 3]).unwrap();
        let (g, w) = (got.to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
        assert!(g.iter().zip(&w).all(|(a, b)| (a - b).abs() < 1e-12), "{g:?} against {w:?}");
        gradcheck(|xs| apply(Op::AttentionUpTo { scale: 0.6 }, &[&xs[0], &xs[1], &xs[2], &last]), &[q.clone(), k.clone(), v.clone()], GradcheckOptions::default()).unwrap();
        // With new rows `[1, B, H_kv, D]` standing in for the cache's at `last`.
        let (kn, vn) = (rand(&[1, 2, 2, 3], 5), rand(&[1, 2, 2, 3], 6));
        gradcheck(|xs| apply(Op::AttentionUpTo { scale: 0.6 }, &[&xs[0], &xs[1], &xs[2], &last, &xs[3], &xs[4]]), &[q, k, v, kn, vn], GradcheckOptions::default()).unwrap();
        assert_eq!(DType::F64, got.dtype());
    }
}
