//! Run-time compilation with NVRTC to a cubin for the device's architecture, cached on disk
//! (`KILN_CACHE_DIR`, default `~/.cache/kiln/kernels`) under a hash of the source, the
//! architecture and the driver and NVRTC versions, so a second process starts warm.

use crate::hash::fnv64;
use crate::{Device, Error, Result};
use cudarc::nvrtc::{result as nr, sys as ns};
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

pub(crate) fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = crate::switches::cache_dir() {
        return Some(d);
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

/// The cubin of `src` for `arch` (`sm_90`) compiled with extra NVRTC `options` (`-D` macros of
/// custom ops), from the disk cache or freshly compiled. `ours`: one of the project's generated
/// kernels (compiled in NVRTC's minimal mode), not a user's.
pub(crate) fn cubin(src: &str, options: &[String], ours: bool, arch: &str, driver: i32, device: Device) -> Result<(Vec<u8>, KernelSource)> {
    let (ma, mi) = nvrtc_version();
    let (driver, ma, mi, opts) = (driver.to_le_bytes(), ma.to_le_bytes(), mi.to_le_bytes(), options.join("\n"));
    let mut parts: Vec<&[u8]> = vec![src.as_bytes(), arch.as_bytes(), &driver, &ma, &mi];
    // Only kernels with options hash them, so the keys of generated kernels stay as they were.
    if !opts.is_empty() {
        parts.push(opts.as_bytes());
    }
    let key = format!("{:016x}", fnv64(&parts));
    let path = cache_dir().map(|d| d.join(format!("{key}.cubin")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            if complete_elf(&bytes) {
                DISK_HITS.fetch_add(1, Ordering::Relaxed);
                return Ok((bytes, KernelSource::DiskCache));
            }
        }
    }
    let bytes = compile(src, options, ours, arch, device)?;
    COMPILED.fetch_add(1, Ordering::Relaxed);
    if let Some(p) = &path {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
            // Whole or not at all: other threads and processes read the cache meanwhile.
            let _ = crate::files::write_atomically(p, &bytes);
        }
    }
    Ok((bytes, KernelSource::Compiled))
}

/// Whether `bytes` hold a whole 64-bit little-endian ELF image (as NVRTC's cubins are): its
/// headers and every section with contents lie inside. A cache file cut short (a full disk, a
/// crashed writer) is compiled again rather than handed to the driver.
fn complete_elf(bytes: &[u8]) -> bool {
    let word = |at: u64, n: u64| {
        let (at, n) = (usize::try_from(at).ok()?, n as usize);
        bytes.get(at..at.checked_add(n)?).map(|b| b.iter().rev().fold(0u64, |v, &x| (v << 8) | x as u64))
    };
    let within = |off: u64, len: u64| off.checked_add(len).is_some_and(|end| end <= bytes.len() as u64);
    if bytes.len() < 64 || &bytes[..4] != b"\x7fELF" || bytes[4] != 2 || bytes[5] != 1 {
        return false;
    }
    let (Some(phoff), Some(shoff), Some(phsize), Some(phnum), Some(shsize), Some(shnum)) = (word(0x20, 8), word(0x28, 8), word(0x36, 2), word(0x38, 2), word(0x3a, 2), word(0x3c, 2)) else {
        return false;
    };
    if !within(phoff, phsize * phnum) || !within(shoff, shsize * shnum) || (shnum > 0 && shsize < 0x28) {
        return false;
    }
    // Section headers: type at 4, file offset at 0x18, size at 0x20; NOBITS (8) takes no space.
    (0..shnum).all(|i| {
        let h = shoff + i * shsize;
        match (word(h + 4, 4), word(h + 0x18, 8), word(h + 0x20, 8)) {
            (Some(8), _, _) => true,
            (Some(_), Some(off), Some(size)) => within(off, size),
            _ => false,
        }
    })
}

