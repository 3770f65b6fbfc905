//! The `kiln` program: the training demo by default, `kiln bench` for the shared side-by-side
//! benchmark, `kiln profile` for one bench workload under the profiler, `kiln generate` for
//! text from a `transformers` model directory, `kiln launch` for the ranks of a distributed job,
//! `kiln doctor` for the production checklist on the demo's step or a bench workload.

mod cli;

use clap::{Parser, Subcommand};
use kiln::prelude::*;

#[derive(Parser)]
#[command(name = "kiln", version, about = "kiln: tensors, autograd and generated kernels")]
struct Args {
    #[command(subcommand)]
    cmd: Option<Cmd>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Trains the 784-256-10 MLP on built-in data (what `kiln` does with no arguments), or with
    /// `lm` a small GPT-2 on two-digit sums, then completes sums it never saw.
    Demo {
        /// `mlp` (the default) or `lm`.
        #[arg(default_value = "mlp")]
        which: String,
        /// Training steps of the MLP (batch 32).
        #[arg(long, default_value_t = 600)]
        steps: usize,
        /// Training time of the language model, in seconds.
        #[arg(long, default_value_t = 60.0)]
        seconds: f64,
    },
    /// Runs the shared benchmark workloads on the GPU and writes their JSON.
    Bench {
        /// Only workloads whose name contains this.
        #[arg(long)]
        only: Option<String>,
        #[arg(long, default_value = "kiln.json")]
        out: std::path::PathBuf,
        /// Let F32 products use TF32 tensor cores (`kiln::cuda::set_allow_tf32`), as PyTorch's
        /// `allow_tf32`: faster, not FP32-accurate. The JSON's system field says so.
        #[arg(long)]
        allow_tf32: bool,
        /// Also time the device-to-device copy at four sizes (the roofline's fit).
        #[arg(long)]
        copy_fit: bool,
        /// `cuda` (the shared workloads on GPU 0) or `cpu` (their CPU-sized rows, beside
        /// `bench/torch_cpu.py`).
        #[arg(long, default_value = "cuda")]
        device: String,
        /// The data-parallel rows of `ddp_reference.py` (all-reduce bus bandwidth, DDP steps),
        /// under `kiln launch`: NCCL with `--device cuda`, the TCP backend with `cpu`.
        #[arg(long)]
        distributed: bool,
    },
    /// Runs one call of a bench workload under the profiler: prints the per-kernel table and
    /// writes a Chrome trace.
    Profile {
        /// A workload name of the bench (`pointwise.add_relu.f32.1e8`, ...).
        workload: String,
        /// Where the Chrome trace goes.
        #[arg(long, default_value = "trace.json")]
        trace: std::path::PathBuf,
        /// Profile the workload's compiled form (`kiln::compile`) instead of its eager one.
        #[arg(long)]
        compiled: bool,
        /// With `--compiled`, the bench's compiled variant to profile (`compiled`,
        /// `reduce_overhead` or `max_autotune` for a training or decode step); the first if absent.
        #[arg(long, requires = "compiled")]
        variant: Option<String>,
    },
    /// Continues a prompt with a `transformers` model directory (GPT-2 or Llama family:
    /// config.json, safetensors weights, tokenizer.json), printing tokens as they come.
    Generate {
        /// The model directory.
        #[arg(long)]
        model: std::path::PathBuf,
        #[arg(long)]
        prompt: String,
        #[arg(long, default_value_t = 64)]
        max_new_tokens: usize,
        /// 0 decodes greedily.
        #[arg(long, default_value_t = 0.0)]
        temperature: f64,
        #[arg(long)]
        top_k: Option<usize>,
        #[arg(long)]
        top_p: Option<f64>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// `cuda` (GPU 0 when there is one, else the CPU), `cuda:N` or `cpu`.
        #[arg(long, default_value = "cuda")]
        device: String,
        /// The parameters' dtype: f32, bf16 or f16.
        #[arg(long, default_value = "f32")]
        dtype: String,
        /// Decode through one compiled step (on a GPU one CUDA graph replayed per token).
        #[arg(long)]
        compile: bool,
    },
    /// Checks the production checklist (synchronisations, GPU busy time, compilation,
    /// precision, launches, loader) on a bench workload, or by default the demo's MLP
    /// training step.
    Doctor {
        /// `demo` (the default) or a bench workload, by its name in the bench schema.
        workload: Option<String>,
        /// Check the step compiled in this mode (default, reduce-overhead, max-autotune).
        #[arg(long, num_args = 0..=1, default_missing_value = "default")]
        compiled: Option<String>,
        /// The checklist as JSON.
        #[arg(long)]
        json: bool,
        /// Also write the checked steps' Chrome trace here.
        #[arg(long)]
        trace: Option<std::path::PathBuf>,
    },
    /// Starts the ranks of one node with torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
    /// MASTER_ADDR, MASTER_PORT), prefixes their output with the rank, and stops them all when
    /// one fails.
    Launch {
        #[arg(long, default_value_t = 1)]
        nproc_per_node: usize,
        #[arg(long, default_value_t = 1)]
        nnodes: usize,
        #[arg(long, default_value_t = 0)]
        node_rank: usize,
        #[arg(long, default_value = "127.0.0.1")]
        master_addr: String,
        #[arg(long, default_value_t = 29500)]
        master_port: u16,
        /// The program and its arguments, after `--`.
        #[arg(last = true, required = true)]
        program: Vec<String>,
    },
}

