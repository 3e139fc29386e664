"""The training step as one XLA graph per step, two ways ([compile] step):

- `LazyStep` ("lazy"): torch_xla's own way. The step is traced on the host every step under
  `torch_xla.compile(full_graph=True)`; XLA finds the graph in its cache and runs it.
- `ReplayedStep` ("replay", the default): traces the step at its first two steps and from then on
  runs the cached executable directly on the new inputs (`_run_cached_graph`, the call torch_xla's
  dynamo bridge makes), without executing any Python of the step. Tracing costs host time every
  step that, on a small host, cannot hide behind the device (docs/performance.md).

Replay is only correct if everything that changes between steps is an input of the graph:
- the step's arguments (the batch, the learning rate as a device scalar), and
- `state`: parameters, buffers and optimizer state. Those the step updates become outputs, and
  after each replay every such tensor is rebound in place to its new value (the old buffer is
  donated to the graph, so the update needs no second copy, as with a lazy step).
Every other input the trace finds (Python scalars XLA uploads as data: betas, eps, the clipping
norm, ...) is frozen at its traced value. A value that changes per step but reaches the graph as a
Python number would be silently stale, so the second step is traced too and its frozen inputs
must equal the first's: otherwise it is an error naming the fix. (A tensor the step writes that is
not in `state` would be stale too, and that no check can see: train.py passes every parameter,
buffer and optimizer state tensor.)

In both, anything that would execute inside the step (a stray `.item()`) is an error, not a second
graph; `CompileGuard` turns a compile after warm-up into an error or a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.utils import _pytree as pytree

from torchtitan_xla.runtime import common
from torchtitan_xla.runtime.xla.device import compile_stats


def build_step(kind: str, fn: Callable[..., torch.Tensor], state: Sequence[torch.Tensor], *,
               name: str = "train_step", whole: bool = False):
    """The step compiler `[compile] step` names, wrapping `fn`; `state` as for ReplayedStep.
    `whole` (one graph, not per block) is what every step here is already."""
    if kind == "lazy":
        return LazyStep(fn, name=name)
    return ReplayedStep(fn, state, name=name)


class LazyStep:
    """`step(*args)` traces `fn(*args)` and runs it as one XLA graph (torch_xla.compile)."""

    def __init__(self, fn: Callable[..., torch.Tensor], *, name: str = "train_step"):
        self.fn, self.name = fn, name

    def __call__(self, *args) -> torch.Tensor:
        import torch_xla

        with torch_xla.compile(full_graph=True, name=self.name):
            return self.fn(*args)


class ReplayedStep:
    """`step = ReplayedStep(fn, state)`; `step(*args)` runs `fn(*args)` (which returns a tensor
    and updates `state` in place) as one XLA graph.

    The arguments are tensors or pytrees of them (a Batch). The first two calls trace `fn`; later
    calls with arguments of the same structure, shapes, dtypes and shardings replay the graph.
    Arguments of a new signature (a batch of another shape) are traced again, at their first two
    calls, and compile a new graph as a lazy step would."""

    def __init__(self, fn: Callable[..., torch.Tensor], state: Sequence[torch.Tensor], *,
                 name: str = "train_step"):
        self.fn, self.state, self.name = fn, list(state), name
        self._lazy = LazyStep(fn, name=name)
        self._signature = None
        self._traces = 0  # of the current signature
        self._graph_hash = None
        self._inputs: list[tuple[str, object]] = []  # ("arg", i) | ("state", i) | ("frozen", tensor)
        self._updated: list[int] = []  # indices into state of the tensors the step writes

    def __call__(self, *args) -> torch.Tensor:
        import torch_xla

        if any(torch._is_functional_tensor(t) for t in self.state[:1]):
            # torch_xla's functionalization is on (torch_xla made the state before `configure`
            # turned it off): its wrappers would keep the old values when the values underneath
            # are replaced, so every step is traced, as the lazy step does.
            return self._lazy(*args)
        tensors, structure = pytree.tree_flatten(args)  # a Batch's tensors are its leaves
        signature = [structure, *_signature(tensors)]
        if signature != self._signature:
            self._signature, self._traces = signature, 0
        if self._traces < 2:
            inputs = self._trace(args, tensors, compare=self._traces == 1)
            self._traces += 1
        else:
            if any(torch_xla._XLAC._check_tensor_need_materialization(tensors)):
                torch_xla.sync()  # an argument still being computed: the graph needs its data
            inputs = [self._input(kind, ref, tensors) for kind, ref in self._inputs]
        results = torch_xla._XLAC._run_cached_graph(self._graph_hash, inputs)
        for index, value in zip(self._updated, results[1:]):
            torch_xla._XLAC._replace_xla_tensor(self.state[index], value)
        return results[0]

    def _input(self, kind: str, ref, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        if kind == "arg":
            return tensors[ref]
        if kind == "state":
            return self.state[ref]
        return ref

    def _trace(self, args: Sequence, tensors: Sequence[torch.Tensor], *,
               compare: bool) -> list[torch.Tensor]:
        """Trace `fn(*args)` lazily, compile and cache its graph, and return the graph's inputs for
        this step (the traced tensors are then reset: the caller runs the cached graph).
        `tensors`: the arguments' tensors (pytree leaves), which later steps pass in their place."""
        import torch_xla
        import torch_xla.core.xla_model as xm
        from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

        torch_xla.sync()  # everything the step reads is data before tracing starts
        xm.wait_device_ops()
        handles = {}
        for i, t in enumerate(tensors):
            handles.setdefault(_handle(t), ("arg", i))
        for i, t in enumerate(self.state):
            handles.setdefault(_handle(t), ("state", i))

        saved_allow = torch_xla._XLAC._get_allow_execution()
        saved_name = torch_xla._XLAC._get_current_graph_name()
        # Like torch_xla.compile(full_graph=True): anything that would execute inside the step
        # (a stray .item()) is an error, not a second graph.
        torch_xla._XLAC._set_allow_execution(False)
        torch_xla._XLAC._set_current_graph_name(self.name)
        try:
            result = self.fn(*args)
        finally:
            torch_xla._XLAC._set_allow_execution(saved_allow)
            torch_xla._XLAC._set_current_graph_name(saved_name)
        updated = [i for i, need in enumerate(
            torch_xla._XLAC._check_tensor_need_materialization(self.state)) if need]
        outputs = [result] + [self.state[i] for i in updated]
        _, values = torch_xla._XLAC._get_tensors_xla_device_data_node(outputs)
        value_handles = torch_xla._XLAC._get_tensors_handle(values)
        inputs = [handles.get(h, ("frozen", v)) for h, v in zip(value_handles, values)]
        written = set(updated)
        for (kind, ref), value in zip(inputs, values):
            # The old buffers of what the step updates are dead after it: let XLA reuse them.
            if kind == "state" and ref in written:
                torch_xla._XLAC._set_buffer_donation(value, True)
        with alias_with_buffer_donor_config():
            graph_hash = torch_xla._XLAC._get_graph_hash(outputs)
            torch_xla._XLAC._xla_warm_up_cache(outputs, [])
        if compare:
            self._check_same_graph(updated, inputs)
        self._graph_hash, self._updated, self._inputs = graph_hash, updated, inputs
        # The traced tensors now hold pending computations (and gradients exist); the cached graph
        # replaces all of it, run on the data the trace started from.
        torch_xla._XLAC._clear_pending_irs(str(torch_xla.device()))
        return values

    def _check_same_graph(self, updated, inputs) -> None:
        """The second trace against the first. Their hashes may differ (the first step's inputs
        come from initialisation, later ones from the step itself, and may carry different
        sharding annotations); what matters is that the step reads the same things."""
        import torch_xla

        if updated != self._updated or [k for k, _ in inputs] != [k for k, _ in self._inputs]:
            raise RuntimeError(f"{self.name}: the second step traced a graph with different "
                               f"inputs or outputs than the first; it cannot be replayed")
        frozen = [(before, now) for (kind, now), (_, before) in zip(inputs, self._inputs)
                  if kind == "frozen"]
        # One transfer for all of them (there are a few dozen scalars).
        values = torch_xla._XLAC._xla_get_cpu_tensors([t for pair in frozen for t in pair])
        for before, now in zip(values[0::2], values[1::2]):
            if not torch.equal(before, now):
                raise RuntimeError(
                    f"{self.name}: a value the step reads as a Python number changed between "
                    f"steps 1 and 2 ({before.tolist()} -> {now.tolist()}); a replayed step would "
                    f"keep the first. Pass it to the step as a device tensor.")


def _signature(args: Sequence[torch.Tensor]) -> list:
    import torch_xla

    return [(t.shape, t.dtype, torch_xla._XLAC._get_xla_sharding_spec(t)) for t in args]


def _handle(t: torch.Tensor) -> int:
    import torch_xla

    return torch_xla._XLAC._get_tensors_handle([t])[0]


def region(kind: str, fn: Callable):
    """`fn` itself: the step it runs in is one graph already."""
    return fn


def CompileGuard(first_step: int, on_recompile: str = "error"):
    """The recompile guard (runtime/common.py) on XLA's compile count."""
    return common.CompileGuard(first_step, on_recompile, count=lambda: compile_stats()[0],
                              what="XLA", hint="PT_XLA_DEBUG_LEVEL=1")
