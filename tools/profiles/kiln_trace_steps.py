"""How far each device kernel of a `kiln profile --trace` Chrome trace moves the timeline on: its
end minus the latest end before it (kernels in start order), summed by name, with the gaps where
no kernel ran. In a replayed CUDA graph with programmatic dependent launch a kernel starts while
the one before still runs, so its own duration overstates what it adds; this is what it adds.

    python3 tools/profiles/kiln_trace_steps.py TRACE.json[.gz] [--last N] [--each]

--last N: only the last N kernels (one replay of an N-kernel graph); --each: one line per kernel.
"""
import argparse, gzip, json

ap = argparse.ArgumentParser()
ap.add_argument("trace")
ap.add_argument("--last", type=int, default=0)
ap.add_argument("--each", action="store_true")
args = ap.parse_args()
opener = gzip.open if args.trace.endswith(".gz") else open
events = json.load(opener(args.trace, "rt"))
events = events["traceEvents"] if isinstance(events, dict) else events
cupti = {e["tid"] for e in events if e.get("ph") == "M" and e.get("pid") == 1 and "CUPTI" in e["args"].get("name", "")}
device = sorted((e for e in events if e.get("ph") == "X" and e.get("pid") == 1 and e.get("tid") in cupti), key=lambda e: e["ts"])
if args.last:
    device = device[-args.last:]
by_name, end, first = {}, None, None
for e in device:
    s, d = e["ts"], e.get("dur", 0.0)
    first = s if first is None else first
    adds = s + d - end if end is not None else d
    gap = max(0.0, s - end) if end is not None else 0.0
    if args.each:
        print(f"{e['name'][:60]:60s} start {s - first:9.2f} dur {d:7.2f} adds {adds:7.2f} idle before {gap:6.2f}")
    c, t, g, du = by_name.get(e["name"], (0, 0.0, 0.0, 0.0))
    by_name[e["name"]] = (c + 1, t + adds, g + gap, du + d)
    end = max(end or 0.0, s + d)
span = end - first if device else 0.0
print(f"{len(device)} kernels over {span:.2f} us (first start to last end)")
print(f"{'kernel':60s} {'calls':>5s} {'adds us':>9s} {'avg':>6s} {'idle':>7s} {'dur avg':>7s}")
for n, (c, t, g, du) in sorted(by_name.items(), key=lambda kv: -kv[1][1]):
    print(f"{n[:60]:60s} {c:5d} {t:9.2f} {t / c:6.2f} {g:7.2f} {du / c:7.2f}")
