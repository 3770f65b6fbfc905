//! `key_averages`: events grouped by name, printed like `torch.profiler`'s table.

use super::{Event, EventKind};
use std::fmt::Write;

/// The column a table is sorted by (descending).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SortBy {
    DeviceTimeTotal,
    HostTimeTotal,
    Calls,
}

/// One name's figures: every kernel, copy and memset of that name.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelStats {
    pub name: String,
    pub calls: usize,
    /// Sum of measured device times (µs); a CPU kernel's device time is its host time.
    pub device_total_us: f64,
    /// Host time spent launching (on a GPU) or running (on the CPU), µs.
    pub host_total_us: f64,
}

impl KernelStats {
    pub fn device_avg_us(&self) -> f64 {
        self.device_total_us / self.calls as f64
    }
    pub fn host_avg_us(&self) -> f64 {
        self.host_total_us / self.calls as f64
    }
}

/// The profile's work grouped by name, in order of first appearance.
#[derive(Clone, Debug)]
pub struct KeyAverages {
    rows: Vec<KernelStats>,
}

impl KeyAverages {
    pub(super) fn new(events: &[Event]) -> KeyAverages {
        let work = events.iter().filter(|e| matches!(e.kind, EventKind::Kernel | EventKind::Graph | EventKind::Copy(_) | EventKind::Memset));
        Self::grouped(work.map(|e| (e.name.as_str(), e.device_us.unwrap_or(0.0), e.host_us)))
    }

    /// The kernels CUPTI saw the GPU run, grouped by their names (no host times).
    pub(super) fn of_device_kernels(kernels: &[&super::DeviceKernel]) -> KeyAverages {
        Self::grouped(kernels.iter().map(|k| (k.name.as_str(), k.device_us, 0.0)))
    }

    /// (name, device µs, host µs) items summed per name, in order of first appearance.
    fn grouped<'a>(items: impl Iterator<Item = (&'a str, f64, f64)>) -> KeyAverages {
        let mut rows: Vec<KernelStats> = Vec::new();
        for (name, device_us, host_us) in items {
            let i = match rows.iter().position(|r| r.name == name) {
                Some(i) => i,
                None => {
                    rows.push(KernelStats { name: name.to_string(), calls: 0, device_total_us: 0.0, host_total_us: 0.0 });
                    rows.len() - 1
                }
            };
            let r = &mut rows[i];
            r.calls += 1;
            r.device_total_us += device_us;
            r.host_total_us += host_us;
        }
        KeyAverages { rows }
    }

    pub fn rows(&self) -> &[KernelStats] {
        &self.rows
    }

    pub fn get(&self, name: &str) -> Option<&KernelStats> {
        self.rows.iter().find(|r| r.name == name)
    }

    /// The rows sorted by `sort`, largest first (ties keep first-appearance order).
    pub fn sorted(&self, sort: SortBy) -> Vec<&KernelStats> {
        let mut rows: Vec<&KernelStats> = self.rows.iter().collect();
        rows.sort_by(|a, b| match sort {
            SortBy::DeviceTimeTotal => b.device_total_us.total_cmp(&a.device_total_us),
            SortBy::HostTimeTotal => b.host_total_us.total_cmp(&a.host_total_us),
            SortBy::Calls => b.calls.cmp(&a.calls),
        });
        rows
    }

    /// The table of the first `limit` rows by `sort` (`usize::MAX` for all), with totals.
    pub fn table(&self, sort: SortBy, limit: usize) -> String {
        let rows = self.sorted(sort);
        let shown = &rows[..limit.min(rows.len())];
        let width = shown.iter().map(|r| r.name.chars().count()).max().unwrap_or(0).clamp(6, 48);
        let mut s = String::new();
        let _ = writeln!(s, "{:<width$}  {:>6}  {:>12}  {:>12}  {:>12}", "kernel", "calls", "device total", "device avg", "host total");
        for r in shown {
            let _ = writeln!(s, "{:<width$}  {:>6}  {:>12}  {:>12}  {:>12}", clip(&r.name, width), r.calls, fmt_us(r.device_total_us), fmt_us(r.device_avg_us()), fmt_us(r.host_total_us));
        }
        if shown.len() < rows.len() {
            let _ = writeln!(s, "({} more not shown)", rows.len() - shown.len());
        }
        let calls: usize = rows.iter().map(|r| r.calls).sum();
        let device: f64 = rows.iter().map(|r| r.device_total_us).sum();
        let host: f64 = rows.iter().map(|r| r.host_total_us).sum();
        let _ = write!(s, "{:<width$}  {calls:>6}  {:>12}  {:>12}  {:>12}", "total", fmt_us(device), "", fmt_us(host));
        s
    }
}

fn clip(name: &str, width: usize) -> String {
    if name.chars().count() <= width {
        return name.to_string();
    }
    let head: String = name.chars().take(width - 2).collect();
    format!("{head}..")
}

/// µs as torch prints durations: `12.345us`, `1.234ms`, `2.000s`.
pub(crate) fn fmt_us(us: f64) -> String {
    if us < 1e3 {
        format!("{us:.3}us")
    } else if us < 1e6 {
        format!("{:.3}ms", us / 1e3)
    } else {
        format!("{:.3}s", us / 1e6)
    }
}
