"""Median duration and DRAM traffic per kernel name from `ncu --csv` output (stdin)."""
import csv, sys, statistics, collections
rows = [r for r in csv.reader(l for l in sys.stdin if l.startswith('"'))]
hdr, body = rows[0], rows[1:]
ki, mi, vi = hdr.index("Kernel Name"), hdr.index("Metric Name"), hdr.index("Metric Value")
d = collections.defaultdict(lambda: collections.defaultdict(list))
for r in body:
    try: d[r[ki][:70]][r[mi]].append(float(r[vi].replace(",", "")))
    except ValueError: pass
for k, m in d.items():
    t = statistics.median(m["gpu__time_duration.sum"])
    b = statistics.median(m.get("dram__bytes_read.sum", [0])) + statistics.median(m.get("dram__bytes_write.sum", [0]))
    print(f"{k:70s} n={len(m['gpu__time_duration.sum']):3d} {t/1e3:8.1f} us  {b/1e6:8.1f} MB  {b/t:7.0f} GB/s")
