"""Steps with a non-finite loss or gradient norm ([training] skip_nonfinite_steps,
max_consecutive_nonfinite) on the XLA runtime; the native runtime's in test_native_runtime.py.

The debug model (two blocks) at lr 1e3 diverges: step 2's loss is in the millions, and from step 5
on every gradient norm is NaN. Skipped, those steps leave the weights and the optimizer state as
step 4 left them; applied, the weights turn NaN and no checkpoint of them is written. Either way the
run stops with one line once too many come in a row, and a finite checkpoint survives."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import all_tensors, train_py_two_blocks
from helpers import STEP_LINE, event_scalars, tiny_args

DIVERGING = ["--optimizer.lr", "1e3", "--training.steps", "12", "--checkpoint.enable",
             "--checkpoint.interval", "4"]
STEP = re.compile(r"step:\s+(\d+)\s+loss:\s+(\S+)\s.*grad_norm:\s+(\S+)")


def _train(folder: Path, *extra: str) -> tuple[int, str]:
    """train.py's command line: (exit code, log)."""
    p = train_py_two_blocks(tiny_args(folder, *DIVERGING, *extra), timeout=600)
    return p.returncode, p.stderr


def _logged(log: str) -> dict[int, tuple[float, float]]:
    """(loss, grad norm) by step, as the log line prints them (nan included)."""
    return {int(s): (float(loss), float(norm)) for s, loss, norm in STEP.findall(log)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The diverging run skipping (keeping two checkpoints, stopping after 6 in a row, TensorBoard
    on), and applying its non-finite steps (keeping one checkpoint, stopping after 5)."""
    folder = tmp_path_factory.mktemp("nonfinite")
    skipped = _train(folder / "skipped", "--checkpoint.keep_latest_k", "2",
                     "--training.max_consecutive_nonfinite", "6", "--metrics.enable_tensorboard")
    applied = _train(folder / "applied", "--checkpoint.keep_latest_k", "1", "--training.no-skip_nonfinite_steps",
                     "--training.max_consecutive_nonfinite", "5")
    return {"folder": folder, "skipped": skipped, "applied": applied}


def test_skipped_steps_leave_the_weights_and_optimizer_state_as_they_were(runs):
    code, log = runs["skipped"]
    logged = _logged(log)
    assert all(math.isfinite(n) for s, (_, n) in logged.items() if s <= 4), logged
    assert all(math.isnan(n) for s, (_, n) in logged.items() if s >= 5), logged
    # Counted in the log line, from the first non-finite step on.
    assert "skipped steps" not in "".join(ln for ln in log.splitlines() if "step:     4 " in ln)
    for step in range(5, 11):
        assert f"step: {step:>5}" in log and f"skipped steps: {step - 4}" in log
    # Step 8's checkpoint holds exactly what step 4's does, but for the step and the RNG states.
    checkpoints = runs["folder"] / "skipped" / "checkpoint"
    four, eight = all_tensors(checkpoints / "step-4"), all_tensors(checkpoints / "step-8")
    moved = {k for k in four if not torch.equal(four[k], eight[k])}
    assert moved <= {"train_state.torch_rng", "train_state.xla_rng"}, moved
    assert sum(k.startswith("model.") for k in four) > 10 and sum(k.startswith("optimizer.") for k in four) > 10
    assert all(t.isfinite().all() for k, t in eight.items() if t.is_floating_point())
    # Stopped at the sixth in a row, in one line, exit code 1.
    assert code == 1
    assert log.rstrip().splitlines()[-1] == (
        "error: steps 5..10: 6 steps in a row had a non-finite loss or gradient norm ([training] "
        "max_consecutive_nonfinite = 6); their updates were skipped, the weights are step 4's; lower "
        "[optimizer] lr, or look at the data of step 5")


def test_the_skip_count_is_a_tensorboard_scalar(runs):
    (tb,) = (runs["folder"] / "skipped" / "tb").iterdir()
    assert event_scalars(tb)["loss_metrics/nonfinite_steps"] == [
        (s, float(max(s - 4, 0))) for s in range(1, 11)]


def test_a_finite_step_is_unchanged_bit_for_bit_by_the_skip(runs):
    """Steps 1-4 are finite: skipping or not, the same losses and gradient norms to the last bit
    (and step 5's loss, computed before its update)."""
    skipped, applied = _logged(runs["skipped"][1]), _logged(runs["applied"][1])
    assert [skipped[s] for s in range(1, 5)] == [applied[s] for s in range(1, 5)]
    assert skipped[5][0] == applied[5][0]


def test_no_checkpoint_of_nonfinite_weights_is_written_and_the_finite_one_survives(runs):
    code, log = runs["applied"]
    assert "checkpoint step-8 not written: " in log
    assert "weights are NaN or inf; step-4 stays the newest checkpoint" in log
    checkpoints = runs["folder"] / "applied" / "checkpoint"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-4"]  # keep_latest_k = 1 kept it
    assert all(t.isfinite().all() for t in all_tensors(checkpoints / "step-4").values() if t.is_floating_point())
    assert code == 1
    assert log.rstrip().splitlines()[-1] == (
        "error: steps 5..9: 5 steps in a row had a non-finite loss or gradient norm ([training] "
        "max_consecutive_nonfinite = 5); their updates were applied, the weights are not finite; lower "
        "[optimizer] lr, or look at the data of step 5")


def test_the_run_resumes_from_the_checkpoint_saved_while_skipping(runs, tmp_path):
    """Step 8 (saved after four skipped steps) resumes: step 9 gives the loss it gave in the first
    run, bit for bit (the same weights, data and state)."""
    shutil.copytree(runs["folder"] / "skipped" / "checkpoint", tmp_path / "checkpoint")
    code, log = _train(tmp_path, "--training.steps", "9", "--training.max_consecutive_nonfinite", "0")
    assert code == 0, log[-3000:]
    assert "Resumed from" in log and "step-8" in log
    first = {int(s): v for s, v in STEP_LINE.findall(runs["skipped"][1])}
    again = {int(s): v for s, v in STEP_LINE.findall(log)}
    assert again == {9: first[9]}


@pytest.mark.parametrize("finite", [True, False])
def test_fused_adamw_skips_itself_as_if_the_step_never_ran(finite):
    """The native compiled step's fused AdamW skips a non-finite step through its own `found_inf`
    (no copies of its parameters or state): the parameters, moments and step count equal, bit for
    bit, those of the same optimizer whose third step was not run at all (or was, when finite); a
    tensor outside the optimizer (the MoE bias) is still copied back by the guard."""
    from torchtitan_xla.optimizer import NonFiniteGuard, step_with_lr
    from torchtitan_xla.optimizer.nonfinite import _skips_itself

    def run(guarded: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
        bias = torch.zeros(3)
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False, fused=True)
        guard = NonFiniteGuard("cpu", skip=True)
        for step in range(3):
            for p in params:
                p.grad = torch.randn_like(p)
            bad = step == 2 and not finite
            if bad:
                params[0].grad[1, 2] = float("nan")
            written = [*params, *(t for s in opt.state.values() for t in s.values()), bias]

            def update():
                step_with_lr(opt, torch.tensor(1e-2))
                bias.add_(1.0)

            if guarded:
                ok = torch.stack([p.grad.isfinite().all() for p in params]).all()
                guard.update(ok, written, update, opt)
            elif not bad:
                update()
        assert _skips_itself(opt) and opt.state[params[0]]["step"].item() == (3 if finite else 2)
        return [*params, *(t for s in opt.state.values() for t in s.values()), bias]

    for a, b in zip(run(guarded=True), run(guarded=False), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
