//! GPT-2 (`GPT2LMHeadModel`) with `transformers`' parameter names: `transformer.wte`, `wpe`,
//! `h.{i}.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc, mlp.c_proj}`, `ln_f`; the Conv1D
//! weights are stored `[in, out]` (`y = x W + b`) and `lm_head` is `wte` itself.

use super::cache::Step;
use super::checkpoint::{Fields, Weights};
use super::{CausalLm, KvCache};
use crate::nn::functional as F;
use crate::{DType, Device, Error, Result, Tensor};

/// The fields of GPT-2's `config.json` kiln reads.
#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// The MLP's width (`n_inner`, 4 * n_embd when null).
    pub n_inner: usize,
    /// `activation_function`: `gelu_new` (tanh GELU, GPT-2's), `gelu`, `relu`, `silu`, `tanh`.
    pub activation: String,
    pub layer_norm_epsilon: f64,
    pub scale_attn_weights: bool,
    pub scale_attn_by_inverse_layer_idx: bool,
}

/// GPT-2 small (124M: 12 layers, d 768, 12 heads, vocab 50257, 1024 positions), as
/// `transformers`' `GPT2Config()`.
impl Default for Gpt2Config {
    fn default() -> Self {
        Gpt2Config {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd: 768,
            n_layer: 12,
            n_head: 12,
            n_inner: 3072,
            activation: "gelu_new".into(),
            layer_norm_epsilon: 1e-5,
            scale_attn_weights: true,
            scale_attn_by_inverse_layer_idx: false,
        }
    }
}

impl Gpt2Config {
    pub(super) fn from_json(map: &serde_json::Map<String, serde_json::Value>) -> Result<Gpt2Config> {
        let f = Fields { map };
        let d = Gpt2Config::default();
        let n_embd = f.size("n_embd", None)?;
        let n_head = f.size("n_head", None)?;
        let c = Gpt2Config {
            vocab_size: f.size("vocab_size", None)?,
            n_positions: f.size("n_positions", Some(d.n_positions))?,
            n_embd,
            n_layer: f.size("n_layer", None)?,
            n_head,
            n_inner: f.size("n_inner", Some(4 * n_embd))?,
            activation: f.string("activation_function", &d.activation)?,
            layer_norm_epsilon: f.number("layer_norm_epsilon", Some(d.layer_norm_epsilon))?,
            scale_attn_weights: f.flag("scale_attn_weights", d.scale_attn_weights)?,
            scale_attn_by_inverse_layer_idx: f.flag("scale_attn_by_inverse_layer_idx", d.scale_attn_by_inverse_layer_idx)?,
        };
        if !n_embd.is_multiple_of(n_head) {
            return Err(Error::Io { op: "models::load", msg: format!("config.json: n_embd {n_embd} is not a multiple of n_head {n_head}") });
        }
        super::activation(&c.activation)?;
        Ok(c)
    }
}

/// GPT-2's transformer block: pre-norm attention and MLP, each added to the residual.
struct Block {
    ln_1: (Tensor, Tensor),
    c_attn: (Tensor, Tensor),
    c_proj: (Tensor, Tensor),
    ln_2: (Tensor, Tensor),
    c_fc: (Tensor, Tensor),
    mlp_proj: (Tensor, Tensor),
}

/// `GPT2LMHeadModel`.
pub struct Gpt2 {
    pub config: Gpt2Config,
    wte: Tensor,
    wpe: Tensor,
    blocks: Vec<Block>,
    ln_f: (Tensor, Tensor),
    act: fn(&Tensor) -> Result<Tensor>,
}

/// A Conv1D layer: `x W + b` with W `[in, out]`, as `transformers` computes it (`addmm` over the
/// rows), so under autocast the bias is cast too and the result is in the autocast dtype.
fn conv1d(x: &Tensor, (w, b): &(Tensor, Tensor)) -> Result<Tensor> {
    let (features, out) = (x.shape()[x.ndim() - 1], w.shape()[1]);
    let mut shape = x.shape().to_vec();
    *shape.last_mut().expect("a Conv1D input has features") = out;
    b.addmm(&x.reshape(&[-1, features as i64])?, w, 1.0, 1.0)?.reshape_usize(&shape)
}

