//! Generation: one prefill over the prompts, then one decode step per new token against a
//! static cache; the next token is chosen on the host from the last position's logits.

use super::CausalLm;
use crate::{DType, Device, Error, Result, Tensor};

/// How [`generate`] chooses tokens. The default is greedy decoding of 32 tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateOptions {
    pub max_new_tokens: usize,
    /// 0 chooses the most likely token (greedy); above 0 samples from the logits divided by it.
    pub temperature: f64,
    /// Samples among the `k` most likely tokens only (ties at the k-th kept, as `transformers`).
    pub top_k: Option<usize>,
    /// Samples among the most likely tokens whose probabilities sum to at least `p` (nucleus).
    pub top_p: Option<f64>,
    /// Seeds the sampling: the same seed, prompts and model give the same tokens.
    pub seed: u64,
    /// A sequence ends once it produces one of these (the stop token is kept in its output).
    pub stop_tokens: Vec<u32>,
    /// Fills the left of shorter prompts in a batch (masked out; any id the model has).
    pub pad_token: u32,
    /// Decodes through one compiled [`CausalLm::decode_step`] under `Mode::ReduceOverhead`
    /// (traced once; on a GPU one CUDA graph replayed per token) instead of eager steps. The
    /// tokens are the same. Prompts of one length only: a padded batch is an error.
    pub compiled: bool,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions { max_new_tokens: 32, temperature: 0.0, top_k: None, top_p: None, seed: 0, stop_tokens: vec![], pad_token: 0, compiled: false }
    }
}

impl GenerateOptions {
    fn check(&self, vocab: usize) -> Result<()> {
        let op = "generate";
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(Error::arg(op, format!("temperature must be finite and at least 0, got {}", self.temperature)));
        }
        if self.top_k == Some(0) {
            return Err(Error::arg(op, "top_k must be at least 1"));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(Error::arg(op, format!("top_p must be in (0, 1], got {p}")));
            }
        }
        if self.pad_token as usize >= vocab {
            return Err(Error::arg(op, format!("pad_token {} is outside the vocabulary of {vocab}", self.pad_token)));
        }
        Ok(())
    }
}

/// A small seeded generator (SplitMix64) for the sampling draws.
struct Draws(u64);

