"""The next token from the last position's logits [batch, vocab], on the device (no host sync):
greedy at temperature 0, else a sample from softmax(logits / temperature) restricted to the top k
and to the smallest set of tokens whose probability reaches top_p (transformers' warpers, in
that order). The sample is the Gumbel-max trick: argmax(logits + Gumbel noise) is distributed
as softmax(logits), drawn with the device's RNG (the runtime's `set_seed` repeats it)."""

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


def next_tokens(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """[batch, vocab] float logits -> [batch] token ids."""
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
    uniform = torch.rand_like(logits).clamp_min(1e-20)  # [0, 1): never 0 under the logs
    return (logits - torch.log(-torch.log(uniform))).argmax(-1)
