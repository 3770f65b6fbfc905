//! The `kiln` program's demo runs to the end, learns, and profiles a training step.

use crate::common::*;

#[test]
fn the_demo_trains_to_the_end_and_profiles_a_step() {
    let d = dev();
    let mut out = Vec::new();
    let r = kiln::demo::run(200, &d, false, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("held-out accuracy") && text.contains("eager step"), "{text}");
    assert!(r.last_loss < r.first_loss, "{r:?}");
    assert!(r.accuracy > 0.2, "better than chance (0.1): {r:?}");
    // Forward, loss, backward and update: two products forward, four backward at least.
    assert!(r.kernels_per_step >= 6, "{r:?}");
    assert_eq!(r.kernels_per_step, r.profile.kernel_count());
    assert!(text.contains(&format!("{} kernels per step", r.kernels_per_step)), "{text}");
    let matmul = if d.is_cuda() { "cublas_gemm_float32" } else { "matmul" };
    assert!(r.profile.key_averages().get(matmul).is_some_and(|m| m.calls >= 5), "{:?}", r.profile.kernel_names());
    let avg = r.profile.key_averages();
    let top = &avg.sorted(kiln::profiler::SortBy::DeviceTimeTotal)[0].name;
    assert!(text.contains("device total") && text.contains(top.as_str()), "the table is printed:\n{text}");
}

#[test]
fn the_demo_needs_a_step() {
    let e = kiln::demo::run(0, &dev(), false, &mut Vec::new()).unwrap_err().to_string();
    assert!(e.contains("demo") && e.contains("at least one training step"), "{e}");
}

#[test]
fn the_language_model_demo_learns_and_scores_every_held_out_sum() {
    let mut out = Vec::new();
    // A step budget, not a time budget, so a loaded machine runs the same training.
    let r = kiln::demo::lm::run(3600.0, 40, &dev(), false, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert_eq!(r.steps, 40, "{r:?}");
    assert!(r.last_loss < 0.8 * r.first_loss, "40 steps lower the loss: {r:?}");
    assert_eq!(r.held_out, 1000, "one sum in ten is held out");
    assert!((0.0..=1.0).contains(&r.exact_match), "{r:?}");
    assert!(text.contains(&format!("held-out sums answered exactly: {} of 1000", (r.exact_match * 1000.0).round() as usize)), "{text}");
    let e = kiln::demo::lm::run(0.0, 10, &dev(), false, &mut Vec::new()).unwrap_err().to_string();
    assert!(e.contains("seconds"), "{e}");
}
