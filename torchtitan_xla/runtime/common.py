"""What both runtimes use: the recompile guard, scan as a Python loop, and the saved-tensor hooks
that keep a checkpointed block's input on the host."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torchtitan_xla.logging import logger


class CompileGuard:
    """Any compile after warm-up (the first two steps) is a graph that changed.

    `check(step)` after each step raises (`on_recompile = "error"`) or warns and moves on
    ("warn"), naming how to find out why. Compiles that are expected (a checkpoint save's small
    transfer graphs) happen inside `allowed()`. `count` is the runtime's compile counter, `what`
    and `hint` name its compiler and its debugging switch."""

    def __init__(self, first_step: int, on_recompile: str = "error", *,
                 count: Callable[[], int], what: str, hint: str):
        self.warmup_end = first_step + 1  # the first step compiles; any compile after the second
        self.on_recompile = on_recompile
        self.count, self.what, self.hint = count, what, hint
        self.baseline: int | None = None

    def check(self, step: int) -> None:
        compiles = self.count()
        if step == self.warmup_end:
            self.baseline = compiles
        elif self.baseline is not None and compiles > self.baseline:
            message = (f"step {step}: {self.what} compiled a new graph after warm-up ({compiles} "
                       f"compiles, {self.baseline} at step {self.warmup_end}); run with "
                       f"{self.hint} to see why")
            if self.on_recompile == "error":
                raise RuntimeError(message)
            logger.warning(message)
            self.baseline = compiles

    @contextlib.contextmanager
    def allowed(self) -> Iterator[None]:
        try:
            yield
        finally:
            if self.baseline is not None:
                self.baseline = self.count()


def python_scan(fn: Callable, init, xs):
    """`carry, ys = fn(carry, x)` over the leading dimension of every tensor in `xs`, as a Python
    loop; ys stacked."""
    import torch

    ys = []
    carry = init
    for i in range(xs[0].shape[0]):
        carry, y = fn(carry, tuple(t[i] for t in xs))
        ys.append(y)
    return carry, tuple(torch.stack(parts) for parts in zip(*ys))
