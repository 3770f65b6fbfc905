"""Registers, spills and shared memory of each kernel in the given .cu files as NVRTC compiles
it for sm_90 with kiln's options, and the threads an SM then holds (registers allowing).
Runs on the GPU machine (the CUDA toolkit's NVRTC) or here without a GPU (the NVRTC that
tools/nvrtc/local.sh fetches into target/nvrtc; NVRTC_LIB names another):
  python3 tools/rows/nvrtc_regs.py build/*.cu
  KILN_SAMPLES_DIR=/tmp/samples cargo test --lib every_kernel_family_has_samples
  python3 tools/rows/nvrtc_regs.py /tmp/samples/fused_*loop*.cu"""
import os, re, sys

import nvrtc

for path in sys.argv[1:]:
    src = nvrtc.kernel_source(path)
    ok, log, _ = nvrtc.compile_source(src, ["-Xptxas=-v"])
    if not ok:
        print(path, "failed:", log[:300])
        continue
    # ptxas reports each function: its name, then its spills, then its registers and shared memory.
    for m in re.finditer(r"Compiling entry function '(\S+)'.*?(\d+) bytes spill stores, (\d+) bytes spill loads.*?Used (\d+) registers(.*?)\n", log, re.S):
        name, stores, loads, regs = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        smem = re.search(r"(\d+) bytes smem", m.group(5))
        # Registers are handed out per warp in units of 256.
        per_warp = -(-regs * 32 // 256) * 256
        threads = min(2048, 65536 // per_warp * 32)
        # A literal block size only (`32 * WARPS` and the like are left out).
        bounds = re.search(r"__launch_bounds__\((\d+)\s*[,)]", src)
        # (An SM holds at most 32 blocks.)
        block = f", blocks of {bounds.group(1)}: {min(32, threads // int(bounds.group(1)))} per SM" if bounds else ""
        print(f"{os.path.basename(path):72s} {regs:3d} registers, spills {stores}/{loads} B, smem {smem.group(1) if smem else 0} B: {threads} threads per SM{block}")
