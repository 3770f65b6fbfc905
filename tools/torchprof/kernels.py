"""PyTorch's kernel table for one call of a shared bench workload, to set beside `kiln profile`:
    python3 tools/torchprof/kernels.py WORKLOAD [eager|default|reduce-overhead|max-autotune] [ROWS]
Runs the workload as `torch_reference.py` builds it (its `measure` is replaced by one profiled
call after three warm-ups) and prints the profiler's table by device time."""
import os, sys
import torch
from torch.profiler import profile, ProfilerActivity

here = os.path.dirname(os.path.abspath(__file__))
for d in (os.path.join(here, "..", "..", ".gpu", "bench"), os.path.join(here, "..", "..", "..", "shared", "bench")):
    sys.path.insert(0, d)
import torch_reference as R

name, mode = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "default")
rows = int(sys.argv[3]) if len(sys.argv) > 3 else 25

def profiled(fn_eager, make_compiled, timer, nbytes=None, modes=("default",)):
    f = fn_eager if mode == "eager" else make_compiled(mode)
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        f()
        torch.cuda.synchronize()
    kernels = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(f"{name} {mode}: {len(kernels)} device events, {sum(e.device_time for e in kernels) / 1e3:.3f} ms of device time")
    print(p.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=80))
    return {}

R.measure = profiled
R.workloads()[name]()
