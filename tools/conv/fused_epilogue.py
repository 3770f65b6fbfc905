# Whether cuDNN runs a convolution with its bias, residual add and ReLU as one kernel on this GPU,
# and how fast: torch.cudnn_convolution_relu / _add_relu (cuDNN's fused graph) against the
# convolution followed by one pointwise pass (what a compiled program runs today), on ResNet-50's
# bottleneck shapes at batch 128, BF16, channels-last.
import torch, torch.nn.functional as F
torch.backends.cudnn.benchmark = True
dev = "cuda"
shapes = [  # (C in, C out, H, kernel, stride)
    (64, 64, 56, 1, 1), (64, 64, 56, 3, 1), (64, 256, 56, 1, 1), (256, 64, 56, 1, 1),
    (128, 128, 28, 3, 1), (128, 512, 28, 1, 1), (256, 256, 14, 3, 1), (256, 1024, 14, 1, 1),
    (512, 512, 7, 3, 1), (512, 2048, 7, 1, 1),
]
def bench(f, n=50):
    for _ in range(5): f()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10): f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): g.replay()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / n / 10 * 1e3
tot = [0.0, 0.0, 0.0, 0.0]
for ci, co, h, k, st in shapes:
    x = torch.randn(128, ci, h, h, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    w = torch.randn(co, ci, k, k, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last) * 0.05
    b = torch.randn(co, device=dev, dtype=torch.bfloat16)
    oh = h // st
    z = torch.randn(128, co, oh, oh, device=dev, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    pad = k // 2
    sep = bench(lambda: torch.relu(F.conv2d(x, w, None, st, pad) + b.view(1, -1, 1, 1) + z))
    conv = bench(lambda: F.conv2d(x, w, None, st, pad))
    fr = bench(lambda: torch.cudnn_convolution_relu(x, w, b, (st, st), (pad, pad), (1, 1), 1))
    far = bench(lambda: torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, (st, st), (pad, pad), (1, 1), 1))
    ref = torch.relu(F.conv2d(x.float(), w.float(), b.float(), st, pad) + z.float())
    err = (torch.cudnn_convolution_add_relu(x, w, z, 1.0, b, (st, st), (pad, pad), (1, 1), 1).float() - ref).abs().max().item()
    for i, v in enumerate([conv, sep, fr, far]): tot[i] += v
    print(f"{ci:4}->{co:4} {h:3}x{h:<3} k{k}: conv {conv:7.1f} us, conv+bias+add+relu (eager ops) {sep:7.1f}, fused relu {fr:7.1f}, fused add+relu {far:7.1f}  (max err {err:.3g})")
print("totals (us): conv %.0f, separate %.0f, fused relu %.0f, fused add relu %.0f" % tuple(tot))
