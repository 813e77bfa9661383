"""flashedu.models: the GPT config, the model on every attention backend (and on a function of
your own, such as your Triton exercise kernels), the training loop."""

import itertools
import math
import shutil
import warnings
from pathlib import Path

import pytest
import torch

import flashedu
from flashedu.models import (
    GPT,
    GPTConfig,
    Trainer,
    TrainSettings,
    lr_factor,
    plot_history,
    tiny_config,
)
from flashedu.models import data as text
from flashedu.models.train import main

ROOT = Path(__file__).resolve().parents[1]

# The GPT3Config of the PyTorch implementation PeTeRr0/FlashAttention-pytorch (its README),
# field by field (device is 'cuda' if available else 'cpu').
GPT3CONFIG_DEFAULTS = {
    "vocab_size": 50257, "d_model": 768, "n_layers": 12, "n_heads": 12, "d_ff": 3072,
    "dropout": 0.1, "max_seq_len": 512, "lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8,
    "weight_decay": 0.0, "warmup_steps": 1000, "lr_decay": "cosine", "block_size": 128,
    "use_flash_attention": True, "activation": "gelu", "initializer_range": 0.02,
    "gradient_accumulation_steps": 16, "mixed_precision": True, "compile_model": True,
    "epochs": 5}


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices gain nothing from threads, and lose a lot when other jobs share the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def micro_config(**overrides):
    """Smaller than tiny_config: fast enough for the Triton interpreter."""
    fields = {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "max_seq_len": 48,
              "dropout": 0.0}
    return tiny_config(**{**fields, **overrides})


# --- config ------------------------------------------------------------------------------


def test_config_defaults_are_gpt3configs():
    cfg = GPTConfig()
    assert {k: getattr(cfg, k) for k in GPT3CONFIG_DEFAULTS} == GPT3CONFIG_DEFAULTS
    assert cfg.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert cfg.attention_backend == "auto" and cfg.head_dim == 64


@pytest.mark.parametrize("field, value, error, words", [
    ("d_model", 100, ValueError, "multiple of n_heads"),
    ("n_layers", 0, ValueError, "n_layers must be >= 1"),
    ("vocab_size", 2.5, TypeError, "vocab_size must be an int"),
    ("dropout", 1.0, ValueError, "dropout must be a float in [0, 1)"),
    ("lr", -1e-3, ValueError, "lr must be a positive"),
    ("betas", (0.9,), ValueError, "betas must be two floats"),
    ("lr_decay", "step", ValueError, "lr_decay must be one of"),
    ("activation", "swish", ValueError, "activation must be one of"),
    ("attention_backend", "flash", ValueError, "attention_backend must be one of"),
    ("device", "tpu", ValueError, "device must be"),
    ("mixed_precision", 1, TypeError, "mixed_precision must be a bool"),
    ("warmup_steps", -1, ValueError, "warmup_steps must be an int >= 0"),
])
def test_config_rejects_bad_values(field, value, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace(")", r"\)").replace("(", r"\(")):
        GPTConfig(**{field: value})


def test_config_attention_choices():
    assert GPTConfig(use_flash_attention=False, device="cpu").backend == "naive"
    assert GPTConfig(device="cpu").backend == "numpy"  # auto follows the device
    assert GPTConfig(device="cuda").backend == "triton"
    with pytest.raises(ValueError, match="use_flash_attention=False selects naive"):
        GPTConfig(use_flash_attention=False, attention_backend="triton")
    # dropout on attention weights only where the backend has it: else 0, or an error if asked
    assert GPTConfig(attention_backend="naive").attention_dropout == 0.1
    assert GPTConfig(attention_backend="sdpa").attention_dropout == 0.1
    assert GPTConfig(attention_backend="numpy").attention_dropout == 0.1
    assert GPTConfig(attention_backend="triton").attention_dropout == 0.1
    assert GPTConfig(attention_backend="numba").attention_dropout == 0.0
    with pytest.raises(ValueError, match="has no dropout"):
        GPTConfig(attention_backend="numba", attn_dropout=0.1)


# --- model -------------------------------------------------------------------------------


