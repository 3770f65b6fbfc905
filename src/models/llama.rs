//! The Llama family (`LlamaForCausalLM`, and Mistral's identical layout) with `transformers`'
//! parameter names: `model.embed_tokens`, `model.layers.{i}.{input_layernorm,
//! self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj}`, `model.norm`,
//! `lm_head` (or the embedding when `tie_word_embeddings`). RMSNorm, rotary embeddings in the
//! rotate-half form, SwiGLU and grouped-query attention.

use super::cache::Step;
use super::checkpoint::{Fields, Weights};
use super::{CausalLm, KvCache};
use crate::nn::functional as F;
use crate::{DType, Device, Error, Result, Tensor};

/// How rotary frequencies are scaled (`rope_scaling` / `rope_parameters`).
#[derive(Clone, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear { factor: f64 },
    /// Llama 3's: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

/// The fields of a Llama `config.json` kiln reads.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Biases on the q, k, v and o projections (`attention_bias`).
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub hidden_act: String,
}

impl LlamaConfig {
    pub(super) fn from_json(map: &serde_json::Map<String, serde_json::Value>) -> Result<LlamaConfig> {
        let f = Fields { map };
        let bad = |msg: String| Error::Io { op: "models::load", msg: format!("config.json: {msg}") };
        let hidden = f.size("hidden_size", None)?;
        let heads = f.size("num_attention_heads", None)?;
        let kv = f.size("num_key_value_heads", Some(heads))?;
        if !heads.is_multiple_of(kv) {
            return Err(bad(format!("num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")));
        }
        // transformers 5 keeps the rotary settings in `rope_parameters`; earlier versions keep
        // `rope_theta` and `rope_scaling` at the top level.
        let rope = map.get("rope_parameters").and_then(|v| v.as_object()).or_else(|| map.get("rope_scaling").and_then(|v| v.as_object()));
        let theta = match rope.and_then(|r| r.get("rope_theta")) {
            Some(v) => v.as_f64().filter(|x| *x > 0.0).ok_or_else(|| bad(format!("rope_theta must be a positive number, got {v}")))?,
            None => f.number("rope_theta", Some(10000.0))?,
        };
        let num = |r: &serde_json::Map<String, serde_json::Value>, k: &str| r.get(k).and_then(|v| v.as_f64()).filter(|x| x.is_finite() && *x > 0.0).ok_or_else(|| bad(format!("rope scaling needs a positive {k}")));
        let rope_scaling = match rope {
            None => RopeScaling::None,
            Some(r) => match r.get("rope_type").or_else(|| r.get("type")).and_then(|v| v.as_str()).unwrap_or("default") {
                "default" => RopeScaling::None,
                "linear" => RopeScaling::Linear { factor: num(r, "factor")? },
                "llama3" => RopeScaling::Llama3 {
                    factor: num(r, "factor")?,
                    low_freq_factor: num(r, "low_freq_factor")?,
                    high_freq_factor: num(r, "high_freq_factor")?,
                    original_max_position_embeddings: num(r, "original_max_position_embeddings")?,
                },
                other => return Err(bad(format!("rope scaling {other:?} is not one kiln has (default, linear, llama3)"))),
            },
        };
        let c = LlamaConfig {
            vocab_size: f.size("vocab_size", None)?,
            hidden_size: hidden,
            intermediate_size: f.size("intermediate_size", None)?,
            num_hidden_layers: f.size("num_hidden_layers", None)?,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: f.size("head_dim", Some(hidden / heads))?,
            max_position_embeddings: f.size("max_position_embeddings", Some(2048))?,
            rms_norm_eps: f.number("rms_norm_eps", Some(1e-6))?,
            rope_theta: theta,
            rope_scaling,
            tie_word_embeddings: f.flag("tie_word_embeddings", false)?,
            attention_bias: f.flag("attention_bias", false)?,
            mlp_bias: f.flag("mlp_bias", false)?,
            hidden_act: f.string("hidden_act", "silu")?,
        };
        if !c.head_dim.is_multiple_of(2) {
            return Err(bad(format!("head_dim {} must be even for rotary embeddings", c.head_dim)));
        }
        super::activation(&c.hidden_act)?;
        Ok(c)
    }

