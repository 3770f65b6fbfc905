//! Multi-tensor optimiser updates, as PyTorch's `multi_tensor_apply`: one generated kernel
//! updates a whole list of parameters (and their state) in place. The list travels as a table
//! passed by value (tensor count, each tensor's first block, element count and one address per
//! slot: parameter, gradient, state buffers); block `b` finds its tensor by binary search over
//! the first blocks and updates one chunk of `CHUNK` elements of it. Hyperparameters are scalar
//! kernel parameters. A table holds at most `tensors_per_launch` tensors, so that the kernel's
//! parameters stay within 4 KiB (the limit before CUDA 12.1); longer lists take more launches.
//!
//! Each update is written as the per-tensor path's sequence of eager ops (optim/mod.rs), one
//! rounding per op: products and sums are never contracted into FMAs (`--fmad=false`), division
//! and square root are IEEE-rounded (NVRTC's defaults, as in the eager kernels), and F16/BF16
//! values are rounded to their storage type after every op, as each eager op stores its result.
//! The results are therefore those of the per-tensor path, bit for bit.

use crate::backend::cuda::kernels::codegen::{load, short, storage_type, store, PRELUDE};
use crate::dtype::CType;
use crate::backend::cuda::kernels::dev_of;
use crate::backend::cuda::{CudaDevice, Kernel, KernelKey};
use crate::{DType, Error, Result, Tensor};
use std::fmt::Write;

/// Elements one block updates (PyTorch's chunk size).
pub(crate) const CHUNK: usize = 65536;
const THREADS: u32 = 512;
/// Elements a thread loads before it computes (independent loads in flight).
const ILP: usize = 4;
/// Bytes of the table; the scalars after it take at most 128 more, within the 4 KiB limit.
const TABLE_BYTES: usize = 3840;

/// Which update a kernel applies; the flags are what the source depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Rule {
    /// SGD. Slots: parameter, gradient, and the momentum buffer when `momentum`.
    /// Scalars: lr, weight_decay, momentum, 1 - dampening; the flag marks a first step (the
    /// buffer is written, not read: a copy of the gradient).
    Sgd { weight_decay: bool, momentum: bool, nesterov: bool },
    /// Adam (AdamW when `decoupled`). Slots: parameter, gradient, exp_avg, exp_avg_sq.
    /// Scalars: weight_decay, 1 - lr * weight_decay, beta1, 1 - beta1, beta2, 1 - beta2,
    /// sqrt(bias_correction2), eps, lr / bias_correction1.
    Adam { weight_decay: bool, decoupled: bool },
}

impl Rule {
    /// Addresses per tensor.
    pub(crate) fn depth(self) -> usize {
        match self {
            Rule::Sgd { momentum, .. } => 2 + momentum as usize,
            Rule::Adam { .. } => 4,
        }
    }
    /// Scalar parameters (f64) after the table; an `int` flag follows them.
    pub(crate) fn scalars(self) -> usize {
        match self {
            Rule::Sgd { .. } => 4,
            Rule::Adam { .. } => 9,
        }
    }
    /// The update's kernel name (`foreach_sgd_m_f32`), on either device.
    pub(crate) fn name(self, dtype: DType) -> String {
        let flags = match self {
            Rule::Sgd { weight_decay, momentum, nesterov } => format!("sgd{}{}{}", if momentum { "_m" } else { "" }, if nesterov { "_n" } else { "" }, if weight_decay { "_wd" } else { "" }),
            Rule::Adam { weight_decay, decoupled } => format!("{}{}", if decoupled { "adamw" } else { "adam" }, if weight_decay { "_wd" } else { "" }),
        };
        format!("foreach_{flags}_{}", short(dtype))
    }
}

/// Parameter dtypes the kernels take (their state has the parameter's dtype).
pub(crate) fn supports(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F64 | DType::F16 | DType::BF16)
}

/// Tensors one table holds with `depth` addresses each.
pub(crate) fn tensors_per_launch(depth: usize) -> usize {
    (TABLE_BYTES / 8 - 1) / (2 + depth)
}

/// Words of a table: the count, then per tensor its first block, its element count and its
/// `depth` addresses, each as an array of `nt`.
fn table_words(depth: usize) -> usize {
    1 + (2 + depth) * tensors_per_launch(depth)
}

