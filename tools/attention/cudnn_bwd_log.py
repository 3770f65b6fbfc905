"""PyTorch's cuDNN attention forward + backward on a few shapes, once each, to be run with
cuDNN's and cudnn-frontend's logging on: the logs show the operation graphs (nodes, tensors,
dims, strides, dtypes, ids) and engines cuDNN builds on this GPU.
    CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=cudnn.log CUDNN_FRONTEND_LOG_INFO=1 \
    CUDNN_FRONTEND_LOG_FILE=fe.log python3 tools/attention/cudnn_bwd_log.py [causal|mask]
`mask`: an additive BF16 mask of shape (N, 1, L, S), broadcast over the heads."""
import sys
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend

kind = sys.argv[1] if len(sys.argv) > 1 else "full"
for (n, h, l, s, d) in [(2, 4, 256, 256, 64), (2, 4, 256, 256, 128)]:
    q = torch.randn(n, h, l, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(n, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(n, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    mask = torch.randn(n, 1, l, s, device="cuda", dtype=torch.bfloat16) if kind == "mask" else None
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=kind == "causal").backward(torch.randn_like(q))
    torch.cuda.synchronize()
    print(kind, n, h, l, s, d, "grads", q.grad.norm().item(), k.grad.norm().item(), v.grad.norm().item(), flush=True)
print("torch", torch.__version__, "cudnn", torch.backends.cudnn.version())
