"""The learning-rate schedule: warmup-stable-decay and its special cases."""

import math

import pytest

from torchtitan_xla.config import parse_args
from torchtitan_xla.optimizer import lr_factor


def factors(steps, warmup, decay_type="linear", min_lr=0.0, decay_ratio=None):
    import torch

    from torchtitan_xla.optimizer import build_lr_scheduler

    cfg = parse_args(["--training.steps", str(steps), "--lr_scheduler.warmup_steps", str(warmup),
                      "--lr_scheduler.decay_type", decay_type, "--lr_scheduler.min_lr_factor", str(min_lr),
                      *(["--lr_scheduler.decay_ratio", str(decay_ratio)] if decay_ratio is not None else [])])
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = build_lr_scheduler(opt, cfg)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_linear_warmup_then_linear_decay():
    f = factors(10, 4)
    assert f[:4] == pytest.approx([1 / 5, 2 / 5, 3 / 5, 4 / 5])
    assert f[4:] == pytest.approx([6 / 7, 5 / 7, 4 / 7, 3 / 7, 2 / 7, 1 / 7])


@pytest.mark.parametrize("decay_type", ["linear", "sqrt", "cosine"])
def test_lr_is_never_exactly_zero_and_decays_monotonically(decay_type):
    # torch_xla bakes 0.0 into the graph as a constant: an lr of 0 would recompile the step.
    f = factors(50, 5, decay_type)
    assert min(f) > 0
    assert all(a >= b for a, b in zip(f[5:], f[6:]))


def test_min_lr_factor_and_warmup_stable_decay():
    f = factors(20, 2, "cosine", min_lr=0.1, decay_ratio=0.5)
    assert f[2:10] == [1.0] * 8  # stable phase
    assert all(0.1 < x < 1.0 for x in f[10:])
    assert f[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 10 / 11)))


def test_lr_factor_formula_points():
    kw = dict(warmup_steps=0, decay_start=0, decay_steps=3, min_lr_factor=0.0)
    assert lr_factor(0, decay_type="sqrt", **kw) == pytest.approx(1 - math.sqrt(1 / 4))
    assert lr_factor(2, decay_type="linear", **kw) == pytest.approx(1 / 4)


def test_constant_after_warmup_is_decay_ratio_0():
    f = factors(12, 3, "cosine", min_lr=0.1, decay_ratio=0.0)
    assert f[:3] == pytest.approx([1 / 4, 2 / 4, 3 / 4])
    assert f[3:] == [1.0] * 9


def test_cosine_with_warmup_is_the_cosine_decay_over_every_step_after_warmup():
    """decay_type = cosine, decay_ratio unset: warmup, then half a cosine down to min_lr_factor
    (offset by one step at each end so that the lr is never exactly 0 or repeated)."""
    steps, warmup, floor = 20, 4, 0.1
    f = factors(steps, warmup, "cosine", min_lr=floor)
    assert f[:warmup] == pytest.approx([(s + 1) / (warmup + 1) for s in range(warmup)])
    decay = steps - warmup
    assert f[warmup:] == pytest.approx(
        [floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * (k + 1) / (decay + 1))) for k in range(decay)],
        rel=1e-12)


def test_warmup_longer_than_the_run_is_cut_with_one_warning_naming_its_source(tmp_path):
    """warmup_steps > training.steps warms up over the whole run, and says so once at start,
    naming the file or flag of each key (docs/optimizers.md)."""
    import logging

    import torch

    from torchtitan_xla.logging import logger
    from torchtitan_xla.optimizer import build_lr_scheduler

    toml = tmp_path / "job.toml"
    toml.write_text("[lr_scheduler]\nwarmup_steps = 200\n")
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        for argv in (["--job.config_file", str(toml), "--training.steps", "10"],
                     ["--job.config_file", str(toml), "--training.steps", "200"]):
            opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            sched = build_lr_scheduler(opt, parse_args(argv))
    finally:
        logger.removeHandler(handler)
    warnings = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert warnings == [f"{toml}: [lr_scheduler] warmup_steps = 200 exceeds command line: "
                        f"--training.steps = 10: warming up over all 10 steps instead (the lr stays "
                        f"below its peak)"]  # and none for the 200-step run
    assert sched.get_last_lr()[0] == pytest.approx(1 / 201)
    assert factors(10, 200) == pytest.approx([(s + 1) / 11 for s in range(10)])
