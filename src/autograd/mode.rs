//! Whether ops record autograd history on this thread.

use std::cell::Cell;

thread_local! {
    static GRAD_ENABLED: Cell<bool> = const { Cell::new(true) };
}

pub fn is_grad_enabled() -> bool {
    GRAD_ENABLED.with(|g| g.get())
}

/// Restores the previous mode when dropped, also on early return or panic.
struct Guard(bool);
impl Drop for Guard {
    fn drop(&mut self) {
        GRAD_ENABLED.with(|g| g.set(self.0));
    }
}

fn with_mode<R>(enabled: bool, f: impl FnOnce() -> R) -> R {
    let _guard = Guard(GRAD_ENABLED.with(|g| g.replace(enabled)));
    f()
}

/// Runs `f` without recording history (`torch.no_grad`): no tape, no saved tensors.
pub fn no_grad<R>(f: impl FnOnce() -> R) -> R {
    with_mode(false, f)
}

/// `torch.inference_mode`: in kiln the same as `no_grad` (recording is already free of
/// per-tensor bookkeeping when it is off).
pub fn inference_mode<R>(f: impl FnOnce() -> R) -> R {
    with_mode(false, f)
}

/// Runs `f` with recording on, inside a `no_grad` region (`torch.enable_grad`).
pub fn enable_grad<R>(f: impl FnOnce() -> R) -> R {
    with_mode(true, f)
}
