//! `kiln generate`: a `transformers` model directory continues a prompt, tokens printed as they
//! come, then the decode rate.

use kiln::models::{self, GenerateOptions};
use kiln::{DType, Device, Error, Result};
use std::io::Write;
use std::path::Path;

/// What `kiln generate` was asked for.
pub struct Request<'a> {
    pub model: &'a Path,
    pub prompt: &'a str,
    pub options: GenerateOptions,
    pub device: Device,
    pub dtype: DType,
}

pub fn run(r: Request) -> Result<()> {
    let lm = models::load(r.model, r.dtype, &r.device)?;
    let Some(tok) = lm.tokenizer.as_ref() else {
        return Err(Error::Io { op: "generate", msg: format!("{}: no tokenizer.json beside the model", r.model.display()) });
    };
    let prompt = tok.encode(r.prompt)?;
    let mut options = r.options;
    // The end-of-text token ends generation, as `transformers`' default eos does.
    options.stop_tokens.extend(["<|endoftext|>", "</s>", "<|end_of_text|>", "<|eot_id|>"].iter().filter_map(|t| tok.token_id(t)));
    let mut out = std::io::stdout().lock();
    let _ = write!(out, "{}", r.prompt);
    let _ = out.flush();
    let (mut ids, mut shown) = (Vec::new(), String::new());
    let mut first: Option<std::time::Instant> = None;
    let start = std::time::Instant::now();
    models::generate(lm.model.as_ref(), &[prompt], &options, |_, t| {
        first.get_or_insert_with(std::time::Instant::now);
        ids.push(t);
        // Decoding all tokens so far and printing what is new keeps multi-byte characters whole.
        if let Ok(text) = tok.decode(&ids) {
            if let Some(new) = text.strip_prefix(shown.as_str()) {
                let _ = write!(out, "{new}");
                let _ = out.flush();
                shown = text;
            }
        }
    })?;
    let end = std::time::Instant::now();
    let decode = first.map(|f| end - f).unwrap_or_default();
    let rate = if ids.len() > 1 { (ids.len() - 1) as f64 / decode.as_secs_f64() } else { 0.0 };
    let _ = writeln!(out);
    eprintln!(
        "{} tokens in {:.2} s ({} model on {}): first token after {:.0} ms, then {rate:.1} tokens/s",
        ids.len(),
        (end - start).as_secs_f64(),
        lm.model_type,
        r.device,
        first.map_or(0.0, |f| (f - start).as_secs_f64() * 1e3)
    );
    Ok(())
}
