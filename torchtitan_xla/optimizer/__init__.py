"""The optimizer (`[optimizer] name`) and the learning-rate schedule (schedule.py).

AdamW and Adam are torch's own; Muon, Lion and Adafactor are written here (muon.py, lion.py,
adafactor.py) because torch's Muon and Adafactor read Python numbers per step (`.item()`, a Python
lr) and Lion is not in torch. Each is tested against its reference (torch.optim.Muon /
torch.optim.Adafactor, the lion-pytorch package) in float64.

Every optimizer here runs inside the replayed step (runtime/step.py): its state exists before the
first step (`init_state`, so step 1 traces the same graph as step 2 and a checkpoint loads into
it in place), its step count lives on the device, and the learning rate arrives as a device
tensor (`step_with_lr`), never as a Python number that changes per step.
"""

from __future__ import annotations

import torch

from torchtitan_xla.config import JobConfig
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.optimizer.adafactor import Adafactor
from torchtitan_xla.optimizer.lion import Lion
from torchtitan_xla.optimizer.muon import Muon, muon_param_groups
from torchtitan_xla.optimizer.nonfinite import NonFiniteGuard
from torchtitan_xla.optimizer.offload import HostOffload
from torchtitan_xla.optimizer.schedule import build_lr_scheduler, lr_factor
from torchtitan_xla.optimizer.state import new_states, zeros_like_param

__all__ = ["Adafactor", "Lion", "Muon", "NonFiniteGuard", "build_lr_scheduler", "build_optimizer",
           "lr_factor", "optimizer_state_tensors", "step_with_lr"]


def build_optimizer(model: torch.nn.Module, job_config: JobConfig) -> torch.optim.Optimizer:
    """The optimizer `[optimizer] name` names, over every trainable parameter (frozen ones, as
    under LoRA, get no state), its state created; with `offload`, over their host copies."""
    cfg = job_config.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    offload = HostOffload(params) if cfg.offload else None
    if offload is not None:
        params = offload.host_params
    # capturable: Adam's step count and bias corrections live on the device, so the step's graph
    # reads them as data instead of baking this step's Python numbers into it.
    on_device = any(p.device.type not in ("cpu", "meta") for p in params)
    if cfg.name in ("AdamW", "Adam"):
        cls = torch.optim.AdamW if cfg.name == "AdamW" else torch.optim.Adam
        # The native runtime's compiled step leaves the update to torch's fused kernel, one call
        # for all parameters (torchtitan's default): compiled, the update took longer than the
        # model. Where torch has it (the CPU, CUDA); torch-tpu's is not known to exist. On the host
        # (offload) always: it is the CPU's fast update, and it skips a non-finite step itself.
        fused = (job_config.compile.step == "compile" or offload is not None) and all(
            p.device.type in ("cpu", "cuda") for p in params)
        optimizer = cls(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                        weight_decay=cfg.weight_decay, foreach=False, capturable=on_device, fused=fused)
    elif cfg.name == "Muon":
        groups = muon_param_groups(model)
        if not groups[0]["params"]:
            raise ConfigError("[optimizer] name = \"Muon\": the model has no 2-D hidden weights "
                              "(parameters under `layers.`) to orthogonalise; use AdamW")
        optimizer = Muon(groups, lr=cfg.lr, muon_lr=cfg.muon_lr, weight_decay=cfg.weight_decay,
                         momentum=cfg.muon_momentum, ns_steps=cfg.muon_ns_steps,
                         ns_dtype=getattr(torch, cfg.muon_ns_dtype), adjust_lr=cfg.muon_adjust_lr,
                         betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    elif cfg.name == "Lion":
        optimizer = Lion(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    else:
        optimizer = Adafactor(params, lr=cfg.lr, beta2_decay=cfg.adafactor_beta2_decay,
                              d=cfg.adafactor_clip_threshold, weight_decay=cfg.weight_decay)
    init_optimizer_state(optimizer)
    if offload is not None:
        offload.attach(optimizer)
    # A pipelined model saves its optimizer state under the per-layer layout too
    # (parallelisms/pipeline_parallel.py).
    for attach in getattr(model, "optimizer_hooks", ()):
        attach(optimizer)
    return optimizer


@torch.no_grad()
def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state up front, exactly as the first `optimizer.step()` would, each tensor with
    its parameter's sharding where it has the parameter's shape."""
    if hasattr(optimizer, "init_state"):
        optimizer.init_state()
        return
    for group, p, state in new_states(optimizer):  # torch's Adam(W)
        device = p.device if group["capturable"] or group["fused"] else "cpu"
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for name in ("exp_avg", "exp_avg_sq"):
            state[name] = zeros_like_param(p)


@torch.compiler.disable  # a compiled step calls the optimizer's own kernels (above)
def step_with_lr(optimizer: torch.optim.Optimizer, lrs: torch.Tensor) -> None:
    """`optimizer.step()` with group i's learning rate `lrs[i]` (a device tensor, one per group;
    a scalar serves every group).

    The groups keep their Python floats otherwise, for the scheduler and the state dict; only the
    traced update reads the tensor."""
    saved = [group["lr"] for group in optimizer.param_groups]
    for i, group in enumerate(optimizer.param_groups):
        group["lr"] = lrs if lrs.dim() == 0 else lrs[i]
    try:
        optimizer.step()
    finally:
        for group, value in zip(optimizer.param_groups, saved):
            group["lr"] = value


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values()
            if isinstance(t, torch.Tensor)]
