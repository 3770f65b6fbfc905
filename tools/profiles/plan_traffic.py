"""Bytes each fused kernel of a compiled program moves, estimated from its plan.

    KILN_PLAN_FOR=cuda KILN_LOG=fusion kiln profile WORKLOAD --compiled > plan.txt
    python3 tools/profiles/plan_traffic.py plan.txt [--rows 40]

Reads the first program's kernel list (the lines after "N kernels, M library products, S
steps") and counts, per kernel, every full-size input once and every stored output once at its
dtype's size; row inputs and outputs count one value per row, broadcast inputs nothing. Inputs
that are views (a broadcast made outside the kernel) count at full size, so the figure is an
upper bound for them. Also counts the stored outputs that are broadcasts of row values (a view
would do) and the outputs of one kernel that compute the same expression twice.
"""
import argparse, re

SIZE = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "U8": 1, "Bool": 1}

ap = argparse.ArgumentParser()
ap.add_argument("plan")
ap.add_argument("--rows", type=int, default=40)
args = ap.parse_args()

lines = open(args.plan).read().split("\n")
start = next(i for i, l in enumerate(lines) if re.match(r"\d+ kernels, \d+ library products", l))
kernels = []
for l in lines[start + 1:]:
    if not l.startswith("  fused_"):
        break
    kernels.append(l)

rows, broadcast_bytes, broadcasts, duplicate_bytes, duplicates = [], 0, 0, 0, 0
for l in kernels:
    name, space, dims, rest = re.match(r"  (\S+) (\w+) \{([^}]*)\}:(.*)", l).groups()
    d = {k.strip(): int(v) for k, v in (x.split(":") for x in dims.split(","))}
    if space == "Flat":
        full, per_row = d["numel"], d["numel"]
    elif space == "Rows":
        full, per_row = d["rows"] * d["cols"], d["rows"]
    else:  # Mid: the kept dim's values are the row values
        full, per_row = d["outer"] * d["rows"] * d["inner"], d["rows"]
    parts = [p.strip() for p in rest.split("|")]
    ops = {}
    for p in parts[1:]:
        m = re.match(r"t(\d+)=(\w+)(?:\(([^)]*)\))?\[([^\]]*)\]:(\w+)(\(row\))?$", p)
        if m:
            ops[m.group(1)] = m.groups()[1:]
    moved = 0
    for i, (node, row) in enumerate(re.findall(r"in\d+=(%\d+)(\(row\))?", parts[0])):
        # The first op reading the input says how (broadcast or not) and at which dtype.
        use = next(((k, a, o, dt) for k, a, o, dt, _ in ops.values() if f"In({i})" in o.split(", ")), None)
        if use is None or use[0] == "Broadcast":
            continue
        kind, arg, _, dt = use
        if kind == "Binary" and arg:
            dt = arg.split(",")[1].strip()
        moved += (per_row if row else full) * SIZE.get(dt, 4)
    seen = {}
    for node, t in re.findall(r"(%\d+)<-t(\d+)", l):
        kind, arg, operands, dt, row = ops[t]
        n = per_row if row else full
        moved += n * SIZE.get(dt, 4)
        expr = (kind, arg, operands)
        if kind == "Broadcast" and not row:
            broadcasts += 1
            broadcast_bytes += n * SIZE.get(dt, 4)
        if expr in seen and not row:
            duplicates += 1
            duplicate_bytes += n * SIZE.get(dt, 4)
        seen[expr] = node
    rows.append((moved, name, space, dims.strip()))

total = sum(r[0] for r in rows)
print(f"{len(rows)} kernels: {total / 1e9:.2f} GB, {total / 4.8e12 * 1e3:.2f} ms at the H200's 4.8 TB/s")
print(f"stored broadcasts of row values: {broadcasts} ({broadcast_bytes / 1e6:.0f} MB); outputs computed twice in one kernel: {duplicates} ({duplicate_bytes / 1e6:.0f} MB)")
for moved, name, space, dims in sorted(rows, reverse=True)[: args.rows]:
    print(f"{moved / 1e6:9.1f} MB  {name[:64]:64s} {space} {dims}")
