"""Mixture of experts in place of a block's SwiGLU (Mixtral; GShard's dispatch): plain PyTorch, no
parallelism code.

A router picks each token's top-k experts; the token's output is the sum of those experts' SwiGLU
outputs weighted by their router probabilities, renormalised over the k (Mixtral's routing, as
transformers' MixtralSparseMoeBlock computes it).

The tokens reach their experts by GShard's dense dispatch rather than by gathering: each sequence
is a group, every expert has C slots per group, and one-hot dispatch / combine tensors
[batch, seq, expert, slot] move tokens into the slots and the experts' outputs back by einsum.
Shapes are static and nothing waits on the host, so the layer traces into one XLA graph. For
expert parallelism the stacked expert weights [expert, ...] are sharded on dim 0 and the
expert-side tensors [expert, batch, slot, dim] annotated at `expert_inputs` / `expert_outputs`
(identity modules, hooked from outside): resharding them between batch and expert is what the SPMD
partitioner does by all-to-all. With capacity_factor 0, C is the sequence length: no expert can
receive more than every token of a sequence, so nothing is dropped and the result is exactly the
gathered computation. With c > 0, C = ceil(c * k * seq / E) and the choices past an expert's C are
dropped (their share of the output is zero; the block's residual carries the token on).

Parameters (under the block's `feed_forward`): `router.weight` [E, dim], `w1` and `w3`
[E, hidden, dim], `w2` [E, dim, hidden] (expert e computes w2[e] silu(w1[e] x) * w3[e] x, as the
dense FeedForward's w1/w3/w2).

With `[moe] grouped_mm` the experts run instead on the routed tokens sorted by expert, as grouped
matmuls (`sorted_experts`; megablox's layout): no slots, so no E-fold work on the tokens, dropless.
The grouped matmul is a plain PyTorch reference here, swapped for torch_xla's Pallas kernel on TPU
from outside (moe_kernels.py) by setting `routed_experts`.

DeepSeek-V2's router is the softmax one without renormalising (`norm_topk=False`), times
`routed_scaling`, within the `topk_groups` groups with the best single scores.
DeepSeek-V3's router (`router="sigmoid"`) scores each expert by a sigmoid, chooses the top-k of
score + `expert_bias` (a buffer: checkpointed, never trained by the gradient) within the
`topk_groups` groups of experts whose two best biased scores sum highest, and weights the chosen
experts by their scores renormalised, times `routed_scaling`, as transformers' DeepseekV3TopkRouter.
Training moves the bias towards balance after each step (`update_expert_bias`: auxiliary-loss-free
load balancing); its `aux` is the paper's sequence-wise balance loss. `shared_experts` always-on
experts (one SwiGLU) add to every token's output.

Router losses reach the gradient without a second return path through the model: the trainer sets
`aux_loss_weight` and `z_loss_weight` (already divided by its number of microbatches), and the
forward output carries `aux_loss_weight * aux + z_loss_weight * z` into backward (AddAuxLossGrad).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from torchtitan_xla.models.llama.layers import FeedForward, glu, upcast


class AddAuxLossGrad(torch.autograd.Function):
    """Returns `out` unchanged; in backward, gives `loss` a gradient of 1 besides passing `out`'s
    gradient through (Megatron's MoEAuxLossAutoScaler). So `loss` (already weighted) is minimised
    with the model's loss without being added to it: the model's output and its return values stay
    as they are, and activation checkpointing, which recomputes the forward, rebuilds it."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(loss)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (loss,) = ctx.saved_tensors
        return grad_out, torch.ones_like(loss)


def dispatch_and_combine(experts: torch.Tensor, weights: torch.Tensor, num_experts: int,
                         capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GShard's dispatch of each sequence's choices into the experts' slots.

    experts, weights: [batch, seq, k] each token's chosen experts (distinct) and their weights; a
    choice of expert id E (padding) takes no slot. Returns dispatch [batch, seq, expert, slot] (1
    where a token occupies a slot) and combine (the same, holding the choice's weight), in the
    weights' dtype, and kept [batch, seq, k] (False for a choice past its expert's capacity).

    Slots are given in priority order: every token's first choice before any second choice, and
    within a rank in sequence order (GShard), so under capacity a token loses its lower choices first.
    """
    b, s, k = experts.shape
    chosen = experts[..., None] == torch.arange(num_experts, device=experts.device)  # [b, s, k, E]
    # Each choice's slot = how many choices before it (in priority order) went to its expert.
    by_rank = chosen.transpose(1, 2).reshape(b, k * s, num_experts).to(torch.int32)
    slot = ((torch.cumsum(by_rank, dim=1, dtype=torch.int32) - 1) * by_rank).sum(-1)
    slot = slot.view(b, k, s).transpose(1, 2)  # [b, s, k]
    # A comparison, not F.one_hot: a slot past the capacity matches no column (the choice is
    # dropped) without a data-dependent check.
    in_slot = slot[..., None] == torch.arange(capacity, device=slot.device)  # [b, s, k, C]
    # A token's k experts are distinct, so each (expert, slot) entry sums at most one term: exact.
    in_slot = in_slot.to(weights.dtype)
    dispatch = torch.einsum("bske,bskc->bsec", chosen.to(weights.dtype), in_slot)
    combine = torch.einsum("bske,bskc->bsec", chosen * weights[..., None], in_slot)
    return dispatch, combine, slot < capacity


def grouped_mm_reference(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Rows of lhs [m, k] in consecutive groups of group_sizes [E] rows, group e times rhs[e]
    [k, n]: megablox's gmm, in plain PyTorch (every expert over every row, masked: E times the
    kernel's work, but static shapes and nothing on the host)."""
    rows = torch.arange(lhs.shape[0], device=lhs.device)
    group = (rows[:, None] >= torch.cumsum(group_sizes, 0)[None, :]).sum(-1)  # [m]
    out = lhs.new_zeros(lhs.shape[0], rhs.shape[-1])
    for e in range(rhs.shape[0]):
        out = out + (group == e)[:, None].to(lhs.dtype) * (lhs @ rhs[e])
    return out


def sorted_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, w1: torch.Tensor,
                   w2: torch.Tensor, w3: torch.Tensor, grouped_mm=grouped_mm_reference) -> torch.Tensor:
    """The experts on every routed token (dropless): the tokens' k copies sorted by expert, each
    expert's SwiGLU as grouped matmuls over its run of rows, the outputs weighted and summed back
    per token. x [batch, seq, dim]; experts, weights [batch, seq, k] (expert id E: no expert)."""
    b, s, d = x.shape
    k, num_experts = experts.shape[-1], w1.shape[0]
    choice = experts.reshape(-1)  # [b*s*k], token t's choices at t*k ... t*k + k-1
    order = torch.argsort(choice, stable=True)
    token = order // k
    rows = x.reshape(-1, d)[token]
    group_sizes = (choice[:, None] == torch.arange(num_experts, device=x.device)).sum(0).to(torch.int32)
    h = (F.silu(grouped_mm(rows, w1.transpose(1, 2), group_sizes))
         * grouped_mm(rows, w3.transpose(1, 2), group_sizes))
    y = grouped_mm(h, w2.transpose(1, 2), group_sizes) * weights.reshape(-1)[order, None].to(h.dtype)
    # Rows past the groups (choices routed to no expert, id E: padding) are left out: a kernel
    # need not write them.
    y = torch.where((choice[order] < num_experts)[:, None], y, 0)
    return x.new_zeros(b * s, d, dtype=y.dtype).index_add(0, token, y).view(b, s, d)


class MoE(nn.Module):
    """Top-k routed SwiGLU experts over tokens [batch, seq, dim]; see the module docstring.

    After each forward, `router_stats` holds that forward's float32 [aux, z, dropped_fraction,
    load max/min (tokens of the most chosen expert over the least's, the least counted as >= 1)],
    `expert_load` float32 [2, E]: each expert's fraction of the tokens choosing it (summing to
    top_k over the experts) and its mean router probability, and `expert_counts` float32 [E] the
    choices of each expert (all detached: for logging and the bias update)."""

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, top_k: int,
                 capacity_factor: float = 0.0, *, router: str = "softmax", norm_topk: bool = True,
                 groups: int = 1, topk_groups: int = 1, routed_scaling: float = 1.0, shared_experts: int = 0,
                 act: str = "silu", bias: bool = False):
        super().__init__()
        self.act = act
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.router_kind, self.norm_topk = router, norm_topk
        self.groups, self.topk_groups = groups, topk_groups
        self.routed_scaling = routed_scaling
        self.router = nn.Linear(dim, num_experts, bias=bias)
        # DeepSeek-V3: the selection bias, float32 whatever the model's dtype (as its checkpoints).
        self.expert_bias = (nn.Buffer(torch.zeros(num_experts, dtype=torch.float32))
                            if router == "sigmoid" else None)
        self.shared_experts = FeedForward(dim, hidden_dim * shared_experts) if shared_experts else None
        # Stacked, [expert, out, in] as each expert's nn.Linear weight: one annotation on dim 0
        # shards the experts.
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # gpt-oss: each expert's biases, b1 and b3 [E, hidden] on w1's and w3's outputs, b2 [E, dim]
        # on w2's (weighted with the rest of the expert's output).
        self.b1 = self.b2 = self.b3 = None
        if bias:
            self.b1 = nn.Parameter(torch.zeros(num_experts, hidden_dim))
            self.b2 = nn.Parameter(torch.zeros(num_experts, dim))
            self.b3 = nn.Parameter(torch.zeros(num_experts, hidden_dim))
        # Identities around the expert computation: where expert parallelism annotates the
        # expert-side tensors [E, batch, C, dim] (forward hooks, from outside, as `attention.sdpa`
        # is swapped), e.g. first by batch, then by expert, which the partitioner does by all-to-all.
        self.expert_inputs, self.expert_outputs = nn.Identity(), nn.Identity()
        # Set from outside for [moe] grouped_mm: (x, experts, weights, w1, w2, w3) -> out, the
        # experts on the routed tokens without slots (`sorted_experts`). None: GShard's dispatch.
        self.routed_experts = None
        # Set by the trainer; plain floats, so a weight of 0 leaves the loss out of the graph.
        self.aux_loss_weight = 0.0
        self.z_loss_weight = 0.0
        self.router_stats: torch.Tensor | None = None
        self.expert_load: torch.Tensor | None = None
        self.expert_counts: torch.Tensor | None = None

    def capacity(self, seqlen: int) -> int:
        """Slots per expert for a sequence of `seqlen` tokens. More than seqlen is never needed."""
        if self.capacity_factor == 0:
            return seqlen
        return min(seqlen, math.ceil(self.capacity_factor * self.top_k * seqlen / self.num_experts))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """x [batch, seq, dim]; `tokens` [batch, seq] False where x is padding, which is then
        routed to no expert (its output is zero) and left out of the router losses and stats."""
        logits = self.router(x)  # [b, s, E]
        probs, experts, weights = self.route(logits)
        real = torch.ones_like(x[..., 0], dtype=probs.dtype) if tokens is None else tokens.to(probs.dtype)
        if tokens is not None:  # expert id E matches no expert: no slot, no row of a group
            experts = torch.where(tokens[..., None], experts, self.num_experts)
        if self.routed_experts is not None:
            out = self.routed_experts(x, experts, weights, self.w1, self.w2, self.w3)
            kept = torch.ones_like(experts, dtype=torch.bool)
        else:
            out, kept = self.dispatched_experts(x, experts, weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)

        # Load balancing (Switch / Mixtral, as transformers' load_balancing_loss_func for one
        # layer): E * sum_e (fraction of tokens choosing e among their top-k) * (mean probability
        # of e). The fractions count choices before capacity drops, and carry no gradient. Means
        # over the real tokens; DeepSeek-V3's is per sequence (sequence_balance_loss).
        count = real.sum().clamp(min=1)
        chosen = (experts[..., None] == torch.arange(self.num_experts, device=x.device)).sum(-2)  # [b, s, E]
        counts = chosen.to(probs.dtype).sum((0, 1))
        fraction = counts / count
        mean_prob = (probs * real[..., None]).sum((0, 1)) / count
        if self.router_kind == "sigmoid":
            aux = sequence_balance_loss(probs, chosen, real, self.top_k)
        else:
            aux = self.num_experts * (fraction * mean_prob).sum()
        # Router z-loss (ST-MoE): keeps the logits small, where the softmax is well conditioned.
        z = (torch.logsumexp(upcast(logits), dim=-1).pow(2) * real).sum() / count
        dropped = 1 - (kept.to(probs.dtype) * real[..., None]).sum() / (count * self.top_k)
        # How unevenly the experts are loaded: the most chosen expert's tokens over the least's.
        spread = counts.max() / counts.min().clamp(min=1)
        self.router_stats = torch.stack([aux, z, dropped, spread]).detach().float()
        self.expert_load = torch.stack([fraction, mean_prob]).detach().float()
        self.expert_counts = counts.detach().float()

        if self.aux_loss_weight or self.z_loss_weight:
            out = AddAuxLossGrad.apply(out, self.aux_loss_weight * aux + self.z_loss_weight * z)
        return out

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(scores [b, s, E], each token's top_k experts and their weights [b, s, k]); scores in
        float32 or wider: softmax probabilities (Mixtral, DeepSeek-V2), or sigmoid scores with the
        bias added for choosing only (DeepSeek-V3)."""
        sigmoid = self.router_kind == "sigmoid"
        scores = upcast(logits).sigmoid() if sigmoid else upcast(logits).softmax(-1)
        choice = scores + self.expert_bias.to(scores.dtype) if sigmoid else scores
        if self.groups > 1:  # only experts of the topk_groups best groups: V3 ranks a group by its
            # two best (biased) scores, V2 by its best
            grouped = choice.unflatten(-1, (self.groups, -1))
            group_scores = grouped.topk(2 if sigmoid else 1, dim=-1).values.sum(-1)
            best = group_scores.topk(self.topk_groups, dim=-1).indices
            allowed = (best[..., None] == torch.arange(self.groups, device=logits.device)).any(-2)
            choice = grouped.masked_fill(~allowed[..., None], float("-inf")).flatten(-2)
        top, experts = choice.topk(self.top_k, dim=-1)
        weights = scores.gather(-1, experts) if sigmoid or self.groups > 1 else top
        if self.norm_topk:  # (V3's epsilon: sigmoid scores can all be tiny)
            weights = weights / (weights.sum(-1, keepdim=True) + (1e-20 if sigmoid else 0.0))
        return scores, experts, weights * self.routed_scaling if self.routed_scaling != 1.0 else weights

    def dispatched_experts(self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor):
        """GShard: the experts on their slots; (out, kept) as `dispatch_and_combine`."""
        dispatch, combine, kept = dispatch_and_combine(experts, weights, self.num_experts,
                                                       self.capacity(x.shape[1]))
        # Batch and expert stay separate dimensions throughout, so that batch and experts can be
        # sharded on different mesh axes.
        xe = self.expert_inputs(torch.einsum("bsec,bsd->ebcd", dispatch.type_as(x), x))
        gate, up = torch.einsum("ebcd,ehd->ebch", xe, self.w1), torch.einsum("ebcd,ehd->ebch", xe, self.w3)
        if self.b1 is not None:  # (an empty slot's output is then not 0, but its combine weight is)
            gate, up = gate + self.b1[:, None, None].to(gate.dtype), up + self.b3[:, None, None].to(up.dtype)
        ye = torch.einsum("ebch,edh->ebcd", glu(self.act, gate, up), self.w2)
        if self.b2 is not None:
            ye = ye + self.b2[:, None, None].to(ye.dtype)
        ye = self.expert_outputs(ye)
        return torch.einsum("bsec,ebcd->bsd", combine.type_as(ye), ye), kept

    def init_weights(self, init_std: float) -> None:
        # As the dense FeedForward (and torchtitan's MoE): w1 at 0.02, the rest at the block's std.
        nn.init.trunc_normal_(self.router.weight, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        for w in (self.w2, self.w3):
            nn.init.trunc_normal_(w, mean=0.0, std=init_std)
        if self.expert_bias is not None:
            self.expert_bias.zero_()
        for b in (self.router.bias, self.b1, self.b2, self.b3):
            if b is not None:
                nn.init.zeros_(b)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)


def sequence_balance_loss(scores: torch.Tensor, chosen: torch.Tensor, real: torch.Tensor,
                          top_k: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (its eq. 17-20, without the alpha): per sequence,
    sum_e f_e P_e with f_e = E / (k T) x (tokens choosing e) and P_e the mean over the T tokens of
    e's score normalised over the experts; the mean over the sequences. 1 when balanced.
    scores [b, s, E]; chosen [b, s, E] 1 where a token chose the expert; real [b, s] 1 for real
    tokens (padding counts in neither)."""
    num_experts = scores.shape[-1]
    tokens = real.sum(1).clamp(min=1)[:, None]  # [b, 1]
    f = num_experts / top_k * (chosen.to(scores.dtype) * real[..., None]).sum(1) / tokens
    p = (scores / scores.sum(-1, keepdim=True) * real[..., None]).sum(1) / tokens
    return (f * p).sum(-1).mean()


@torch.no_grad()
def update_expert_bias(blocks: list[MoE], counts: list[torch.Tensor], rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3): after a step, each expert's bias rises by
    `rate` if it was chosen less than the mean of its block's experts, falls if more:
    b += rate * sign(mean(counts) - counts). `counts` [E]: the step's choices of each block's experts
    (every microbatch and rank). On the device, inside the step: no host sync."""
    for m, c in zip(blocks, counts):
        m.expert_bias.add_(torch.sign(c.mean() - c), alpha=rate)


def set_router_loss_weights(model: nn.Module, aux_loss_weight: float, z_loss_weight: float,
                            microbatches: int = 1) -> list[MoE]:
    """Give every MoE block of `model` its share of the router losses' weights, so that the
    gradient is that of weight * (the losses' mean over the blocks and the microbatches), as the
    language-model loss is a mean over microbatches. Returns the MoE blocks in model order ([] for
    a dense model), whose `router_stats` the training step reads after each forward."""
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    for m in blocks:
        m.aux_loss_weight = aux_loss_weight / (len(blocks) * microbatches)
        m.z_loss_weight = z_loss_weight / (len(blocks) * microbatches)
    return blocks


def inactive_expert_params(model: nn.Module) -> int:
    """Expert weights a token does not run through (it uses top_k of num_experts experts): MFU
    counts active parameters only (metrics.num_flops_per_token)."""
    return sum(sum(w.numel() for w in (m.w1, m.w2, m.w3, m.b1, m.b2, m.b3) if w is not None)
               * (m.num_experts - m.top_k) // m.num_experts for m in model.modules() if isinstance(m, MoE))