/// The tables of launches over `entries` (each: its addresses, `depth` of them, and its element
/// count, which must be positive), with the blocks each launch needs.
pub(crate) fn tables(depth: usize, entries: &[(Vec<u64>, usize)]) -> Vec<(Vec<u64>, u64)> {
    let nt = tensors_per_launch(depth);
    entries
        .chunks(nt)
        .map(|list| {
            let mut w = vec![0u64; table_words(depth)];
            w[0] = list.len() as u64;
            let mut blocks = 0u64;
            for (k, (ptrs, numel)) in list.iter().enumerate() {
                debug_assert!(*numel > 0 && ptrs.len() == depth);
                w[1 + k] = blocks;
                w[1 + nt + k] = *numel as u64;
                for (s, p) in ptrs.iter().enumerate() {
                    w[1 + (2 + s) * nt + k] = *p;
                }
                blocks += numel.div_ceil(CHUNK) as u64;
            }
            (w, blocks)
        })
        .collect()
}

/// The kernel's source, after the prelude and the `#define`s of `gen`.
const SOURCE: &str = include_str!("foreach.cu");

/// The kernel's name and CUDA C source.
pub(crate) fn gen(rule: Rule, dtype: DType) -> (String, String) {
    let name = rule.name(dtype);
    let depth = rule.depth();
    let nt = tensors_per_launch(depth);
    let t = CType::of(dtype);
    let (adam, weight_decay, decoupled, momentum, nesterov) = match rule {
        Rule::Sgd { weight_decay, momentum, nesterov } => (false, weight_decay, false, momentum, nesterov),
        Rule::Adam { weight_decay, decoupled } => (true, weight_decay, decoupled, false, false),
    };
    let mut c = String::from(PRELUDE);
    let _ = writeln!(c, "#define KNAME {name}\n#define NT {nt}\n#define ILP {ILP}\n#define CHUNK {CHUNK}ll\n#define THREADS {THREADS}\n#define DEPTH {depth}");
    let _ = writeln!(c, "#define COMPUTE_T {}\n#define STORAGE_T {}", t.name(), storage_type(dtype));
    let _ = writeln!(c, "#define LD(x) {}\n#define ST(x) {}", load(dtype, t, "x"), store(dtype, t, "x"));
    let _ = writeln!(c, "#define SQRT {}", if t == CType::F32 { "sqrtf" } else { "sqrt" });
    for (flag, on) in [("ADAM", adam), ("WEIGHT_DECAY", weight_decay), ("DECOUPLED", decoupled), ("MOMENTUM", momentum), ("NESTEROV", nesterov)] {
        let _ = writeln!(c, "#define {flag} {}", on as u8);
    }
    c.push_str(SOURCE);
    (name, c)
}

/// Updates in place the tensors of `entries`, each given by its slots (all contiguous, of
/// `dtype`, of one shape, at least one element, on one device, no two written ones sharing
/// memory), with `scalars` as `rule` lists them. The caller bumps their versions.
pub(crate) fn launch(rule: Rule, dtype: DType, entries: &[Vec<&Tensor>], scalars: &[f64], first: bool) -> Result<()> {
    let Some(t0) = entries.first().and_then(|e| e.first()) else { return Ok(()) };
    debug_assert_eq!(scalars.len(), rule.scalars());
    let dev = dev_of(t0)?;
    let kern = dev.kernel_with(KernelKey::Named(rule.name(dtype)), &["--fmad=false".to_string()], || gen(rule, dtype))?;
    if cfg!(debug_assertions) {
        check_params(&dev, kern, rule)?;
    }
    let list = entries.iter().map(|slots| Ok((slots.iter().map(|t| crate::backend::cuda::kernels::data_ptr(t)).collect::<Result<Vec<u64>>>()?, slots[0].numel()))).collect::<Result<Vec<_>>>()?;
    for (mut words, blocks) in tables(rule.depth(), &list) {
        let grid =
            u32::try_from(blocks).ok().filter(|&b| b <= i32::MAX as u32).ok_or_else(|| Error::arg("optimizer step", format!("{blocks} blocks of {CHUNK} elements: more than a launch holds")))?;
        let mut scalars = scalars.to_vec();
        let mut flag = first as i32;
        let mut params: Vec<*mut std::ffi::c_void> = vec![words.as_mut_ptr() as *mut std::ffi::c_void];
        params.extend(scalars.iter_mut().map(|s| s as *mut f64 as *mut std::ffi::c_void));
        params.push(&mut flag as *mut i32 as *mut std::ffi::c_void);
        // SAFETY: the parameters are the kernel's: the table (`words` is `struct Table`, all
        // u64), then `rule.scalars()` doubles and an int (sizes checked in debug builds). The
        // addresses are of live tensors the caller holds; buffers are reused in stream order.
        unsafe { dev.launch_params(kern, (grid, 1, 1), (THREADS, 1, 1), 0, &mut params) }?;
    }
    Ok(())
}