    /// The rotary inverse frequencies, `head_dim / 2` of them, scaled as the config says.
    fn inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim;
        (0..d / 2)
            .map(|i| {
                let f = 1.0 / self.rope_theta.powf((2 * i) as f64 / d as f64);
                match self.rope_scaling {
                    RopeScaling::None | RopeScaling::Linear { .. } => f,
                    RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        if wavelen < old / high_freq_factor {
                            f
                        } else if wavelen > old / low_freq_factor {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    }
                }
            })
            .collect()
    }
}

/// A projection `x W^T + b` with W `[out, in]` (nn.Linear's layout).
struct Proj {
    weight: Tensor,
    bias: Option<Tensor>,
}

impl Proj {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        F::linear(x, &self.weight, self.bias.as_ref())
    }
}

struct Layer {
    input_layernorm: Tensor,
    q: Proj,
    k: Proj,
    v: Proj,
    o: Proj,
    post_attention_layernorm: Tensor,
    gate: Proj,
    up: Proj,
    down: Proj,
}

/// `LlamaForCausalLM`.
pub struct Llama {
    pub config: LlamaConfig,
    embed_tokens: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    /// None when tied to the embedding.
    lm_head: Option<Tensor>,
    inv_freq: Tensor,
    act: fn(&Tensor) -> Result<Tensor>,
}

