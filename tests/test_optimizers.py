"""Optimizers: each against its reference on the same parameters and gradients for 10 steps in
float64 on the CPU (torch.optim.AdamW / Adafactor / Muon, the lion-pytorch package); the state
created before the first step; then each in train.py: fsdp=4 x tp=2 against one device, and exact
resume from a checkpoint of its state."""

from __future__ import annotations

import pytest
import torch

from torchtitan_xla.config import ConfigError, parse_args
from torchtitan_xla.models.llama import ModelArgs, Transformer
from torchtitan_xla.optimizer import build_optimizer, step_with_lr

STEPS = 10


def _model(seed: int = 0) -> Transformer:
    """A small Llama in float64 on the CPU: embeddings, 2-D hidden weights (square, tall and wide),
    norms and the output projection, named as in training."""
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(dim=16, n_layers=1, n_heads=2, vocab_size=40, multiple_of=8)).double()
    model.init_weights()
    return model


def _gradients(model: torch.nn.Module) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(p.shape, generator=g, dtype=p.dtype) for p in model.parameters()]
            for _ in range(STEPS)]


def _train(model, optimizers, grads, lrs=None) -> list[torch.Tensor]:
    """Apply the gradients step by step (the lr of step i: lrs[i], for our optimizers through the
    device-tensor path); the parameters after each step."""
    history = []
    for i, step_grads in enumerate(grads):
        for p, g in zip(model.parameters(), step_grads):
            p.grad = g.clone()
        for opt in optimizers:
            if lrs is None:
                opt.step()
            else:
                step_with_lr(opt, torch.tensor(lrs[i], dtype=torch.float64))
        history.append(torch.cat([p.detach().flatten().clone() for p in model.parameters()]))
    return history


def _ours(name: str, *flags: str):
    model = _model()
    return model, build_optimizer(model, parse_args(["--optimizer.name", name, *flags]))


def _assert_same(ours, reference, rtol=1e-12):
    assert len(ours) == len(reference) == STEPS
    for step, (a, b) in enumerate(zip(ours, reference)):
        torch.testing.assert_close(a, b, rtol=rtol, atol=rtol, msg=lambda m, s=step: f"step {s + 1}: {m}")


def test_adamw_is_torchs():
    model, opt = _ours("AdamW", "--optimizer.lr", "0.01")
    ours = _train(model, [opt], _gradients(model))
    ref_model = _model()
    ref = torch.optim.AdamW(ref_model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    _assert_same(ours, _train(ref_model, [ref], _gradients(ref_model)), rtol=0)


def test_adafactor_equals_torch_optim_adafactor():
    flags = ["--optimizer.lr", "0.05", "--optimizer.weight_decay", "0.01",
             "--optimizer.adafactor_clip_threshold", "1.5"]
    model, opt = _ours("Adafactor", *flags)
    ours = _train(model, [opt], _gradients(model))
    ref_model = _model()
    ref = torch.optim.Adafactor(ref_model.parameters(), lr=0.05, beta2_decay=-0.8, d=1.5,
                                weight_decay=0.01, foreach=False)
    _assert_same(ours, _train(ref_model, [ref], _gradients(ref_model)))


def test_lion_equals_lion_pytorch():
    lion_pytorch = pytest.importorskip("lion_pytorch")
    flags = ["--optimizer.lr", "1e-3", "--optimizer.beta2", "0.99", "--optimizer.weight_decay", "0.5"]
    model, opt = _ours("Lion", *flags)
    ours = _train(model, [opt], _gradients(model))
    ref_model = _model()
    ref = lion_pytorch.Lion(ref_model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.5)
    _assert_same(ours, _train(ref_model, [ref], _gradients(ref_model)), rtol=0)


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_muon_equals_torch_optim_muon_and_adamw_for_the_rest(monkeypatch, adjust):
    """torch.optim.Muon on the 2-D hidden weights plus torch.optim.AdamW on everything else. Both
    run the Newton-Schulz iteration in float64 here (torch's always casts to bfloat16: its own
    iteration is compared with ours in the next test)."""
    from torch.optim import _muon

    from torchtitan_xla.optimizer.muon import newton_schulz

    model = _model()
    opt = build_optimizer(model, parse_args(["--optimizer.name", "Muon", "--optimizer.lr", "0.02",
                                             "--optimizer.muon_adjust_lr", adjust]))
    for group in opt.param_groups:
        group["ns_dtype"] = torch.float64
    ours = _train(model, [opt], _gradients(model))

    monkeypatch.setattr(_muon, "_zeropower_via_newtonschulz",
                        lambda g, coefficients, steps, eps: newton_schulz(g, steps, torch.float64))
    ref_model = _model()
    named = dict(ref_model.named_parameters())
    matrices = [p for n, p in named.items() if n.startswith("layers.") and p.dim() == 2]
    rest = [p for n, p in named.items() if not (n.startswith("layers.") and p.dim() == 2)]
    assert len(matrices) == 7 and len(rest) == 5  # wq wk wv wo w1 w2 w3; embeddings, 3 norms, output
    refs = [torch.optim.Muon(matrices, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                             adjust_lr_fn=adjust),
            torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)]
    _assert_same(ours, _train(ref_model, refs, _gradients(ref_model)))


