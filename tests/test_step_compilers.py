"""The step compilers ([compile] step): ReplayedStep, traced twice and then its compiled graph
replayed, must train exactly like the lazy step; the process switch each needs; and both give the
same losses in train.py, bit for bit, on one device and on fsdp=4 x tp=2."""

import ast
import subprocess
import sys

import pytest
from helpers import REPO, _env, tiny_args, train_run


def _build(xla_device):
    import torch
    import torch_xla

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(),
                                torch.nn.Linear(32, 4)).to(xla_device)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, foreach=False,
                            capturable=True)
    for p in model.parameters():
        opt.state[p].update(step=torch.zeros((), device=xla_device),
                            exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
    torch_xla.sync()
    return model, opt


def _step_fn(model, opt, traces: list):
    import torch

    from torchtitan_xla.optimizer import step_with_lr

    def step(x, y, lr):
        traces.append(1)  # runs only when the step is traced
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        step_with_lr(opt, lr)
        return loss.detach()
    return step


def _batches(n, rows=8):
    import torch

    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 16, generator=g), torch.randn(rows, 4, generator=g)) for _ in range(n)]


def _lazy_losses(xla_device, batches, lr) -> list[float]:
    """The lazy step's losses on `batches`, from a fresh model, at one lr (a device scalar)."""
    import torch_xla

    model, opt = _build(xla_device)
    lazy, losses = _step_fn(model, opt, []), []
    for x, y in batches:
        loss = lazy(x.to(xla_device), y.to(xla_device), lr)
        torch_xla.sync()
        losses.append(loss.item())
    return losses


LRS = [0.01, 0.02, 0.03, 0.01, 0.005, 0.02, 0.04]


def test_replayed_step_trains_bit_exactly_like_the_lazy_step_and_traces_twice(xla_device):
    import torch
    import torch_xla

    from torchtitan_xla.optimizer import optimizer_state_tensors
    from torchtitan_xla.runtime import compile_stats
    from torchtitan_xla.runtime.xla.step import ReplayedStep

    batches = _batches(len(LRS))
    model, opt = _build(xla_device)
    lazy, traces = _step_fn(model, opt, []), []
    expected = []
    for (x, y), lr in zip(batches, LRS):
        loss = lazy(x.to(xla_device), y.to(xla_device), torch.tensor(lr, device=xla_device))
        torch_xla.sync()
        expected.append(loss.item())
    expected_state = [t.cpu() for t in [*model.parameters(), *optimizer_state_tensors(opt)]]

    model, opt = _build(xla_device)
    state = [*model.parameters(), *optimizer_state_tensors(opt)]
    step = ReplayedStep(_step_fn(model, opt, traces), state)
    losses = []
    for i, ((x, y), lr) in enumerate(zip(batches, LRS)):
        if i == 2:
            compiles_after_warmup = compile_stats()[0]
        losses.append(step(x.to(xla_device), y.to(xla_device),
                           torch.tensor(lr, device=xla_device)).item())
    assert losses == expected  # bit-exact, every step
    assert len(traces) == 2  # steps 3..7 ran no Python of the step
    assert compile_stats()[0] == compiles_after_warmup
    # The same tensor objects hold the new values (the optimizer and checkpoints hold them).
    assert state == [*model.parameters(), *optimizer_state_tensors(opt)]
    for got, want in zip(state, expected_state):
        assert torch.equal(got.cpu(), want)
    assert opt.state[model[0].weight]["step"].item() == len(LRS)


def test_a_new_batch_shape_is_traced_again(xla_device):
    """A batch of another shape cannot run in the cached graph: it is traced (and compiled)
    anew, and trains like the lazy step."""
    import torch

    from torchtitan_xla.optimizer import optimizer_state_tensors
    from torchtitan_xla.runtime.xla.step import ReplayedStep

    batches = _batches(3) + _batches(3, rows=5)
    lr = torch.tensor(0.01, device=xla_device)
    expected = _lazy_losses(xla_device, batches, lr)

    model, opt = _build(xla_device)
    traces = []
    step = ReplayedStep(_step_fn(model, opt, traces),
                        [*model.parameters(), *optimizer_state_tensors(opt)])
    losses = [step(x.to(xla_device), y.to(xla_device), lr).item() for x, y in batches]
    assert losses == expected
    assert len(traces) == 4  # steps 1 and 2, and the first two 5-row batches


