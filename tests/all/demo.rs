//! The `kiln` program's demo runs to the end and learns.

use crate::common::*;

#[test]
fn the_demo_trains_to_the_end() {
    let d = dev();
    let mut out = Vec::new();
    let r = kiln::demo::run(200, &d, false, &mut out).unwrap();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("held-out accuracy") && text.contains("eager step"), "{text}");
    assert!(r.last_loss < r.first_loss, "{r:?}");
    assert!(r.accuracy > 0.2, "better than chance (0.1): {r:?}");
    assert_eq!(r.kernels_per_step.is_some(), d.is_cuda());
}
