"""PyTorch's scaled-dot-product attention backends (cuDNN, flash, memory-efficient, math) on the
shapes of shapes.txt, forward and forward + backward, in device time (median of 30 event-timed
calls after 5 warm-ups): the other side of examples/attention_bench.rs.
    python3 tools/attention/torch_sdpa.py tools/attention/shapes.txt"""
import sys, torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

def event_us(fn, iters=30, warm=5):
    for _ in range(warm): fn()
    torch.cuda.synchronize(); ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e) * 1e3)
    return sorted(ts)[len(ts) // 2]

backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION), ("math", SDPBackend.MATH)]
print(f"{'shape (N H L S D dtype causal)':<34} " + " ".join(f"{b + ' fwd/fwd_bwd':>22}" for b, _ in backends))
for line in open(sys.argv[1] if len(sys.argv) > 1 else "tools/attention/shapes.txt"):
    line = line.strip()
    if not line or line.startswith("#"): continue
    n, h, l, s, d, dt, causal = line.split()
    n, h, l, s, d = map(int, (n, h, l, s, d)); dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[dt]
    q = torch.randn(n, h, l, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(n, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(n, h, s, d, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(n, h, l, d, device="cuda", dtype=dtype)
    mask = torch.randn(n, 1, l, s, device="cuda", dtype=dtype) if causal == "mask" else None
    cells = []
    for name, b in backends:
        try:
            with sdpa_kernel(b):
                with torch.no_grad(): fwd = event_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal == "causal"))
                both = event_us(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal == "causal").backward(g))
            cells.append(f"{fwd:>10.1f}/{both:<11.1f}")
        except Exception as ex:
            cells.append(f"{'n/a':>22}")
    print(f"{line:<34} " + " ".join(cells), flush=True)