def test_a_batch_of_named_tensors_is_replayed_like_its_tensors(xla_device):
    """train.py's step takes a Batch (a pytree): its tensors are the graph's inputs, replayed
    bit-exactly; a batch carrying another set of tensors is another graph."""
    import torch

    from torchtitan_xla.batch import Batch
    from torchtitan_xla.optimizer import optimizer_state_tensors
    from torchtitan_xla.runtime.xla.step import ReplayedStep

    batches, lr = _batches(4), torch.tensor(0.01, device=xla_device)
    expected = _lazy_losses(xla_device, batches, lr)

    model, opt = _build(xla_device)
    traces = []
    plain = _step_fn(model, opt, traces)

    def step_fn(batch: Batch, lr):
        y = batch.labels if batch.reference_logps is None else batch.labels + batch.reference_logps
        return plain(batch.inputs, y, lr)

    step = ReplayedStep(step_fn, [*model.parameters(), *optimizer_state_tensors(opt)])
    losses = [step(Batch(x.to(xla_device), y.to(xla_device)), lr).item() for x, y in batches]
    assert losses == expected and len(traces) == 2
    x, y = batches[0]
    step(Batch(x.to(xla_device), y.to(xla_device), reference_logps=torch.zeros(8, 1, device=xla_device)), lr)
    assert len(traces) == 3  # another structure: traced anew


def test_native_blocks_compile_one_graph_per_batch_shape():
    """The native runtime's compiled blocks take one graph per shape, as XLA does: a microbatch,
    the reference's and validation's whole batches are each a static graph. torch.compile's
    automatic dynamic shapes would make the second shape symbolic, which the blockwise attention's
    query blocks cannot trace under DTensor (found with DPO at seq_len 256 on one process)."""
    import torch
    from torch._dynamo.utils import counters

    from torchtitan_xla.models import get_model_args, get_model_class
    from torchtitan_xla.models.llama.attention_kernels import apply_attention_kernel
    from torchtitan_xla.parallelisms.parallelize_llama import apply_compile

    args = get_model_args("llama3", "debugmodel", vocab_size=256, max_seq_len=128, n_layers=1,
                          dim=64, n_heads=4)
    model = get_model_class("llama3")(args)
    model.init_weights()
    apply_attention_kernel(model, "blockwise", None, "CPU")
    apply_compile(model, backend="aot_eager")  # dynamo's graphs alone, without inductor's kernels
    before = counters["stats"]["unique_graphs"]
    # As in a native process: importing torch_xla (this test process has) turns this off.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=True):
        for rows in (2, 4, 6, 4):
            model(torch.randint(0, 256, (rows, 128))).sum().backward()
    assert counters["stats"]["unique_graphs"] - before == 3  # 2, 4 and 6 rows; 4 again reused


def test_a_per_step_python_number_is_an_error_not_a_stale_value(xla_device):
    import torch

    from torchtitan_xla.optimizer import optimizer_state_tensors
    from torchtitan_xla.runtime.xla.step import ReplayedStep

    model, opt = _build(xla_device)
    calls = []

    def step_fn(x):
        calls.append(1)
        opt.zero_grad(set_to_none=True)
        # A per-step scale read as a Python number: XLA uploads it as data, so the replayed
        # graph would keep the first value for ever.
        loss = model(x).square().mean() * (0.5 + len(calls))
        loss.backward()
        opt.step()
        return loss.detach()

    step = ReplayedStep(step_fn, [*model.parameters(), *optimizer_state_tensors(opt)])
    x = torch.randn(8, 16).to(xla_device)
    step(x)
    with pytest.raises(RuntimeError) as err:
        step(x)
    assert str(err.value) == (
        "train_step: a value the step reads as a Python number changed between steps 1 and 2 "
        "(1.5 -> 2.5); a replayed step would keep the first. Pass it to the step as a device "
        "tensor.")


