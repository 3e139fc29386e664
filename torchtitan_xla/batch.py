"""The step's batch: named tensors, each with the batch's rows first, on the mesh's batch axes.

What varies between pre-training, SFT and the preference objectives is which of these a batch
carries, not how the loop runs:
- `inputs`, `labels` [rows, seq]: always (labels are IGNORE_INDEX where a token is not trained on);
- `positions`, `document_ids` [rows, seq]: when several documents share a row (chat packing) or
  documents come in pairs (preference data): the model's positions and attention mask follow them;
- `reference_logps` [rows, slots]: dpo and ipo, each document's summed log-probability under the
  reference model (reference/; document d of a row in slot d - 1), computed by its own graph or
  stored with the pairs, read by the step as data; grpo: [rows, seq], each token's;
- `advantages` [rows], `old_logps` [rows, seq]: grpo's rollouts (grpo/): each completion's
  advantage, and its tokens' log-probabilities under the policy that sampled them (when a rollout
  gets more than one update).

A Batch is a pytree (torch.utils._pytree), so a compiled step takes one as its argument: its
tensors are the graph's inputs, its field names part of the traced program.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.utils import _pytree as pytree


@dataclasses.dataclass(frozen=True)
class Batch:
    inputs: torch.Tensor
    labels: torch.Tensor
    positions: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    reference_logps: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    old_logps: torch.Tensor | None = None

    @classmethod
    def of(cls, loaded: tuple | list) -> Batch:
        """A data loader's batch: (inputs, labels[, positions, document_ids[, reference_logps]]), or
        a Batch already (grpo's rollouts)."""
        return loaded if isinstance(loaded, Batch) else cls(*loaded)

    @property
    def packed(self) -> bool:
        """Whether rows carry their documents' positions (packed chat rows, preference pairs):
        labels are then masked per document, so losses are normalised by the counted labels."""
        return self.positions is not None

    @property
    def packing(self) -> tuple[torch.Tensor, ...]:
        """The model's extra arguments: (positions, document_ids), or () for whole sequences."""
        return (self.positions, self.document_ids) if self.packed else ()

    def replace(self, **tensors: torch.Tensor | None) -> Batch:
        return dataclasses.replace(self, **tensors)

    def microbatches(self, dp_degree: int, steps: int) -> list[Batch]:
        """This batch cut for gradient accumulation into `steps` microbatches, each still spanning
        every data-parallel rank: [dp x steps x local, ...] -> steps x [dp x local, ...] (a rank's
        rows are a contiguous block of the batch, its microbatches contiguous blocks of that)."""
        if steps == 1:
            return [self]
        names = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        parts = {n: _split(getattr(self, n), dp_degree, steps) for n in names}
        return [self.replace(**{n: parts[n][k] for n in names}) for k in range(steps)]


def _split(t: torch.Tensor, dp_degree: int, steps: int) -> list[torch.Tensor]:
    t = t.view(dp_degree, steps, -1, *t.shape[1:])
    return [t[:, k:k + 1].reshape(-1, *t.shape[3:]) for k in range(steps)]


pytree.register_dataclass(Batch)
