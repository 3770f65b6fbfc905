//! `kiln demo lm`: a small GPT-2 learns two-digit addition ("12+7=19") from sums it makes up,
//! for a given time with a progress bar, then completes sums it never saw (greedy, through
//! `models::generate`); the held-out exact-match rate shows what it learned.

use crate::models::{generate, CausalLm, GenerateOptions, Gpt2, Gpt2Config};
use crate::nn::functional::{self as F, CrossEntropyOptions};
use crate::nn::Module;
use crate::optim::{AdamConfig, AdamW, Optimizer};
use crate::{manual_seed, DType, Device, Result, Tensor};
use std::io::Write;
use std::time::Instant;

/// The characters of the task: digits, then `+`, `=`, the end of a sum and padding.
const CHARS: &[u8] = b"0123456789+=\n.";
const END: u32 = 12;
const PAD: u32 = 13;
/// The longest sum, "99+99=198\n".
const LEN: usize = 10;

fn encode(s: &str) -> Vec<u32> {
    s.bytes().map(|c| CHARS.iter().position(|&x| x == c).expect("a task character") as u32).collect()
}
fn decode(ids: &[u32]) -> String {
    ids.iter().filter(|&&t| t < PAD && t != END).map(|&t| CHARS[t as usize] as char).collect()
}

/// Which (a, b) pairs training never sees: one in ten, fixed.
fn held_out(a: usize, b: usize) -> bool {
    (a * 31 + b * 17).is_multiple_of(10)
}

/// What a run learned.
#[derive(Clone, Debug)]
pub struct LmReport {
    pub steps: usize,
    pub first_loss: f32,
    pub last_loss: f32,
    /// Held-out sums answered exactly.
    pub exact_match: f64,
    pub held_out: usize,
    pub step_ms: f64,
}

/// A batch of `n` training sums: inputs and targets `[n, LEN - 1]`, targets -100 except on
/// the answer (after `=`) and its end.
fn batch(n: usize, state: &mut u64, device: &Device) -> Result<(Tensor, Tensor)> {
    let mut next = || {
        *state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (*state >> 33) as usize
    };
    let (mut x, mut y) = (Vec::with_capacity(n * (LEN - 1)), Vec::with_capacity(n * (LEN - 1)));
    while x.len() < n * (LEN - 1) {
        let (a, b) = (next() % 100, next() % 100);
        if held_out(a, b) {
            continue;
        }
        let mut s = encode(&format!("{a}+{b}={}\n", a + b));
        let answer = s.iter().position(|&t| t == 11).expect("an =") + 1;
        s.resize(LEN, PAD);
        for j in 0..LEN - 1 {
            x.push(s[j] as i64);
            y.push(if j + 1 >= answer && s[j + 1] != PAD { s[j + 1] as i64 } else { -100 });
        }
    }
    Ok((Tensor::from_vec(x, &[n, LEN - 1], device)?, Tensor::from_vec(y, &[n, LEN - 1], device)?))
}

/// Trains for about `seconds` (or `max_steps` steps, whichever ends first) on `device`, then
/// scores the held-out sums; writes progress and results to `out`.
pub fn run(seconds: f64, max_steps: usize, device: &Device, progress: bool, out: &mut dyn Write) -> Result<LmReport> {
    let io = |e: std::io::Error| crate::Error::Io { op: "demo lm", msg: e.to_string() };
    if !(seconds > 0.0 && seconds.is_finite()) {
        return Err(crate::Error::arg("demo lm", format!("the training time must be a positive number of seconds, got {seconds}")));
    }
    manual_seed(0);
    let config = Gpt2Config { vocab_size: CHARS.len(), n_positions: 16, n_embd: 64, n_layer: 2, n_head: 4, n_inner: 256, ..Default::default() };
    let model = Gpt2::new(config, DType::F32, device)?;
    let params = model.parameters();
    let count: usize = params.iter().map(|p| p.numel()).sum();
    let mut opt = AdamW::new(params, AdamConfig { lr: 3e-3, beta2: 0.98, weight_decay: 0.01, ..Default::default() });
    writeln!(out, "kiln {}: a {count}-parameter GPT-2 learns two-digit addition on {device} for {seconds:.0} s (batch 128, AdamW lr 3e-3)", env!("CARGO_PKG_VERSION")).map_err(io)?;
    let bar = if progress { indicatif::ProgressBar::new((seconds * 10.0) as u64) } else { indicatif::ProgressBar::hidden() };
    bar.set_style(indicatif::ProgressStyle::with_template("{bar:40} {elapsed}/{msg}").unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()));
    let opts = CrossEntropyOptions::default();
    let (mut first, mut last, mut steps) = (f32::NAN, f32::NAN, 0);
    let mut rng = 1u64;
    let start = Instant::now();
    let mut last_loss = None;
    while start.elapsed().as_secs_f64() < seconds && steps < max_steps {
        let (x, y) = batch(128, &mut rng, device)?;
        let logits = model.forward(&x)?;
        let loss = F::cross_entropy_with(&logits.reshape(&[-1, CHARS.len() as i64])?, &y.reshape(&[-1])?, &opts)?;
        loss.backward()?;
        opt.step()?;
        opt.zero_grad();
        steps += 1;
        // Reading a loss waits for the device: only now and then, and the first and last.
        if steps == 1 || steps % 25 == 0 {
            last = loss.item::<f32>()?;
            if steps == 1 {
                first = last;
            }
            bar.set_position((start.elapsed().as_secs_f64() * 10.0) as u64);
            bar.set_message(format!("{seconds:.0}s  step {steps}  loss {last:.3}"));
        }
        last_loss = Some(loss);
    }
    if let Some(l) = last_loss {
        last = l.item::<f32>()?;
    }
    bar.finish_and_clear();
    let step_ms = start.elapsed().as_secs_f64() * 1e3 / steps.max(1) as f64;
    writeln!(out, "loss {first:.3} -> {last:.3} over {steps} steps ({step_ms:.1} ms per step)").map_err(io)?;

    // Every held-out sum, completed greedily in batches (left-padded: the prompts differ in length).
    let sums: Vec<(usize, usize)> = (0..100).flat_map(|a| (0..100).map(move |b| (a, b))).filter(|&(a, b)| held_out(a, b)).collect();
    let gen = GenerateOptions { max_new_tokens: 4, stop_tokens: vec![END], pad_token: PAD, ..Default::default() };
    let mut right = 0;
    let mut shown = 0;
    for chunk in sums.chunks(250) {
        let prompts: Vec<Vec<u32>> = chunk.iter().map(|(a, b)| encode(&format!("{a}+{b}="))).collect();
        let answers = generate(&model as &dyn CausalLm, &prompts, &gen, |_, _| {})?;
        for ((a, b), ans) in chunk.iter().zip(answers) {
            let got = decode(&ans);
            let ok = got == (a + b).to_string();
            right += ok as usize;
            if shown < 6 {
                writeln!(out, "  {a}+{b}={got}  {}", if ok { "right" } else { "wrong" }).map_err(io)?;
                shown += 1;
            }
        }
    }
    let exact_match = right as f64 / sums.len() as f64;
    writeln!(out, "held-out sums answered exactly: {right} of {} ({:.1}%)", sums.len(), 100.0 * exact_match).map_err(io)?;
    Ok(LmReport { steps, first_loss: first, last_loss: last, exact_match, held_out: sums.len(), step_ms })
}