def test_muon_takes_the_linear_weights_not_biases_nor_stacked_experts():
    """gpt-oss's debug model: Muon's group is every block's linear weights (the attention's four and
    the router); its biases, sinks and the experts' [E, ...] weights and [E, dim] biases go to AdamW."""
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer
    from torchtitan_xla.optimizer.muon import muon_param_groups

    with torch.device("meta"):
        model = Transformer(get_model_args("gpt_oss", "debugmodel", vocab_size=64, n_layers=1))
    names = {id(p): n for n, p in model.named_parameters()}
    muon, adamw = ({names[id(p)].removeprefix("layers.0.") for p in g["params"]} for g in muon_param_groups(model))
    assert muon == {"attention.wq.weight", "attention.wk.weight", "attention.wv.weight", "attention.wo.weight",
                    "feed_forward.router.weight"}
    assert {"feed_forward.b1", "feed_forward.b2", "feed_forward.w1", "attention.wq.bias"} <= adamw


def test_newton_schulz_matches_torch_in_bfloat16_and_float32_matches_float64():
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, _zeropower_via_newtonschulz

    from torchtitan_xla.optimizer.muon import NS_COEFFICIENTS, newton_schulz

    assert NS_COEFFICIENTS == (DEFAULT_A, DEFAULT_B, DEFAULT_C)
    g = torch.Generator().manual_seed(3)
    for shape in [(16, 16), (48, 16), (16, 48), (256, 256), (768, 256)]:
        m = torch.randn(shape, generator=g)
        exact = newton_schulz(m.double(), 5, torch.float64)
        theirs = _zeropower_via_newtonschulz(m, NS_COEFFICIENTS, 5, 1e-7).double()
        ours = newton_schulz(m, 5, torch.bfloat16).double()

        def off(x, y=exact):
            return ((x - y).norm() / y.norm()).item()

        # Both round to bfloat16 at the same points; only float32 accumulation orders differ
        # (measured: identical up to 48 x 16, 0.3-0.7% apart at 256 x 256 and 768 x 256).
        assert off(ours, theirs) < 0.01, shape
        assert off(ours) <= 1.1 * off(theirs), shape  # as far from the exact iteration as torch's
        torch.testing.assert_close(newton_schulz(m, 5, torch.float32).double(), exact, rtol=1e-5, atol=1e-5)
        # What the iteration is for: singular values pulled towards 1 (the tiny ones of a random
        # square matrix stay small after 5 steps).
        s, before = torch.linalg.svdvals(exact), torch.linalg.svdvals(m.double())
        assert s.max() < 1.3 and 0.6 < s.median() < 1.2 and before.max() > 5, (s, before)


@pytest.mark.parametrize("name", ["Muon", "Lion", "Adafactor"])
def test_a_device_tensor_lr_gives_the_float_lr_updates(name):
    """In training the lr reaches the optimizer as a tensor (the replayed step reads it as data);
    it must act exactly as the same Python float."""
    lrs = [1e-3 * (1 + i) for i in range(STEPS)]
    model, opt = _ours(name)
    as_tensor = _train(model, [opt], _gradients(model), lrs)
    model, opt = _ours(name)
    as_float = []
    for i, step_grads in enumerate(_gradients(model)):
        for group in opt.param_groups:
            group["lr"] = lrs[i]
        as_float += _train(model, [opt], [step_grads])
    _assert_same(as_tensor, as_float, rtol=0)


def test_state_exists_before_the_first_step(xla_device):
    """State created up front (same shapes and dtypes as torch would create) so step 0 and every
    later step trace the same graph, and a checkpoint loads into it in place."""
    model = torch.nn.Linear(4, 3).to(xla_device)
    opt = build_optimizer(model, parse_args([]))
    state = opt.state[model.weight]
    # capturable: the step count lives on the device, so the step's graph reads it as data.
    assert state["step"].device.type == "xla" and state["step"].item() == 0.0
    assert state["exp_avg"].shape == (3, 4) and state["exp_avg"].device.type == "xla"
    assert torch.count_nonzero(state["exp_avg_sq"].cpu()) == 0
    model.weight.grad = torch.ones_like(model.weight)
    model.bias.grad = torch.ones_like(model.bias)
    opt.step()
    assert state["step"].item() == 1.0  # torch used our state rather than making its own
    assert set(state) == {"step", "exp_avg", "exp_avg_sq"}


