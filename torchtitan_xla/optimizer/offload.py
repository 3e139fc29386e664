"""The optimizer's state in the host's memory (`[optimizer] offload = true`, native runtime).

ZeRO-Offload's layout, FSDP2's `CPUOffloadPolicy` step: the optimizer (torch's AdamW or Adam, its
fused CPU kernel) updates a float32 copy of each trainable parameter's local block kept on the
host, so its state is made and kept there too. Each update copies the gradients to the host and the
updated weights back; the device holds the weights and their gradients, no optimizer state.

The host copies are DTensors with their parameters' layouts (plain tensors for plain parameters),
so the optimizer's state dict has the same keys, shapes and shardings with offload or without: a
checkpoint written either way loads either way.

Only elementwise updates split this way into each process's blocks on the host, and the skip of
a non-finite step (optimizer/nonfinite.py) needs the kernel's own `found_inf`: hence AdamW and
Adam (config/checks.py refuses the rest). torch_xla 2.9 has no API for host memory spaces
(pytorch/xla#8049): the XLA runtime refuses the key."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchtitan_xla import runtime
from torchtitan_xla.logging import logger


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to_local() if isinstance(t, DTensor) else t


def _on_host(like: torch.Tensor) -> torch.Tensor:
    """An empty tensor on the host shaped like `like`'s local block, with its layout, in float32 or
    wider (bfloat16 weights get float32 copies, as ZeRO's). Pinned where there is an accelerator:
    copies to and from pinned memory run beside the compute."""
    local = _local(like)
    host = torch.empty(local.shape, dtype=torch.promote_types(local.dtype, torch.float32), device="cpu",
                       pin_memory=local.device.type != "cpu")
    if not isinstance(like, DTensor):
        return host
    return DTensor.from_local(host, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


class HostOffload:
    """Each trainable parameter on the device paired with the host copy the optimizer updates."""

    def __init__(self, params: list[torch.Tensor]):
        self.device_params = params
        self.host_params = [_on_host(p).requires_grad_(True) for p in params]
        self._grads = [_on_host(p) for p in params]  # where each step's gradients land
        # The host copies are filled from the device at the first update, after any checkpoint or
        # initial weights have been loaded into the device's parameters.
        self._filled = False

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.register_step_pre_hook(self._before_update)
        optimizer.register_step_post_hook(self._after_update)
        optimizer.host_offload = self  # the device parameters it writes (nonfinite.py)
        logger.info(f"Optimizer: on the host, {self.state_bytes(optimizer) / 2**20:.2f} MiB of state, "
                    f"weights and gradients for this process; its state on the device: none")

    def state_bytes(self, optimizer: torch.optim.Optimizer) -> int:
        """This process's bytes of optimizer state and host weights, all on the host."""
        tensors = [*self.host_params, *self._grads,
                   *(t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))]
        return sum(_local(t).numel() * _local(t).element_size() for t in tensors)

    @torch.no_grad()
    def _before_update(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        if not self._filled:
            for p, host in zip(self.device_params, self.host_params):
                _local(host).copy_(_local(p), non_blocking=True)
            self._filled = True
        for p, host, grad in zip(self.device_params, self.host_params, self._grads):
            if p.grad is None:
                host.grad = None
                continue
            _local(grad).copy_(_local(p.grad), non_blocking=True)
            host.grad = grad
        # The fused kernel reads its learning rate and `found_inf` on the parameters' device; it
        # would move them there without waiting for the copy.
        for group in optimizer.param_groups:
            if torch.is_tensor(group["lr"]):
                group["lr"] = _local(group["lr"]).to("cpu")
        if getattr(optimizer, "found_inf", None) is not None:
            optimizer.found_inf = _local(optimizer.found_inf).to("cpu")
        runtime.wait()  # the gradients are on the host before the CPU reads them

    @torch.no_grad()
    def _after_update(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        for p, host in zip(self.device_params, self.host_params):
            _local(p).copy_(_local(host), non_blocking=True)
            host.grad = None
