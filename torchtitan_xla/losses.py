"""The training loss (`[loss]`): cross-entropy with optional label smoothing and z-loss, computed
on full logits or in token chunks that never hold them all.

For every token with final hidden state h, output weight W (vocab x dim), logits x = W h and
lse = logsumexp(x), the loss is

    (1 - eps) * (lse - x[label]) + eps * (lse - mean_j x[j]) + z * lse^2

(label smoothing `eps` as `F.cross_entropy` defines it; PaLM's z-loss with weight `z`, which keeps
the softmax normaliser near 1). Labels of -100 are ignored (loss and gradient 0), as in
`F.cross_entropy`.

`chunk_size = 0` computes the full [tokens, vocab] logits through the model's `output` layer (so
tensor parallelism's vocabulary-sharded logits apply). `chunk_size = c` is the cut cross-entropy:
the projection and the loss run over `c` tokens of every data-parallel rank at a time, forward and
backward (a custom autograd function whose backward recomputes each chunk's logits), so only one
chunk's logits exist at once. With Llama 3's 128k vocabulary the full logits and their gradient
are the step's largest tensors (docs/performance.md has the compiled step's memory both ways).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_xla import runtime
from torchtitan_xla.config import JobConfig
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES

IGNORE_INDEX = -100

# (model, inputs, labels[, positions, document_ids]) -> per-token losses [dp ranks, tokens per
# rank] or [dp ranks, rows per rank, seq], float32. Positions and document ids come with packed
# conversations (datasets/chat.py) and with context parallelism's reordered sequences.
LossFn = Callable[..., torch.Tensor]


def token_losses(logits: torch.Tensor, labels: torch.Tensor, *, label_smoothing: float = 0.0,
                 z_loss: float = 0.0, split_sequence: bool = False) -> torch.Tensor:
    """The loss of every token from logits [..., vocab] (computed in float32 or wider).
    `split_sequence`: the logits are split along the sequence over devices (context parallelism),
    which flattening [batch, seq] for F.cross_entropy would gather: reductions over the vocabulary
    instead (they hold one more [tokens, vocab] buffer at the peak: the label gather's gradient)."""
    logits = logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits
    if isinstance(logits, DTensor) or split_sequence:
        return _vocab_reduced_token_losses(logits, labels, label_smoothing, z_loss)
    flat = logits.flatten(0, -2)
    losses = F.cross_entropy(flat, labels.flatten(), reduction="none", label_smoothing=label_smoothing,
                             ignore_index=IGNORE_INDEX)
    if z_loss:
        valid = labels.flatten() != IGNORE_INDEX
        losses = losses + z_loss * torch.logsumexp(flat, dim=-1).square() * valid
    return losses.view(labels.shape)


def _vocab_reduced_token_losses(logits: torch.Tensor, labels: torch.Tensor, label_smoothing: float,
                                z_loss: float) -> torch.Tensor:
    """token_losses as four reductions over the vocabulary (the max, the sum of exponentials, the
    label's logit, the sum), the token dimensions left as they are. On the native runtime's
    vocab-sharded DTensor logits each is a per-shard value all-reduced over `tp`, so the full logits
    never exist on one device (DTensor has no such rule for F.cross_entropy or logsumexp: it would
    gather them)."""
    valid = (labels != IGNORE_INDEX).unsqueeze(-1)  # [..., 1] throughout: DTensor's masked
    # partial (the label's logit on the shard that holds it) must be reduced in the gather's shape
    top = logits.detach().amax(-1, keepdim=True)  # exp's range; its gradient would cancel
    lse = top + (logits - top).exp().sum(-1, keepdim=True).log()
    losses = lse - (1 - label_smoothing) * logits.gather(-1, torch.where(valid, labels.unsqueeze(-1), 0))
    if label_smoothing:
        losses = losses - label_smoothing * logits.mean(-1, keepdim=True)
    if z_loss:
        losses = losses + z_loss * lse.square()
    return torch.where(valid, losses, 0.0).squeeze(-1)


def _chunks(t: torch.Tensor, chunk: int) -> torch.Tensor:
    """[ranks, tokens, ...] -> [chunks, ranks, chunk, ...]: what the loop steps over."""
    return t.unflatten(1, (-1, chunk)).transpose(0, 1)


def _unchunk(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).flatten(1, 2)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token losses of h [ranks, tokens, dim] against W [vocab, dim], `chunk` tokens of every
    rank at a time, in a loop (runtime.kernels.scan: one XLA while loop). Forward keeps only each
    token's logsumexp; backward recomputes each chunk's logits and accumulates dW in the loop's
    carry. The matmuls run in `dtype` (the autocast dtype), the softmax and the loss in float32 or
    wider."""

    @staticmethod
    def forward(ctx, h, weight, labels, chunk: int, label_smoothing: float, z_loss: float, dtype):
        acc = torch.promote_types(h.dtype, torch.float32)
        eps, z = label_smoothing, z_loss

        def step(w, xs):
            h_c, y = xs[0].flatten(0, 1).to(dtype), xs[1].flatten()  # [ranks x chunk, ...]
            # The chunk's logits, transposed ([vocab, tokens]): the only logits alive. W @ h^T is
            # the product orientation XLA CPU runs fastest (docs/performance.md).
            x = (w @ h_c.T).to(acc)
            lse = torch.logsumexp(x, dim=0)
            target = x.gather(0, y.clamp(min=0).unsqueeze(0)).squeeze(0)
            loss = (1 - eps) * (lse - target) + eps * (lse - x.mean(0)) + z * lse.square()
            loss = torch.where(y != IGNORE_INDEX, loss, 0.0)
            return w, (loss.view(xs[1].shape), lse.view(xs[1].shape))

        _, (losses, lse) = runtime.kernels.scan(step, weight.to(dtype),
                                                (_chunks(h, chunk), _chunks(labels, chunk)))
        ctx.save_for_backward(h, weight, labels, lse)
        ctx.chunk, ctx.label_smoothing, ctx.z_loss, ctx.dtype = chunk, label_smoothing, z_loss, dtype
        return _unchunk(losses)

    @staticmethod
    def backward(ctx, grad):
        h, weight, labels, lse = ctx.saved_tensors
        eps, z, dtype = ctx.label_smoothing, ctx.z_loss, ctx.dtype
        acc = torch.promote_types(h.dtype, torch.float32)
        vocab = weight.shape[0]

        need_w = ctx.needs_input_grad[1]  # not for a frozen output layer (LoRA)

        def step(carry, xs):
            w, grad_w = carry
            h_c, y, g, lse_c = (t.flatten(0, 1) for t in xs)  # [ranks x chunk, ...]
            h_c = h_c.to(dtype)
            x = (w @ h_c.T).to(acc)  # recomputed, [vocab, tokens] as in forward
            # d loss / d x = p (1 + 2 z lse) - (1 - eps) onehot(label) - eps / vocab
            is_label = torch.arange(vocab, device=x.device).unsqueeze(1) == y  # fused, never stored
            dx = torch.exp(x - lse_c) * (1 + 2 * z * lse_c) - eps / vocab - (1 - eps) * is_label.to(acc)
            dx = (dx * (g * (y != IGNORE_INDEX))).to(dtype)
            if need_w:
                grad_w = grad_w + (dx @ h_c).to(acc)
            return (w, grad_w), ((dx.T @ w).to(h.dtype).view(xs[0].shape),)

        grad_w = torch.zeros(weight.shape if need_w else (), dtype=acc, device=weight.device)
        init = (weight.to(dtype), grad_w)
        xs = (*(_chunks(t, ctx.chunk) for t in (h, labels, grad)), lse)  # lse is kept chunked
        (_, grad_w), (grad_h,) = runtime.kernels.scan(step, init, xs)
        return _unchunk(grad_h), grad_w.to(weight.dtype) if need_w else None, None, None, None, None, None


def chunked_token_losses(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int, *,
                         label_smoothing: float = 0.0, z_loss: float = 0.0,
                         dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-token losses [ranks, tokens] of hidden states h [ranks, tokens, dim] against the output
    weight [vocab, dim], never holding more than `chunk` tokens' logits per rank."""
    if h.shape[1] % chunk:
        raise ValueError(f"chunk {chunk} does not divide {h.shape[1]} tokens")
    return _ChunkedCrossEntropy.apply(h, weight, labels, chunk, label_smoothing, z_loss,
                                      dtype or h.dtype)


def build_loss_fn(job_config: JobConfig, *, dp_degree: int, autocast_dtype: torch.dtype | None,
                  plain: bool = False) -> LossFn:
    """The step's loss: (model, inputs [batch, seq], labels[, positions, document_ids]) -> per-token
    losses [dp ranks, tokens per rank] (with context parallelism [dp ranks, rows per rank, seq]) in
    float32, 0 where the label is IGNORE_INDEX. The batch's rows are split into `dp_degree` contiguous blocks,
    one per data-parallel rank (the batch sharding), so chunks never cross a rank's rows.
    `plain`: without label smoothing and z-loss (validation's loss, whose exp is the perplexity).
    grpo: the logits divided by its sampling temperature (the policy's log-probabilities are those
    the rollouts sampled from, as TRL's)."""
    cfg = job_config.loss
    smoothing, z = (0.0, 0.0) if plain else (cfg.label_smoothing, cfg.z_loss_weight)
    temperature = job_config.grpo.temperature if job_config.training.objective == "grpo" else 1.0
    split = job_config.parallelism.context_parallel_degree > 1
    autocast = dict(device_type=runtime.autocast_device_type(), dtype=autocast_dtype or torch.bfloat16,
                    enabled=autocast_dtype is not None)

    def full(model, inputs, labels, *packing):
        with torch.autocast(**autocast):
            logits = model(inputs, *packing)
        if temperature != 1.0:
            logits = logits / temperature
        losses = token_losses(logits, labels, label_smoothing=smoothing, z_loss=z, split_sequence=split)
        # A split sequence stays [dp ranks, rows, seq] (merging rows and sequence would gather it).
        return losses.view(dp_degree, -1, losses.shape[-1]) if split else losses.view(dp_degree, -1)

    def chunked(model, inputs, labels, *packing):
        with torch.autocast(**autocast):
            h = model.hidden_states(inputs, *packing)
        if temperature != 1.0:  # W h / t = W (h / t)
            h = h / temperature

        def losses(h, weight, labels, ranks=dp_degree):
            return chunked_token_losses(h.view(ranks, -1, h.shape[-1]), weight, labels.view(ranks, -1),
                                        cfg.chunk_size, label_smoothing=smoothing, z_loss=z,
                                        dtype=autocast_dtype or h.dtype)

        if isinstance(h, DTensor):  # one process per device: each loops over its own rows
            mesh, tokens = h.device_mesh, (BATCH_AXES, None)
            local = functools.partial(losses, ranks=dp_degree // _batch_blocks(mesh))
            return runtime.per_shard(local, mesh, [(*tokens, None), (None, None), tokens], tokens,
                                     BATCH_AXES)(h, model.output.weight, labels)
        return losses(h, model.output.weight, labels)

    return chunked if cfg.chunk_size else full


def _batch_blocks(mesh) -> int:
    """Blocks the mesh splits the batch into (its batch axes' sizes multiplied)."""
    return math.prod(mesh.size(i) for i, axis in enumerate(mesh.mesh_dim_names) if axis in BATCH_AXES)
