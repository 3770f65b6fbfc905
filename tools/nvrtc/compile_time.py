"""Times NVRTC on kiln's generated kernels: per option set, frontend-only (PTX) against full (cubin),
first compile in the process against later ones, and several sources compiled on threads at once.

    KILN_LOG=kernels kiln bench --only reduction.layernorm 2> kernels.log
    python3 tools/nvrtc/compile_time.py kernels.log
"""
import ctypes, glob, re, sys, threading, time

lib = ctypes.CDLL(sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))[-1])
P = ctypes.c_void_p


def compile_src(src, opts, ptx_only=False):
    prog = P()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
    assert r == 0, r
    arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    t = time.perf_counter()
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    if r == 0:
        size = ctypes.c_size_t()
        (lib.nvrtcGetPTXSize if ptx_only else lib.nvrtcGetCUBINSize)(prog, ctypes.byref(size))
    dt = time.perf_counter() - t
    if r != 0:
        n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, buf)
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
        return None, buf.value.decode()[:200]
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return dt, None


def sources(path):
    text = open(path, errors="replace").read().splitlines()
    out, cur = [], None
    for line in text:
        m = re.match(r"^\[kiln kernels\] (\S+) \((sm_\d+)\):$", line)
        if m:
            cur = [m.group(1), []]; out.append(cur); continue
        if re.match(r"^\[kiln \w+\] ", line):
            cur = None; continue
        if cur is not None:
            cur[1].append(line)
    return [(n, "\n".join(l) + "\n") for n, l in out]


srcs = sources(sys.argv[1])
print(f"{len(srcs)} kernel sources: " + ", ".join(n for n, _ in srcs[:12]))
base = ["--gpu-architecture=sm_90", "--std=c++17", "-default-device", "--minimal"]
trivial = 'extern "C" __global__ void t(float* y) { y[threadIdx.x] = 1.0f; }\n'
t0, _ = compile_src(trivial, base)
t1, _ = compile_src(trivial + "//2\n", base)
print(f"trivial kernel: first compile in the process {t0*1e3:.1f} ms, second {t1*1e3:.1f} ms")
uniq = [0]


def fresh(s):
    uniq[0] += 1
    return s + f"// v{uniq[0]}\n"


variants = [
    ("cubin --minimal", base, False),
    ("cubin, no --minimal", base[:-1], False),
    ("ptx only (compute_90)", ["--gpu-architecture=compute_90", "--std=c++17", "-default-device", "--minimal"], True),
    ("cubin -Ofc=max", base + ["-Ofc=max"], False),
    ("cubin -Ofc=mid", base + ["-Ofc=mid"], False),
    ("cubin -Ofc=min", base + ["-Ofc=min"], False),
    ("cubin ptxas -O1", base + ["--ptxas-options=-O1"], False),
    ("cubin -dopt=on", base + ["-dopt=on"], False),
]
for name, src in srcs[:6]:
    row = [f"{name[:40]:40s} {len(src):6d}B"]
    for vname, opts, ptx in variants:
        ts = []
        for _ in range(3):
            dt, err = compile_src(fresh(src), opts, ptx)
            if err:
                ts = None; row.append(f"{vname}: ERR {err.splitlines()[0] if err else ''}"); break
            ts.append(dt)
        if ts:
            row.append(f"{vname}: {sorted(ts)[1]*1e3:.0f}")
    print(" | ".join(row))

# Several different sources at once: threads (ctypes drops the GIL around the call).
pool = [fresh(s) for _, s in srcs[:8]] * (1 if len(srcs) >= 8 else 8 // max(1, len(srcs)) + 1)
pool = [fresh(s) for s in pool[:8]]
t = time.perf_counter()
for s in pool:
    compile_src(s, base)
serial = time.perf_counter() - t
pool = [fresh(s) for s in pool]
t = time.perf_counter()
th = [threading.Thread(target=compile_src, args=(s, base)) for s in pool]
[x.start() for x in th]; [x.join() for x in th]
par = time.perf_counter() - t
print(f"8 sources: serial {serial*1e3:.0f} ms, on 8 threads {par*1e3:.0f} ms")
