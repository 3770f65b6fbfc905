//! Shared helpers: the test device, host references, and tolerance checks.
#![allow(dead_code)]

use kiln::{DType, Device, Tensor};

/// The device under test: `KILN_TEST_DEVICE=cuda` (or `cuda:N`) selects a GPU, else the CPU.
pub fn dev() -> Device {
    match std::env::var("KILN_TEST_DEVICE").as_deref() {
        Ok(s) if s.starts_with("cuda") => Device::Cuda(s.strip_prefix("cuda:").and_then(|n| n.parse().ok()).unwrap_or(0)),
        _ => Device::Cpu,
    }
}

/// A tensor of `shape` on the test device from f64 host values, converted to `dtype`.
pub fn t(values: &[f64], shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_slice(values, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap().to_device(&dev()).unwrap()
}

/// The tensor's values as f64 on the host.
pub fn vals(x: &Tensor) -> Vec<f64> {
    x.detach().to_dtype(DType::F64).unwrap().to_device(&Device::Cpu).unwrap().to_vec::<f64>().unwrap()
}

/// Deterministic pseudo-random values in [-2, 2) (independent of kiln's generator).
pub fn host_rand(n: usize, seed: u64) -> Vec<f64> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((s >> 11) as f64 / (1u64 << 53) as f64) * 4.0 - 2.0
        })
        .collect()
}

/// Asserts |a - b| <= atol + rtol |b| elementwise (NaNs must match NaNs).
#[track_caller]
pub fn assert_close(a: &[f64], b: &[f64], rtol: f64, atol: f64) {
    assert_close_named("", a, b, rtol, atol)
}

/// `assert_close`, naming what is compared (a parameter, a step) in the failure.
#[track_caller]
pub fn assert_close_named(what: &str, a: &[f64], b: &[f64], rtol: f64, atol: f64) {
    assert_eq!(a.len(), b.len(), "{what}: lengths differ");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let ok = (x.is_nan() && y.is_nan()) || x == y || (x - y).abs() <= atol + rtol * y.abs();
        assert!(ok, "{what}{}element {i}: got {x}, expected {y} (rtol {rtol}, atol {atol})", if what.is_empty() { "" } else { ": " });
    }
}

/// Runs test `name` of this binary (an ignored one) as a child process with `KILN_CACHE_DIR`
/// set to `cache_dir`, and reads the `key=value` numbers from the line of its output that
/// starts with `marker`, in the order of `keys`.
pub fn child_counts(name: &str, cache_dir: &std::path::Path, marker: &str, keys: &[&str]) -> Vec<u64> {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KILN_CACHE_DIR", cache_dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    let line = text
        .lines()
        .find_map(|l| l.split_once(marker).map(|(_, rest)| rest.to_string()))
        .unwrap_or_else(|| panic!("child printed no counts:\n{text}\n{}", String::from_utf8_lossy(&out.stderr)));
    keys.iter().map(|k| line.split_whitespace().find_map(|w| w.strip_prefix(k)).unwrap().parse::<u64>().unwrap()).collect()
}

/// Runs the ignored test `name` of this binary as a child process with the variables `env` set
/// (switches read once per process), and asserts that it passed.
#[track_caller]
pub fn run_child_with(name: &str, env: &[(&str, &str)]) {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([name, "--exact", "--ignored", "--test-threads=1"])
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{name} with {env:?}:\n{text}");
}

/// A fresh directory holding `files` (tests run side by side, so each gets its own).
pub fn dir_with(tag: &str, files: &[(&str, &[u8])]) -> std::path::PathBuf {
    static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let d = std::env::temp_dir().join(format!("kiln-test-{}-{tag}-{}", std::process::id(), N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    for (name, bytes) in files {
        std::fs::write(d.join(name), bytes).unwrap();
    }
    d
}

/// The tensors of an embedded safetensors file (`include_bytes!`), by name, on the host.
pub fn embedded_safetensors(bytes: &[u8]) -> std::collections::HashMap<String, Tensor> {
    let d = dir_with("embedded", &[("e.safetensors", bytes)]);
    let t = kiln::nn::safetensors::load(d.join("e.safetensors"), &Device::Cpu).unwrap().into_iter().collect();
    let _ = std::fs::remove_dir_all(&d);
    t
}