impl Llama {
    /// Every parameter's name, shape and whether it is a norm weight (ones when fresh).
    fn shapes(c: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
        let (e, i, d) = (c.hidden_size, c.intermediate_size, c.head_dim);
        let (q, kv) = (c.num_attention_heads * d, c.num_key_value_heads * d);
        let mut v = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, e])];
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            v.push((p("input_layernorm.weight"), vec![e]));
            for (n, out, inp, bias) in [("self_attn.q_proj", q, e, c.attention_bias), ("self_attn.k_proj", kv, e, c.attention_bias), ("self_attn.v_proj", kv, e, c.attention_bias), ("self_attn.o_proj", e, q, c.attention_bias)] {
                v.push((p(&format!("{n}.weight")), vec![out, inp]));
                if bias {
                    v.push((p(&format!("{n}.bias")), vec![out]));
                }
            }
            v.push((p("post_attention_layernorm.weight"), vec![e]));
            for (n, out, inp) in [("mlp.gate_proj", i, e), ("mlp.up_proj", i, e), ("mlp.down_proj", e, i)] {
                v.push((p(&format!("{n}.weight")), vec![out, inp]));
                if c.mlp_bias {
                    v.push((p(&format!("{n}.bias")), vec![out]));
                }
            }
        }
        v.push(("model.norm.weight".into(), vec![e]));
        if !c.tie_word_embeddings {
            v.push(("lm_head.weight".into(), vec![c.vocab_size, e]));
        }
        v
    }

    /// A model with fresh weights as `transformers` initialises them (normal with std 0.02,
    /// norm weights ones, biases zeros).
    pub fn new(config: LlamaConfig, dtype: DType, device: &Device) -> Result<Llama> {
        let mut w = Weights::fresh(Llama::shapes(&config), |n| n.ends_with("norm.weight"))?;
        Llama::from_weights(config, &mut w, dtype, device)
    }

    pub(super) fn from_weights(config: LlamaConfig, w: &mut Weights, dtype: DType, device: &Device) -> Result<Llama> {
        // A tied checkpoint may still carry the head; it is the embedding.
        if config.tie_word_embeddings {
            w.drop_unused(|n| n == "lm_head.weight");
        }
        // Older checkpoints carry the rotary frequencies as buffers; they are computed here.
        w.drop_unused(|n| n.ends_with("rotary_emb.inv_freq"));
        let mut take = |name: String, shape: &[usize]| w.take(&name, shape, dtype, device);
        let shapes: std::collections::HashMap<String, Vec<usize>> = Llama::shapes(&config).into_iter().collect();
        let mut get = |name: String| {
            let shape = shapes[&name].clone();
            take(name, &shape)
        };
        let c = &config;
        let proj = |get: &mut dyn FnMut(String) -> Result<Tensor>, name: String, bias: bool| -> Result<Proj> {
            Ok(Proj { weight: get(format!("{name}.weight"))?, bias: if bias { Some(get(format!("{name}.bias"))?) } else { None } })
        };
        let embed_tokens = get("model.embed_tokens.weight".into())?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = |s: &str| format!("model.layers.{l}.{s}");
            layers.push(Layer {
                input_layernorm: get(p("input_layernorm.weight"))?,
                q: proj(&mut get, p("self_attn.q_proj"), c.attention_bias)?,
                k: proj(&mut get, p("self_attn.k_proj"), c.attention_bias)?,
                v: proj(&mut get, p("self_attn.v_proj"), c.attention_bias)?,
                o: proj(&mut get, p("self_attn.o_proj"), c.attention_bias)?,
                post_attention_layernorm: get(p("post_attention_layernorm.weight"))?,
                gate: proj(&mut get, p("mlp.gate_proj"), c.mlp_bias)?,
                up: proj(&mut get, p("mlp.up_proj"), c.mlp_bias)?,
                down: proj(&mut get, p("mlp.down_proj"), c.mlp_bias)?,
            });
        }
        let norm = get("model.norm.weight".into())?;
        let lm_head = if c.tie_word_embeddings { None } else { Some(get("lm_head.weight".into())?) };
        let inv_freq = Tensor::from_vec(config.inv_freq(), &[config.head_dim / 2], &Device::Cpu)?.to_dtype(DType::F32)?.to_device(device)?;
        let act = super::activation(&config.hidden_act)?;
        Ok(Llama { config, embed_tokens, layers, norm, lm_head, inv_freq, act })
    }

    fn tensors_mut(&mut self) -> Vec<&mut Tensor> {
        let mut v = vec![&mut self.embed_tokens];
        for l in &mut self.layers {
            v.push(&mut l.input_layernorm);
            for p in [&mut l.q, &mut l.k, &mut l.v, &mut l.o] {
                v.push(&mut p.weight);
                v.extend(p.bias.as_mut());
            }
            v.push(&mut l.post_attention_layernorm);
            for p in [&mut l.gate, &mut l.up, &mut l.down] {
                v.push(&mut p.weight);
                v.extend(p.bias.as_mut());
            }
        }
        v.push(&mut self.norm);
        v.extend(self.lm_head.as_mut());
        v
    }

    /// RMSNorm in F32, as `transformers` computes it, scaled by `w` in the input's dtype.
    fn rms_norm(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        let x32 = x.to_dtype(DType::F32)?;
        let r = x32.square()?.mean(&[-1], true)?.add_scalar(self.config.rms_norm_eps)?.rsqrt()?;
        x32.mul(&r)?.to_dtype(x.dtype())?.mul(w)
    }

    /// cos and sin `[B, 1, T, D]` of the rotary angles at `positions` `[B, T]`, in `dtype`.
    fn rotary(&self, positions: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let mut pos = positions.to_dtype(DType::F32)?;
        if let RopeScaling::Linear { factor } = self.config.rope_scaling {
            pos = pos.div_scalar(factor)?;
        }
        let freqs = pos.unsqueeze(-1)?.mul(&self.inv_freq)?;
        let emb = crate::cat(&[&freqs, &freqs], -1)?.unsqueeze(1)?;
        Ok((emb.cos()?.to_dtype(dtype)?, emb.sin()?.to_dtype(dtype)?))
    }
}

/// x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1] for the halves x1, x2 of the head dim.
fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let half = x.shape()[3] / 2;
    let (x1, x2) = (x.narrow(3, 0, half)?, x.narrow(3, half, half)?);
    let rotated = crate::cat(&[&x2.neg()?, &x1], -1)?;
    x.mul(cos)?.add(&rotated.mul(sin)?)
}

