//! The CPU's native fused kernels (C compiled at run time) against its interpreter: the same
//! compiled functions run both ways on the host, over flat and row kernels, every float dtype,
//! integer and boolean values, broadcast and strided inputs, values beyond the fast sin/cos
//! range, NaN and infinities.

use crate::common::{assert_close, assert_close_named, host_rand, vals};
use kiln::compile::compile;
use kiln::cpu::{cpu_codegen_counts, set_cpu_codegen, CpuCodegen};
use kiln::nn::functional as F;
use kiln::{DType, Device, Result, Tensor};

/// `f` compiled twice and run on `xs`, once natively and once interpreted: (native, interpreted).
fn both(xs: &[Tensor], f: impl Fn(&[Tensor]) -> Result<Tensor> + Clone + Send + Sync + 'static) -> (Vec<f64>, Vec<f64>) {
    let run = |how: CpuCodegen| {
        let prev = set_cpu_codegen(Some(how));
        let g = f.clone();
        let c = compile(move |xs: &[Tensor]| Ok(vec![g(xs)?]));
        let before = cpu_codegen_counts();
        let out = c.call(xs).unwrap().remove(0);
        let after = cpu_codegen_counts();
        set_cpu_codegen(prev);
        (vals(&out), after.native_runs - before.native_runs, after.interpreted_runs - before.interpreted_runs)
    };
    let (native, n_native, n_interp_there) = run(CpuCodegen::C);
    let (interp, n_native_there, _) = run(CpuCodegen::Interpret);
    if compiler_found() {
        assert!(n_native > 0 && n_interp_there == 0, "every kernel ran natively ({n_native} native, {n_interp_there} interpreted; last build error: {:?})", kiln::cpu::cpu_codegen_error());
    }
    assert_eq!(n_native_there, 0, "the interpreter ran the second");
    (native, interp)
}

/// Whether this machine has a C compiler (CI's does; elsewhere the native path falls back).
fn compiler_found() -> bool {
    std::process::Command::new(std::env::var("CC").unwrap_or_else(|_| "cc".into())).arg("--version").output().is_ok_and(|o| o.status.success())
}

fn host(values: Vec<f64>, shape: &[usize], dtype: DType) -> Tensor {
    Tensor::from_vec(values, shape, &Device::Cpu).unwrap().to_dtype(dtype).unwrap()
}

#[test]
fn flat_kernels_match_the_interpreter_bit_for_bit_in_every_float_dtype() {
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        let x = host(host_rand(5000, 1).iter().map(|v| v * 3.0).collect(), &[50, 100], dt);
        let (a, b) = both(&[x], |xs| {
            let x = &xs[0];
            x.sin()?.exp()?.add(&x.cos()?.abs()?.log()?)?.mul(&x.tanh()?)?.add(&x.sigmoid()?.sqrt()?)
        });
        assert_close_named(&format!("{dt:?}"), &a, &b, 0.0, 0.0);
    }
}

#[test]
fn sin_and_cos_beyond_the_fast_range_and_special_values_match() {
    let mut v = host_rand(6000, 2).iter().map(|x| x * 100.0).collect::<Vec<_>>();
    v.extend([1e5, -3e7, 8192.0, 8192.5, f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 0.0, -0.0, 1e-40, 88.0, 89.5, -104.5]);
    let n = v.len();
    let x = host(v, &[n], DType::F32);
    let (a, b) = both(std::slice::from_ref(&x), |xs| xs[0].sin()?.add(&xs[0].cos()?));
    assert_close(&a, &b, 0.0, 0.0);
    let (a, b) = both(&[x], |xs| xs[0].exp()?.add(&xs[0].abs()?.log()?));
    assert_close(&a, &b, 0.0, 0.0);
}

#[test]
fn row_kernels_match_the_interpreter() {
    for dt in [DType::F32, DType::F64, DType::BF16] {
        for cols in [7, 64, 301, 2048] {
            let x = host(host_rand(24 * cols, cols as u64), &[24, cols], dt);
            let w = host(host_rand(cols, 3), &[cols], dt);
            let b = host(host_rand(cols, 4), &[cols], dt);
            let (p, q) = both(std::slice::from_ref(&x), |xs| F::softmax(&xs[0], -1));
            assert_close_named(&format!("softmax {dt:?} {cols}"), &p, &q, 0.0, 0.0);
            let (p, q) = both(&[x.clone(), w, b], move |xs| F::layer_norm(&xs[0], &[cols], Some(&xs[1]), Some(&xs[2]), 1e-5));
            assert_close_named(&format!("layer_norm {dt:?} {cols}"), &p, &q, 0.0, 0.0);
            let (p, q) = both(&[x], |xs| xs[0].amax(&[-1], true)?.add(&xs[0].sum(&[-1], true)?)?.add(&xs[0].amin(&[-1], false)?.unsqueeze(1)?));
            assert_close_named(&format!("max + sum + min {dt:?} {cols}"), &p, &q, 0.0, 0.0);
        }
    }
}

