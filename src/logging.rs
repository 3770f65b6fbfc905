//! `KILN_LOG`: what kiln tells about its own work, through the `log` facade.
//!
//! `KILN_LOG` is a comma-separated list of categories (`graph,kernels,recompiles,breaks,fusion,
//! sync,alloc,memory`, or `all`), read once. Each topic logs at `info` level to the target
//! `kiln::<topic>` (`kiln::kernels`, ...), so an application's logger can filter them. When a
//! topic is enabled and the application installed no logger, kiln installs a minimal one that
//! prints `[kiln <topic>] message` to stderr, so `KILN_LOG=kernels cargo run` needs no setup.
//!
//! Code in kiln logs with [`log()`] (or the [`kiln_log!`](crate::kiln_log) macro), which builds
//! the message only when the topic is enabled:
//!
//! ```
//! use kiln::logging::{self, Topic};
//! logging::log(Topic::Graph, || format!("captured {} nodes", 3));
//! kiln::kiln_log!(Topic::Fusion, "fused {} ops into {}", 2, "fused_add_relu_0");
//! ```

use crate::{Error, Result};
use std::sync::{Once, OnceLock};

/// What a log line is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Topic {
    /// Captured graphs, as text.
    Graph,
    /// Generated kernels and their source.
    Kernels,
    /// Why a compiled function was traced again.
    Recompiles,
    /// Graph breaks and their reasons.
    Breaks,
    /// Fusion decisions.
    Fusion,
    /// Host synchronisations, with their call sites.
    Sync,
    /// Device memory allocations and frees.
    Alloc,
    /// A compiled program's memory plan: its planned peak of live values.
    Memory,
}

impl Topic {
    pub const ALL: [Topic; 8] = [Topic::Graph, Topic::Kernels, Topic::Recompiles, Topic::Breaks, Topic::Fusion, Topic::Sync, Topic::Alloc, Topic::Memory];

    /// The name used in `KILN_LOG`.
    pub fn name(self) -> &'static str {
        match self {
            Topic::Graph => "graph",
            Topic::Kernels => "kernels",
            Topic::Recompiles => "recompiles",
            Topic::Breaks => "breaks",
            Topic::Fusion => "fusion",
            Topic::Sync => "sync",
            Topic::Alloc => "alloc",
            Topic::Memory => "memory",
        }
    }

    /// The `log` target: `kiln::<name>`.
    pub fn target(self) -> &'static str {
        match self {
            Topic::Graph => "kiln::graph",
            Topic::Kernels => "kiln::kernels",
            Topic::Recompiles => "kiln::recompiles",
            Topic::Breaks => "kiln::breaks",
            Topic::Fusion => "kiln::fusion",
            Topic::Sync => "kiln::sync",
            Topic::Alloc => "kiln::alloc",
            Topic::Memory => "kiln::memory",
        }
    }

    fn bit(self) -> u32 {
        1 << (self as u32)
    }
}

/// The categories a `KILN_LOG` value asks for. Names are trimmed and case-insensitive; empty
/// entries are skipped; an unknown name is an error naming it and the known ones.
pub fn parse(spec: &str) -> Result<Vec<Topic>> {
    let mut cats = Vec::new();
    for word in spec.split(',').map(|w| w.trim().to_ascii_lowercase()).filter(|w| !w.is_empty()) {
        if word == "all" {
            cats.extend(Topic::ALL);
            continue;
        }
        match Topic::ALL.iter().find(|c| c.name() == word) {
            Some(c) => cats.push(*c),
            None => {
                let known: Vec<&str> = Topic::ALL.iter().map(|c| c.name()).collect();
                return Err(Error::arg("KILN_LOG", format!("unknown topic '{word}'; known: {}, all", known.join(", "))));
            }
        }
    }
    cats.dedup();
    Ok(cats)
}

/// The enabled categories as bits, from `KILN_LOG` on first use. A bad value is reported once
/// on stderr and its known names still apply: a typo must not stop the program.
fn mask() -> u32 {
    static MASK: OnceLock<u32> = OnceLock::new();
    *MASK.get_or_init(|| {
        let Some(spec) = crate::switches::log() else { return 0 };
        let known = spec.split(',').filter_map(|w| parse(w).map_err(|e| eprintln!("kiln: {e}")).ok()).flatten();
        known.fold(0, |m, c| m | c.bit())
    })
}

/// Whether `KILN_LOG` enables `topic`.
pub fn enabled(topic: Topic) -> bool {
    mask() & topic.bit() != 0
}

/// Logs the message `msg` builds at `info` level under `topic`, if `KILN_LOG` enables it.
pub fn log(topic: Topic, msg: impl FnOnce() -> String) {
    if enabled(topic) {
        ensure_logger();
        log::info!(target: topic.target(), "{}", msg());
    }
}

/// `kiln_log!(Topic::Graph, "format {}", args)`: [`log()`] with a format string.
#[macro_export]
macro_rules! kiln_log {
    ($cat:expr, $($arg:tt)+) => {
        $crate::logging::log($cat, || format!($($arg)+))
    };
}

/// A warning under `topic` whether or not `KILN_LOG` enables it (sync debug mode's reports).
pub(crate) fn warn(topic: Topic, msg: &str) {
    ensure_logger();
    log::warn!(target: topic.target(), "{msg}");
}

/// Installs [`StderrLogger`] unless the application has a logger; with ours, kiln's lines show.
fn ensure_logger() {
    static INSTALL: Once = Once::new();
    INSTALL.call_once(|| {
        if log::set_logger(&StderrLogger).is_ok() {
            log::set_max_level(log::LevelFilter::Info);
        }
    });
}

/// Prints kiln's records (and others at warn or above) to stderr as `[kiln <topic>] msg`.
struct StderrLogger;

impl log::Log for StderrLogger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.target().starts_with("kiln::") || m.level() <= log::Level::Warn
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            let tag = r.target().strip_prefix("kiln::").map_or_else(|| r.target().to_string(), |c| format!("kiln {c}"));
            eprintln!("[{tag}] {}", r.args());
        }
    }
    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bits_are_distinct() {
        let all = Topic::ALL.iter().fold(0, |m, c| m | c.bit());
        assert_eq!(all.count_ones() as usize, Topic::ALL.len());
    }
}