@pytest.mark.parametrize("name, keys", [
    ("Muon", ({"momentum_buffer"}, {"step", "exp_avg", "exp_avg_sq"})),
    ("Lion", ({"exp_avg"}, {"exp_avg"})),
    ("Adafactor", ({"step", "row_var", "col_var"}, {"step", "variance"})),
])
def test_our_optimizers_create_their_state_up_front(name, keys):
    model, opt = _ours(name)
    hidden, norm = model.layers["0"].attention.wq.weight, model.norm.weight
    assert set(opt.state[hidden]) == keys[0] and set(opt.state[norm]) == keys[1]
    before = {k: v.clone() for k, v in opt.state[hidden].items()}
    _train(model, [opt], _gradients(model)[:1])
    assert all(opt.state[hidden][k].shape == v.shape for k, v in before.items())  # updated in place


def test_muon_without_hidden_weights_is_one_line():
    with pytest.raises(ConfigError) as e:
        build_optimizer(torch.nn.Linear(4, 3), parse_args(["--optimizer.name", "Muon"]))
    assert str(e.value) == ('[optimizer] name = "Muon": the model has no 2-D hidden weights '
                            '(parameters under `layers.`) to orthogonalise; use AdamW')


OFFLOAD = ["--runtime.backend", "native", "--optimizer.offload", "--optimizer.lr", "0.01"]


@pytest.mark.parametrize("name", ["AdamW", "Adam"])
def test_the_offloaded_optimizer_keeps_its_state_on_the_host_and_updates_as_torchs_fused_kernel(name):
    """`[optimizer] offload`: the model's parameters (on the GPU where there is one) are updated
    bit for bit as by torch's fused CPU kernel over a CPU copy; no optimizer state is on the device or is a
    model parameter; a non-finite step changes nothing; its state dict is the plain optimizer's,
    and a resume from it continues exactly. (In training: tests/test_native_runtime.py.)"""
    from torchtitan_xla.optimizer import NonFiniteGuard, optimizer_state_tensors

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, grads = _model().to(device), _gradients(_model())
    lrs = [1e-2 * (i + 1) for i in range(STEPS)]
    opt = build_optimizer(model, parse_args(["--optimizer.name", name, *OFFLOAD]))
    ref_model = _model()
    cls = torch.optim.AdamW if name == "AdamW" else torch.optim.Adam
    ref = cls(ref_model.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)

    def train(model, opt, steps):
        on = next(model.parameters()).device
        for i in steps:
            for p, g in zip(model.parameters(), grads[i]):
                p.grad = g.to(on)
            step_with_lr(opt, torch.tensor(lrs[i], dtype=torch.float64, device=on))
            model.zero_grad(set_to_none=True)
        return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()

    assert torch.equal(train(model, opt, range(5)), train(ref_model, ref, range(5)))
    state = optimizer_state_tensors(opt)
    assert len(state) == 3 * len(list(model.parameters())) and all(t.device.type == "cpu" for t in state)
    assert not {id(p) for p in model.parameters()} & {id(p) for p in opt.state}
    assert all(p.device.type == "cpu" and not p.is_set_to(m) for p, m in
               zip(opt.host_offload.host_params, model.parameters()))
    saved = opt.state_dict()
    assert {i: {k: v.shape for k, v in s.items()} for i, s in saved["state"].items()} == {
        i: {k: v.shape for k, v in s.items()} for i, s in ref.state_dict()["state"].items()}

    # A non-finite step: weights, state and step counts as they were.
    before = [t.clone() for t in (*model.parameters(), *state)]
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    NonFiniteGuard(device, skip=True).update(torch.tensor(False, device=device), list(model.parameters()),
                                             lambda: step_with_lr(opt, torch.tensor(0.01, device=device)), opt)
    assert all(torch.equal(a, b) for a, b in zip(before, (*model.parameters(), *state)))

    # Resumed from the state dict into a new model and optimizer: steps 6-10 exactly.
    resumed = _model().to(device)
    resumed.load_state_dict(model.state_dict())
    resumed_opt = build_optimizer(resumed, parse_args(["--optimizer.name", name, *OFFLOAD]))
    resumed_opt.load_state_dict(saved)
    assert torch.equal(train(resumed, resumed_opt, range(5, STEPS)), train(ref_model, ref, range(5, STEPS)))