def test_forward_shape_tying_and_param_count():
    model = GPT(micro_config())
    ids = torch.randint(0, 256, (3, 17))
    assert model(ids).shape == (3, 17, 256)
    names = [n for n, _ in model.named_parameters()]
    assert not any("head" in n for n in names)  # the readout is tok_emb itself
    d, f, L, V, T = 32, 64, 2, 256, 48
    per_block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d)
    assert model.num_params() == V * d + T * d + L * per_block + 2 * d


def test_forward_rejects_bad_ids():
    model = GPT(micro_config())
    with pytest.raises(ValueError, match="int64 tensor"):
        model(torch.zeros(2, 5))
    with pytest.raises(ValueError, match="max_seq_len=48"):
        model(torch.zeros(1, 49, dtype=torch.int64))
    with pytest.raises(TypeError, match="GPTConfig"):
        GPT({"d_model": 32})


def test_attention_is_causal():
    torch.manual_seed(0)
    model = GPT(micro_config()).eval()
    ids = torch.randint(0, 256, (1, 20))
    changed = ids.clone()
    changed[0, 12:] = (changed[0, 12:] + 1) % 256
    a, b = model(ids), model(changed)
    assert torch.equal(a[0, :12], b[0, :12])  # positions before 12 cannot see the change
    assert not torch.allclose(a[0, 12:], b[0, 12:])


def _logits_and_grads(backend, ids):
    # Triton runs on the kernel device: the GPU, or the CPU under its interpreter.
    device = flashedu.runtime.kernel_device() if backend == "triton" else torch.device("cpu")
    torch.manual_seed(0)
    model = GPT(micro_config(attention_backend=backend, device=device.type)).to(device)
    logits = model(ids.to(device))
    targets = ids.roll(-1, 1).to(device)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return logits.detach().cpu(), {n: p.grad.cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("backend", ["numpy", "triton", "sdpa"])
def test_backends_give_naive_logits_and_gradients(backend):
    if backend in flashedu.BACKENDS and flashedu.available_backends()[backend] is not None:
        pytest.skip(f"{backend} unavailable: {flashedu.available_backends()[backend]}")
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 40))  # 40: several Triton / NumPy tiles, the last partial
    ref_logits, ref_grads = _logits_and_grads("naive", ids)
    logits, grads = _logits_and_grads(backend, ids)
    torch.testing.assert_close(logits, ref_logits, atol=2e-5, rtol=1e-4)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], atol=2e-5, rtol=1e-4, msg=name)


# --- data --------------------------------------------------------------------------------


def test_corpus_and_byte_tokenizer():
    corpus = text.load_corpus()
    assert 400_000 < len(corpus) < 1_000_000 and int(corpus.max()) < 128  # plain ASCII
    assert text.decode(corpus[:41]) == "GENESIS\n\n\nGenesis 1\n\nIn the beginning God"
    assert text.decode(text.encode("naïve — ok")) == "naïve — ok"
    x, y = text.get_batch(corpus, 4, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])


# --- training ----------------------------------------------------------------------------


