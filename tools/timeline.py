"""The device kernels of a `kiln profile --trace` file in start order: each kernel's start
(from the first), duration and the gap since the latest end before it, then where the span
went (kernels busy, gaps) and the kernels grouped by name. Shows whether a compiled step's
kernels overlap (graph branches) or wait on each other.
    python3 tools/timeline.py trace.json [rows]"""
import json, sys
from collections import defaultdict

events = json.load(open(sys.argv[1]))["traceEvents"]
rows = int(sys.argv[2]) if len(sys.argv) > 2 else 200
ks = sorted((e for e in events if e.get("cat") == "kernel" and e.get("pid", 0) != 0), key=lambda e: e["ts"])
if not ks:
    sys.exit("no device kernels in the trace")
t0, end, busy_until, gaps = ks[0]["ts"], ks[0]["ts"], ks[0]["ts"], 0.0
groups = defaultdict(lambda: [0, 0.0])
for i, k in enumerate(ks):
    gap = k["ts"] - busy_until
    gaps += max(gap, 0.0)
    busy_until = max(busy_until, k["ts"] + k["dur"])
    g = groups[k["name"][:48]]
    g[0] += 1
    g[1] += k["dur"]
    if i < rows:
        print(f"{k['ts'] - t0:9.2f} us  {k['dur']:7.2f}  gap {gap:6.2f}  tid {k.get('tid')}  {k['name'][:70]}")
span = busy_until - t0
print(f"{len(ks)} kernels over {span:.1f} us: summed durations {sum(k['dur'] for k in ks):.1f} us, idle gaps {gaps:.1f} us")
for name, (n, us) in sorted(groups.items(), key=lambda x: -x[1][1])[:25]:
    print(f"  {n:4d} x {us / n:7.2f} us = {us:8.1f}  {name}")
