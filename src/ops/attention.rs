//! What [`Op::AttentionUpTo`](super::Op::AttentionUpTo) is made of where its GPU kernel does not
//! compute it (on the host, on the GPU for more than one query row or in F32, and for its
//! gradient): the masked attention over every key/value head repeated for its query heads. The
//! functional traces these ops in a compiled function wherever the kernel will not run: inside
//! a captured CUDA graph, eager ops that upload host values (`arange`) must not run.

use super::AttnDims;
use crate::{DType, Result, Tensor};

thread_local! {
    static SETTLED_CACHE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// While held, `Op::AttentionUpTo` on this thread takes its cache (keys, values) and `last` as
/// settled: no kernel still running writes them, so its GPU kernel loads the cache before it
/// waits for the kernel before (`compile::runtime` holds it for a compiled decode step's
/// attention where no earlier step writes in place and the program has launched a kernel). An
/// operand the op first copies (a head dim that is not contiguous) is never settled: the copy
/// is that kernel before.
pub(crate) struct SettledCache(());

impl SettledCache {
    pub(crate) fn hold() -> SettledCache {
        SETTLED_CACHE.set(true);
        SettledCache(())
    }

    /// Whether one is held.
    pub(crate) fn held() -> bool {
        SETTLED_CACHE.get()
    }
}

impl Drop for SettledCache {
    fn drop(&mut self) {
        SETTLED_CACHE.set(false);
    }
}

/// For q `[L, B, H, D]`, k and v `[S, B, H_kv, D]`, `last` `[B]` (I64) and the new rows
/// `[1, B, H_kv, D]` (when given, standing in for row `last[b]`): the keys and values attended,
/// each key/value head repeated for the H / H_kv query heads of its group (`[S, B, H, D]`, or
/// with the new rows `[S + 1, B, H, D]`: the cache, then the new row, which each batch sees
/// where `0 <= last[b] < S`, in place of the cache's row there), and the additive mask
/// `[B, H, L, S (+ 1)]` in q's dtype, 0 on the keys seen and -inf on the others.
pub(crate) fn up_to_operands(q: &Tensor, k: &Tensor, v: &Tensor, last: &Tensor, new: Option<(&Tensor, &Tensor)>) -> Result<(Tensor, Tensor, Tensor)> {
    let (l, b, h) = (q.shape()[0], q.shape()[1], q.shape()[2]);
    let (s, hkv, d) = (k.shape()[0], k.shape()[2], k.shape()[3]);
    let keys = Tensor::arange(0.0, s as f64, 1.0, DType::I64, &q.device())?.unsqueeze(0)?;
    let last = last.unsqueeze(1)?;
    let (k, v, seen) = match new {
        None => (k.clone(), v.clone(), keys.le(&last)?),
        Some((kn, vn)) => {
            let fresh = last.ge_scalar(0)?.logical_and(&last.lt_scalar(s as f64)?)?;
            (crate::cat(&[k, kn], 0)?, crate::cat(&[v, vn], 0)?, crate::cat(&[&keys.lt(&last)?, &fresh], 1)?)
        }
    };
    let s = k.shape()[0];
    let heads = |t: &Tensor| match hkv == h {
        true => Ok(t.clone()),
        false => t.unsqueeze(3)?.broadcast_to(&[s, b, hkv, h / hkv, d])?.reshape_usize(&[s, b, h, d]),
    };
    let mask = Tensor::zeros(&[b, s], q.dtype(), &q.device())?.masked_fill(&seen.logical_not()?, f64::NEG_INFINITY)?;
    Ok((heads(&k)?, heads(&v)?, mask.reshape_usize(&[b, 1, 1, s])?.broadcast_to(&[b, h, l, s])?))
}

/// A key or value gradient of [`up_to_operands`]' keys or values (summed over each group's
/// heads) split into the cache's part and, where there were new rows, theirs (its last row).
pub(crate) fn split_new_row(g: &Tensor, new: bool) -> Result<(Tensor, Option<Tensor>)> {
    if !new {
        return Ok((g.clone(), None));
    }
    let s = g.shape()[0] - 1;
    Ok((g.narrow(0, 0, s)?, Some(g.narrow(0, s, 1)?)))
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

/// `t` (`[L, B, H, D]` or `[B, L, H, D]`) in the other order: its first two dims swapped, a view.
pub(crate) fn swap_seq_batch(t: &Tensor) -> Result<Tensor> {
    t.permute(&[1, 0, 2, 3])
}

/// An attention op's operand as the backends take it: `[L, B, H, D]`, a view of a batch-first
/// one when `batch_first`.
pub(crate) fn seq_first(t: &Tensor, batch_first: bool) -> Result<Tensor> {
    if batch_first {
        swap_seq_batch(t)
    } else {
        Ok(t.clone())
    }
}

/// An attention op's q, k and v (`xs`' first three) as the backends take them: `seq_first`,
/// with a contiguous head dim.
pub(crate) fn seq_first_qkv(xs: &[&Tensor], batch_first: bool) -> Result<(Tensor, Tensor, Tensor)> {
    let one = |t: &Tensor| super::head_dim_contiguous(&seq_first(t, batch_first)?);
    Ok((one(xs[0])?, one(xs[1])?, one(xs[2])?))
}

/// Gradient `i` (of q, k, v) in [`Op::AttentionBackward`](super::Op::AttentionBackward)'s
/// packed result, a view of it in the op's order: `[L or S, B, H, D]`, or `[B, L or S, H, D]`
/// when `batch_first` (where `AttnDims::grads` puts it).
pub(crate) fn grad_of(packed: &Tensor, n: &AttnDims, batch_first: bool, i: usize) -> Result<Tensor> {
    let AttnDims { l, s, b, h, d } = *n;
    if batch_first && l == s {
        // Side by side per row: `[B, L, 3, H, D]`.
        return packed.narrow(0, 0, 3 * b * l * h * d)?.reshape_usize(&[b, l, 3, h, d])?.narrow(2, i, 1)?.reshape_usize(&[b, l, h, d]);
    }
    let rows = if i == 0 { l } else { s };
    let shape = if batch_first { [b, rows, h, d] } else { [rows, b, h, d] };
    packed.narrow(0, n.grads(batch_first)[i].0, rows * b * h * d)?.reshape_usize(&shape)
}

/// A seq-first packed gradient (`Op::AttentionBackward` with `batch_first` false) laid out as
/// the batch-first one (`AttnDims::grads`), for backends whose kernels write only the first.
pub(crate) fn batch_first_grads(seq_first: &Tensor, n: &AttnDims) -> Result<Tensor> {
    let AttnDims { l, s, b, h, d } = *n;
    let swapped = |i: usize| swap_seq_batch(&grad_of(seq_first, n, false, i)?);
    let (q, k, v) = (swapped(0)?, swapped(1)?, swapped(2)?);
    let flat = |t: Tensor| -> Result<Tensor> { t.contiguous()?.reshape(&[-1]) };
    let grads_len = (l + 2 * s) * b * h * d;
    let tail = seq_first.narrow(0, grads_len, seq_first.numel() - grads_len)?;
    match l == s {
        true => super::movement::cat(&[&flat(super::movement::cat(&[&q.unsqueeze(2)?, &k.unsqueeze(2)?, &v.unsqueeze(2)?], 2)?)?, &tail], 0),
        false => super::movement::cat(&[&flat(q)?, &flat(k)?, &flat(v)?, &tail], 0),
    }
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

    /// The batch-first attention on the host equals the seq-first one with its operands and
    /// output permuted, forward and backward (with keys as many as queries, whose gradients go
    /// side by side, and with more keys), and its gradient checks by finite differences; each
    /// gradient's view sits where `AttnDims::grads` says.
    #[test]
    fn batch_first_attention_is_the_seq_first_one_permuted() {
        let rand = crate::ops::host_values;
        let swap = |t: &Tensor| t.permute(&[1, 0, 2, 3]).unwrap();
        for (l, s) in [(3, 3), (2, 5)] {
            // Seq-first operands [L, B, H, D].
            let (q, k, v, g) = (rand(&[l, 2, 2, 4], 1), rand(&[s, 2, 2, 4], 2), rand(&[s, 2, 2, 4], 3), rand(&[l, 2, 2, 4], 4));
            for causal in [false, true] {
                let seq = Op::Attention { scale: 0.5, causal, batch_first: false };
                let bf = Op::Attention { scale: 0.5, causal, batch_first: true };
                let want = apply(seq.clone(), &[&q, &k, &v]).unwrap();
                let got = apply(bf.clone(), &[&swap(&q), &swap(&k), &swap(&v)]).unwrap();
                assert!(got.is_contiguous() && got.shape() == [2, l, 2, 4]);
                assert_eq!(swap(&got).to_vec::<f64>().unwrap(), want.to_vec::<f64>().unwrap());
                let back = |batch_first: bool| Op::AttentionBackward { scale: 0.5, causal, batch_first };
                let seq_packed = apply(back(false), &[&q, &k, &v, &want, &g]).unwrap();
                let bf_packed = apply(back(true), &[&swap(&q), &swap(&k), &swap(&v), &got, &swap(&g)]).unwrap();
                let n = crate::ops::AttnDims::of(q.shape(), k.shape());
                for i in 0..3 {
                    let a = super::grad_of(&seq_packed, &n, false, i).unwrap();
                    let b = super::grad_of(&bf_packed, &n, true, i).unwrap();
                    assert_eq!(swap(&b).to_vec::<f64>().unwrap(), a.to_vec::<f64>().unwrap(), "gradient {i}, {l} queries, {s} keys");
                    // Where the view sits is where the backends write it.
                    for (view, batch_first) in [(&a, false), (&b, true)] {
                        let (at, st) = n.grads(batch_first)[i];
                        let lbh = if batch_first { [view.strides()[1], view.strides()[0], view.strides()[2]] } else { [view.strides()[0], view.strides()[1], view.strides()[2]] };
                        assert_eq!((view.layout().offset, lbh), (at, st), "gradient {i}, batch first {batch_first}");
                    }
                }
                assert_eq!(n.grads(true)[1].0 == 2 * 4, l == s, "side by side only for as many keys as queries");
                let f = move |xs: &[Tensor]| apply(bf.clone(), &[&xs[0], &xs[1], &xs[2]]);
                gradcheck(f, &[swap(&q), swap(&k), swap(&v)], GradcheckOptions::default()).unwrap();
            }
        }
    }
}
