"""Sums the device kernels of a `kiln profile --trace` Chrome trace (CUPTI's timeline: pid 1, the
threads named "kernels (CUPTI)"; pid 1 tid 0 is the launches as kiln's hooks timed them) by name and by kind (`kinds.py`, as `torch_kernels.py` sums PyTorch's), to set beside PyTorch's table.

    python3 tools/profiles/kiln_trace_kinds.py TRACE.json[.gz] [--rows 40]
"""
import argparse, gzip, json
from kinds import kind

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--rows", type=int, default=40)
args = ap.parse_args()
opener = gzip.open if args.trace.endswith(".gz") else open
events = json.load(opener(args.trace, "rt"))
events = events["traceEvents"] if isinstance(events, dict) else events
cupti = {e["tid"] for e in events if e.get("ph") == "M" and e.get("pid") == 1 and "CUPTI" in e["args"].get("name", "")}
device = [e for e in events if e.get("ph") == "X" and e.get("pid") == 1 and e.get("tid") in cupti]

by_name, by_kind = {}, {}
for e in device:
    n, d = e["name"], e.get("dur", 0.0)
    c, t = by_name.get(n, (0, 0.0)); by_name[n] = (c + 1, t + d)
    c, t = by_kind.get(kind(n), (0, 0.0)); by_kind[kind(n)] = (c + 1, t + d)
total = sum(t for _, t in by_kind.values())
print(f"{len(device)} device activities, {total / 1e3:.3f} ms of device time")
for k, (c, t) in sorted(by_kind.items(), key=lambda kv: -kv[1][1]):
    print(f"   {k:42s} {c:5d} calls {t / 1e3:9.3f} ms")
print(f"{'kernel':70s} {'calls':>5s} {'total ms':>9s} {'avg us':>8s}")
for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[: args.rows]:
    print(f"{n[:70]:70s} {c:5d} {t / 1e3:9.3f} {t / c:8.1f}")
