"""Steps whose loss or gradient norm is not finite: the update skipped inside the step's graph.

One NaN gradient applied to the weights makes every later step NaN, and every checkpoint saved
after it useless. `NonFiniteGuard` decides on the device, with no host sync: the update runs, and
each tensor it wrote (parameters, optimizer state, the MoE balance bias) is then selected back to
its value before the update when the step was not finite (optax's `apply_if_finite`). On XLA the
selection fuses into the update's elementwise loop; on the native runtime the old values are
copied first (`[training] skip_nonfinite = false` saves that copy). A finite step is unchanged bit
for bit: `where(True, new, old)` is `new`. torch's fused Adam(W) (the native runtime's compiled
step) skips its own update instead, as under AMP's GradScaler: given `found_inf` = 1 its kernel
writes nothing and its step count is put back, so only what else the update wrote is copied.

Its counters (non-finite steps since the launch, and in a row now) live on the device too and
travel with the step's other statistics, read at log and checkpoint steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch.distributed.tensor import DTensor

from torchtitan_xla.errors import RunError


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own block (the selection is elementwise, `finite` the same on every process):
    three plain ops per tensor instead of three DTensor dispatches, which cost an eager step on
    the native runtime a fifth more. A plain tensor is itself: a detached alias of an XLA tensor
    traced differently in the replayed step (a third compile)."""
    return t.detach().to_local() if isinstance(t, DTensor) else t


class NonFiniteGuard:
    def __init__(self, device: torch.device | str, *, skip: bool, max_in_a_row: int = 0):
        self.skip, self.max_in_a_row = skip, max_in_a_row
        # float32: they are stacked with the loss into the one tensor the log step reads
        self.count = torch.zeros((), dtype=torch.float32, device=device)
        self.in_a_row = torch.zeros((), dtype=torch.float32, device=device)

    @property
    def state(self) -> list[torch.Tensor]:
        """What the step reads and writes besides the model and the optimizer (for the replay)."""
        return [self.count, self.in_a_row]

    def seen(self) -> bool:
        """Whether any step since the launch was not finite (a host read of the last step's counter)."""
        return bool(self.count.item())

    @torch.no_grad()
    def update(self, finite: torch.Tensor, written: Sequence[torch.Tensor], update: Callable[[], None],
               optimizer: torch.optim.Optimizer | None = None):
        """Run `update()`, which writes the tensors `written` in place; where `finite` (a boolean
        device scalar) is false, they keep their values from before it. The counters count the
        step as non-finite either way (with `skip` off the update is applied as computed).
        `optimizer`: the one `update()` steps, if it can skip itself (fused Adam(W))."""
        finite = _local(finite)
        if self.skip and _skips_itself(optimizer):
            written = _not_its_own(optimizer, written)
            update = partial(_skipping, optimizer, (~finite).float(), update)
        before = [_local(t).clone() for t in written] if self.skip else []
        update()
        for t, old in zip(written, before):
            t = _local(t)
            t.copy_(torch.where(finite, t, old))
        bad = (~finite).float()
        self.count.add_(bad)
        self.in_a_row.copy_((self.in_a_row + 1) * bad)

    def check(self, step: int, in_a_row: float) -> None:
        """Stop the run after `max_in_a_row` non-finite steps in a row (0: never), given the
        counter's value read back after `step`."""
        n = int(in_a_row)
        if not self.max_in_a_row or n < self.max_in_a_row:
            return
        weights = (f"their updates were skipped, the weights are step {step - n}'s" if self.skip
                   else "their updates were applied, the weights are not finite")
        raise RunError(f"steps {step - n + 1}..{step}: {n} steps in a row had a non-finite loss or "
                       f"gradient norm ([training] max_consecutive_nonfinite = {self.max_in_a_row}); "
                       f"{weights}; lower [optimizer] lr, or look at the data of step {step - n + 1}")


@torch.compiler.disable  # outside the compiled update, as the optimizer's step is (optimizer/__init__.py)
def _skipping(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, update: Callable[[], None]) -> None:
    optimizer.found_inf = found_inf  # read by Adam(W).step, as AMP's GradScaler sets it
    try:
        update()
    finally:
        del optimizer.found_inf


@torch.compiler.disable  # read eagerly: traced, every group's lr would become a guard
def _not_its_own(optimizer: torch.optim.Optimizer, written: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    own = {id(t) for group in optimizer.param_groups for p in group["params"]
           for t in (p, *optimizer.state[p].values())}
    # Offloaded: the device's weights are copied from the host's, which a skipped update keeps.
    offload = getattr(optimizer, "host_offload", None)
    own |= {id(p) for p in (offload.device_params if offload else ())}
    return [t for t in written if id(t) not in own]


def _skips_itself(optimizer: torch.optim.Optimizer | None) -> bool:
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.defaults["fused"])
