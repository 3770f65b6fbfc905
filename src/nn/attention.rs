//! Multi-head attention (`nn.MultiheadAttention`): PyTorch's parameter names, masks, layouts
//! and returned weights, written with matmul and softmax so autograd and autocast apply.

use super::functional as F;
use super::{init, Linear, Module};
use crate::{DType, Device, Error, Result, Tensor};
use std::sync::atomic::{AtomicBool, Ordering};

/// The optional arguments of [`MultiheadAttention::attend`], PyTorch's defaults.
#[derive(Clone, Copy, Debug)]
pub struct AttnArgs<'a> {
    /// `[N, S]` (or `[S]` unbatched): bool `true` ignores that key; a float mask is added.
    pub key_padding_mask: Option<&'a Tensor>,
    /// `[L, S]` or `[N * num_heads, L, S]`: bool `true` forbids attending; a float mask is added.
    pub attn_mask: Option<&'a Tensor>,
    /// Also return the attention weights.
    pub need_weights: bool,
    /// Average the returned weights over heads (`[N, L, S]`), else `[N, num_heads, L, S]`.
    pub average_attn_weights: bool,
}

impl Default for AttnArgs<'_> {
    fn default() -> Self {
        AttnArgs { key_padding_mask: None, attn_mask: None, need_weights: true, average_attn_weights: true }
    }
}

pub struct MultiheadAttention {
    pub embed_dim: usize,
    pub num_heads: usize,
    /// Dropout on the attention weights in training mode.
    pub dropout: f64,
    /// Inputs and outputs are `[N, L, E]` instead of `[L, N, E]`.
    pub batch_first: bool,
    /// The stacked query, key and value projections, `[3E, E]`.
    pub in_proj_weight: Tensor,
    pub in_proj_bias: Option<Tensor>,
    pub out_proj: Linear,
    training: AtomicBool,
}

impl MultiheadAttention {
    /// With bias, no dropout, sequence-first inputs.
    #[track_caller]
    pub fn new(embed_dim: usize, num_heads: usize, dev: &Device) -> Result<Self> {
        let _site = crate::profiler::call_site();
        Self::with_options(embed_dim, num_heads, 0.0, true, false, dev)
    }

    /// PyTorch's initialisation: out_proj as a Linear (its bias then zeroed), in_proj_weight
    /// xavier uniform, in_proj_bias zeros.
    #[track_caller]
    pub fn with_options(embed_dim: usize, num_heads: usize, dropout: f64, bias: bool, batch_first: bool, dev: &Device) -> Result<Self> {
        let _site = crate::profiler::call_site();
        if num_heads == 0 || embed_dim == 0 || !embed_dim.is_multiple_of(num_heads) {
            return Err(Error::arg("MultiheadAttention", format!("embed_dim {embed_dim} must be a positive multiple of num_heads {num_heads}")));
        }
        if !(0.0..=1.0).contains(&dropout) {
            return Err(Error::arg("MultiheadAttention", format!("dropout must be in [0, 1], got {dropout}")));
        }
        let out_proj = Linear::with_bias(embed_dim, embed_dim, bias, dev)?;
        if let Some(b) = &out_proj.bias {
            crate::no_grad(|| b.zero_())?;
        }
        let in_proj_weight = init::xavier_uniform(&[3 * embed_dim, embed_dim], dev)?.requires_grad();
        let in_proj_bias = if bias { Some(Tensor::zeros(&[3 * embed_dim], DType::F32, dev)?.requires_grad()) } else { None };
        Ok(MultiheadAttention { embed_dim, num_heads, dropout, batch_first, in_proj_weight, in_proj_bias, out_proj, training: AtomicBool::new(true) })
    }

