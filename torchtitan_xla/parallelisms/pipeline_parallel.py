"""Pipeline parallelism inside one SPMD program (`[parallelism] pipeline_parallel_degree = S`).

As MaxText does it: the blocks' weights are stacked [repeats R, stages S, layers per stage K, ...]
with the stage dimension split over the `pp` mesh axis, so each pp group of devices holds its
stage's layers (FSDP, TP split them further inside the group). The batch is cut into M
microbatches. At every iteration all stages run at once on the activations they hold (the block
applied under torch.vmap over the stage dimension: each device computes its own stage), then the
activations move one stage on: slices and a concatenation along the pp-split dimension, which XLA
partitions into one collective permute (ring_attention.shift). The last stage's output goes back to
stage 0: in the circular schedule (R > 1) layer (r x S + s) x K + k sits on stage s and a
microbatch goes round the stages R times. Microbatches go round in groups of S, so the one stage 0
takes back is the one the last stage just finished.

Work item w (microbatch, round) runs on stage s at iteration w + s: M x R + S - 1 iterations, in
S - 1 of which each stage has nothing to do, the bubble (S - 1) / (M x R + S - 1). The iterations
are unrolled into the step's one graph (the step is one graph already; its size grows with M x R).

The embedding and the output layer run outside the pipeline, on every stage's devices (replicated
over pp, split by FSDP / TP inside each): they are a small share of the weights, and keeping them
there leaves the loss, its masks and the batch layout exactly as without pipelining.

Checkpoints keep the ordinary per-layer names (`layers.N....`): the model's and the optimizer's
state dicts are converted on the way out and back in (hooks below), so a pipelined checkpoint
resumes without pipelining and the reverse, and the HF export reads the same names.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from torchtitan_xla import runtime
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES, ParallelDims
from torchtitan_xla.parallelisms.ring_attention import shift


@dataclass(frozen=True)
class Schedule:
    """Which microbatch and round each stage works on at each iteration."""

    stages: int
    microbatches: int
    repeats: int = 1

    @property
    def iterations(self) -> int:
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """The fraction of iterations a stage idles."""
        return (self.stages - 1) / self.iterations

    def work(self, iteration: int, stage: int) -> tuple[int, int] | None:
        """(microbatch, round) stage `stage` runs at `iteration`, or None (idle). Work items go in
        groups of S microbatches: w = group x S x R + round x S + i, microbatch group x S + i."""
        w = iteration - stage
        if not 0 <= w < self.microbatches * self.repeats:
            return None
        group, rest = divmod(w, self.stages * self.repeats)
        rnd, i = divmod(rest, self.stages)
        return group * self.stages + i, rnd


def layer_index(schedule: Schedule, rnd: int, stage: int, k: int, per_stage: int) -> int:
    """The model layer at [round, stage, k] of the stacked weights."""
    return (rnd * schedule.stages + stage) * per_stage + k


def _set(root: nn.Module, dotted: str, value: torch.Tensor | None) -> None:
    """Set (or delete, for None) the parameter at `dotted`, creating plain modules on the way."""
    *path, leaf = dotted.split(".")
    for name in path:
        if not hasattr(root, name):
            root.add_module(name, nn.Module())
        root = getattr(root, name)
    root._parameters.pop(leaf, None)
    if value is not None:
        root.register_parameter(leaf, value)


def _get(root: nn.Module, dotted: str) -> torch.Tensor:
    return functools.reduce(getattr, dotted.split("."), root)


class Stages(nn.Module):
    """The stacked block weights [R, S, K, ...] under the block's own parameter names; called by
    the pipelined `model.layers.forward`, never on its own."""


def apply_pipeline(model: nn.Module, mesh, dims: ParallelDims, *, full_ac: bool,
                   saved_spec: Callable[[torch.Size, tuple, int], tuple]) -> None:
    """Stack the blocks' weights (each keeps its FSDP / TP spec, with the stage dimension over `pp`)
    into `model.stages` and run `model.layers` as the pipeline. `full_ac`: each layer keeps only its
    input, recomputing the rest in the backward. `saved_spec(shape, spec, S)`: the layout a layer
    takes in a checkpoint (its spec, split over `pp` as well)."""
    schedule = Schedule(dims.pp, dims.pp_microbatches, dims.pp_repeats)
    blocks = list(model.layers.values())
    per_stage = len(blocks) // (schedule.stages * schedule.repeats)
    template = blocks[0]
    names = [n for n, _ in template.named_parameters()]
    canonical = [n for n, _ in model.named_parameters()]
    layer_specs = {}
    stages = Stages()
    for n in names:
        p = _get(template, n)
        spec = getattr(p, "_partition_spec", (None,) * p.dim())
        layer_specs[n] = spec
        stacked = nn.Parameter(torch.empty(schedule.repeats, schedule.stages, per_stage, *p.shape,
                                           dtype=p.dtype, device=p.device), requires_grad=p.requires_grad)
        stacked_spec = (None, "pp", None, *spec)
        runtime.mark_sharding(stacked, mesh, stacked_spec)
        stacked._partition_spec = stacked_spec
        _set(stages, n, stacked)
    for block in blocks:
        for n in names:
            _set(block, n, None)
    model.stages = stages
    views = {}  # canonical name -> (stacked name, [round, stage, k])
    for r in range(schedule.repeats):
        for s in range(schedule.stages):
            for k in range(per_stage):
                for n in names:
                    views[f"layers.{layer_index(schedule, r, s, k, per_stage)}.{n}"] = (n, (r, s, k))
    layout = _Layout(model, mesh, canonical, views, layer_specs, saved_spec, schedule.stages)
    model.init_weights = _init_then_stack(model, blocks, names, layout)
    model.register_state_dict_post_hook(lambda *args: layout.model_state_out(*args))
    model.register_load_state_dict_pre_hook(layout.model_state_in)
    model.optimizer_hooks = (layout.attach,)
    model.layers.forward = _Pipeline(template, stages, names, schedule, per_stage, mesh, full_ac)


def _init_then_stack(model: nn.Module, blocks: list[nn.Module], names: list[str], layout: _Layout):
    """The model's own init on per-layer weights (the same random draws as without pipelining),
    stacked into the stage layout; the per-layer tensors are dropped before anything is computed."""
    original = model.init_weights

    @torch.no_grad()
    def init_weights() -> None:
        for block in blocks:
            for n in names:
                stacked = _get(model.stages, n)
                t = stacked.new_empty(stacked.shape[3:])
                runtime.mark_sharding(t, layout.mesh, layout.layer_specs[n])
                _set(block, n, nn.Parameter(t, requires_grad=False))
        original()
        for n in names:
            stacked = _get(model.stages, n)
            stacked.copy_(torch.stack([_get(b, n) for b in blocks]).view(stacked.shape))
        for block in blocks:
            for n in names:
                _set(block, n, None)

    return init_weights


class _Pipeline:
    """`model.layers.forward` for the pipeline: (h, cos, sin, *mask) -> h, as the blocks in turn."""

    def __init__(self, template: nn.Module, stages: Stages, names: list[str], schedule: Schedule,
                 per_stage: int, mesh, full_ac: bool):
        self.template, self.stages, self.names = template, stages, names
        self.schedule, self.per_stage, self.mesh, self.full_ac = schedule, per_stage, mesh, full_ac
        self.dp = math.prod(dict(zip(mesh.axis_names, mesh.mesh_shape))[a] for a in BATCH_AXES)

    def _layer(self, weights: dict[str, torch.Tensor], h: torch.Tensor,
               *rest: torch.Tensor) -> torch.Tensor:
        """One layer of one stage (vmapped over the stages)."""
        return functional_call(self.template, weights, (h, *rest))

    def _weights(self, iteration: int) -> dict[str, torch.Tensor]:
        """[S, K, ...]: every stage's layers for the round it works on now (stages idle in the
        bubble take a working neighbour's)."""
        sched = self.schedule
        stacked = {n: _get(self.stages, n) for n in self.names}
        if sched.repeats == 1:
            return {n: w[0] for n, w in stacked.items()}
        work = [sched.work(iteration, s) for s in range(sched.stages)]
        rounds = [w[1] for w in work if w is not None]
        rounds = [w[1] if w is not None else rounds[0] for w in work]
        out = {n: w[rounds[0]] for n, w in stacked.items()}
        for rnd in sorted(set(rounds) - {rounds[0]}):
            which = torch.tensor([r == rnd for r in rounds], device=out[self.names[0]].device)
            out = {n: torch.where(which.view(-1, *(1,) * (o.dim() - 1)), stacked[n][rnd], o)
                   for n, o in out.items()}
        return out

    def __call__(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 *mask: torch.Tensor) -> torch.Tensor:
        sched, mesh = self.schedule, self.mesh
        m = sched.microbatches
        batch = h.shape[0]
        # What travels with a microbatch through the stages: its activations, and its rotary
        # tables and mask when it has its own (packed documents); else the tables are shared.
        travelling = [h, *((cos, sin) if cos.dim() == 3 else ()), *mask]
        shared = () if cos.dim() == 3 else (cos, sin)

        # [batch, seq, ...] on every stage's devices, and [stage, batch, seq, ...]: the activations
        # split along the sequence over tp between blocks (as the blocks' own constraints have
        # them), the rest whole. (Unconstrained, XLA moved the microbatches and the outputs between
        # devices of other stages to reorder them.)
        def layout(t: torch.Tensor, *stage: str) -> torch.Tensor:
            seq = "tp" if t.dim() - len(stage) == 3 and t.is_floating_point() else None
            rest = (None,) * (t.dim() - len(stage) - 2)
            return runtime.constraint(mesh, (*stage, BATCH_AXES, seq, *rest))(t)

        def split(t: torch.Tensor) -> list[torch.Tensor]:
            # Each microbatch takes the same share of every data-parallel rank's sequences.
            t = layout(t).view(self.dp, m, batch // (self.dp * m), *t.shape[1:])
            return [layout(t[:, i].reshape(-1, *t.shape[3:])) for i in range(m)]

        def activations(t: torch.Tensor) -> torch.Tensor:
            return layout(t, "pp")

        inputs = [split(t) for t in travelling]
        states = [t.new_zeros(sched.stages, *x[0].shape) for t, x in zip(travelling, inputs)]
        stage = torch.arange(sched.stages, device=h.device)
        first, last = stage == 0, (stage == sched.stages - 1).to(h.dtype)
        outputs: list[torch.Tensor | None] = [None] * m
        for it in range(sched.iterations):
            if it:  # every stage takes the previous one's (stage 0 the last's): a collective permute
                states = [shift(x, 0) for x in states]
            fresh = sched.work(it, 0)
            if fresh is not None and fresh[1] == 0:  # a new microbatch enters stage 0
                states = [torch.where(first.view(-1, *(1,) * (x.dim() - 1)), inp[fresh[0]][None], x)
                          for x, inp in zip(states, inputs)]
            out = activations(self._run(self._weights(it), [activations(states[0]), *states[1:]], shared))
            states = [out, *states[1:]]
            done = sched.work(it, sched.stages - 1)
            if done is not None and done[1] == sched.repeats - 1:
                # The last stage's, on every stage's devices: one all-reduce over pp (a slice made
                # XLA send it to the first stage's devices, then all-reduce it there).
                outputs[done[0]] = layout((out * last.view(-1, *(1,) * (out.dim() - 1))).sum(0))
        # Back to the batch's order: microbatch i is every rank's i-th share.
        out = torch.stack([o.view(self.dp, -1, *o.shape[1:]) for o in outputs], 1)
        return layout(out.reshape(batch, *out.shape[3:]))

    def _run(self, weights: dict[str, torch.Tensor], states: list[torch.Tensor],
             shared: tuple) -> torch.Tensor:
        """Every stage's K layers on the microbatch it holds; with full checkpointing each layer
        keeps only its input, as without pipelining (torch's checkpoint cannot run inside vmap, so
        each layer is vmapped on its own)."""
        layer = torch.vmap(self._layer, in_dims=(0,) * (1 + len(states)) + (None,) * len(shared))
        names = list(weights)

        def run(*flat: torch.Tensor) -> torch.Tensor:
            with runtime.batched_over("pp"):
                return layer(dict(zip(names, flat[:len(names)])), *flat[len(names):])

        h, rest = states[0], states[1:]
        for k in range(self.per_stage):
            flat = [*(w[:, k] for w in weights.values()), h, *rest, *shared]
            h = runtime.kernels.checkpoint(run, *flat) if self.full_ac else run(*flat)
        return h


class _Layout:
    """The stacked weights (and their optimizer state) under the per-layer names checkpoints use."""

    def __init__(self, model: nn.Module, mesh, canonical: list[str], views: dict, layer_specs: dict,
                 saved_spec: Callable, stages: int):
        self.model, self.mesh, self.canonical, self.views = model, mesh, canonical, views
        self.layer_specs, self.saved_spec, self.stages = layer_specs, saved_spec, stages

    def _stacked(self, n: str) -> torch.Tensor:
        return _get(self.model.stages, n)

    def _out(self, t: torch.Tensor, n: str, at: tuple) -> torch.Tensor:
        """Layer `at` of stacked `t`, split like the layer and over `pp` too: a checkpoint's
        per-layer tensors take one stage's memory on each device, not the whole model's."""
        layer = t.detach()[at]
        spec = self.saved_spec(layer.shape, self.layer_specs[n], self.stages)
        runtime.mark_sharding(layer, self.mesh, spec)
        return layer

    def _in(self, layers: list[torch.Tensor], n: str) -> torch.Tensor:
        stacked = self._stacked(n)
        t = torch.stack([x.to(stacked.device) for x in layers]).view(stacked.shape)
        runtime.mark_sharding(t, self.mesh, stacked._partition_spec)
        return t

    def _stacked_names(self, prefix: str = "") -> list[str]:
        return [f"{prefix}stages.{n}" for n in self.layer_specs]

    def model_state_out(self, module, state_dict, prefix, local_metadata):
        out = {}
        for name in self.canonical:
            if name in self.views:
                n, at = self.views[name]
                out[prefix + name] = self._out(state_dict[f"{prefix}stages.{n}"], n, at)
            else:
                out[prefix + name] = state_dict[prefix + name]
        stacked = set(self._stacked_names(prefix))
        out.update({k: v for k, v in state_dict.items() if k not in out and k not in stacked})
        state_dict.clear()
        state_dict.update(out)

    def model_state_in(self, module, state_dict, prefix, *args):
        if not any(prefix + name in state_dict for name in self.views):
            return
        by_stacked: dict[str, list] = {n: [] for n in self.layer_specs}
        for name, (n, _) in self.views.items():  # in stacked order
            by_stacked[n].append(state_dict.pop(prefix + name))
        for n, layers in by_stacked.items():
            state_dict[f"{prefix}stages.{n}"] = self._in(layers, n)

    # ---- the optimizer's state: torch numbers parameters in their groups' order ----------------

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_state_dict_post_hook(self.optimizer_state_out)
        optimizer.register_load_state_dict_pre_hook(self.optimizer_state_in)

    def _entries(self, optimizer) -> list[list[tuple[str, torch.Tensor, str | None, tuple | None]]]:
        """Per group, its parameters in per-layer order: (name, parameter, stacked name, layer)."""
        params = dict(self.model.named_parameters())
        groups = []
        for group in optimizer.param_groups:
            members = {id(p) for p in group["params"]}
            entries = []
            for name in self.canonical:
                n, at = self.views.get(name, (None, None))
                p = self._stacked(n) if n else params[name]
                if id(p) in members:
                    entries.append((name, p, n, at))
            groups.append(entries)
        return groups

    def optimizer_state_out(self, optimizer, state_dict):
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        state, groups, c = {}, [], 0
        for saved, entries in zip(state_dict["param_groups"], self._entries(optimizer)):
            ids = []
            for _, p, n, at in entries:
                st = state_dict["state"].get(index[id(p)])
                if st is not None:
                    state[c] = {k: self._out(v, n, at) if n and torch.is_tensor(v) and v.shape == p.shape
                                else v for k, v in st.items()}
                ids.append(c)
                c += 1
            groups.append({**saved, "params": ids})
        return {"state": state, "param_groups": groups}

    def optimizer_state_in(self, optimizer, state_dict):
        index = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
        state, c = {}, 0
        layers: dict[int, dict[str, list]] = {}
        for entries in self._entries(optimizer):
            for _, p, n, _ in entries:
                st = state_dict["state"].get(c)
                c += 1
                if st is None:
                    continue
                if n is None:
                    state[index[id(p)]] = st
                    continue
                for k, v in st.items():
                    layers.setdefault(index[id(p)], {}).setdefault(k, []).append((n, v))
        for i, by_key in layers.items():
            state[i] = {k: self._in([v for _, v in vs], vs[0][0]) if torch.is_tensor(vs[0][1])
                        and vs[0][1].dim() == len(self.layer_specs[vs[0][0]]) else vs[0][1]
                        for k, vs in by_key.items()}
        groups = [{**saved, "params": [index[id(p)] for p in g["params"]]}
                  for saved, g in zip(state_dict["param_groups"], optimizer.param_groups)]
        return {"state": state, "param_groups": groups}
