"""The next token from the last position's logits [batch, vocab], on the device (no host sync):
greedy at temperature 0, else a sample from softmax(logits / temperature) restricted to the top k
and to the smallest set of tokens whose probability reaches top_p (transformers' warpers, in
that order). The sample is the Gumbel-max trick: argmax(logits + Gumbel noise) is distributed
as softmax(logits).

The noise is not drawn from a device's random generator but hashed from a counter: (the batch's
key, the token's index, the row, the vocabulary entry) through a 32-bit integer mixer. So the same
seed gives the same draws on every runtime, device and mesh (XLA's generator and torch's CPU one
differ; a sharded generator may differ again), and a draw depends on nothing but its place.
GRPO's rollouts are then the same on one device, on a mesh and on the native runtime, so their
losses can be compared step by step (tests/test_grpo.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0
    top_k: int = 0  # 0: every token
    top_p: float = 1.0
    seed: int = 0

    def check(self, where: str = "[generate]") -> None:
        """Raises ValueError naming the key for values out of range."""
        if self.temperature < 0:
            raise ValueError(f"{where} temperature = {self.temperature}: expected 0 (greedy) or more")
        if self.top_k < 0:
            raise ValueError(f"{where} top_k = {self.top_k}: expected 0 (every token) or more")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{where} top_p = {self.top_p}: expected a value in (0, 1]")


# lowbias32 (Chris Wellons' hash prospector): two multiply-xorshift rounds on int32, whose
# products wrap alike in torch and XLA. The logical right shift shifts the low 31 bits and adds
# the sign bit back: torch_xla 2.9's `>>` on a negative int32 rounds toward zero (-5 >> 16 is 0
# there, -1 in torch), and its floor division is inexact near 2**31 (2**31 - 1 // 2**16 = 32768).
_M1, _M2 = 0x7FEB352D, 0x846CA68B - (1 << 32)


def _shifted(x: torch.Tensor, bits: int) -> torch.Tensor:
    return ((x & 0x7FFFFFFF) >> bits) + (x < 0).to(torch.int32) * (1 << (31 - bits))


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = (x ^ _shifted(x, 16)) * _M1
    x = (x ^ _shifted(x, 15)) * _M2
    return x ^ _shifted(x, 16)


def uniform_noise(key: torch.Tensor, index: torch.Tensor, shape: tuple[int, int],
                  first_row: int = 0) -> torch.Tensor:
    """[rows, vocab] float32 uniforms in (0, 1), a hash of (`key`, `index`, row, column): int32
    tensors of one element each (a batch's key; the token's index in the completion); rows are
    numbered from `first_row` (a data rank's first row in the whole batch)."""
    rows, vocab = shape
    h = _mix(_mix(key.to(torch.int32)) ^ index.to(torch.int32))
    h = _mix(h ^ (torch.arange(rows, dtype=torch.int32, device=key.device) + first_row))[:, None]
    h = _mix(h ^ torch.arange(vocab, dtype=torch.int32, device=key.device)[None, :])
    # 23 bits: (2**24 - 0.5) / 2**24 would round to 1.0 in float32, whose Gumbel noise is +inf
    return (_shifted(h, 9).float() + 0.5) * 2.0**-23


def next_tokens(logits: torch.Tensor, sampling: Sampling, key: torch.Tensor | None = None,
                index: torch.Tensor | None = None, first_row: int = 0) -> torch.Tensor:
    """[batch, vocab] float logits -> [batch] token ids; sampling draws the noise of (`key`,
    `index`, `first_row`) (uniform_noise)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        # A token goes when the ones ranked above it already reach top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= sampling.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    uniform = uniform_noise(key, index, tuple(logits.shape), first_row)
    return (logits - torch.log(-torch.log(uniform))).argmax(-1)