impl Gpt2 {
    /// A model with fresh weights drawn as `transformers` initialises GPT-2 (normal with std
    /// 0.02, layer norms ones and zeros, biases zeros).
    pub fn new(config: Gpt2Config, dtype: DType, device: &Device) -> Result<Gpt2> {
        let mut w = Weights::fresh(Gpt2::shapes(&config), |n| n.ends_with("ln_1.weight") || n.ends_with("ln_2.weight") || n.ends_with("ln_f.weight"))?;
        Gpt2::from_weights(config, &mut w, dtype, device)
    }

    /// Every parameter's name and shape, in `transformers`' order.
    fn shapes(c: &Gpt2Config) -> Vec<(String, Vec<usize>)> {
        let e = c.n_embd;
        let mut v = vec![("transformer.wte.weight".to_string(), vec![c.vocab_size, e]), ("transformer.wpe.weight".to_string(), vec![c.n_positions, e])];
        for i in 0..c.n_layer {
            let p = |s: &str| format!("transformer.h.{i}.{s}");
            for (n, s) in [
                ("ln_1.weight", vec![e]),
                ("ln_1.bias", vec![e]),
                ("attn.c_attn.weight", vec![e, 3 * e]),
                ("attn.c_attn.bias", vec![3 * e]),
                ("attn.c_proj.weight", vec![e, e]),
                ("attn.c_proj.bias", vec![e]),
                ("ln_2.weight", vec![e]),
                ("ln_2.bias", vec![e]),
                ("mlp.c_fc.weight", vec![e, c.n_inner]),
                ("mlp.c_fc.bias", vec![c.n_inner]),
                ("mlp.c_proj.weight", vec![c.n_inner, e]),
                ("mlp.c_proj.bias", vec![e]),
            ] {
                v.push((p(n), s));
            }
        }
        v.push(("transformer.ln_f.weight".into(), vec![e]));
        v.push(("transformer.ln_f.bias".into(), vec![e]));
        v
    }

    /// The model from a checkpoint's tensors (names with or without the `transformer.` prefix
    /// of `GPT2Model` checkpoints).
    pub(super) fn from_weights(config: Gpt2Config, w: &mut Weights, dtype: DType, device: &Device) -> Result<Gpt2> {
        // The causal-mask buffers older checkpoints carry, and the tied head, are not parameters.
        w.drop_unused(|n| n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias") || n == "lm_head.weight");
        let bare = !w.has("transformer.wte.weight") && w.has("wte.weight");
        let mut take = |name: &str, shape: &[usize]| {
            let name = if bare { name.strip_prefix("transformer.").unwrap_or(name) } else { name };
            w.take(name, shape, dtype, device)
        };
        let mut params = Vec::new();
        for (name, shape) in Gpt2::shapes(&config) {
            params.push(take(&name, &shape)?);
        }
        let mut it = params.into_iter();
        let mut next = || it.next().expect("one tensor per shape");
        let (wte, wpe) = (next(), next());
        let mut blocks = Vec::with_capacity(config.n_layer);
        for _ in 0..config.n_layer {
            blocks.push(Block {
                ln_1: (next(), next()),
                c_attn: (next(), next()),
                c_proj: (next(), next()),
                ln_2: (next(), next()),
                c_fc: (next(), next()),
                mlp_proj: (next(), next()),
            });
        }
        let ln_f = (next(), next());
        let act = super::activation(&config.activation)?;
        Ok(Gpt2 { config, wte, wpe, blocks, ln_f, act })
    }

    fn tensors(&self) -> Vec<&Tensor> {
        let mut v = vec![&self.wte, &self.wpe];
        for b in &self.blocks {
            for (w, bias) in [&b.ln_1, &b.c_attn, &b.c_proj, &b.ln_2, &b.c_fc, &b.mlp_proj] {
                v.push(w);
                v.push(bias);
            }
        }
        v.push(&self.ln_f.0);
        v.push(&self.ln_f.1);
        v
    }
}

impl crate::nn::Module for Gpt2 {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.forward_ids(ids, None, None)
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        Gpt2::shapes(&self.config).into_iter().map(|(n, _)| n).zip(self.tensors().into_iter().cloned()).collect()
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        f(&mut self.wte)?;
        f(&mut self.wpe)?;
        for b in &mut self.blocks {
            for (w, bias) in [&mut b.ln_1, &mut b.c_attn, &mut b.c_proj, &mut b.ln_2, &mut b.c_fc, &mut b.mlp_proj] {
                f(w)?;
                f(bias)?;
            }
        }
        f(&mut self.ln_f.0)?;
        f(&mut self.ln_f.1)
    }
}