@pytest.mark.parametrize("flags, message", [
    (["--optimizer.offload"], "command line: --optimizer.offload = true needs [runtime] backend = \"native\": torch_xla "
     "2.9 has no API to keep tensors in the host's memory space (pytorch/xla#8049)"),
    (["--runtime.backend", "native", "--optimizer.offload", "--optimizer.name", "Lion"],
     "command line: --optimizer.offload = true updates with torch's fused AdamW or Adam on the host, not [optimizer] "
     "name = 'Lion': Muon and Adafactor read each weight matrix whole, Lion has no host kernel that "
     "skips non-finite steps"),
])
def test_optimizer_offload_it_cannot_run_is_one_line(flags, message):
    with pytest.raises(ConfigError) as e:
        parse_args(flags)
    assert str(e.value) == message


# ---- in train.py: every mesh, checkpoints ---------------------------------------------------------

ONE_BLOCK = {"n_layers": 1}
OPTIMIZERS = {
    # The Newton-Schulz iteration in float32: in bfloat16 the meshes' different summation orders
    # are rounded to 8 bits and no tolerance below 1e-3 would hold.
    "muon": ["--optimizer.name", "Muon", "--optimizer.muon_ns_dtype", "float32"],
    "lion": ["--optimizer.name", "Lion", "--optimizer.lr", "2e-4", "--optimizer.beta2", "0.99"],
    "adafactor": ["--optimizer.name", "Adafactor", "--optimizer.lr", "1e-2"],
}


# The loss options in train.py, on the same processes: label smoothing and z-loss on full logits,
# and the same loss chunked (tests/test_losses.py has the float64 checks).
LOSSES = {
    "full loss": ["--loss.label_smoothing", "0.1", "--loss.z_loss_weight", "1e-3"],
    "chunked loss": ["--loss.label_smoothing", "0.1", "--loss.z_loss_weight", "1e-3", "--loss.chunk_size", "32"],
}


def _args(folder, *extra: str) -> list[str]:
    from helpers import tiny_args

    return tiny_args(folder, "--training.steps", "10", "--lr_scheduler.warmup_steps", "2", *extra)


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """Each optimizer for 10 steps on one device, saving at step 5, then the same run resumed from
    that checkpoint; all in one process."""
    from helpers import train_many

    runs = {}
    for name, flags in OPTIMIZERS.items():
        folder = tmp_path_factory.mktemp(name)
        args = _args(folder, *flags, "--training.local_batch_size", "8", "--checkpoint.enable",
                     "--checkpoint.interval", "5")
        runs[name] = args
        runs[f"{name} resumed"] = [*args, "--checkpoint.load_step", "5"]
    for name, flags in LOSSES.items():
        runs[name] = _args(tmp_path_factory.mktemp("loss"), *flags, "--training.local_batch_size", "8")
    return train_many(runs, devices=1, model_overrides=ONE_BLOCK)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_resume_restores_the_optimizer_state_exactly(one_device, name):
    straight, resumed = one_device[name]["losses"], one_device[f"{name} resumed"]["losses"]
    assert sorted(straight) == list(range(1, 11)) and sorted(resumed) == list(range(6, 11))
    assert resumed == {s: straight[s] for s in range(6, 11)}  # bit for bit
    # Warm-up (steps 1 and 2) compiles at most three graphs (Adafactor's first step adds one);
    # after it train.py's CompileGuard fails any run that compiles again, so none did.
    assert one_device[name]["compiles"] <= 3, one_device[name]["compiles"]


def test_each_optimizer_and_the_chunked_loss_on_fsdp4_tp2_give_the_losses_of_one_device(tmp_path, one_device):
    from helpers import train_many

    mesh = ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]
    runs = {name: _args(tmp_path / name, *flags, *mesh) for name, flags in OPTIMIZERS.items()}
    runs["chunked loss"] = _args(tmp_path / "chunked", *LOSSES["chunked loss"], *mesh)
    results = train_many(runs, devices=8, model_overrides=ONE_BLOCK)
    # The chunked loss with smoothing and z-loss: the full-logits loss's numbers, on both meshes.
    full, chunked = one_device["full loss"]["losses"], one_device["chunked loss"]["losses"]
    assert sorted(full) == list(range(1, 11))
    for step in full:
        assert chunked[step] == pytest.approx(full[step], rel=1e-5), step
        assert results["chunked loss"]["losses"][step] == pytest.approx(full[step], rel=1e-5), step
    for name in OPTIMIZERS:
        got, want = results[name]["losses"], one_device[name]["losses"]
        assert got.keys() == want.keys()
        for step in want:  # only the summation order differs
            assert got[step] == pytest.approx(want[step], rel=1e-5), (name, step)
        # The state of a parameter's shape is sharded like the parameter.
        state_key = {"muon": "momentum_buffer", "lion": "exp_avg", "adafactor": "variance"}[name]
        for pname, p in results[name]["params"].items():
            assert p["actual"] == p["expected"], (name, pname)
            if state_key in p:
                assert p[state_key] == p["actual"], (name, pname, state_key)
        assert sum(state_key in p for p in results[name]["params"].values()) >= 3