#[test]
fn broadcast_strided_integer_and_boolean_inputs_match() {
    let x = host(host_rand(64 * 96, 5), &[64, 96], DType::F32);
    let bias = host(host_rand(96, 6), &[96], DType::F32);
    let (a, b) = both(&[x.clone(), bias], |xs| xs[0].add(&xs[1])?.relu());
    assert_close(&a, &b, 0.0, 0.0);
    // A transposed input: strided runs.
    let (a, b) = both(std::slice::from_ref(&x), |xs| xs[0].t()?.exp()?.mul_scalar(2.0));
    assert_close(&a, &b, 0.0, 0.0);
    let i = host(host_rand(64 * 96, 7).iter().map(|v| (v * 50.0).round()).collect(), &[64, 96], DType::I64);
    let (a, b) = both(&[i.clone(), x.clone()], |xs| {
        let m = xs[0].gt_scalar(3.0)?;
        kiln::where_(&m, &xs[1], &xs[0].to_dtype(DType::F32)?.remainder_scalar(7.0)?)
    });
    assert_close(&a, &b, 0.0, 0.0);
    let (a, b) = both(&[i], |xs| xs[0].mul_scalar(3.0)?.sub_scalar(5.0)?.abs()?.sum(&[-1], false));
    assert_close(&a, &b, 0.0, 0.0);
}

#[test]
fn compiled_gradients_are_the_same_natively() {
    let x = host(host_rand(64 * 80, 8), &[64, 80], DType::F64).requires_grad();
    let grad = |how: CpuCodegen| {
        let prev = set_cpu_codegen(Some(how));
        let f = compile(|x: &Tensor| F::softmax(&x.sin()?.mul_scalar(2.0)?, -1)?.mul(x)?.sum_all());
        let x = x.detach().requires_grad();
        f.call(&x).unwrap().backward().unwrap();
        set_cpu_codegen(prev);
        vals(&x.grad().unwrap())
    };
    assert_close(&grad(CpuCodegen::C), &grad(CpuCodegen::Interpret), 0.0, 0.0);
}


/// Run as a child process by the test below, with 8 MiB as the streaming threshold.
#[test]
#[ignore = "run as a child process by row_kernels_with_outputs_past_the_caches_stream_them_out_unchanged"]
fn streamed_rows_child() {
    // Over 8 MiB of output, in rows whose starts fall at every alignment (odd widths): the
    // streaming stores' unaligned heads and tails.
    for (dt, rows, cols) in [(DType::F32, 1030, 2051), (DType::F64, 520, 2049)] {
        let x = host(host_rand(rows * cols, 5), &[rows, cols], dt);
        let w = host(host_rand(cols, 6), &[cols], dt);
        let (p, q) = both(std::slice::from_ref(&x), |xs| F::softmax(&xs[0], -1));
        assert_close_named(&format!("softmax {dt:?}"), &p, &q, 0.0, 0.0);
        let (p, q) = both(&[x, w], move |xs| F::layer_norm(&xs[0], &[cols], Some(&xs[1]), None, 1e-5));
        assert_close_named(&format!("layer_norm {dt:?}"), &p, &q, 0.0, 0.0);
    }
}

