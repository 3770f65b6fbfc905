"""NVRTC as kiln runs it, for the tools here: the library (NVRTC_LIB, else the CUDA toolkit's on
the GPU machine, else the one tools/nvrtc/local.sh fetches into target/nvrtc) and a compile of a
.cu file's kernel part for sm_90 with kiln's options."""
import ctypes, glob, os

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "../..")
_libs = [os.environ.get("NVRTC_LIB")] + sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))[-1:] + [os.path.join(root, "target/nvrtc/libnvrtc.so.13")]
lib = ctypes.CDLL(next(p for p in _libs if p and os.path.exists(p)))


def kernel_source(path):
    # The harness wrappers of make_variants.py are host code; NVRTC takes the kernel part only.
    return open(path).read().split("\nvoid launch_")[0]


def compile_source(src, extra=()):
    """(compiled, log, cubin or None) of `src` with kiln's NVRTC options and `extra` ones."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-default-device", b"--minimal"] + [o.encode() for o in extra]
    ok = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts)) == 0
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    cubin = None
    if ok:
        lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
        code = ctypes.create_string_buffer(n.value)
        lib.nvrtcGetCUBIN(prog, code)
        cubin = code.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ok, buf.value.decode(), cubin
