//! The Chrome trace format (chrome://tracing, Perfetto): "X" slices on a host track (pid 0:
//! launches, copies, syncs, CPU kernels) and one track per CUDA stream (pid 1 + device ordinal),
//! with, where CUPTI reported them, the kernels each launch ran on tracks of their own (a
//! library's kernels, every kernel of a graph replay), "C" counters for the device memory in
//! use, "M" records naming the tracks, and a track of marks a tool laid over the timeline (the
//! doctor's idle gaps).

use super::{Event, EventKind};
use crate::Device;
use serde_json::{json, Map, Value};

/// A device track: launches timed by events on a stream (by its handle, 0 for the default
/// stream), or the kernels CUPTI saw run on a stream (by CUPTI's stream id).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Track {
    Launches(u64),
    Kernels(u32),
    Marks,
}

/// A slice a tool marks on a device's timeline, on a track of its own.
pub(crate) struct Mark {
    pub device: Device,
    pub name: String,
    pub start_us: f64,
    pub us: f64,
    pub args: Value,
}

/// The track number of `key` on its device's process, numbered in order of appearance.
fn track(tracks: &mut Vec<(Device, Track)>, key: (Device, Track)) -> u64 {
    let i = tracks.iter().position(|t| *t == key).unwrap_or_else(|| {
        tracks.push(key);
        tracks.len() - 1
    });
    i as u64
}

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

/// The trace of `events`, with `marks` on a track named `marks_track` of each device's process.
pub(super) fn chrome_trace(events: &[Event], marks: &[Mark], marks_track: &str) -> Value {
    let mut out = vec![meta("process_name", 0, 0, "host".into()), meta("thread_name", 0, 0, "profiled thread".into())];
    // Tracks become small numbers per device, in order of appearance.
    let mut tracks: Vec<(Device, Track)> = Vec::new();
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
            let tid = track(&mut tracks, (e.device, Track::Launches(e.stream.unwrap_or(0))));
            out.push(json!({"name": e.name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": device_pid(e.device), "tid": tid, "args": args(e)}));
        }
        for k in &e.device_kernels {
            let tid = track(&mut tracks, (e.device, Track::Kernels(k.stream)));
            let a = json!({"grid": [k.grid.0, k.grid.1, k.grid.2], "block": [k.block.0, k.block.1, k.block.2], "launched by": e.name, "in a CUDA graph": k.in_graph});
            out.push(json!({"name": k.name, "cat": "kernel", "ph": "X", "ts": k.device_start_us, "dur": k.device_us, "pid": device_pid(e.device), "tid": tid, "args": a}));
        }
        if e.device.is_cuda() && !devices.contains(&e.device) {
            devices.push(e.device);
        }
    }
    for m in marks {
        let tid = track(&mut tracks, (m.device, Track::Marks));
        out.push(json!({"name": m.name, "cat": "mark", "ph": "X", "ts": m.start_us, "dur": m.us, "pid": device_pid(m.device), "tid": tid, "args": m.args}));
        if !devices.contains(&m.device) {
            devices.push(m.device);
        }
    }
    for d in devices {
        out.push(meta("process_name", device_pid(d), 0, d.to_string()));
    }
    for (tid, (d, t)) in tracks.iter().enumerate() {
        let name = match t {
            Track::Launches(s) => format!("stream {s:#x}"),
            Track::Kernels(s) => format!("kernels (CUPTI), stream {s}"),
            Track::Marks => marks_track.to_string(),
        };
        out.push(meta("thread_name", device_pid(*d), tid as u64, name));
    }
    json!({"traceEvents": out, "displayTimeUnit": "ms"})
}

#[cfg(test)]
mod tests {
    use super::super::{DeviceKernel, Event, EventKind};
    use crate::Device;

    fn launch(name: &str, stream: u64, ran: Vec<DeviceKernel>) -> Event {
        let d = Device::Cuda(0);
        Event { kind: EventKind::Kernel, name: name.into(), device: d, start_us: 0.0, host_us: 1.0, device_us: Some(2.0), device_start_us: Some(3.0), grid: None, block: None, stream: Some(stream), bytes: 0, bytes_in_use: None, location: None, device_kernels: ran }
    }

    fn ran(name: &str, stream: u32) -> DeviceKernel {
        DeviceKernel { name: name.into(), device_start_us: 3.5, device_us: 1.0, grid: (1, 1, 1), block: (32, 1, 1), stream, in_graph: true }
    }

    #[test]
    fn kernels_cupti_saw_get_tracks_apart_from_the_launch_tracks() {
        let events = [launch("replay", 0x10, vec![ran("k1", 7), ran("k2", 7)]), launch("gemm", 0x10, vec![ran("xmma", 9)])];
        let trace = super::chrome_trace(&events, &[], "");
        let all = trace["traceEvents"].as_array().unwrap();
        let tid = |name: &str| all.iter().find(|e| e["name"] == name && e["pid"] == 1).map(|e| e["tid"].as_u64().unwrap());
        // The launches share their stream's track; CUPTI's streams 7 and 9 get one each.
        assert_eq!((tid("replay"), tid("gemm"), tid("k1"), tid("k2"), tid("xmma")), (Some(0), Some(0), Some(1), Some(1), Some(2)));
        let names: Vec<&str> = all.iter().filter(|e| e["name"] == "thread_name" && e["pid"] == 1).map(|e| e["args"]["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["stream 0x10", "kernels (CUPTI), stream 7", "kernels (CUPTI), stream 9"]);
        assert!(all.iter().any(|e| e["name"] == "k1" && e["args"]["launched by"] == "replay" && e["args"]["in a CUDA graph"] == true));
    }

    #[test]
    fn marks_go_on_a_named_track_of_their_device() {
        let events = [launch("gemm", 0x10, vec![])];
        let marks = [super::Mark { device: Device::Cuda(0), name: "idle".into(), start_us: 5.0, us: 4.0, args: serde_json::json!({"look at": "a.rs:3"}) }];
        let trace = super::chrome_trace(&events, &marks, "gaps");
        let all = trace["traceEvents"].as_array().unwrap();
        let mark = all.iter().find(|e| e["name"] == "idle").unwrap();
        assert_eq!((mark["pid"].as_u64(), mark["tid"].as_u64(), mark["ts"].as_f64(), mark["dur"].as_f64()), (Some(1), Some(1), Some(5.0), Some(4.0)));
        assert_eq!(mark["args"]["look at"], "a.rs:3");
        assert!(all.iter().any(|e| e["name"] == "thread_name" && e["pid"] == 1 && e["tid"] == 1 && e["args"]["name"] == "gaps"));
    }
}
