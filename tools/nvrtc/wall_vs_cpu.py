"""NVRTC compile time over a machine's first minutes: each line compiles one small kernel with a
fresh source and prints the machine's uptime, the compile's wall time, the thread's CPU time in
it, and the machine's steal time since the last line (CPU taken by the host), so a slow compile
shows whether the process was descheduled or really computing.

    python3 tools/nvrtc/wall_vs_cpu.py [compiles] [pause_s]
"""
import ctypes, glob, sys, time

lib = ctypes.CDLL(sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so*"))[-1])
opts = [b"--gpu-architecture=sm_90", b"--std=c++17", b"-default-device", b"--minimal"]
arr = (ctypes.c_char_p * len(opts))(*opts)


def stat():
    f = open("/proc/stat").readline().split()[1:]
    return [int(x) for x in f]  # user nice system idle iowait irq softirq steal ...


def compile_once(i):
    src = 'extern "C" __global__ void k(float* y) { y[threadIdx.x] = sinf(y[threadIdx.x]) + %d.0f; }\n' % i
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
    w, c = time.perf_counter(), time.thread_time()
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    w, c = time.perf_counter() - w, time.thread_time() - c
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert r == 0, r
    return w, c


n, pause = int(sys.argv[1]) if len(sys.argv) > 1 else 20, float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
last = stat()
for i in range(n):
    w, c = compile_once(i)
    now = stat()
    d = [a - b for a, b in zip(now, last)]
    last = now
    up = float(open("/proc/uptime").read().split()[0])
    print(f"t={up:6.1f}s compile wall {w*1e3:6.1f} ms, cpu {c*1e3:6.1f} ms; machine since last: busy {sum(d[:3])} idle {d[3]} steal {d[7]} ticks", flush=True)
    time.sleep(pause)