impl Draws {
    /// Uniform in [0, 1).
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The next token from one row of logits.
fn choose(logits: &[f32], o: &GenerateOptions, draws: &mut Draws) -> u32 {
    // The first maximum, as torch.argmax.
    let argmax = |v: &[f64]| v.iter().enumerate().fold(0, |best, (i, &x)| if x > v[best] { i } else { best }) as u32;
    let mut v: Vec<f64> = logits.iter().map(|&x| if x.is_nan() { f64::NEG_INFINITY } else { x as f64 }).collect();
    if o.temperature == 0.0 {
        return argmax(&v);
    }
    for x in &mut v {
        *x /= o.temperature;
    }
    if let Some(k) = o.top_k.filter(|&k| k < v.len()) {
        let mut sorted = v.clone();
        sorted.sort_by(|a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        for x in &mut v {
            if *x < kth {
                *x = f64::NEG_INFINITY;
            }
        }
    }
    let max = v.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return 0;
    }
    let mut p: Vec<f64> = v.iter().map(|&x| (x - max).exp()).collect();
    let total: f64 = p.iter().sum();
    for x in &mut p {
        *x /= total;
    }
    if let Some(top_p) = o.top_p.filter(|&t| t < 1.0) {
        // `transformers`' rule: in ascending order, drop the tokens whose cumulative
        // probability stays at or below 1 - top_p (the most likely token always stays).
        let mut order: Vec<usize> = (0..p.len()).collect();
        order.sort_by(|&a, &b| p[a].total_cmp(&p[b]));
        let mut cum = 0.0;
        for &i in &order[..order.len() - 1] {
            cum += p[i];
            if cum <= 1.0 - top_p {
                p[i] = 0.0;
            }
        }
        let kept: f64 = p.iter().sum();
        for x in &mut p {
            *x /= kept;
        }
    }
    let u = draws.next();
    let mut cum = 0.0;
    let mut last = 0;
    for (i, &x) in p.iter().enumerate() {
        if x > 0.0 {
            cum += x;
            last = i;
            if u < cum {
                return i as u32;
            }
        }
    }
    last as u32
}

/// Continues each prompt of `prompts` (token ids) by up to `opts.max_new_tokens` tokens and
/// returns the new tokens of each. Shorter prompts are padded on the left and masked, as
/// `transformers` batches them. `on_token(row, token)` sees every token as it is chosen.
pub fn generate(model: &dyn CausalLm, prompts: &[Vec<u32>], opts: &GenerateOptions, mut on_token: impl FnMut(usize, u32)) -> Result<Vec<Vec<u32>>> {
    let op = "generate";
    let vocab = model.vocab_size();
    opts.check(vocab)?;
    if prompts.is_empty() || prompts.iter().any(|p| p.is_empty()) {
        return Err(Error::arg(op, "every prompt needs at least one token"));
    }
    if let Some(&bad) = prompts.iter().flatten().find(|&&t| t as usize >= vocab) {
        return Err(Error::arg(op, format!("token {bad} is outside the vocabulary of {vocab}")));
    }
    let b = prompts.len();
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let total = longest + opts.max_new_tokens;
    if total > model.max_positions() {
        return Err(Error::arg(op, format!("{longest} prompt positions and {} new tokens exceed the model's {} positions", opts.max_new_tokens, model.max_positions())));
    }
    let Some(first) = model.parameters().into_iter().next() else {
        return Err(Error::arg(op, "the model has no parameters"));
    };
    let device = first.device();
    let mut out = vec![Vec::new(); b];
    if opts.max_new_tokens == 0 {
        return Ok(out);
    }
    let mut ids = Vec::with_capacity(b * longest);
    let mut mask = Vec::with_capacity(b * longest);
    for p in prompts {
        let pad = longest - p.len();
        ids.extend(std::iter::repeat_n(opts.pad_token as i64, pad).chain(p.iter().map(|&t| t as i64)));
        mask.extend(std::iter::repeat_n(false, pad).chain(std::iter::repeat_n(true, p.len())));
    }
    let padded = mask.iter().any(|m| !m);
    if padded && opts.compiled {
        return Err(Error::arg(op, "compiled decoding takes prompts of one length (decode_step has no padding mask)"));
    }
    let mut mask = if padded { Some(Tensor::from_vec(mask, &[b, longest], &device)?) } else { None };
    let mut cache = model.new_cache(b, total)?;
    crate::no_grad(|| {
        let logits = model.forward_ids(&Tensor::from_vec(ids, &[b, longest], &device)?, Some(&mut cache), mask.as_ref())?.narrow(1, longest - 1, 1)?;
        if opts.compiled {
            let c = &cache;
            let step = crate::compile::compile_with(crate::compile::CompileOptions::new().mode(crate::compile::Mode::ReduceOverhead), move |tok: &Tensor, pos: &Tensor| model.decode_step(tok, pos, c));
            decode(logits, vocab, opts, &mut out, &mut on_token, &mut |next, i| {
                // The i-th new token sits at position longest + i.
                step.call(&Tensor::from_vec(next, &[b, 1], &device)?, &Tensor::full(&[b], (longest + i) as f64, DType::I64, &device)?)
            })
        } else {
            decode(logits, vocab, opts, &mut out, &mut on_token, &mut |next, _| {
                if let Some(m) = &mask {
                    mask = Some(crate::cat(&[m, &Tensor::ones(&[b, 1], DType::Bool, &device)?], 1)?);
                }
                model.forward_ids(&Tensor::from_vec(next, &[b, 1], &device)?, Some(&mut cache), mask.as_ref())
            })
        }
    })?;
    Ok(out)
}

/// The decode loop from the prompts' last logits: chooses each row's token, then runs
/// `step_fn(tokens, i)` on the i-th new tokens for the next logits, until every row stops.
fn decode(
    mut logits: Tensor,
    vocab: usize,
    opts: &GenerateOptions,
    out: &mut [Vec<u32>],
    on_token: &mut dyn FnMut(usize, u32),
    step_fn: &mut dyn FnMut(Vec<i64>, usize) -> Result<Tensor>,
) -> Result<()> {
    let b = out.len();
    let mut draws = Draws(opts.seed);
    let mut done = vec![false; b];
    for step in 0..opts.max_new_tokens {
        let rows = logits.reshape(&[b as i64, vocab as i64])?.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.to_vec::<f32>()?;
        let mut next = Vec::with_capacity(b);
        for (r, row) in rows.chunks(vocab).enumerate() {
            let t = if done[r] { opts.pad_token } else { choose(row, opts, &mut draws) };
            if !done[r] {
                out[r].push(t);
                on_token(r, t);
                done[r] = opts.stop_tokens.contains(&t);
            }
            next.push(t as i64);
        }
        if step + 1 == opts.max_new_tokens || done.iter().all(|&d| d) {
            break;
        }
        logits = step_fn(next, step)?;
    }
    Ok(())
}
