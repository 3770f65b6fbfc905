//! Every family of generated kernel compiled by NVRTC without a GPU: a source that does not
//! compile shows up on any machine that has the NVRTC library (`tools/nvrtc/local.sh` fetches
//! one), not first on a GPU. Each generator lists sources that take its branches (`samples()`
//! beside it); this test compiles them all for Hopper (`sm_90`, where the prelude's
//! programmatic-launch and acquire-release code is in) and Ampere (`sm_80`, where it is not).

use crate::backend::cuda::device::nvrtc;
use rayon::prelude::*;

/// One source a generator writes, with the NVRTC options it is compiled with.
pub(super) struct Sample {
    pub name: String,
    pub src: String,
    pub options: Vec<String>,
}

impl Sample {
    pub(super) fn new((name, src): (String, String)) -> Sample {
        Sample { name, src, options: vec![] }
    }
}

/// Whether this process can load NVRTC (cudarc's dynamic loading).
fn nvrtc_loadable() -> bool {
    // SAFETY: only looks the library up.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

fn all_samples() -> Vec<Sample> {
    let mut all = vec![];
    all.extend(super::codegen::samples());
    all.extend(super::fused::tests::samples());
    all.extend(super::attention::samples());
    all.extend(super::gemv::samples());
    all.extend(super::tf32::samples());
    all.extend(super::foreach::samples());
    all.extend(super::maxpool::samples());
    all.extend(super::copies::samples());
    // Programs schedule the same kernel more than once.
    let mut seen = std::collections::HashSet::new();
    all.retain(|s| seen.insert(s.src.clone()));
    all
}

#[test]
fn every_kernel_family_has_samples() {
    // Without NVRTC the sources are still generated (a generator that panics fails here).
    let all = all_samples();
    for family in ["map_", "sum_", "argmax_", "gather_", "scatter_", "bmm_", "gemv_rows", "gemv_cols", "gemv_rows_bfloat16_fused", "gemv_cols2_r6_float32_fused", "_attend64", "attention_fwd_up_to", "attention_fwd_tc", "attention_bwd_kv", "tf32_gemm_nk", "tf32_gemm_kn", "foreach_", "max_pool2d", "_r"] {
        assert!(all.iter().any(|s| s.name.contains(family)), "no sample of {family}: {:?}", all.iter().map(|s| &s.name).collect::<Vec<_>>());
    }
    // The compiler's mid kernels, both renderings (the eager reductions' names have these
    // parts too).
    for family in ["_mid", "_cols"] {
        assert!(all.iter().any(|s| s.name.starts_with("fused_") && s.name.contains(family)), "no fused sample of {family}");
    }
    // A looped row kernel folding two reductions in one walk (cross-entropy's).
    assert!(all.iter().any(|s| s.name.starts_with("fused_") && s.name.contains("_loop_") && s.src.matches("for (int kbase").count() + 1 < s.src.matches("kb_").count()), "no fused sample of a merged walk");
    // A row kernel storing its rows padded (`fuse::pad_row_outputs`).
    assert!(all.iter().any(|s| s.name.starts_with("fused_") && s.src.contains(" + K + j] = ")), "no fused sample of padded rows");
    for s in &all {
        assert!(s.src.contains(&s.name), "{}: the source does not define its kernel", s.name);
    }
    // `KILN_SAMPLES_DIR=DIR`: every source written there as `NAME.cu`, for
    // `tools/rows/nvrtc_regs.py` (registers and spills without a GPU).
    if let Some(dir) = std::env::var_os("KILN_SAMPLES_DIR") {
        let dir = std::path::PathBuf::from(dir);
        std::fs::create_dir_all(&dir).unwrap();
        for s in &all {
            std::fs::write(dir.join(format!("{}.cu", s.name)), &s.src).unwrap();
        }
    }
}

#[test]
fn every_generated_kernel_compiles_with_nvrtc() {
    if !nvrtc_loadable() {
        eprintln!("skipped: no NVRTC library here (tools/nvrtc/local.sh fetches one)");
        return;
    }
    let all = all_samples();
    let failures: Vec<String> = all
        .par_iter()
        .flat_map_iter(|s| ["sm_90", "sm_80"].into_iter().map(move |arch| (s, arch)))
        .filter_map(|(s, arch)| nvrtc::compile(&s.src, &s.options, true, arch, crate::Device::Cuda(0)).err().map(|e| format!("{} for {arch}: {e}", s.name)))
        .collect();
    assert!(failures.is_empty(), "{} of {} sources do not compile:\n{}", failures.len(), all.len(), failures.join("\n\n"));
    eprintln!("{} sources compiled for sm_90 and sm_80", all.len());
}