fn main() {
    let args = Args::parse();
    let r = match args.cmd {
        None => demo(600),
        Some(Cmd::Demo { which, steps, .. }) if which == "mlp" => demo(steps),
        Some(Cmd::Demo { which, seconds, .. }) if which == "lm" => kiln::demo::lm::run(seconds, usize::MAX, &Device::cuda_if_available(0), true, &mut std::io::stdout().lock()).map(|_| ()),
        Some(Cmd::Demo { which, .. }) => Err(kiln::Error::Arg { op: "demo", msg: format!("{which}: expected mlp or lm") }),
        Some(Cmd::Bench { only, out, device, distributed: true, .. }) => cli::bench_ddp::run(only.as_deref(), &out, &device),
        Some(Cmd::Bench { only, out, device, .. }) if device == "cpu" => cli::bench_cpu::run(only.as_deref(), &out),
        Some(Cmd::Bench { only, out, allow_tf32, copy_fit, device, .. }) if device == "cuda" => cli::bench::run(only.as_deref(), &out, allow_tf32, copy_fit),
        Some(Cmd::Bench { device, .. }) => Err(kiln::Error::Arg { op: "bench", msg: format!("--device {device}: expected cuda or cpu") }),
        Some(Cmd::Launch { nproc_per_node, nnodes, node_rank, master_addr, master_port, program }) => {
            match cli::launch::run(&cli::launch::Launch { nproc_per_node, nnodes, node_rank, master_addr, master_port, program }) {
                Ok(0) => Ok(()),
                Ok(code) => std::process::exit(code),
                Err(e) => Err(e),
            }
        }
        Some(Cmd::Doctor { workload, compiled, json, trace }) => cli::doctor::run(workload.as_deref(), compiled.as_deref(), json, trace.as_deref()),
        Some(Cmd::Profile { workload, trace, compiled, variant }) => cli::profile::run(&workload, &trace, compiled, variant.as_deref()),
        Some(Cmd::Generate { model, prompt, max_new_tokens, temperature, top_k, top_p, seed, device, dtype, compile }) => (|| {
            let device = match device.as_str() {
                "cpu" => Device::Cpu,
                "cuda" => Device::cuda_if_available(0),
                d => match d.strip_prefix("cuda:").and_then(|n| n.parse().ok()) {
                    Some(n) => Device::Cuda(n),
                    None => return Err(kiln::Error::Arg { op: "generate", msg: format!("--device {d}: expected cpu, cuda or cuda:N") }),
                },
            };
            let dtype = match dtype.as_str() {
                "f32" => DType::F32,
                "bf16" => DType::BF16,
                "f16" => DType::F16,
                d => return Err(kiln::Error::Arg { op: "generate", msg: format!("--dtype {d}: expected f32, bf16 or f16") }),
            };
            let options = kiln::models::GenerateOptions { max_new_tokens, temperature, top_k, top_p, seed, compiled: compile, ..Default::default() };
            cli::generate::run(cli::generate::Request { model: &model, prompt: &prompt, options, device, dtype })
        })(),
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}

/// The demo on the GPU when there is one, else the CPU.
fn demo(steps: usize) -> Result<()> {
    let dev = Device::cuda_if_available(0);
    let mut out = std::io::stdout().lock();
    kiln::demo::run(steps, &dev, true, &mut out).map(|_| ())
}
