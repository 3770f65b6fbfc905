"""PyTorch's side of `kiln bench --device cpu`: the same CPU-sized workloads, measured by the
same rules (bandwidth rows: median of 30 calls after 5 warm-ups; steps: wall time per call over
50 calls after 5 warm-ups), eager and torch.compile (Inductor's C++ backend), in the shared schema.

    python bench/torch_cpu.py --out torch-cpu.json
    kiln bench --device cpu --out kiln-cpu.json
    python ../shared/bench/compare.py torch-cpu.json kiln-cpu.json

Needs PyTorch (a CPU build in a virtual environment is enough) and a C++ compiler for
torch.compile. Not part of CI.
"""
import argparse, json, time
import torch
import torch.nn.functional as F

def median_ms(f):
    for _ in range(5): f()
    t = []
    for _ in range(30):
        s = time.perf_counter(); f(); t.append((time.perf_counter() - s) * 1e3)
    return sorted(t)[len(t) // 2]

def wall_ms(f):
    for _ in range(5): f()
    s = time.perf_counter()
    for _ in range(50): f()
    return (time.perf_counter() - s) * 1e3 / 50

def first_s(f):
    s = time.perf_counter(); f(); return time.perf_counter() - s

def bandwidth(nbytes, fn, *args):
    c = torch.compile(fn)
    cs = first_s(lambda: c(*args))
    e, cm = median_ms(lambda: fn(*args)), median_ms(lambda: c(*args))
    return {"eager_ms": e, "compiled_ms": cm, "compiled_compile_s": cs, "bytes": nbytes, "best_GBps": nbytes / (min(e, cm) / 1e3) / 1e9}

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

def train_step(compiled):
    m = mlp(); opt = torch.optim.SGD(m.parameters(), lr=0.01)
    x, y = torch.randn(32, 784), torch.randint(0, 10, (32,))
    def step(x, y):
        loss = F.cross_entropy(m(x), y); loss.backward(); opt.step(); opt.zero_grad(); return loss
    f = torch.compile(step) if compiled else step
    return lambda: f(x, y)

def infer(compiled):
    m = mlp(); x = torch.randn(32, 784)
    def run(x):
        with torch.no_grad(): return m(x)
    f = torch.compile(run) if compiled else run
    return lambda: f(x)

def workloads():
    n = 10_000_000
    a, b = torch.randn(n), torch.randn(n)
    yield "pointwise.add_relu.f32.1e7", lambda: bandwidth(12 * n, lambda a, b: (a + b).relu(), a, b)
    yield "pointwise.exp_sin_log_cos.f32.1e7", lambda: bandwidth(8 * n, lambda x: x.sin().exp() + x.cos().abs().log(), a)
    x, w, bb = torch.randn(2048, 2048), torch.randn(2048), torch.randn(2048)
    yield "reduction.layernorm.f32.2048x2048", lambda: bandwidth(8 * 2048 * 2048, lambda x: F.layer_norm(x, (2048,), w, bb, 1e-5), x)
    yield "reduction.softmax.f32.2048x2048", lambda: bandwidth(8 * 2048 * 2048, lambda x: x.softmax(-1), x)
    m1, m2 = torch.randn(2048, 2048), torch.randn(2048, 2048)
    def matmul():
        ms = median_ms(lambda: m1 @ m2); return {"eager_ms": ms, "GFLOPs": 2 * 2048 ** 3 / (ms / 1e3) / 1e9}
    yield "matmul.f32.2048", matmul
    def step(make):
        c = make(True); cs = first_s(c)
        return {"eager_ms": wall_ms(make(False)), "compiled_ms": wall_ms(c), "compiled_compile_s": cs}
    yield "mlp.infer.bs32", lambda: step(infer)
    yield "mlp.train_sgd.bs32", lambda: step(train_step)

def main():
    ap = argparse.ArgumentParser(); ap.add_argument("--out", default="torch-cpu.json"); ap.add_argument("--only")
    a = ap.parse_args()
    rows = {}
    for name, run in workloads():
        if a.only and a.only not in name: continue
        try: rows[name] = run()
        except Exception as e: rows[name] = {"error": repr(e)}
        print(name, rows[name], flush=True)
    x, y = torch.randn(10_000_000), torch.zeros(10_000_000)
    copy = median_ms(lambda: y.copy_(x))
    json.dump({"system": f"torch-{torch.__version__}", "device": f"cpu ({torch.get_num_threads()} threads)", "copy_GBps": 8e7 / (copy / 1e3) / 1e9, "workloads": rows}, open(a.out, "w"), indent=1)

if __name__ == "__main__":
    main()
