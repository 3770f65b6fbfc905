"""Registers and blocks per SM of each kernel in build/*.cu as NVRTC compiles it with kiln's
options (ptxas under nvcc can budget registers differently). On the GPU machine, after
make_variants.py:  python3 nvrtc_regs.py build/*.cu"""
import ctypes, glob, os, re, subprocess, sys, tempfile

lib = ctypes.CDLL(sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))[-1])
P = ctypes.c_void_p
for path in sys.argv[1:]:
    src = open(path).read()
    # The harness wrappers are host code; NVRTC takes the kernel part only.
    src = src.split("\nvoid launch_")[0]
    prog = P()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-default-device", b"--minimal"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    if lib.nvrtcCompileProgram(prog, len(opts), arr) != 0:
        n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, buf)
        print(path, "failed:", buf.value.decode()[:300]); continue
    size = ctypes.c_size_t(); lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
    cubin = ctypes.create_string_buffer(size.value); lib.nvrtcGetCUBIN(prog, cubin)
    f = tempfile.NamedTemporaryFile(suffix=".cubin", delete=False); f.write(cubin.raw); f.close()
    usage = subprocess.run(["cuobjdump", "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    for m in re.finditer(r"Function (\S+):\s*\n\s*REG:(\d+)", usage):
        regs = int(m.group(2))
        per_warp = -(-regs * 32 // 256) * 256
        print(f"{os.path.basename(path):24s} {m.group(1)[:60]:60s} {regs} registers (NVRTC): {65536 // (per_warp * 16)} blocks of 512 per SM")
