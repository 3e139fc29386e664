"""The KV cache of generation: fixed-size buffers beside the model (never its parameters), one per
layer, written in place at the slots of each call's tokens.

Every row of a batch shares the slots (prompts are left-padded to one length), so a decode step
writes one slot, given as a device tensor: the position is data and one compiled decode graph
serves every step. Each slot also keeps its token's position in its row and its document (1: the
row's text, 0: padding), from which the mask of each call is made as packing's is (layers.py:
`position_mask`): a query sees the keys of its document at or before its position. Slots not yet
written hold a position no query reaches. Padding sees only padding, so its rows stay finite.

What a layer keeps is its attention's business: Llama's keys and values [batch, size, kv_heads,
head_dim]; latent attention (mla.py) its normalised latent and rotated key part, expanded at each
call. The buffers take the dtype and device of the first values written.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from torchtitan_xla.models.llama.layers import within

UNWRITTEN = 1 << 30  # the position of a slot not yet written: after every query's


def _zeros_laid_out_as(t: torch.Tensor, batch: int, size: int) -> torch.Tensor:
    """Zeros [batch, size, *t.shape[2:]] laid out as `t`: a DTensor's buffer is split as its values
    are (the heads over tp; `new_zeros` would make it whole, and each process's block of `t` would
    not fit it)."""
    if not isinstance(t, DTensor):
        return t.new_zeros(batch, size, *t.shape[2:])
    local = t.to_local()
    shape = (batch, size, *t.shape[2:])
    return DTensor.from_local(local.new_zeros(local.shape[0], size, *local.shape[2:]), t.device_mesh,
                              t.placements, shape=shape, stride=torch.empty(shape, device="meta").stride())


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own block, which shares its storage (DTensor has no rule for index_copy_; the
    slots' dimension is never sharded, so each block is written where it is)."""
    return t.to_local() if isinstance(t, DTensor) else t


class LayerCache:
    """Layer `layer`'s view of a KVCache. Made at each `cache[i]`; the cache holds no reference to
    it, so a finished cache is freed at once, not at the next cyclic collection (its buffers are
    the device memory of a whole batch's keys and values)."""

    def __init__(self, cache: KVCache, layer: int):
        self._cache, self._layer = cache, layer

    def mask_within(self, window: int = 0) -> torch.Tensor:
        """This call's mask; with a `window`, only the keys fewer than `window` positions back."""
        cache = self._cache
        if not window:
            return cache.mask
        near = within(cache.query_positions[:, :, None], cache.key_positions[:, None, :], window)
        return cache.mask & near[:, None]

    def update(self, *new: torch.Tensor) -> list[torch.Tensor]:
        """Store `new` [batch, tokens, ...] at this call's slots; every slot's values, [batch, size, ...]."""
        cache = self._cache
        if cache.buffers[self._layer] is None:
            cache.buffers[self._layer] = [_zeros_laid_out_as(t, cache.batch, cache.size) for t in new]
        for buffer, t in zip(cache.buffers[self._layer], new):
            _local(buffer).index_copy_(1, cache.slots, _local(t).to(buffer.dtype))
        return cache.buffers[self._layer]


class KVCache:
    """`cache.write(slots, positions, document_ids)` before each call of the model with `cache=`;
    `cache[i]` is layer i's."""

    def __init__(self, n_layers: int, batch: int, size: int, device: torch.device | str):
        self.batch, self.size = batch, size
        self.key_positions = torch.full((batch, size), UNWRITTEN, dtype=torch.long, device=device)
        self.key_documents = torch.zeros((batch, size), dtype=torch.long, device=device)
        self.buffers: list[list[torch.Tensor] | None] = [None] * n_layers
        self.slots = self.mask = self.query_positions = None

    def __getitem__(self, layer: int) -> LayerCache:
        return LayerCache(self, layer)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, document_ids: torch.Tensor) -> None:
        """The next call's tokens go to `slots` [tokens] of every row, at `positions` [batch, tokens]
        of `document_ids` [batch, tokens]."""
        self.slots, self.query_positions = slots, positions
        self.key_positions.index_copy_(1, slots, positions)
        self.key_documents.index_copy_(1, slots, document_ids)
        same = document_ids[:, :, None] == self.key_documents[:, None, :]
        self.mask = (same & within(positions[:, :, None], self.key_positions[:, None, :]))[:, None]
