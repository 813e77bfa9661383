"""A Hugging Face Llama on flashedu's Triton kernels against the same model on SDPA: a training
step, and greedy generation with the KV cache.

    flashedu bench transformers --json docs/bench/transformers_h100.json
    flashedu bench transformers --dry-run     # tiny sizes (no GPU: Triton's interpreter)

The model is transformers' LlamaForCausalLM built from its config with random weights (nothing
is downloaded): by default hidden 1024, 8 layers, 16 query heads sharing 4 K/V heads (GQA, head
dim 64), vocabulary 32000, bf16 weights. Each method runs the same weights on the same tokens,
in one process: flashedu (flashedu.integrations.transformers: attn_implementation "edu", backend
triton), and "sdpa" pinned to one of SDPA's kernels (``sdpa_kernel``; left alone, SDPA picks
cuDNN on an H100).

- error: each method's logits on two sequences of the training batch against the same model in
  float32 on SDPA's math kernel; flashedu's must stay within tolerance.py's allowance beside
  the first SDPA method's (else the exit status is 1).
- train: AdamW steps on B x T random tokens (no padding: causal, no mask), after warm-up
  steps; ms per step and tokens/s.
- generate: greedy decoding of G prompts of P tokens, N new tokens each (no end-of-sequence
  token, so each makes N); new tokens/s over the whole call, the prompt's forward included.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import time

from . import core

# method -> the SDPA kernel it pins (None: flashedu's triton backend)
METHODS = {"flashedu": None, "sdpa-flash": "FLASH_ATTENTION", "sdpa-cudnn": "CUDNN_ATTENTION",
           "sdpa-efficient": "EFFICIENT_ATTENTION", "sdpa-math": "MATH"}
DTYPES = ("bf16", "fp16", "fp32")


methods = core.names_of(METHODS)  # argparse type: comma-separated names of METHODS


def parse_args(argv):
    p = core.parser("transformers", __doc__)
    p.add_argument("--hidden", type=core.positive_int, default=1024)
    p.add_argument("--layers", type=core.positive_int, default=8)
    p.add_argument("--heads", type=core.positive_int, default=16)
    p.add_argument("--kv-heads", type=core.positive_int, default=4)
    p.add_argument("--vocab", type=core.positive_int, default=32000)
    p.add_argument("--batch", type=core.positive_int, default=8, help="training: sequences")
    p.add_argument("--seq-len", type=core.positive_int, default=1024, help="training: T")
    p.add_argument("--gen-batch", type=core.positive_int, default=8, help="generation: prompts")
    p.add_argument("--prompt", type=core.positive_int, default=128, help="generation: P")
    p.add_argument("--new-tokens", type=core.positive_int, default=128, help="generation: N")
    p.add_argument("--warmup", type=core.positive_int, default=3)
    p.add_argument("--steps", type=core.positive_int, default=10, help="timed training steps")
    p.add_argument("--methods", type=methods, default=["flashedu", "sdpa-flash", "sdpa-cudnn"])
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--json", type=core.output_file, help="write the results here")
    p.add_argument("--dry-run", action="store_true",
                   help="a tiny model in float32 against sdpa-math (no GPU: the CPU and "
                        "Triton's interpreter): checks this benchmark")
    args = p.parse_args(argv)
    if args.hidden % args.heads:
        p.error(f"--hidden ({args.hidden}) must be a multiple of --heads ({args.heads})")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if "flashedu" not in args.methods:
        args.methods.insert(0, "flashedu")
    return args


def build_model(args, device, dtype):
    """The Llama of the arguments, seeded: every call gives the same weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        intermediate_size=256 * -(-8 * args.hidden // 3 // 256),  # 8/3 hidden, up to 256s
        max_position_embeddings=max(args.seq_len, args.prompt + args.new_tokens),
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype)


def use(model, method):
    """The model on ``method``, and the context that pins its SDPA kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model.config._attn_implementation = "edu" if method == "flashedu" else "sdpa"
    kernel = METHODS[method]
    return contextlib.nullcontext() if kernel is None else sdpa_kernel(getattr(SDPBackend, kernel))


def sync(device) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def logits_error(model, method, ids, ref) -> float:
    import torch

    from flashedu import tolerance

    with use(model, method), torch.no_grad():
        return tolerance.max_error(model(input_ids=ids).logits, ref)


def train_rate(model, method, ids, args, device) -> dict:
    """ms per AdamW step and tokens/s, after ``args.warmup`` steps."""
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model.train()

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    with use(model, method):
        for _ in range(args.warmup):
            step()
        sync(device)
        start = time.perf_counter()
        for _ in range(args.steps):
            loss = step()
        sync(device)
        elapsed = time.perf_counter() - start
    model.eval()
    return {"train_ms": 1e3 * elapsed / args.steps,
            "train_tokens_per_s": ids.numel() * args.steps / elapsed, "last_loss": loss.item()}


def generate_rate(model, method, prompts, args, device) -> dict:
    """New tokens/s of greedy generation (one untimed call first)."""
    import torch

    def generate():
        return model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts),
                              max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                              do_sample=False)

    with use(model, method), torch.no_grad():
        generate()
        sync(device)
        start = time.perf_counter()
        out = generate()
        sync(device)
        elapsed = time.perf_counter() - start
    new = out[:, prompts.shape[1]:].numel()
    return {"generate_s": elapsed, "generate_tokens_per_s": new / elapsed}


def run_method(model, state, method, data, args, device) -> dict:
    """One method's row (the weights reset first), or its error."""
    import torch

    ids, prompts, ref = data
    model.load_state_dict(state)
    row = {"method": method}
    try:
        row["logits_max_err"] = logits_error(model, method, ids[:2], ref)
        row.update(generate_rate(model, method, prompts, args, device))
        row.update(train_rate(model, method, ids, args, device))
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as exc:  # noqa: BLE001 - a kernel SDPA lacks here is reported, not fatal
        row["error"] = core.error_text(exc)
    finally:
        if device == "cuda":
            torch.cuda.empty_cache()
    return row


