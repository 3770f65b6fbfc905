"""The kernels PyTorch runs for one step of a training workload of
../shared/bench/torch_reference.py (`resnet50.train.bf16amp.bs128` or `gpt2.train.bf16amp.8x1024`),
eager and torch.compile'd, as a table by device time and summed by kind (convolution and
products, Triton, other), to set beside `kiln profile`'s table.

    python3 tools/profiles/torch_kernels.py [--workload resnet50|gpt2] [--modes eager,default] [--rows 40]

The GPT-2 model is torch_reference.py's own (found beside it in .gpu/bench or ../shared/bench).
"""
import argparse, os, sys
import torch, torch.nn.functional as F
from kinds import kind
from torch.profiler import profile, ProfilerActivity

ap = argparse.ArgumentParser()
ap.add_argument("--workload", default="resnet50", choices=["resnet50", "gpt2"])
ap.add_argument("--modes", default="eager,default")
ap.add_argument("--rows", type=int, default=40)
args = ap.parse_args()
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
torch.manual_seed(0)

def resnet50():
    import torchvision
    model = torchvision.models.resnet50().cuda().train().to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(128, 3, 224, 224, device="cuda").to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (128,), device="cuda")
    return model, opt, lambda m: F.cross_entropy(m(x), y)

def gpt2():
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (".gpu/bench", os.path.join(here, "../../../shared/bench")):
        sys.path.insert(0, d)
    from torch_reference import GPT2
    model = GPT2().cuda().train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    idx = torch.randint(0, 50257, (8, 1024), device="cuda")
    tgt = torch.randint(0, 50257, (8, 1024), device="cuda")
    return model, opt, lambda m: F.cross_entropy(m(idx).flatten(0, 1).float(), tgt.flatten())

model, opt, loss_of = {"resnet50": resnet50, "gpt2": gpt2}[args.workload]()

def stepper(m):
    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_of(m)
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    return step

for mode in args.modes.split(","):
    step = stepper(model if mode == "eager" else torch.compile(model, mode=mode))
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        step(); torch.cuda.synchronize()
    ev = [e for e in p.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.self_device_time_total for e in ev)
    print(f"== {args.workload} {mode}: {sum(e.count for e in ev)} device activities, {total / 1e3:.3f} ms of device time")
    by = {}
    for e in ev:
        k = kind(e.key); c, t = by.get(k, (0, 0.0)); by[k] = (c + e.count, t + e.self_device_time_total)
    for k, (c, t) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        print(f"   {k:24s} {c:5d} calls {t / 1e3:9.3f} ms")
    print(f"{'kernel':70s} {'calls':>5s} {'total ms':>9s} {'avg us':>8s}")
    for e in sorted(ev, key=lambda e: -e.self_device_time_total)[: args.rows]:
        print(f"{e.key[:70]:70s} {e.count:5d} {e.self_device_time_total / 1e3:9.3f} {e.self_device_time_total / e.count:8.1f}")
