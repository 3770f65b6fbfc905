//! Compiler services on the device: max-autotune's timed choices, kept on disk (`autotune`), and
//! the rehearsal that builds a first run's kernels side by side before it runs (`rehearsal`).

pub(crate) mod autotune;
pub(crate) mod rehearsal;