def test_lr_schedule_warmup_then_cosine():
    f = [lr_factor(s, 10, 110, "cosine", 0.1) for s in range(120)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warmup
    assert f[10] == pytest.approx(1.0) and f[60] == pytest.approx(0.55)  # cosine midpoint
    assert f[110] == pytest.approx(0.1) and f[119] == pytest.approx(0.1)
    assert all(a >= b for a, b in itertools.pairwise(f[10:]))  # decays after warmup
    assert lr_factor(60, 10, 110, "linear", 0.1) == pytest.approx(0.55)


def test_tiny_gpt_learns_the_text():
    """A few hundred steps on CPU: the loss falls from ln(256) towards the text's entropy."""
    trainer = Trainer(tiny_config(), TrainSettings(batch_size=8, seq_len=64, max_steps=250,
                                                   eval_every=250, progress=False))
    history = trainer.fit()
    first = history[0]["loss"]
    last = sum(r["loss"] for r in history[-20:]) / 20
    assert first == pytest.approx(math.log(256), abs=0.15)  # a fresh model guesses uniformly
    assert last < 2.8 and history[-1]["val_loss"] < 3.0, (first, last, history[-1])


def test_resume_continues_bit_identically(tmp_path):
    """Checkpoint at step 4 of 8, resume in a fresh trainer: the same losses, bit for bit."""
    config = micro_config(dropout=0.1, gradient_accumulation_steps=2, warmup_steps=3)
    ckpt = tmp_path / "ckpt.pt"
    settings = {"batch_size": 2, "seq_len": 32, "max_steps": 8, "progress": False}
    straight = Trainer(config, TrainSettings(checkpoint_path=str(ckpt), checkpoint_every=4, **settings))
    straight.fit(until=4)
    shutil.copy(ckpt, tmp_path / "step4.pt")  # the run saves again at step 8, over ckpt
    straight.fit()
    losses = [r["loss"] for r in straight.history]
    torch.manual_seed(123)  # whatever the process did in between must not matter
    resumed = Trainer.resume(tmp_path / "step4.pt")
    assert resumed.step == 4
    resumed.fit()
    assert [r["loss"] for r in resumed.history] == losses
    for p, q in zip(resumed.model.parameters(), straight.model.parameters()):
        assert torch.equal(p, q)


def test_each_step_trains_on_the_batch_its_generator_gives_though_drawn_ahead():
    """The next step's first micro-batch is drawn at the end of a step (to be on the GPU
    before the step's kernels end): every step still trains on the windows the generator
    gives in order, and a batch size changed between steps is drawn again at the new size
    from the same state."""
    from flashedu.models import data as text

    config = micro_config(gradient_accumulation_steps=1)
    trainer = Trainer(config, TrainSettings(batch_size=2, seq_len=16, max_steps=6,
                                            progress=False))
    seen = []
    run = trainer.run_model_loss
    trainer.run_model_loss = lambda x, y: (seen.append(x.clone()), run(x, y))[1]
    trainer.train_step()
    trainer.train_step()
    trainer.settings.batch_size = 3
    trainer.train_step()
    generator = torch.Generator().manual_seed(trainer.settings.seed)
    expected = [text.get_batch(trainer.train_data, n, 16, generator)[0] for n in (2, 2, 3)]
    assert [x.shape[0] for x in seen] == [2, 2, 3]
    assert all(torch.equal(a, b) for a, b in zip(seen, expected))


def test_fit_draws_no_batch_past_its_last_step():
    """fit draws each step's next batch ahead, but not after its last step: the generator has
    then given exactly one batch a step."""
    from flashedu.models import data as text

    trainer = Trainer(micro_config(gradient_accumulation_steps=1),
                      TrainSettings(batch_size=2, seq_len=16, max_steps=6, progress=False))
    trainer.fit(until=3)
    assert trainer._prefetched is None
    generator = torch.Generator().manual_seed(trainer.settings.seed)
    for _ in range(3):
        text.get_batch(trainer.train_data, 2, 16, generator)
    assert torch.equal(trainer.generator.get_state(), generator.get_state())


def test_gradient_accumulation_matches_one_big_batch():
    """2 micro-batches of 4 = 1 batch of 8 drawn from the same generator (same windows)."""
    params = []
    for accum, batch in ((2, 4), (1, 8)):
        trainer = Trainer(micro_config(gradient_accumulation_steps=accum),
                          TrainSettings(batch_size=batch, seq_len=32, max_steps=1, progress=False))
        trainer.train_step()
        params.append(list(trainer.model.parameters()))
    for p, q in zip(*params):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_cli_trains_saves_plots_and_resumes(tmp_path, capsys):
    ckpt, png = tmp_path / "ck.pt", tmp_path / "loss.png"
    args = ["--steps", "3", "--batch-size", "2", "--seq-len", "16", "--d-model", "16",
            "--n-heads", "2", "--eval-every", "3", "--no-progress"]
    assert main(args + ["--checkpoint", str(ckpt), "--plot", str(png)]) == 0
    assert ckpt.exists() and png.stat().st_size > 10_000
    assert main(["--resume", str(ckpt), "--steps", "5", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "step 3: loss" in out and "step 5: loss" in out


def test_plot_history_draws_train_and_validation():
    history = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "val_loss": 4.5}]
    fig = plot_history(history)
    lines = fig.axes[0].get_lines()
    assert [list(line.get_ydata()) for line in lines] == [[5.0, 4.0], [4.5]]


# --- attention_backend as a function (your own kernel) -----------------------------------


def sdpa_attention(q, k, v, *, is_causal):
    """An attention function of the form GPTConfig(attention_backend=...) takes."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


@pytest.mark.parametrize("value", [3, None, ["naive"], b"sdpa"])
def test_attention_backend_of_the_wrong_type_is_a_type_error(value):
    with pytest.raises(TypeError, match="attention_backend must be a backend name .* or a function"):
        micro_config(attention_backend=value)


def test_attention_function_with_a_wrong_form_fails_at_the_first_forward():
    ids = torch.randint(0, 256, (1, 8))
    no_is_causal = GPT(micro_config(attention_backend=lambda q, k, v: q))
    with pytest.raises(TypeError, match=r"attention_backend=.*<lambda> failed .* fn\(q, k, v, \*, is_causal\)"):
        no_is_causal(ids)
    wrong_shape = GPT(micro_config(attention_backend=lambda q, k, v, *, is_causal: q[:, :, :1]))
    with pytest.raises(ValueError, match=r"attention_backend=.*returned \(1, 2, 1, 16\); it must"):
        wrong_shape(ids)


def test_a_function_as_attention_backend_trains():
    config = micro_config(attention_backend=sdpa_attention, warmup_steps=5)
    assert config.backend is sdpa_attention and config.backend_name == "test_models.sdpa_attention"
    trainer = Trainer(config, TrainSettings(batch_size=4, seq_len=32, max_steps=40, progress=False))
    history = trainer.fit()
    first, last = history[0]["loss"], sum(r["loss"] for r in history[-5:]) / 5
    assert first == pytest.approx(math.log(256), abs=0.15) and last < first - 1.5, (first, last)


def test_a_function_as_attention_backend_gives_the_backends_numbers():
    torch.manual_seed(1)
    ids = torch.randint(0, 256, (2, 24))
    outs = []
    for backend in ("naive", sdpa_attention):
        torch.manual_seed(0)
        outs.append(GPT(micro_config(attention_backend=backend))(ids))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)


def test_resume_with_an_attention_function(tmp_path):
    """A function is saved by name; resume asks for it and then continues bit-identically."""
    config = micro_config(attention_backend=sdpa_attention, warmup_steps=2)
    settings = {"batch_size": 2, "seq_len": 16, "max_steps": 4, "progress": False}
    straight = Trainer(config, TrainSettings(**settings))
    straight.fit(until=2)
    straight.save(tmp_path / "step2.pt")
    assert straight.state_dict()["config"]["attention_backend"] == "callable:test_models.sdpa_attention"
    straight.fit()
    with pytest.raises(ValueError, match="test_models.sdpa_attention .* pass it again"):
        Trainer.resume(tmp_path / "step2.pt")
    with pytest.raises(ValueError, match="pass the function itself"):
        GPTConfig(**torch.load(tmp_path / "step2.pt", weights_only=True)["config"])
    resumed = Trainer.resume(tmp_path / "step2.pt", attention_backend=sdpa_attention)
    resumed.fit()
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in straight.history]


def test_attention_dropout_that_cannot_run_is_announced():
    with pytest.warns(UserWarning, match="'numba' has no dropout: dropout=0.1 applies to the "
                                         "embeddings and the residual branches, not to the attention"):
        GPT(micro_config(attention_backend="numba", dropout=0.1))
    with pytest.warns(UserWarning, match="sdpa_attention' has no dropout.*dropout_p keyword"):
        GPT(micro_config(attention_backend=sdpa_attention, dropout=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GPT(micro_config(attention_backend="numba", dropout=0.1, attn_dropout=0.0))  # said
        GPT(micro_config(attention_backend="naive", dropout=0.1))  # naive has dropout
        with_dropout = GPT(micro_config(dropout=0.1, attention_backend=(
            lambda q, k, v, *, is_causal, dropout_p=0.0: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=is_causal, dropout_p=dropout_p))))
    assert with_dropout.blocks[0].attn.attn_dropout == 0.1
    with pytest.raises(ValueError, match="has no dropout"):
        micro_config(attention_backend=sdpa_attention, attn_dropout=0.1)


# --- your Triton exercise kernels as the attention ---------------------------------------


def _triton_or_skip():
    reason = flashedu.available_backends()["triton"]
    if reason is not None:
        pytest.skip(f"triton unavailable: {reason}")


def _write_exercise(folder, notebook, finished=()):
    """A course folder with solutions/<notebook> and an exercises/ copy in which only the
    graded cells named in ``finished`` are done (the others raise NotImplementedError)."""
    import nbformat

    nb = nbformat.read(ROOT / "solutions" / f"{notebook}.ipynb", as_version=4)
    (folder / "solutions").mkdir(exist_ok=True)
    (folder / "exercises").mkdir(exist_ok=True)
    nbformat.write(nb, folder / "solutions" / f"{notebook}.ipynb")
    for cell in nb.cells:
        meta = cell.metadata.get("nbgrader", {})
        if meta.get("solution") and meta.get("grade_id") not in finished:
            head = cell.source.split("### BEGIN SOLUTION")[0]
            cell.source = head + "    # YOUR CODE HERE\n    raise NotImplementedError()"
    nbformat.write(nb, folder / "exercises" / f"{notebook}.ipynb")


def test_loader_falls_back_to_the_solution_and_says_so(tmp_path, capsys):
    from flashedu.models.learner import load_exercise_kernels

    _triton_or_skip()
    _write_exercise(tmp_path, "06_triton_kernel")
    kernels = load_exercise_kernels(["06_triton_kernel"], root=tmp_path)
    out = capsys.readouterr().out
    assert "triton_forward_kernel: USING THE SOLUTION from solutions/06_triton_kernel.ipynb" in out
    assert "still raises NotImplementedError" in out
    assert kernels.from_solutions == ["triton_forward_kernel"]
    assert "NotImplementedError" not in Path(kernels["triton_forward_kernel"].fn.__code__.co_filename).read_text()

    (tmp_path / "mine").mkdir()
    _write_exercise(tmp_path / "mine", "06_triton_kernel", finished={"triton_forward_kernel"})
    kernels = load_exercise_kernels(["06_triton_kernel"], root=tmp_path / "mine")
    assert "triton_forward_kernel: your kernel flash_forward_kernel, from exercises/" in capsys.readouterr().out
    assert kernels.from_solutions == []


def test_loader_reports_a_cell_that_does_not_run(tmp_path):
    import nbformat

    from flashedu.models.learner import load_exercise_kernels

    _triton_or_skip()
    _write_exercise(tmp_path, "06_triton_kernel")
    path = tmp_path / "exercises" / "06_triton_kernel.ipynb"
    nb = nbformat.read(path, as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("solution"))
    cell.source = cell.source.replace("raise NotImplementedError()", "O_i = (")  # unfinished line
    nbformat.write(nb, path)
    with pytest.raises(RuntimeError, match="graded cells of 06_triton_kernel .* do not run as a "
                                           "module: SyntaxError"):
        load_exercise_kernels(["06_triton_kernel"], root=tmp_path, quiet=True)


def test_loader_takes_each_finished_kernel_and_no_unfinished_one(tmp_path, capsys):
    """Exercise 07 half done: the learner's dK/dV kernel, the solution's dQ kernel."""
    from flashedu.models.learner import ExerciseAttention, load_exercise_kernels

    _triton_or_skip()
    if not (ROOT / "solutions" / "07_triton_backward.ipynb").exists():
        pytest.skip("no solutions/07_triton_backward.ipynb in this checkout")
    _write_exercise(tmp_path, "07_triton_backward", finished={"triton_backward_dkdv_kernel"})
    kernels = load_exercise_kernels(["07_triton_backward"], root=tmp_path)
    out = capsys.readouterr().out
    assert "triton_backward_dkdv_kernel: your kernel dkdv_kernel, from exercises/" in out
    assert "triton_backward_dq_kernel: USING THE SOLUTION from solutions/07_triton_backward" in out
    assert kernels.from_solutions == ["triton_backward_dq_kernel"]
    with pytest.raises(ValueError, match="no triton_forward_kernel among the kernels"):
        ExerciseAttention(kernels)


def test_loader_resolves_the_course_folder_from_notebooks(monkeypatch):
    from flashedu.models.learner import course_root

    monkeypatch.chdir(ROOT / "notebooks")
    assert course_root() == ROOT


def _kernel_tolerance():
    """float32 in Triton's interpreter; on a GPU tl.dot rounds float32 inputs to TF32."""
    return 1e-5 if flashedu.runtime.triton_interpreted() else 1e-2


def _exercise_attention():
    from flashedu.models.learner import ExerciseAttention, load_exercise_kernels

    _triton_or_skip()
    return ExerciseAttention(load_exercise_kernels(root=ROOT, quiet=True), Br=16, Bc=16)


@pytest.mark.parametrize("causal", [True, False])
def test_exercise_kernels_give_the_numpy_backends_output_and_gradients(causal):
    """Two heads of two sequences, T=37 (three tiles of 16, the last partial), d=16."""
    attn = _exercise_attention()
    q, k, v = (torch.randn(2, 2, 37, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 2, 37, 16, dtype=torch.float64)
    out = attn(q.float(), k.float(), v.float(), is_causal=causal)
    ref = flashedu.attention(q, k, v, is_causal=causal, backend="numpy")
    assert out.dtype == torch.float32
    tol = _kernel_tolerance()
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=10 * tol)
    mine = torch.autograd.grad(out, (q, k, v), grad.float())
    theirs = torch.autograd.grad(ref, (q, k, v), grad)
    for name, a, b in zip("qkv", mine, theirs):
        torch.testing.assert_close(a, b, atol=tol, rtol=10 * tol, msg=f"d{name}")


def test_exercise_kernels_use_the_backward_launcher_when_exercise_07_is_there():
    attn = _exercise_attention()
    if not attn.has_backward_kernels:
        pytest.skip("no exercise 07 (Triton backward kernels) in solutions/ yet: the backward "
                    "runs flashedu's NumPy Algorithm 4")
    assert "dK/dV and dQ kernels" in attn.describe()


def test_exercise_kernels_keep_bf16_and_reject_bad_head_dims():
    attn = _exercise_attention()
    q = torch.randn(1, 1, 20, 16, dtype=torch.bfloat16)
    out = attn(q, q, q, is_causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    assert out.dtype == torch.bfloat16 and (out.float() - ref).abs().max() < 2e-2
    saved = micro_config(attention_backend=attn).to_dict()  # a checkpoint keeps its name only
    assert saved["attention_backend"] == "callable:flashedu.models.learner.ExerciseAttention"
    with pytest.raises(ValueError, match="head dim d=24: the exercise kernels need a power of two"):
        attn(*(torch.randn(1, 1, 8, 24) for _ in range(3)), is_causal=True)


def test_a_gpt_trains_on_the_exercise_kernels_as_on_the_package():
    """Same seed, same batches: the loss curves of the two attentions nearly coincide."""
    attn = _exercise_attention()
    losses = {}
    for name, backend in (("exercise", attn), ("package", "numpy")):
        config = micro_config(n_layers=1, attention_backend=backend, warmup_steps=3)
        trainer = Trainer(config, TrainSettings(batch_size=2, seq_len=32, max_steps=6, progress=False))
        losses[name] = [r["loss"] for r in trainer.fit()]
    assert losses["exercise"][-1] < losses["exercise"][0] - 0.2
    tol = 1e-4 if flashedu.runtime.triton_interpreted() else 2e-2  # TF32 dots on a GPU
    assert max(abs(a - b) for a, b in zip(*losses.values())) < tol, losses


def test_exercise_tiles_shrink_where_a_gpu_lacks_shared_memory():
    """Triton raises OutOfResources at launch when a tile needs more shared memory than the GPU
    has: the adapter halves Br and Bc (not below 16), says so, and retries."""
    attn = _exercise_attention()
    attn.Br = attn.Bc = 64

    class OutOfResources(Exception):  # Triton's exception, by name
        pass

    tried = []

    def step():
        tried.append((attn.Br, attn.Bc))
        if attn.Br > 16:
            raise OutOfResources("out of resource: shared memory")
        return "ran"

    with pytest.warns(UserWarning) as record:
        assert attn.fit_tiles(step) == "ran"
    assert tried == [(64, 64), (32, 32), (16, 16)]
    assert [str(w.message).split("retrying with ")[1] for w in record] == ["Br=32, Bc=32",
                                                                          "Br=16, Bc=16"]

    def never_fits():
        raise OutOfResources("out of resource: shared memory")

    with pytest.raises(OutOfResources):  # at 16 there is nothing smaller to try
        attn.fit_tiles(never_fits)
