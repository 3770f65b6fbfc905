"""Summarises a `KILN_LOG=kernels` log's matrix-product autotuning: per problem, the fastest
cuBLASLt candidate, the fastest generated kernel and the winner.
Usage: python3 tools/autotune_summary.py LOG"""
import re, sys

blocks, cur = [], None
for line in open(sys.argv[1], errors="replace"):
    m = re.search(r"autotune gemm Problem \{(.*)\}:", line)
    if m:
        cur = {"problem": m.group(1), "lt": [], "gen": []}
        blocks.append(cur)
        continue
    m = re.match(r"\s+(.*): ([0-9.]+) ms", line)
    if cur is not None and m:
        (cur["gen"] if m.group(1).startswith("generated") else cur["lt"]).append((float(m.group(2)), m.group(1)))
    elif cur is not None and not line.startswith(" "):
        cur = None
for b in blocks:
    p = b["problem"]
    dims = " ".join(f"{k}={v}" for k, v in re.findall(r"\b(batch|m|n|k|epilogue): (\w+)", p))
    lt = min(b["lt"]) if b["lt"] else (float("nan"), "-")
    gen = min(b["gen"]) if b["gen"] else (float("nan"), "-")
    print(f"{dims}: cuBLASLt {lt[0] * 1e3:.1f} us ({lt[1][:40]}), generated {gen[0] * 1e3:.1f} us ({gen[1]}), x{lt[0] / gen[0]:.2f}")
