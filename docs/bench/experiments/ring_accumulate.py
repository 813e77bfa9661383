"""One ring micro-step's backward calls (H=16, d=128, bf16; 8192 query rows of a 65536-row
shard against 4096 or 8192 keys): gradients added by the kernels into the ring's buffers
(``block_backward_into``) against fresh gradient tensors added afterwards by torch."""

import json
import os

import torch
from triton.testing import do_bench

from flashedu.distributed import (
    _row_dot_triton,
    block_backward,
    block_backward_into,
    block_forward,
)

H, d, n, rows_per_call = 16, 128, 65536, 8192
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v, dout = (
    torch.randn(1, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)
)
scale = d**-0.5
out, L = block_forward(q, k[:, :, :8192], v[:, :, :8192], causal=False, scale=scale, local="triton")
out = out.to(torch.bfloat16)
D = _row_dot_triton(out, dout)
dq = torch.zeros_like(q)
result = []
for keys in (4096, 8192):
    K, V = k[:, :, :keys].contiguous(), v[:, :, :keys].contiguous()
    dK = torch.zeros(K.shape, dtype=torch.float32, device="cuda")
    dV = torch.zeros_like(dK)
    calls = [(a, a + rows_per_call) for a in range(0, n, rows_per_call)]
    args = lambda a, b: (q[:, :, a:b], K, V, out[:, :, a:b], L[:, :, a:b], dout[:, :, a:b])

    def into():
        for a, b in calls:
            block_backward_into(*args(a, b), (dq[:, :, a:b], dK, dV), causal=False,
                                scale=scale, local="triton", D=D[:, :, a:b])

    def separate():
        for a, b in calls:
            dq_t, dk_t, dv_t = block_backward(*args(a, b), causal=False, scale=scale,
                                              local="triton", D=D[:, :, a:b])
            dq[:, :, a:b] += dq_t
            dK.add_(dk_t)
            dV.add_(dv_t)

    for name, fn in (("into", into), ("separate", separate), ("into", into)):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ms = do_bench(fn, warmup=5, rep=100)
        extra = (torch.cuda.max_memory_allocated() - base) / 1e6
        result.append(dict(keys=keys, variant=name, ms=ms, extra_MB=extra))
        print(f"keys={keys} {name}: {ms:.3f} ms per micro-step, {extra:.0f} MB above the inputs",
              flush=True)
json.dump(
    {"device": torch.cuda.get_device_name(), "commit": os.environ.get("GIT_COMMIT"),
     "rows": result},
    open(os.environ.get("OUT", ".") + "/ring_accumulate.json", "w"),
    indent=1,
)
