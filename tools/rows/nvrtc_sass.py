"""SASS of kernels in the given .cu files as NVRTC compiles them for sm_90 with kiln's options,
without a GPU: each loop's instructions by opcode (a loop is a backward branch), and with
--dump the whole listing. The disassembler is `nvdisasm` of the `nvidia-cuda-nvdisasm` wheel
(fetched into target/nvdisasm once); NVRTC as in nvrtc_regs.py (target/nvrtc here, from
tools/nvrtc/local.sh).
  KILN_SAMPLES_DIR=/tmp/samples cargo test --lib every_kernel_family_has_samples
  python3 tools/rows/nvrtc_sass.py /tmp/samples/fused_*looptail*.cu
A row kernel's walks are its loops: instructions per value of a walk are its loop's size over
VPT (the straight path runs a little less: a branch's other side is counted too)."""
import collections, glob, os, re, subprocess, sys, tempfile, zipfile

import nvrtc

root = nvrtc.root


def nvdisasm():
    for p in ["/usr/local/cuda/bin/nvdisasm", os.path.join(root, "target/nvdisasm/nvdisasm")]:
        if os.path.exists(p):
            return p
    d = os.path.join(root, "target/nvdisasm")
    os.makedirs(d, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, "nvidia-cuda-nvdisasm>=13,<14"], check=True)
        z = zipfile.ZipFile(glob.glob(tmp + "/*.whl")[0])
        name = next(n for n in z.namelist() if n.endswith("/bin/nvdisasm"))
        open(os.path.join(d, "nvdisasm"), "wb").write(z.read(name))
    os.chmod(os.path.join(d, "nvdisasm"), 0o755)
    return os.path.join(d, "nvdisasm")


dis = nvdisasm()
dump = "--dump" in sys.argv
for path in [a for a in sys.argv[1:] if a != "--dump"]:
    ok, log, code = nvrtc.compile_source(nvrtc.kernel_source(path))
    if not ok:
        print(path, "failed:", log[:300])
        continue
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(code)
        f.flush()
        sass = subprocess.run([dis, "-c", f.name], capture_output=True, text=True, check=True).stdout
    labels, instrs = {}, []
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            labels[m.group(1)] = len(instrs)
        elif m := re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line):
            instrs.append(m.group(1))
    if dump:
        print("\n".join(instrs))
    print(f"{os.path.basename(path)}: {len(instrs)} instructions")
    for i, ins in enumerate(instrs):
        m = re.search(r"BRA `?\(?(\.L_x_\d+)", ins)
        if m and labels.get(m.group(1), len(instrs)) < i:
            start = labels[m.group(1)]
            ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", x).split()[0].split(".")[0] for x in instrs[start:i + 1])
            print(f"  loop at {start}..{i}: {i - start + 1} instructions;", ", ".join(f"{k} {v}" for k, v in ops.most_common(12)))
