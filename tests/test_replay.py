"""ReplayedStep: the step traced twice, then its compiled graph replayed, must train exactly like
the plain lazy step it replaces."""

import pytest


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


LRS = [0.01, 0.02, 0.03, 0.01, 0.005, 0.02, 0.04]


def test_replayed_step_trains_bit_exactly_like_the_lazy_step_and_traces_twice(xla_device):
    import torch
    import torch_xla

    from torchtitan_xla.optimizer import optimizer_state_tensors
    from torchtitan_xla.replay import ReplayedStep
    from torchtitan_xla.utils import compile_stats

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
    import torch_xla

    from torchtitan_xla.optimizer import optimizer_state_tensors
    from torchtitan_xla.replay import ReplayedStep

    batches = _batches(3) + _batches(3, rows=5)
    lr = torch.tensor(0.01, device=xla_device)
    model, opt = _build(xla_device)
    lazy, expected = _step_fn(model, opt, []), []
    for x, y in batches:
        loss = lazy(x.to(xla_device), y.to(xla_device), lr)
        torch_xla.sync()
        expected.append(loss.item())

    model, opt = _build(xla_device)
    traces = []
    step = ReplayedStep(_step_fn(model, opt, traces),
                        [*model.parameters(), *optimizer_state_tensors(opt)])
    losses = [step(x.to(xla_device), y.to(xla_device), lr).item() for x, y in batches]
    assert losses == expected
    assert len(traces) == 4  # steps 1 and 2, and the first two 5-row batches


def test_a_per_step_python_number_is_an_error_not_a_stale_value(xla_device):
    import torch

    from torchtitan_xla.optimizer import optimizer_state_tensors
    from torchtitan_xla.replay import ReplayedStep

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

    from torchtitan_xla.replay import ReplayedStep

    w = torch.ones(4, device=xla_device)

    def step_fn(x):
        if (x * w).sum().item() > 0:  # reads a device value on the host mid-step
            w.add_(1.0)
        return w.sum()

    with pytest.raises(RuntimeError, match="Unexpected execution happens inside the compiled"):
        ReplayedStep(step_fn, [w])(torch.ones(4, device=xla_device))