/// `src` compiled by NVRTC to a cubin for `arch` (no device needed: the kernel sample check
/// compiles for Hopper on machines without a GPU).
pub(crate) fn compile(src: &str, options: &[String], ours: bool, arch: &str, device: Device) -> Result<Vec<u8>> {
    let err = |msg: String| Error::Kernel { device, msg, code: src.to_string() };
    let csrc = CString::new(src).map_err(|_| err("source contains a NUL byte".into()))?;
    let prog = nr::create_program(&csrc, None).map_err(|e| err(format!("nvrtcCreateProgram: {e:?}")))?;
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into(), "-default-device".into()];
    // The project's kernels use no CUDA runtime types, textures or device launches: NVRTC's
    // minimal mode (12.4 and later) leaves them out (a new row kernel compiled in 155 ms
    // instead of 170 on the H200's host). A user's kernel keeps the full language.
    if ours && nvrtc_version() >= (12, 4) {
        opts.push("--minimal".into());
    }
    opts.extend(options.iter().cloned());
    // SAFETY: `prog` is a live program; options are valid C strings.
    let res = unsafe { nr::compile_program(prog, &opts) };
    if let Err(e) = res {
        // SAFETY: as above.
        let log = unsafe { nr::get_program_log(prog) }.ok().map(|l| unsafe { CStr::from_ptr(l.as_ptr()) }.to_string_lossy().into_owned()).unwrap_or_default();
        unsafe { nr::destroy_program(prog) }.ok();
        let lines = offending_lines(&log, src);
        let lines = if lines.is_empty() { String::new() } else { format!("\nat:\n{lines}") };
        return Err(err(format!("NVRTC failed ({e:?}):\n{log}{lines}")));
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

/// The source lines NVRTC's log reports errors at (`default_program(12): error: ...`), each as
/// `line 12: <text>`, so an error shows the code it is about.
pub(crate) fn offending_lines(log: &str, src: &str) -> String {
    let lines: Vec<&str> = src.lines().collect();
    let mut seen = vec![];
    let mut out = String::new();
    for l in log.lines() {
        let Some(open) = l.find('(') else { continue };
        let Some(close) = l[open..].find("): ").map(|c| open + c) else { continue };
        let Ok(n) = l[open + 1..close].parse::<usize>() else { continue };
        if !l[close..].contains("error") || seen.contains(&n) {
            continue;
        }
        if let Some(text) = n.checked_sub(1).and_then(|i| lines.get(i)) {
            seen.push(n);
            out += &format!("  line {n}: {}\n", text.trim_end());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cut_short_cache_file_is_not_an_image() {
        // A minimal ELF64 image: header, one section of 16 bytes at 64, its header at 80.
        let mut img = vec![0u8; 80 + 2 * 64];
        img[..6].copy_from_slice(b"\x7fELF\x02\x01");
        img[0x28..0x30].copy_from_slice(&80u64.to_le_bytes());
        img[0x3a..0x3c].copy_from_slice(&64u16.to_le_bytes());
        img[0x3c..0x3e].copy_from_slice(&2u16.to_le_bytes());
        let sec = 80 + 64;
        img[sec + 4..sec + 8].copy_from_slice(&1u32.to_le_bytes());
        img[sec + 0x18..sec + 0x20].copy_from_slice(&64u64.to_le_bytes());
        img[sec + 0x20..sec + 0x28].copy_from_slice(&16u64.to_le_bytes());
        assert!(super::complete_elf(&img));
        assert!(!super::complete_elf(&img[..img.len() - 1]), "header table cut");
        img[sec + 0x20..sec + 0x28].copy_from_slice(&1000u64.to_le_bytes());
        assert!(!super::complete_elf(&img), "section past the end");
        assert!(!super::complete_elf(b"// PTX"));
        assert!(!super::complete_elf(&[]));
    }

    #[test]
    fn offending_lines_quote_the_source_nvrtc_points_at() {
        let src = "extern \"C\" __global__ void k(float* y) {\n  y[0] = 1.0f\n}\n";
        let log = "default_program(2): error: expected a \";\"\n  y[0] = 1.0f\n\ndefault_program(2): warning: x\n1 error detected in the compilation of \"default_program\".\n";
        assert_eq!(super::offending_lines(log, src), "  line 2:   y[0] = 1.0f\n");
    }
}
