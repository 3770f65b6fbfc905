//! The Chrome trace format (chrome://tracing, Perfetto): "X" slices on a host track (pid 0:
//! launches, copies, syncs, CPU kernels) and one track per CUDA stream (pid 1 + device ordinal),
//! with, where CUPTI reported them, the kernels each launch ran on tracks of their own (a
//! library's kernels, every kernel of a graph replay), "C" counters for the device memory in
//! use, "M" records naming the tracks.

use super::{Event, EventKind};
use crate::Device;
use serde_json::{json, Map, Value};

/// Track keys from here up are CUPTI's stream ids; launch tracks are keyed by stream handles
/// (user-space addresses, far below it, or 0 for the default stream).
const CUPTI_TRACKS: u64 = 1 << 62;

fn device_pid(d: Device) -> u64 {
    match d {
        Device::Cpu => 0,
        Device::Cuda(n) => 1 + n as u64,
    }
}

fn meta(kind: &str, pid: u64, tid: u64, name: String) -> Value {
    json!({"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}})
}

fn args(e: &Event) -> Value {
    let mut a = Map::new();
    a.insert("device".into(), json!(e.device.to_string()));
    if let (Some(g), Some(b)) = (e.grid, e.block) {
        a.insert("grid".into(), json!([g.0, g.1, g.2]));
        a.insert("block".into(), json!([b.0, b.1, b.2]));
    }
    if e.bytes > 0 {
        a.insert("bytes".into(), json!(e.bytes));
    }
    if let Some(l) = e.location {
        a.insert("call site".into(), json!(format!("{}:{}:{}", l.file(), l.line(), l.column())));
    }
    Value::Object(a)
}

pub(super) fn chrome_trace(events: &[Event]) -> Value {
    let mut out = vec![meta("process_name", 0, 0, "host".into()), meta("thread_name", 0, 0, "profiled thread".into())];
    // Streams become small track numbers per device, in order of appearance.
    let mut streams: Vec<(Device, u64)> = Vec::new();
    let mut devices: Vec<Device> = Vec::new();
    for e in events {
        let cat = e.kind.name();
        if matches!(e.kind, EventKind::Alloc | EventKind::Free) {
            let in_use = e.bytes_in_use.unwrap_or(0);
            out.push(json!({"name": format!("memory {}", e.device), "ph": "C", "ts": e.start_us, "pid": device_pid(e.device), "args": {"allocated bytes": in_use}}));
        } else {
            out.push(json!({"name": e.name, "cat": cat, "ph": "X", "ts": e.start_us, "dur": e.host_us, "pid": 0, "tid": 0, "args": args(e)}));
        }
        if let (Device::Cuda(_), Some(ts), Some(dur)) = (e.device, e.device_start_us, e.device_us) {
            let key = (e.device, e.stream.unwrap_or(0));
            let tid = streams.iter().position(|s| *s == key).unwrap_or_else(|| {
                streams.push(key);
                streams.len() - 1
            }) as u64;
            out.push(json!({"name": e.name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": device_pid(e.device), "tid": tid, "args": args(e)}));
        }
        for k in &e.device_kernels {
            // CUPTI's stream ids, on tracks after the launch tracks.
            let key = (e.device, CUPTI_TRACKS + k.stream as u64);
            let tid = streams.iter().position(|s| *s == key).unwrap_or_else(|| {
                streams.push(key);
                streams.len() - 1
            }) as u64;
            let a = json!({"grid": [k.grid.0, k.grid.1, k.grid.2], "block": [k.block.0, k.block.1, k.block.2], "launched by": e.name, "in a CUDA graph": k.in_graph});
            out.push(json!({"name": k.name, "cat": "kernel", "ph": "X", "ts": k.device_start_us, "dur": k.device_us, "pid": device_pid(e.device), "tid": tid, "args": a}));
        }
        if e.device.is_cuda() && !devices.contains(&e.device) {
            devices.push(e.device);
        }
    }
    for d in devices {
        out.push(meta("process_name", device_pid(d), 0, d.to_string()));
    }
    for (tid, (d, s)) in streams.iter().enumerate() {
        let name = if *s >= CUPTI_TRACKS { format!("kernels (CUPTI), stream {}", s - CUPTI_TRACKS) } else { format!("stream {s:#x}") };
        out.push(meta("thread_name", device_pid(*d), tid as u64, name));
    }
    json!({"traceEvents": out, "displayTimeUnit": "ms"})
}
