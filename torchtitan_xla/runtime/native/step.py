"""The native runtime's step: `fn` run eagerly on DTensors, with torch.compile applied per block
beforehand (`[compile] step = "compile"`, parallelisms/parallelize_llama.apply_compile) or not
("eager"). Plain tensors the step makes (masks, the learning rate) join DTensor arithmetic as
replicated values (`implicit_replication`), as XLA treats an unannotated tensor. A step built
`whole` (generation's prefill and decode, forward only) is one torch.compile'd graph under
"compile"; the training step keeps its per-block graphs.

`CompileGuard` counts torch.compile's graphs: any new one after warm-up (the first two steps) is
a recompile, an error or a warning as `[debug] on_recompile` says."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from torchtitan_xla.runtime import common
from torchtitan_xla.runtime.native.device import compile_stats


def build_step(kind: str, fn: Callable[..., torch.Tensor], state: Sequence[torch.Tensor], *,
               name: str = "train_step", whole: bool = False):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    if whole and kind == "compile":
        # Traced with implicit replication on (entered outside: dynamo does not trace the context).
        fn = torch.compile(fn, dynamic=False)

    def step(*args: torch.Tensor) -> torch.Tensor:
        with implicit_replication():
            out = fn(*args)
        # What the loop reads (the log line's numbers): a plain tensor, as the XLA step returns.
        return out.full_tensor() if isinstance(out, DTensor) else out

    return step


def CompileGuard(first_step: int, on_recompile: str = "error"):
    """The recompile guard (runtime/common.py) on torch.compile's graph count."""
    return common.CompileGuard(first_step, on_recompile, count=lambda: compile_stats()[0],
                              what="torch.compile", hint="TORCH_LOGS=recompiles")