def check_error(rows, dtype) -> str | None:
    """None if flashedu's logits are within tolerance.py's allowance beside the first SDPA
    method's error; else why not."""
    from flashedu import tolerance

    mine = rows[0]
    peer = next((r for r in rows[1:] if "logits_max_err" in r), None)
    if "logits_max_err" not in mine:
        return f"flashedu failed: {mine.get('error')}"
    if peer is None:
        return None
    limit = tolerance.allowed_error(dtype, peer["logits_max_err"])
    if not mine["logits_max_err"] <= limit:
        return (f"flashedu's logits miss float32 by {mine['logits_max_err']:.3g} > allowed "
                f"{limit:.3g} ({peer['method']}: {peer['logits_max_err']:.3g})")
    return None


def table(rows) -> str:
    head = ["method", "train ms", "train tok/s", "gen tok/s", "logits err",
            "flashedu train x", "flashedu gen x"]
    mine = rows[0]
    lines = []
    for r in rows:
        if "error" in r:
            lines.append([r["method"], r["error"][:60], "", "", "", "", ""])
            continue
        ratios = ["", ""]
        if r is not mine and "error" not in mine:  # > 1: flashedu is faster
            ratios = [f"{r['train_ms'] / mine['train_ms']:.2f}x",
                      f"{mine['generate_tokens_per_s'] / r['generate_tokens_per_s']:.2f}x"]
        lines.append([r["method"], f"{r['train_ms']:.2f}", f"{r['train_tokens_per_s']:,.0f}",
                      f"{r['generate_tokens_per_s']:,.0f}", f"{r['logits_max_err']:.2e}",
                      *ratios])
    return core.format_table(head, lines)


def dry_run_sizes(args) -> None:
    args.hidden, args.layers, args.heads, args.kv_heads, args.vocab = 32, 1, 4, 2, 64
    args.batch, args.seq_len, args.gen_batch, args.prompt, args.new_tokens = 2, 16, 2, 8, 3
    args.warmup, args.steps, args.dtype = 1, 1, "fp32"
    args.methods = ["flashedu", "sdpa-math"]  # SDPA's other kernels are CUDA's


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.dry_run:
        dry_run_sizes(args)
    device = core.bench_device(args.dry_run, "transformers")
    if device is None:
        return 1
    try:
        import transformers

        from ..integrations.transformers import register
    except ImportError:
        print('flashedu bench transformers: needs Hugging Face transformers: pip install '
              '"flashedu[transformers]"', file=sys.stderr)
        return 1
    import torch

    register("edu", backend="triton")
    dtype = core.torch_dtype(args.dtype)
    model = build_model(args, device, dtype).eval()
    state = copy.deepcopy(model.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(device)
    prompts = torch.randint(0, args.vocab, (args.gen_batch, args.prompt), generator=g).to(device)
    reference = build_model(args, device, torch.float32).eval()
    with use(reference, "sdpa-math"), torch.no_grad():
        ref = reference(input_ids=ids[:2]).logits
    del reference
    env = core.environment(["transformers", *argv], transformers=transformers.__version__)
    out = {"environment": env, "model": {k: getattr(args, k) for k in (
        "hidden", "layers", "heads", "kv_heads", "vocab", "dtype", "batch", "seq_len",
        "gen_batch", "prompt", "new_tokens", "warmup", "steps")}, "rows": []}
    print(core.headline(env), flush=True)
    for method in args.methods:
        row = run_method(model, state, method, (ids, prompts, ref), args, device)
        out["rows"].append(row)
        print(row, flush=True)
    out["check"] = check_error(out["rows"], dtype) or "ok"
    print(f"\nLlama {args.hidden} wide, {args.layers} layers, {args.heads}/{args.kv_heads} heads, "
          f"{args.dtype}; train {args.batch} x {args.seq_len} tokens, generate {args.gen_batch} x "
          f"({args.prompt} + {args.new_tokens}); transformers {transformers.__version__}")
    print("flashedu x: the method's train ms / flashedu's, flashedu's generation tokens/s / the "
          "method's (> 1: flashedu is faster)\n")
    print(table(out["rows"]))
    print(f"flashedu's logits: {out['check']}")
    if args.json:
        core.write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0 if out["check"] == "ok" else 1
