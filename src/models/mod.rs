//! Pretrained language models in Hugging Face's layouts: a `transformers` model directory
//! (`config.json`, `model.safetensors` or a sharded `model.safetensors.index.json`, and
//! `tokenizer.json`) loads without renaming anything.
//!
//! - [`Gpt2`]: GPT-2 (Conv1D weights stored `[in, out]`, `lm_head` tied to `wte`).
//! - [`Llama`]: the Llama family (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention).
//! - [`Tokenizer`]: Hugging Face's own `tokenizers` over `tokenizer.json`.
//! - [`generate`]: prefill, then decode one token at a time against a static [`KvCache`];
//!   greedy, temperature, top-k and top-p sampling with a seed, stop tokens, left-padded batches.
//!
//! ```no_run
//! # fn main() -> kiln::Result<()> {
//! use kiln::models::{self, GenerateOptions};
//! let lm = models::load("gpt2", kiln::DType::F32, &kiln::Device::Cpu)?;
//! let tok = lm.tokenizer.as_ref().expect("the directory has tokenizer.json");
//! let prompt = tok.encode("The quick brown fox")?;
//! let out = models::generate(lm.model.as_ref(), &[prompt], &GenerateOptions { max_new_tokens: 20, ..Default::default() }, |_, _| {})?;
//! println!("{}", tok.decode(&out[0])?);
//! # Ok(()) }
//! ```

mod cache;
mod checkpoint;
mod generate;
mod gpt2;
mod llama;
mod tokenizer;

pub use cache::KvCache;
pub use generate::{generate, GenerateOptions};
pub use gpt2::{Gpt2, Gpt2Config};
pub use llama::{Llama, LlamaConfig};
pub use tokenizer::Tokenizer;

use crate::{DType, Device, Error, Result, Tensor};
use std::path::Path;

/// A causal language model: token ids in, next-token logits out, with an optional cache of the
/// keys and values of earlier positions.
pub trait CausalLm: crate::nn::Module {
    /// Logits `[B, T, vocab]` for `ids` `[B, T]` (I64) that follow the `cache.len()` positions
    /// already in `cache` (none without one; the new keys and values are written into it).
    /// `mask` `[B, cache.len() + T]` (bool or integer, 1 for a real token) marks left padding;
    /// positions count real tokens only, as `transformers` counts them.
    #[track_caller]
    fn forward_ids(&self, ids: &Tensor, cache: Option<&mut KvCache>, mask: Option<&Tensor>) -> Result<Tensor>;
    /// One decode step with fixed shapes: logits `[B, 1, vocab]` for `ids` `[B, 1]` at
    /// `positions` `[B]` (I64 on the model's device). The keys and values are written at those
    /// positions of `cache` and attention reads its whole capacity under a mask, so the
    /// position is data, not a shape: compiled (`kiln::compile`), one trace serves every
    /// position, and under `Mode::ReduceOverhead` one CUDA graph replays it. `cache.len()` is
    /// neither read nor changed; sequences without padding only.
    fn decode_step(&self, ids: &Tensor, positions: &Tensor, cache: &KvCache) -> Result<Tensor>;
    /// A cache for `batch` sequences of up to `max_len` positions, in the model's dtype and on
    /// its device.
    fn new_cache(&self, batch: usize, max_len: usize) -> Result<KvCache>;
    /// The most positions the model takes (its position table or `max_position_embeddings`).
    fn max_positions(&self) -> usize;
    fn vocab_size(&self) -> usize;
}

/// A model directory loaded: the model and, where the directory has one, its tokenizer.
pub struct Pretrained {
    pub model: Box<dyn CausalLm>,
    pub tokenizer: Option<Tokenizer>,
    /// `config.json`'s `model_type`.
    pub model_type: String,
}

/// Loads the model directory `dir` as `transformers` writes it, its parameters converted to
/// `dtype` on `device`. The architecture comes from `config.json`'s `model_type` (`gpt2`,
/// `llama`, `mistral`); a missing, unexpected or wrongly shaped tensor, a missing shard or a
/// malformed file is an error that names it.
pub fn load(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<Pretrained> {
    let dir = dir.as_ref();
    if !dtype.is_float() {
        return Err(Error::dtype("models::load", dtype, "model parameters need a floating-point dtype"));
    }
    let config = checkpoint::read_config(dir)?;
    let model_type = config.get("model_type").and_then(|v| v.as_str()).unwrap_or("").to_string();
    let mut weights = checkpoint::Weights::read(dir)?;
    let model: Box<dyn CausalLm> = match model_type.as_str() {
        "gpt2" => Box::new(Gpt2::from_weights(Gpt2Config::from_json(&config)?, &mut weights, dtype, device)?),
        "llama" | "mistral" => Box::new(Llama::from_weights(LlamaConfig::from_json(&config)?, &mut weights, dtype, device)?),
        "" => return Err(checkpoint::bad(dir.join("config.json"), "has no model_type")),
        other => return Err(checkpoint::bad(dir.join("config.json"), format!("model_type {other:?} is not one kiln builds (gpt2, llama, mistral)"))),
    };
    weights.finish()?;
    let tokenizer_file = dir.join("tokenizer.json");
    let tokenizer = if tokenizer_file.exists() { Some(Tokenizer::from_file(&tokenizer_file)?) } else { None };
    Ok(Pretrained { model, tokenizer, model_type })
}

/// The activation named `name` in a config.
fn activation(name: &str) -> Result<fn(&Tensor) -> Result<Tensor>> {
    Ok(match name {
        "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" => |x| x.gelu_tanh(),
        "gelu" => |x| x.gelu(),
        "relu" => |x| x.relu(),
        "silu" | "swish" => |x| x.silu(),
        "tanh" => |x| x.tanh(),
        other => return Err(Error::Io { op: "models::load", msg: format!("config.json: activation {other:?} is not one kiln has (gelu_new, gelu, relu, silu, tanh)") }),
    })
}