impl CausalLm for Gpt2 {
    fn forward_ids(&self, ids: &Tensor, cache: Option<&mut KvCache>, mask: Option<&Tensor>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.run(ids, Step::new(ids, cache, mask)?)
    }
    fn decode_step(&self, ids: &Tensor, positions: &Tensor, cache: &KvCache) -> Result<Tensor> {
        if cache.capacity() > self.config.n_positions {
            return Err(Error::arg("Gpt2", format!("a cache of {} positions exceeds the model's {}", cache.capacity(), self.config.n_positions)));
        }
        self.run(ids, Step::at(ids, positions, cache)?)
    }
    fn new_cache(&self, batch: usize, max_len: usize) -> Result<KvCache> {
        let c = &self.config;
        KvCache::new(c.n_layer, batch, c.n_head, max_len, c.n_embd / c.n_head, self.wte.dtype(), &self.wte.device())
    }
    fn max_positions(&self) -> usize {
        self.config.n_positions
    }
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }
}

impl Gpt2 {
    /// The forward pass at `step`'s place: logits `[B, T, vocab]`.
    fn run(&self, ids: &Tensor, mut step: Step) -> Result<Tensor> {
        let c = &self.config;
        let (b, t) = (ids.shape()[0], ids.shape()[1]);
        if let Some(start) = step.start().filter(|s| s + t > c.n_positions) {
            return Err(Error::arg("Gpt2", format!("{} positions exceed the model's {}", start + t, c.n_positions)));
        }
        let (e, heads) = (c.n_embd, c.n_head);
        let d = e / heads;
        let positions = step.positions(b, t, &self.wte.device())?;
        let lookup = |table: &Tensor, idx: &Tensor| table.index_select(0, &idx.reshape(&[-1])?)?.reshape(&[b as i64, t as i64, e as i64]);
        let mut h = lookup(&self.wte, ids)?.add(&lookup(&self.wpe, &positions)?)?;
        let heads_first = |x: &Tensor| x.reshape(&[b as i64, t as i64, heads as i64, d as i64])?.permute(&[0, 2, 1, 3]);
        for (i, blk) in self.blocks.iter().enumerate() {
            let a = F::layer_norm(&h, &[e], Some(&blk.ln_1.0), Some(&blk.ln_1.1), c.layer_norm_epsilon)?;
            let qkv = conv1d(&a, &blk.c_attn)?;
            let mut scale = if c.scale_attn_weights { 1.0 / (d as f64).sqrt() } else { 1.0 };
            if c.scale_attn_by_inverse_layer_idx {
                scale /= (i + 1) as f64;
            }
            // Keys and values side by side in the product: one [2, B, H, T, D] view of both.
            let kv = qkv.narrow(2, e, 2 * e)?.reshape(&[b as i64, t as i64, 2, heads as i64, d as i64])?.permute(&[2, 0, 3, 1, 4])?;
            let o = step.attend(i, &heads_first(&qkv.narrow(2, 0, e)?)?, &kv, scale)?;
            let o = o.permute(&[0, 2, 1, 3])?.reshape(&[b as i64, t as i64, e as i64])?;
            h = h.add(&conv1d(&o, &blk.c_proj)?)?;
            let m = F::layer_norm(&h, &[e], Some(&blk.ln_2.0), Some(&blk.ln_2.1), c.layer_norm_epsilon)?;
            h = h.add(&conv1d(&(self.act)(&conv1d(&m, &blk.c_fc)?)?, &blk.mlp_proj)?)?;
        }
        let h = F::layer_norm(&h, &[e], Some(&self.ln_f.0), Some(&self.ln_f.1), c.layer_norm_epsilon)?;
        let logits = h.matmul(&self.wte.t()?)?;
        // (After the logits: a decode step's cache writes then wait for nothing that follows.)
        step.finish(t)?;
        Ok(logits)
    }
}
