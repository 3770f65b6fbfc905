//! Fused scaled-dot-product attention on the GPU, forward and forward + backward, in device
//! time (median of 30 event-timed calls after 5 warm-ups), beside the same attention written
//! with matmul and softmax (what runs where the fused kernels do not), over the shapes of
//! `tools/attention/shapes.txt`; `tools/attention/torch_sdpa.py` times PyTorch's backends (cuDNN,
//! flash, memory-efficient, math) on the same shapes. The last field of a shape is `full`,
//! `causal`, or `mask` (an additive mask `[N, 1, L, S]`, random values).
//!
//!   cargo run --release --example attention_bench -- tools/attention/shapes.txt

use kiln::BackwardOptions;
use kiln::cuda::Event;
use kiln::nn::functional::{self as F, SdpaOptions};
use kiln::prelude::*;

fn main() -> Result<()> {
    let path = std::env::args().nth(1).unwrap_or_else(|| "tools/attention/shapes.txt".into());
    let text = std::fs::read_to_string(&path).map_err(|e| kiln::Error::Arg { op: "attention_bench", msg: format!("{path}: {e}") })?;
    let dev = Device::cuda_if_available(0);
    manual_seed(0);
    // (cuDNN's fused attention, which takes F16/BF16 rows over 256 keys, needs 9.13.)
    println!("cuDNN: {:?}", kiln::cuda::cudnn_version());
    println!("{:<34} {:>10} {:>12} {:>14} {:>18}", "shape (N H L S D dtype causal)", "fwd_us", "fwd_bwd_us", "unfused_fwd_us", "unfused_fwd_bwd_us");
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| f[i].parse::<usize>().map_err(|_| kiln::Error::Arg { op: "attention_bench", msg: format!("bad line '{line}'") });
        let (n, h, l, s, d) = (num(0)?, num(1)?, num(2)?, num(3)?, num(4)?);
        let dtype = match f[5] {
            "f32" => DType::F32,
            "bf16" => DType::BF16,
            "f16" => DType::F16,
            other => return Err(kiln::Error::Arg { op: "attention_bench", msg: format!("dtype {other}") }),
        };
        let mask = if f[6] == "mask" { Some(Tensor::randn(&[n, 1, l, s], dtype, &dev)?) } else { None };
        let opts = SdpaOptions { is_causal: f[6] == "causal", attn_mask: mask.as_ref(), ..Default::default() };
        let q = Tensor::randn(&[n, h, l, d], dtype, &dev)?.requires_grad();
        let k = Tensor::randn(&[n, h, s, d], dtype, &dev)?.requires_grad();
        let v = Tensor::randn(&[n, h, s, d], dtype, &dev)?.requires_grad();
        let g = Tensor::randn(&[n, h, l, d], dtype, &dev)?;
        let fwd = no_grad(|| Event::median_ms(&dev, 5, 30, || F::scaled_dot_product_attention(&q, &k, &v, &opts)))?;
        let both = Event::median_ms(&dev, 5, 30, || F::scaled_dot_product_attention(&q, &k, &v, &opts)?.backward_with(BackwardOptions { gradient: Some(g.clone()), retain_graph: false }))?;
        // softmax(q k^T / sqrt(D) (+ -inf above the diagonal) (+ mask)) v with plain ops.
        let above = Tensor::full(&[l, s], f64::NEG_INFINITY, dtype, &dev)?.triu(1)?;
        let unfused = || -> Result<Tensor> {
            let mut sc = q.mul_scalar(1.0 / (d as f64).sqrt())?.matmul(&k.transpose(2, 3)?)?;
            if opts.is_causal {
                sc = sc.add(&above)?;
            }
            if let Some(m) = &mask {
                sc = sc.add(m)?;
            }
            F::softmax(&sc, -1)?.matmul(&v)
        };
        let ufwd = no_grad(|| Event::median_ms(&dev, 5, 30, unfused))?;
        let uboth = Event::median_ms(&dev, 5, 30, || unfused()?.backward_with(BackwardOptions { gradient: Some(g.clone()), retain_graph: false }))?;
        println!("{:<34} {:>10.1} {:>12.1} {:>14.1} {:>18.1}", line, fwd * 1e3, both * 1e3, ufwd * 1e3, uboth * 1e3);
    }
    Ok(())
}
