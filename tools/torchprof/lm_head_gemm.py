"""GPT-2's lm_head products at 8 x 1024 tokens (bf16), timed through cuBLAS and through
cuBLASLt (PyTorch's preferred_blas_library), with the kernel each one runs."""
import torch
from torch.profiler import profile, ProfilerActivity
M, K, N = 8192, 768, 50257
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
cases = {"fwd x @ w.t()": lambda: x @ w.t(), "dgrad dy @ w": lambda: dy @ w, "wgrad dy.t() @ x": lambda: dy.t() @ x}
for lib in ["cublas", "cublaslt"]:
    torch.backends.cuda.preferred_blas_library(lib)
    for name, f in cases.items():
        for _ in range(3): f()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10): f()
        e.record(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as p:
            f(); torch.cuda.synchronize()
        k = [ev.name for ev in p.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
        print(f"{lib:9s} {name:18s} {s.elapsed_time(e) / 10:.3f} ms  {k[0][:70] if k else '?'}")