    /// Attention of `query` `[L, N, E]` over `key`/`value` `[S, N, E]` (`[N, L, E]` with
    /// `batch_first`; `[L, E]` unbatched). Returns the output, shaped like `query`, and the
    /// weights when `need_weights`.
    #[track_caller]
    pub fn attend(&self, query: &Tensor, key: &Tensor, value: &Tensor, args: AttnArgs) -> Result<(Tensor, Option<Tensor>)> {
        let _site = crate::profiler::call_site();
        let op = "multi_head_attention";
        F::same_device(op, query, &[Some(key), Some(value), Some(&self.in_proj_weight), args.attn_mask, args.key_padding_mask])?;
        let batched = query.ndim() == 3;
        if !(query.ndim() == 2 || batched) || key.ndim() != query.ndim() || value.ndim() != query.ndim() {
            return Err(Error::shape(op, format!("query, key and value must all be 3-D (batched) or 2-D, got {:?}, {:?} and {:?}", query.shape(), key.shape(), value.shape())));
        }
        // To sequence-first [L, N, E].
        let seq_first = |t: &Tensor| -> Result<Tensor> {
            match (batched, self.batch_first) {
                (false, _) => t.unsqueeze(1),
                (true, true) => t.transpose(0, 1),
                (true, false) => Ok(t.clone()),
            }
        };
        let (q, k, v) = (seq_first(query)?, seq_first(key)?, seq_first(value)?);
        let (l, n, e) = (q.shape()[0], q.shape()[1], q.shape()[2]);
        let s = k.shape()[0];
        if e != self.embed_dim || k.shape()[1..] != [n, e] || v.shape() != k.shape() {
            return Err(Error::shape(op, format!("query {:?}, key {:?} and value {:?} for embed_dim {} (key and value must match, with the query's batch and embed_dim)", query.shape(), key.shape(), value.shape(), self.embed_dim)));
        }
        let (h, hd) = (self.num_heads, self.embed_dim / self.num_heads);

        // Projections; one matmul when it is self-attention.
        let (q, k, v) = if query.id() == key.id() && key.id() == value.id() {
            let qkv = F::linear(&q, &self.in_proj_weight, self.in_proj_bias.as_ref())?.chunk(3, -1)?;
            (qkv[0].clone(), qkv[1].clone(), qkv[2].clone())
        } else {
            let rows = |t: &Tensor, from: usize, n: usize| t.narrow(0, from, n);
            let b = |from: usize, n: usize| self.in_proj_bias.as_ref().map(|b| rows(b, from, n)).transpose();
            let q = F::linear(&q, &rows(&self.in_proj_weight, 0, e)?, b(0, e)?.as_ref())?;
            if key.id() == value.id() {
                // Cross-attention over one memory: its key and value projections are one
                // product with the weight's last 2E rows (a view).
                let kv = F::linear(&k, &rows(&self.in_proj_weight, e, 2 * e)?, b(e, 2 * e)?.as_ref())?.chunk(2, -1)?;
                (q, kv[0].clone(), kv[1].clone())
            } else {
                (q, F::linear(&k, &rows(&self.in_proj_weight, e, e)?, b(e, e)?.as_ref())?, F::linear(&v, &rows(&self.in_proj_weight, 2 * e, e)?, b(2 * e, e)?.as_ref())?)
            }
        };
        let mask = self.merged_mask(&args, batched, n, l, s, q.dtype())?;
        let dropout = if self.training.load(Ordering::Relaxed) { self.dropout } else { 0.0 };
        let scale = 1.0 / (hd as f64).sqrt();
        let (out, w) = if args.need_weights {
            // [len, N, E] -> [N * H, len, hd]
            let heads = |t: &Tensor, len: usize| t.reshape_usize(&[len, n * h, hd])?.transpose(0, 1);
            let (q, k, v) = (heads(&q, l)?, heads(&k, s)?, heads(&v, s)?);
            let mut scores = q.mul_scalar(scale)?.matmul(&k.transpose(1, 2)?)?;
            if let Some(m) = &mask {
                scores = scores.add(m)?;
            }
            let w = F::dropout(&F::softmax(&scores, -1)?, dropout, true)?;
            (w.matmul(&v)?.transpose(0, 1)?.reshape_usize(&[l, n, e])?, Some(w))
        } else {
            // [len, N, E] -> [len, N, H, hd]: views, read in place by the fused kernel.
            let heads = |t: &Tensor, len: usize| t.reshape_usize(&[len, n, h, hd]);
            let mask = mask.map(|m| m.broadcast_to(&[n * h, l, s])?.reshape_usize(&[n, h, l, s])).transpose()?;
            let out = F::attention_lbhd(&heads(&q, l)?, &heads(&k, s)?, &heads(&v, s)?, mask.as_ref(), scale, false, dropout, false)?;
            (out.reshape_usize(&[l, n, e])?, None)
        };
        let out = self.out_proj.forward(&out)?;
        let out = match (batched, self.batch_first) {
            (false, _) => out.squeeze(1)?,
            (true, true) => out.transpose(0, 1)?,
            (true, false) => out,
        };
        let weights = if let Some(w) = w {
            let w = w.reshape_usize(&[n, h, l, s])?;
            let w = if args.average_attn_weights { w.mean(&[1], false)? } else { w };
            Some(if batched { w } else { w.squeeze(0)? })
        } else {
            None
        };
        Ok((out, weights))
    }