/// The kernel's parameter sizes as the driver reports them, against the table and scalars the
/// launch passes.
fn check_params(dev: &CudaDevice, kern: Kernel, rule: Rule) -> Result<()> {
    let got = dev.param_sizes(kern);
    let mut want = vec![table_words(rule.depth()) * 8];
    want.extend(std::iter::repeat_n(8, rule.scalars()));
    want.push(4);
    if got.is_empty() || got == want {
        return Ok(());
    }
    Err(Error::Cuda { op: "optimizer step", device: dev.kiln_device(), msg: format!("kernel {} takes parameters of {got:?} bytes, the launch passes {want:?}", kern.1) })
}

/// Sources of each update rule, for the NVRTC check (`samples.rs`), with the options they
/// are compiled with.
#[cfg(test)]
pub(super) fn samples() -> Vec<super::samples::Sample> {
    let mut v = vec![];
    for dtype in [DType::F32, DType::F64, DType::BF16] {
        for rule in [Rule::Sgd { weight_decay: true, momentum: true, nesterov: true }, Rule::Sgd { weight_decay: false, momentum: false, nesterov: false }, Rule::Adam { weight_decay: true, decoupled: true }, Rule::Adam { weight_decay: false, decoupled: false }] {
            let mut s = super::samples::Sample::new(gen(rule, dtype));
            s.options.push("--fmad=false".into());
            v.push(s);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_stay_within_4k_and_map_blocks_to_tensors() {
        for rule in
            [Rule::Sgd { weight_decay: true, momentum: false, nesterov: false }, Rule::Sgd { weight_decay: true, momentum: true, nesterov: true }, Rule::Adam { weight_decay: true, decoupled: true }]
        {
            let bytes = table_words(rule.depth()) * 8 + rule.scalars() * 8 + 4;
            assert!(bytes <= 4096, "{rule:?}: {bytes} bytes of parameters");
        }
        let nt = tensors_per_launch(4);
        let sizes: Vec<usize> = (0..nt + 3).map(|k| [1, 7, 1000, 70000, CHUNK, CHUNK + 1][k % 6]).collect();
        let entries: Vec<(Vec<u64>, usize)> = sizes.iter().enumerate().map(|(k, &n)| ((0..4).map(|s| (k * 16 + s) as u64).collect(), n)).collect();
        let t = tables(4, &entries);
        assert_eq!(t.len(), 2);
        assert_eq!(t[0].0[0] as usize, nt);
        assert_eq!(t[1].0[0], 3);
        // Launch 0: tensor k starts where the blocks of the ones before it end.
        let mut first = 0;
        for (k, &n) in sizes[..nt].iter().enumerate() {
            assert_eq!(t[0].0[1 + k], first);
            assert_eq!(t[0].0[1 + nt + k], n as u64);
            assert_eq!(t[0].0[1 + 3 * nt + k], (k * 16 + 1) as u64, "the gradient's address");
            first += n.div_ceil(CHUNK) as u64;
        }
        assert_eq!(t[0].1, first);
        assert_eq!(t[1].0[1 + 5 * nt + 2], ((nt + 2) * 16 + 3) as u64, "the last slot of the last tensor");
    }

    #[test]
    fn sources_name_their_kernels() {
        for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
            let (name, src) = gen(Rule::Adam { weight_decay: true, decoupled: false }, dt);
            assert!(src.contains(&format!("#define KNAME {name}\n")) && src.contains(&format!("#define THREADS {THREADS}\n")), "{src}");
        }
        assert!(SOURCE.contains("void __launch_bounds__(THREADS) KNAME("));
        let (name, src) = gen(Rule::Sgd { weight_decay: false, momentum: true, nesterov: true }, DType::BF16);
        assert_eq!(name, "foreach_sgd_m_n_bf16");
        assert!(src.contains("#define MOMENTUM 1\n") && src.contains("#define ADAM 0\n") && SOURCE.contains("first ? (T)0 : kld(q2[i])"));
    }
}
