"""The native runtime's step, by `[compile] step`:
- "compile": the training step's `region`s are torch.compile'd (train.py: each
  microbatch's forward and loss, whose backward AOTAutograd compiles with it, and the update:
  gradient norm, clipping, optimizer, the log line's numbers); the step around them only slices
  microbatches and calls `backward()`.
- "blocks": torch.compile per block (parallelisms/parallelize_llama.apply_compile), the rest eager,
  as torchtitan does: for models whose whole-graph compile takes too long.
- "eager": nothing compiled.
A step built `whole` (forward only: validation, scoring, generation's prefill and decode) is one
torch.compile'd graph under both compilers. Plain tensors the step makes (masks, the learning
rate) join DTensor arithmetic as replicated values (`implicit_replication`), as XLA treats an
unannotated tensor.

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

    if whole and kind != "eager":
        # Traced with implicit replication on (entered outside: dynamo does not trace the context).
        fn = torch.compile(fn, dynamic=False)

    def step(*args: torch.Tensor) -> torch.Tensor:
        with implicit_replication():
            out = fn(*args)
        # What the loop reads (the log line's numbers): a plain tensor, as the XLA step returns.
        return out.full_tensor() if isinstance(out, DTensor) else out

    return step


def region(kind: str, fn: Callable):
    """`fn` torch.compile'd under "compile", as it is otherwise. Graph breaks split it rather than
    stop the run (the optimizer's own kernel runs between the update's halves); the dense step's
    graph count is a test's (tests/test_native_runtime.py), TORCH_LOGS=graph_breaks shows any."""
    return torch.compile(fn, dynamic=False) if kind == "compile" else fn


def CompileGuard(first_step: int, on_recompile: str = "error"):
    """The recompile guard (runtime/common.py) on torch.compile's graph count."""
    return common.CompileGuard(first_step, on_recompile, count=lambda: compile_stats()[0],
                              what="torch.compile", hint="TORCH_LOGS=recompiles")