def test_a_host_sync_inside_the_step_is_an_error(xla_device):
    import torch

    from torchtitan_xla.runtime.xla.step import ReplayedStep

    w = torch.ones(4, device=xla_device)

    def step_fn(x):
        if (x * w).sum().item() > 0:  # reads a device value on the host mid-step
            w.add_(1.0)
        return w.sum()

    with pytest.raises(RuntimeError, match="Unexpected execution happens inside the compiled"):
        ReplayedStep(step_fn, [w])(torch.ones(4, device=xla_device))


_STEP_PROBE = """
import sys; sys.path.insert(0, {repo!r})
from torchtitan_xla import runtime
runtime.configure({configured!r})
import torch, torch_xla
device = torch_xla.device()
print(torch._is_functional_tensor(torch.ones(1, device=device)))
torch.manual_seed(0)
w = torch.randn(4, 4).to(device)
traces = []
def step(x):
    traces.append(1)
    w.mul_(0.5).add_(x)
    return w.sum()
compiled = runtime.build_step({kind!r}, step, [w])
print([compiled(torch.full((4, 4), float(i)).to(device)).item() for i in range(4)], len(traces))
"""


@pytest.mark.parametrize("configured, kind, functional, traces", [
    ("replay", "replay", "False", "2"),
    ("lazy", "lazy", "True", "4"),
    # A replayed step on functional tensors (made before `configure` could turn it off) falls
    # back to tracing every step, with the same results.
    ("lazy", "replay", "True", "4"),
])
def test_functionalization_follows_the_step_compiler(configured, kind, functional, traces):
    """runtime.configure turns torch_xla's functionalization off for `replay` (its replayed graph
    rebinds tensors that functionalization's wrappers would not see; tracing also costs more with
    it: docs/performance.md) and leaves it on for `lazy`, whatever the environment said."""
    import torch

    p = subprocess.run([sys.executable, "-c", _STEP_PROBE.format(repo=str(REPO), configured=configured,
                                                                 kind=kind)],
                       capture_output=True, text=True, env=_env(1, {"XLA_DISABLE_FUNCTIONALIZATION": "1"}),
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    is_functional, results = p.stdout.splitlines()
    assert is_functional == functional
    values, count = results.rsplit(" ", 1)
    assert count == traces  # the step's Python ran twice (replayed after), or every time
    torch.manual_seed(0)
    w, expected = torch.randn(4, 4), []
    for i in range(4):  # the same updates on the host, in float32
        w = w * 0.5 + i
        expected.append(w.sum().item())
    assert ast.literal_eval(values) == pytest.approx(expected, rel=1e-6)


# 20 steps of the debug model cut to 2 blocks (the same code paths).
STEPS_20 = ["--training.steps", "20", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "5"]


@pytest.mark.parametrize("devices, mesh", [
    (1, ["--training.local_batch_size", "4", "--model.name", "qwen3"]),
    (8, ["--training.local_batch_size", "1", "--parallelism.tensor_parallel_degree", "2"]),
], ids=["1-device-qwen3", "fsdp4-tp2"])
def test_lazy_and_replay_train_bit_identically(tmp_path, devices, mesh):
    """The same job with each step compiler: identical losses at every step, to the last bit, and
    neither compiles after warm-up (the run would stop: debug.on_recompile = "error").
    Qwen3 on one device: with XLA CPU's XNNPACK on, its replayed step parted from lazy at step 3 on
    a Zen 3 EPYC (docs/runtime.md); Llama's did not."""
    losses = {}
    for kind in ("replay", "lazy"):
        losses[kind], log = train_run(tiny_args(tmp_path / kind, *mesh, *STEPS_20, "--compile.step", kind),
                                      devices=devices, model_overrides={"n_layers": 2})
        assert f"seed 42, {kind} step" in log
        assert "Training completed: 2 compiles in total" in log
    assert sorted(losses["replay"]) == list(range(1, 21))
    assert losses["lazy"] == losses["replay"]
