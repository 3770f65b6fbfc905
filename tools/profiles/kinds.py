"""The kinds a GPU kernel's name falls under, one definition for PyTorch's tables
(`torch_kernels.py`) and kiln's (`kiln_trace_kinds.py`)."""

def kind(name):
    n = name.lower()
    if n.startswith("triton"):
        return "Triton (Inductor)"
    if n.startswith("fused_"):
        return "generated (kiln)"
    if "multi_tensor_apply" in n:
        return "optimiser (foreach)"
    if any(k in n for k in ("flash", "fmha", "sdpa", "attention", "lean_reduction")):
        return "attention"
    if any(k in n for k in ("conv", "xmma", "cutlass", "implicit_gemm", "wgrad", "dgrad", "fprop", "nhwc", "cudnn", "nvjet", "gemm", "splitk", "sm90_", "sm80_")):
        return "convolution and products (cuDNN, cuBLAS)"
    if "memcpy" in n or "memset" in n:
        return "copies and memsets"
    return "other"
