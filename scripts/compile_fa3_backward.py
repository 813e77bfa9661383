"""Compile fa3_backward_kernel for sm_90 on a machine without a GPU and print its registers,
spills and instruction mix (Triton 3.6's Gluon; TRITON_INTERPRET is turned off here).

    python scripts/compile_fa3_backward.py 128 causal [CONSUMER_REGS]    # ST=2 NB=1 BR=64 in env
"""
import sys, os, re, types, importlib.util, subprocess, collections
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["TRITON_INTERPRET"] = "0"
# load fa3 and fa3_backward as a package-less pair
pkg = types.ModuleType("fx"); pkg.__path__ = [os.path.join(ROOT, "flashedu", "triton")]; sys.modules["fx"] = pkg
for name in ("fa3", "fa3_backward"):
    spec = importlib.util.spec_from_file_location(f"fx.{name}", os.path.join(ROOT, "flashedu", "triton", f"{name}.py"))
    m = importlib.util.module_from_spec(spec); sys.modules[f"fx.{name}"] = m; spec.loader.exec_module(m)
fb = sys.modules["fx.fa3_backward"]
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
d = int(sys.argv[1]); causal = sys.argv[2] == "causal"; regs = int(sys.argv[3]) if len(sys.argv) > 3 else 240
st = int(os.environ.get("ST", 2)); br = int(os.environ.get("BR", 64))
k = fb.fa3_backward_kernel; names = k.arg_names
sig = {}
for n in names:
    sig[n] = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "dO": "*bf16", "dK": "*bf16", "dV": "*bf16",
              "L": "*fp32", "Dl": "*fp32", "dQ": "*fp32", "qk_scale": "fp32", "scale": "fp32"}.get(n, "i32")
consts = dict(HEAD_DIM=d, Br=br, STAGES=st, IS_CAUSAL=causal, CONSUMER_REGS=regs, DQ_BUFFERS=int(os.environ.get("NB", 1)))
for n in consts: sig[n] = "constexpr"
src = GluonASTSource(k, sig, {(names.index(n),): v for n, v in consts.items()},
                     {(names.index(n),): [["tt.divisibility", 16]] for n in ("Q","K","V","dO","L","Dl","dQ","dK","dV")})
c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
tools = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
open("/tmp/fa3_backward.cubin", "wb").write(c.asm["cubin"]); open("/tmp/fa3_backward.ptx", "w").write(c.asm["ptx"])
u = subprocess.run([tools+"/cuobjdump", "-res-usage", "/tmp/fa3_backward.cubin"], capture_output=True, text=True).stdout
sass = subprocess.run([tools+"/nvdisasm", "-c", "/tmp/fa3_backward.cubin"], capture_output=True, text=True).stdout
open(f"/tmp/fa3_backward_{d}.sass", "w").write(sass)
ops = collections.Counter(m.group(1).split(".")[0] for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass))
print(re.search(r"REG:\d+ STACK:\d+ SHARED:\d+", u).group(0), "smem", c.metadata.shared)
print({k_: ops[k_] for k_ in ("HGMMA", "STL", "LDL", "MUFU", "RED", "ATOM", "STS", "BAR") if k_ in ops}, "total", sum(ops.values()))