impl crate::nn::Module for Llama {
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.forward_ids(ids, None, None)
    }
    fn own_parameters(&self) -> Vec<(String, Tensor)> {
        // (`tensors_mut` lists the slots in the order of `shapes`; this reads them.)
        let mut v = vec![self.embed_tokens.clone()];
        for l in &self.layers {
            v.push(l.input_layernorm.clone());
            for p in [&l.q, &l.k, &l.v, &l.o] {
                v.push(p.weight.clone());
                v.extend(p.bias.clone());
            }
            v.push(l.post_attention_layernorm.clone());
            for p in [&l.gate, &l.up, &l.down] {
                v.push(p.weight.clone());
                v.extend(p.bias.clone());
            }
        }
        v.push(self.norm.clone());
        v.extend(self.lm_head.clone());
        Llama::shapes(&self.config).into_iter().map(|(n, _)| n).zip(v).collect()
    }
    fn visit_tensors_mut(&mut self, f: &mut dyn FnMut(&mut Tensor) -> Result<()>) -> Result<()> {
        for t in self.tensors_mut() {
            f(t)?;
        }
        let dev = self.embed_tokens.device();
        self.inv_freq = self.inv_freq.to_device(&dev)?;
        Ok(())
    }
}

impl CausalLm for Llama {
    fn forward_ids(&self, ids: &Tensor, cache: Option<&mut KvCache>, mask: Option<&Tensor>) -> Result<Tensor> {
        let _site = crate::profiler::call_site();
        self.run(ids, Step::new(ids, cache, mask)?)
    }
    fn decode_step(&self, ids: &Tensor, positions: &Tensor, cache: &KvCache) -> Result<Tensor> {
        self.run(ids, Step::at(ids, positions, cache)?)
    }
    fn new_cache(&self, batch: usize, max_len: usize) -> Result<KvCache> {
        let c = &self.config;
        KvCache::new(c.num_hidden_layers, batch, c.num_key_value_heads, max_len, c.head_dim, self.embed_tokens.dtype(), &self.embed_tokens.device())
    }
    fn max_positions(&self) -> usize {
        self.config.max_position_embeddings
    }
    fn vocab_size(&self) -> usize {
        self.config.vocab_size
    }
}

impl Llama {
    /// The forward pass at `step`'s place: logits `[B, T, vocab]`.
    fn run(&self, ids: &Tensor, mut step: Step) -> Result<Tensor> {
        let c = &self.config;
        let (b, t) = (ids.shape()[0], ids.shape()[1]);
        let (e, h, hkv, d) = (c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let dtype = self.embed_tokens.dtype();
        let positions = step.positions(b, t, &self.embed_tokens.device())?;
        let (cos, sin) = self.rotary(&positions, dtype)?;
        let mut x = self.embed_tokens.index_select(0, &ids.reshape(&[-1])?)?.reshape(&[b as i64, t as i64, e as i64])?;
        let heads = |y: &Tensor, n: usize| y.reshape(&[b as i64, t as i64, n as i64, d as i64])?.permute(&[0, 2, 1, 3]);
        let scale = 1.0 / (d as f64).sqrt();
        for (i, l) in self.layers.iter().enumerate() {
            let a = self.rms_norm(&x, &l.input_layernorm)?;
            let q = rope(&heads(&l.q.forward(&a)?, h)?, &cos, &sin)?;
            let k = rope(&heads(&l.k.forward(&a)?, hkv)?, &cos, &sin)?;
            let v = heads(&l.v.forward(&a)?, hkv)?;
            let o = step.attend(i, &q, &crate::stack(&[&k, &v], 0)?, scale)?.permute(&[0, 2, 1, 3])?.reshape(&[b as i64, t as i64, (h * d) as i64])?;
            x = x.add(&l.o.forward(&o)?)?;
            let m = self.rms_norm(&x, &l.post_attention_layernorm)?;
            x = x.add(&l.down.forward(&(self.act)(&l.gate.forward(&m)?)?.mul(&l.up.forward(&m)?)?)?)?;
        }
        let x = self.rms_norm(&x, &self.norm)?;
        let logits = x.matmul(&self.lm_head.as_ref().unwrap_or(&self.embed_tokens).t()?)?;
        // (After the logits: a decode step's cache writes then wait for nothing that follows.)
        step.finish(t)?;
        Ok(logits)
    }
}
