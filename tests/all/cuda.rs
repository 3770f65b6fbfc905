//! The CUDA backend's own behaviour: allocator, out-of-memory, kernel cache across processes,
//! launch counts. On a machine without a GPU they check that CUDA is reported unavailable.

use crate::common::*;
use kiln::cuda;
use kiln::prelude::*;

/// The GPU under test, or `None` when the suite runs on the CPU.
fn gpu() -> Option<Device> {
    match dev() {
        Device::Cuda(n) => Some(Device::Cuda(n)),
        Device::Cpu => None,
    }
}

#[test]
fn without_a_gpu_cuda_is_an_error_not_a_panic() {
    if gpu().is_some() {
        return assert!(cuda::device_count() >= 1);
    }
    if cuda::device_count() == 0 {
        let e = Tensor::zeros(&[4], DType::F32, &Device::Cuda(0)).unwrap_err();
        assert!(matches!(e, kiln::Error::DeviceUnavailable { .. }), "{e}");
        assert!(cuda::memory_stats(&Device::Cuda(0)).is_err());
        assert_eq!(Device::cuda_if_available(0), Device::Cpu);
    }
}

#[test]
fn allocator_reuses_freed_blocks_and_keeps_statistics() {
    let Some(d) = gpu() else { return };
    cuda::synchronize(&d).unwrap();
    let n = 3 << 20; // 12 MiB of f32: a large-block class of its own
    let before = cuda::memory_stats(&d).unwrap();
    let a = Tensor::zeros(&[n], DType::F32, &d).unwrap();
    let during = cuda::memory_stats(&d).unwrap();
    assert!(during.allocated >= before.allocated + n * 4, "{before:?} -> {during:?}");
    assert!(during.peak_allocated >= during.allocated);
    assert!(during.reserved >= during.allocated);
    drop(a);
    let after = cuda::memory_stats(&d).unwrap();
    assert!(after.allocated <= during.allocated - n * 4 + 4096, "freed memory stays counted: {after:?}");
    let b = Tensor::zeros(&[n], DType::F32, &d).unwrap();
    let again = cuda::memory_stats(&d).unwrap();
    assert!(again.cache_hits > after.cache_hits, "the freed block is reused: {after:?} -> {again:?}");
    drop(b);
    cuda::reset_peak_memory_stats(&d).unwrap();
    let reset = cuda::memory_stats(&d).unwrap();
    assert_eq!(reset.peak_allocated, reset.allocated);
    cuda::empty_cache(&d).unwrap();
}

#[test]
fn out_of_memory_is_an_error_with_figures_and_the_process_lives_on() {
    let Some(d) = gpu() else { return };
    let e = Tensor::zeros(&[1usize << 40], DType::F32, &d).unwrap_err(); // 4 TiB
    assert!(matches!(e, kiln::Error::OutOfMemory { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("allocated") && msg.contains("reserved"), "{msg}");
    let x = Tensor::ones(&[1000], DType::F32, &d).unwrap();
    assert_eq!(x.sum_all().unwrap().item::<f32>().unwrap(), 1000.0);
}

#[test]
fn eager_ops_launch_one_kernel_each() {
    let Some(d) = gpu() else { return };
    let a = Tensor::randn(&[1 << 16], DType::F32, &d).unwrap();
    let b = Tensor::randn(&[1 << 16], DType::F32, &d).unwrap();
    (&a + &b).unwrap().relu().unwrap(); // warm: kernels compiled
    let before = cuda::launch_count(&d).unwrap();
    let c = (&a + &b).unwrap().relu().unwrap();
    assert_eq!(cuda::launch_count(&d).unwrap() - before, 2, "add and relu");
    let (ha, hb, hc) = (vals(&a), vals(&b), vals(&c));
    for i in 0..ha.len() {
        assert_eq!(hc[i], ((ha[i] as f32 + hb[i] as f32).max(0.0)) as f64);
    }
}

#[test]
fn random_streams_match_the_cpu() {
    let Some(d) = gpu() else { return };
    for dtype in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        manual_seed(7);
        let g = vals(&Tensor::randn(&[1001], dtype, &d).unwrap());
        manual_seed(7);
        let c = vals(&Tensor::randn(&[1001], dtype, &Device::Cpu).unwrap());
        assert_close(&g, &c, 1e-6, 1e-6);
        manual_seed(9);
        let g = vals(&Tensor::rand(&[1001], dtype, &d).unwrap());
        manual_seed(9);
        let c = vals(&Tensor::rand(&[1001], dtype, &Device::Cpu).unwrap());
        assert_eq!(g, c);
    }
    manual_seed(3);
    let g = Tensor::randint(-5, 17, &[999], &d).unwrap().to_device(&Device::Cpu).unwrap().to_vec::<i64>().unwrap();
    manual_seed(3);
    let c = Tensor::randint(-5, 17, &[999], &Device::Cpu).unwrap().to_vec::<i64>().unwrap();
    assert_eq!(g, c);
}

/// Run as a child process by the test below: compiles one kernel of its own and reports where
/// its cubin came from.
#[test]
#[ignore = "run as a child process by kernels_come_from_the_disk_cache_in_a_second_process"]
fn kernel_cache_child() {
    let d = gpu().expect("run with KILN_TEST_DEVICE=cuda");
    let x = Tensor::randn(&[77], DType::F64, &d).unwrap();
    let _ = x.gelu_tanh().unwrap().erf().unwrap().to_vec::<f64>().unwrap();
    let (compiled, disk) = cuda::kernel_cache_counts();
    println!("KILN_CACHE compiled={compiled} disk={disk}");
}

#[test]
fn kernels_come_from_the_disk_cache_in_a_second_process() {
    let Some(_) = gpu() else { return };
    let dir = std::env::temp_dir().join(format!("kiln-cache-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let run = || {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["cuda::kernel_cache_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
            .env("KILN_CACHE_DIR", &dir)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let line = text.lines().find_map(|l| l.split_once("KILN_CACHE").map(|(_, rest)| rest)).unwrap_or_else(|| panic!("child printed no counts:\n{text}\n{}", String::from_utf8_lossy(&out.stderr))).to_string();
        let num = |k: &str| line.split_whitespace().find_map(|w| w.strip_prefix(k)).unwrap().parse::<u64>().unwrap();
        (num("compiled="), num("disk="))
    };
    let (c1, d1) = run();
    assert!(c1 > 0 && d1 == 0, "first process compiles: compiled={c1} disk={d1}");
    let (c2, d2) = run();
    assert!(c2 == 0 && d2 >= c1, "second process loads every kernel from disk: compiled={c2} disk={d2}");
    let _ = std::fs::remove_dir_all(&dir);
}
