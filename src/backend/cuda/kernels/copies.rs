//! Many small device-to-device copies in one launch: a compiled step's write-back of the small
//! tensors its kernels could not write in place (an optimiser's per-parameter step counts, one
//! per parameter). Each copy alone is a copy-engine transfer, and in a CUDA graph a node of its
//! own that runs after the one before; one kernel takes up to `PER_LAUNCH` of them, a block each.

use crate::backend::cuda::kernels::codegen::PRELUDE;
use crate::backend::cuda::kernels::{data_ptr, dev_of};
use crate::backend::cuda::device::KernelArgs;
use crate::backend::cuda::KernelKey;
use crate::{Result, Tensor};

/// Copies one launch takes: its argument block stays within 4 KiB.
const PER_LAUNCH: usize = 160;
/// Largest copy taken here; larger ones go to the copy engine, which reads at the copy rate.
pub(crate) const MOST_BYTES: usize = 64 * 1024;
const THREADS: u32 = 128;

/// What `copy_many` reads: `n` copies of `bytes[i]` bytes from `src[i]` to `dst[i]`.
#[repr(C)]
#[derive(Clone, Copy)]
struct CopyManyArgs {
    n: i64,
    dst: [u64; PER_LAUNCH],
    src: [u64; PER_LAUNCH],
    bytes: [i64; PER_LAUNCH],
}
// SAFETY: `#[repr(C)]` eight-byte words, declared alike in `source()`.
unsafe impl KernelArgs for CopyManyArgs {}

const NAME: &str = "copy_many";

/// Block `i` copies pair `i` in 16-, 4- or 1-byte words, the widest both addresses and the
/// length allow.
const SOURCE: &str = r#"
extern "C" __global__ void copy_many(CopyManyArgs a) {
  KILN_AFTER_PREVIOUS();
  const long long i = blockIdx.x;
  if (i >= a.n) return;
  const u64 d = a.dst[i], s = a.src[i];
  const long long n = a.bytes[i];
  const u64 all = d | s | (u64)n;
  if ((all & 15) == 0) {
    for (long long j = threadIdx.x; j < n / 16; j += blockDim.x) ((uint4*)d)[j] = ((const uint4*)s)[j];
  } else if ((all & 3) == 0) {
    for (long long j = threadIdx.x; j < n / 4; j += blockDim.x) ((unsigned*)d)[j] = ((const unsigned*)s)[j];
  } else {
    for (long long j = threadIdx.x; j < n; j += blockDim.x) ((unsigned char*)d)[j] = ((const unsigned char*)s)[j];
  }
}
"#;

fn source() -> String {
    format!("{PRELUDE}struct CopyManyArgs {{ long long n; u64 dst[{PER_LAUNCH}]; u64 src[{PER_LAUNCH}]; long long bytes[{PER_LAUNCH}]; }};\n{SOURCE}")
}

/// Copies each `src` into its `dst`: contiguous tensors of one device, dtype and size per pair,
/// at most `MOST_BYTES` each, no `dst` sharing storage with another pair's tensors (the caller
/// checks: `backend::write_many`).
pub(crate) fn copy_many(pairs: &[(&Tensor, &Tensor)]) -> Result<()> {
    let Some(&(first, _)) = pairs.first() else { return Ok(()) };
    let dev = dev_of(first)?;
    let kern = dev.kernel(KernelKey::Named(NAME.into()), || (NAME.into(), source()))?;
    for chunk in pairs.chunks(PER_LAUNCH) {
        let mut a = CopyManyArgs { n: chunk.len() as i64, dst: [0; PER_LAUNCH], src: [0; PER_LAUNCH], bytes: [0; PER_LAUNCH] };
        for (i, (dst, src)) in chunk.iter().enumerate() {
            a.dst[i] = data_ptr(dst)?;
            a.src[i] = data_ptr(src)?;
            a.bytes[i] = (dst.numel() * dst.dtype().size_in_bytes()) as i64;
        }
        dev.launch(kern, (chunk.len() as u32, 1, 1), (THREADS, 1, 1), &a)?;
    }
    Ok(())
}

/// The kernel's source, for the NVRTC check (`samples.rs`).
#[cfg(test)]
pub(super) fn samples() -> Vec<super::samples::Sample> {
    vec![super::samples::Sample::new((NAME.to_string(), source()))]
}