    /// `attn_mask` and `key_padding_mask` as one additive float mask broadcasting over
    /// `[N * H, L, S]`.
    fn merged_mask(&self, args: &AttnArgs, batched: bool, n: usize, l: usize, s: usize, dtype: DType) -> Result<Option<Tensor>> {
        let op = "multi_head_attention";
        let h = self.num_heads;
        let additive = |m: &Tensor, what: &str| -> Result<Tensor> {
            match m.dtype() {
                DType::Bool => Tensor::zeros(m.shape(), dtype, &m.device())?.masked_fill(m, f64::NEG_INFINITY),
                d if d.is_float() => m.to_dtype(dtype),
                d => Err(Error::dtype(op, d, format!("{what} must be bool or floating point"))),
            }
        };
        let attn = match args.attn_mask {
            None => None,
            Some(m) if m.shape() == [l, s] => Some(additive(m, "attn_mask")?.unsqueeze(0)?),
            Some(m) if m.shape() == [n * h, l, s] => Some(additive(m, "attn_mask")?),
            Some(m) => return Err(Error::shape(op, format!("attn_mask of shape {:?}, expected [{l}, {s}] or [{}, {l}, {s}]", m.shape(), n * h))),
        };
        let pad = match args.key_padding_mask {
            None => None,
            Some(m) => {
                let want: &[usize] = if batched { &[n, s] } else { &[s] };
                if m.shape() != want {
                    return Err(Error::shape(op, format!("key_padding_mask of shape {:?}, expected {want:?}", m.shape())));
                }
                let m = additive(m, "key_padding_mask")?.reshape_usize(&[n, 1, 1, s])?;
                Some(m.expand(&[n as i64, h as i64, 1, s as i64])?.reshape_usize(&[n * h, 1, s])?)
            }
        };
        Ok(match (attn, pad) {
            (Some(a), Some(p)) => Some(a.add(&p)?),
            (a, p) => a.or(p),
        })
    }
}

impl Module for MultiheadAttention {
    /// Self-attention of `x` without masks; the output only.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        Ok(self.attend(x, x, x, AttnArgs { need_weights: false, ..Default::default() })?.0)
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        let mut p = vec![("in_proj_weight".to_string(), self.in_proj_weight.clone())];
        if let Some(b) = &self.in_proj_bias {
            p.push(("in_proj_bias".into(), b.clone()));
        }
        p
    }
    fn children(&self) -> Vec<(String, &dyn Module)> {
        vec![("out_proj".into(), &self.out_proj as &dyn Module)]
    }
    fn set_training(&self, training: bool) {
        self.training.store(training, Ordering::Relaxed);
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        f(&mut self.in_proj_weight)?;
        if let Some(b) = &mut self.in_proj_bias {
            f(b)?;
        }
        self.out_proj.visit_tensors_mut(f)
    }
}
