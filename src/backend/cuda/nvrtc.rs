//! Run-time compilation with NVRTC to a cubin for the device's architecture, cached on disk
//! (`KILN_CACHE_DIR`, default `~/.cache/kiln/kernels`) under a hash of the source, the
//! architecture and the driver and NVRTC versions, so a second process starts warm.

use crate::{Device, Error, Result};
use cudarc::nvrtc::{result as nr, sys as ns};
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// FNV-1a, 64 bits: stable across processes and Rust versions (unlike `DefaultHasher`).
fn fnv64(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

pub(crate) fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("KILN_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("kiln/kernels"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/kiln/kernels"))
}

pub(crate) fn nvrtc_version() -> (i32, i32) {
    let (mut a, mut b) = (0, 0);
    // SAFETY: plain out-parameters.
    unsafe { ns::nvrtcVersion(&mut a, &mut b) };
    (a, b)
}

static COMPILED: AtomicU64 = AtomicU64::new(0);
static DISK_HITS: AtomicU64 = AtomicU64::new(0);

/// (kernels compiled by NVRTC, kernels loaded from the disk cache) in this process.
pub fn kernel_cache_counts() -> (u64, u64) {
    (COMPILED.load(Ordering::Relaxed), DISK_HITS.load(Ordering::Relaxed))
}

/// Where a kernel's cubin came from (the profiler and tests look at this).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KernelSource {
    Compiled,
    DiskCache,
}

/// The cubin of `src` for `arch` (`sm_90`), from the disk cache or freshly compiled.
pub(crate) fn cubin(src: &str, arch: &str, driver: i32, device: Device) -> Result<(Vec<u8>, KernelSource)> {
    let (ma, mi) = nvrtc_version();
    let key = format!("{:016x}", fnv64(&[src.as_bytes(), arch.as_bytes(), &driver.to_le_bytes(), &ma.to_le_bytes(), &mi.to_le_bytes()]));
    let path = cache_dir().map(|d| d.join(format!("{key}.cubin")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                DISK_HITS.fetch_add(1, Ordering::Relaxed);
                return Ok((bytes, KernelSource::DiskCache));
            }
        }
    }
    let bytes = compile(src, arch, device)?;
    COMPILED.fetch_add(1, Ordering::Relaxed);
    if let Some(p) = &path {
        // Written to a temporary name and renamed, so a concurrent reader never sees half a file.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
            let tmp = dir.join(format!("{key}.{}.tmp", std::process::id()));
            if std::fs::write(&tmp, &bytes).is_ok() {
                let _ = std::fs::rename(&tmp, p);
            }
        }
    }
    Ok((bytes, KernelSource::Compiled))
}

fn compile(src: &str, arch: &str, device: Device) -> Result<Vec<u8>> {
    let err = |msg: String| Error::Kernel { device, msg, code: src.to_string() };
    let csrc = CString::new(src).map_err(|_| err("source contains a NUL byte".into()))?;
    let prog = nr::create_program(&csrc, None).map_err(|e| err(format!("nvrtcCreateProgram: {e:?}")))?;
    let opts = [format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-default-device".into()];
    // SAFETY: `prog` is a live program; options are valid C strings.
    let res = unsafe { nr::compile_program(prog, &opts) };
    if let Err(e) = res {
        // SAFETY: as above.
        let log = unsafe { nr::get_program_log(prog) }.ok().map(|l| unsafe { CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned()).unwrap_or_default();
        unsafe { nr::destroy_program(prog) }.ok();
        return Err(err(format!("NVRTC failed ({e:?}):\n{log}")));
    }
    let mut size = 0usize;
    // SAFETY: compiled program; the buffer has the size NVRTC reported.
    let bytes = unsafe {
        ns::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| err(format!("nvrtcGetCUBINSize: {e:?}")))?;
        let mut buf = vec![0u8; size];
        ns::nvrtcGetCUBIN(prog, buf.as_mut_ptr() as *mut _).result().map_err(|e| err(format!("nvrtcGetCUBIN: {e:?}")))?;
        nr::destroy_program(prog).ok();
        buf
    };
    Ok(bytes)
}