#[test]
fn row_kernels_with_outputs_past_the_caches_stream_them_out_unchanged() {
    if !compiler_found() {
        return;
    }
    // A fresh kernel cache, so every kernel is generated and its source logged.
    let cache = std::env::temp_dir().join(format!("kiln-stream-test-{}", std::process::id()));
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["cpu_codegen::streamed_rows_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("KILN_CPU_STREAM_BYTES", (8 << 20).to_string())
        .env("KILN_CACHE_DIR", &cache)
        .env("KILN_LOG", "kernels")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    // The sources the child compiled (each named in its log line) stream their rows out.
    let sources: Vec<String> = stderr.lines().filter_map(|l| l.rsplit_once('(').and_then(|(_, p)| p.strip_suffix(')')).filter(|p| p.ends_with(".c")).and_then(|p| std::fs::read_to_string(p).ok())).collect();
    let _ = std::fs::remove_dir_all(&cache);
    assert!(sources.len() >= 4, "four row kernels compiled:\n{stderr}");
    assert!(sources.iter().all(|s| s.contains("kstream(o0")), "every row kernel streams its output");
}

/// Run as a child process without a C compiler by the test below: a compiled softmax against
/// the eager one, and this process's native and interpreted runs.
#[test]
#[ignore = "run as a child process by without_a_c_compiler_kernels_are_interpreted_with_one_warning_and_the_same_results"]
fn no_compiler_child() {
    let x = host(host_rand(64 * 300, 9), &[64, 300], DType::F32);
    let f = compile(|x: &Tensor| F::softmax(&x.exp()?, -1));
    let got = vals(&f.call(&x).unwrap());
    assert_close(&got, &vals(&kiln::no_grad(|| F::softmax(&x.exp()?, -1)).unwrap()), 0.0, 0.0);
    let c = cpu_codegen_counts();
    println!("KILN_NO_CC native={} interpreted={}", c.native_runs, c.interpreted_runs);
}

#[test]
fn without_a_c_compiler_kernels_are_interpreted_with_one_warning_and_the_same_results() {
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["cpu_codegen::no_compiler_child", "--exact", "--ignored", "--nocapture", "--test-threads=1"])
        .env("CC", "/nonexistent/cc")
        .env_remove("KILN_LOG")
        .output()
        .unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "child failed:\n{stdout}\n{stderr}");
    let counts = stdout.lines().find_map(|l| l.split_once("KILN_NO_CC ").map(|(_, r)| r.to_string())).unwrap_or_else(|| panic!("no counts:\n{stdout}"));
    assert!(counts.starts_with("native=0 ") && !counts.ends_with("interpreted=0"), "{counts}");
    let warnings: Vec<&str> = stderr.lines().filter(|l| l.contains("no C compiler")).collect();
    assert_eq!(warnings.len(), 1, "one line says why:\n{stderr}");
}

#[test]
fn sizes_around_every_vector_width_block_and_chunk_boundary_match_the_interpreter() {
    // Flat: the vector widths (4, 8, 16 lanes), four-wide unrolling, the tasks' chunks (16384)
    // and the parallel threshold (32768); a broadcast row and a strided (transposed) operand.
    for dt in [DType::F32, DType::F64, DType::F16, DType::BF16] {
        for n in [1, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 16383, 16384, 16385, 32767, 32768, 32769, 65537] {
            let x = host(host_rand(n, n as u64), &[n], dt);
            let (a, b) = both(std::slice::from_ref(&x), |xs| xs[0].exp()?.mul(&xs[0].sin()?)?.add_scalar(0.5));
            assert_close_named(&format!("flat {dt:?} {n}"), &a, &b, 0.0, 0.0);
        }
        for (r, c) in [(3, 17), (17, 33), (129, 257), (2, 16385)] {
            let x = host(host_rand(r * c, 7), &[r, c], dt);
            let row = host(host_rand(c, 8), &[c], dt);
            let xt = host(host_rand(r * c, 9), &[c, r], dt);
            let (a, b) = both(&[x, row, xt], |xs| xs[0].mul(&xs[1])?.add(&xs[2].t()?)?.relu());
            assert_close_named(&format!("broadcast and strided {dt:?} {r}x{c}"), &a, &b, 0.0, 0.0);
        }
    }
    // Rows: the 32 lanes a reduction folds into, its blocks of 256, and the rows per task.
    for dt in [DType::F32, DType::F64, DType::BF16] {
        for cols in [1, 2, 31, 32, 33, 255, 256, 257, 513] {
            for rows in [1, 7, 9] {
                let x = host(host_rand(rows * cols, (rows * cols) as u64), &[rows, cols], dt);
                let (p, q) = both(std::slice::from_ref(&x), |xs| F::log_softmax(&xs[0], -1)?.add(&xs[0].sum(&[-1], true)?));
                assert_close_named(&format!("rows {dt:?} {rows}x{cols}"), &p, &q, 0.0, 0.0);
            }
        }
    }
}
