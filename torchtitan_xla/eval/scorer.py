"""Log-likelihoods of text continuations under the model, in one compiled graph of fixed shape
[batch_size, seq_len] (the last batch is padded), tokenised as lm-evaluation-harness (0.4) does
with its HF model and a tokenizer that adds BOS (Llama's):

- a (context, continuation) pair: trailing whitespace of the context moves to the continuation;
  the scored tokens are the context's own encoding (with BOS) followed by what the encoding of
  context + continuation holds after that many tokens (lm-eval's `_encode_pair`), which differs
  from the whole string's encoding where BPE merges across the boundary (":" + "\n" -> ":\n");
  an empty context is BOS, then the continuation encoded without BOS; sequences longer than
  seq_len + 1 tokens lose their left end;
- a document (perplexity): encoded without BOS, scored in disjoint windows of seq_len tokens,
  each conditioned on BOS or on the previous seq_len tokens (lm-eval's loglikelihood_rolling with
  add_bos_token=False).
"""

from __future__ import annotations

import torch

from torchtitan_xla import runtime
from torchtitan_xla.losses import token_losses


def pair_tokens(tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """(context tokens + continuation tokens, how many at the end are the continuation), as
    lm-eval's TemplateLM.loglikelihood builds them (docs/evaluation.md)."""
    if not context:  # lm-eval: the prefix token (BOS, else EOS), not the encoding of ""
        context_enc = [tokenizer.prefix_id]
        continuation_enc = tokenizer.encode(continuation, bos=False, eos=False)
    else:
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = tokenizer.encode(context + continuation, bos=True, eos=False)
        context_enc = tokenizer.encode(context, bos=True, eos=False)
        # The context keeps its own encoding even where `whole` merged its last token onward.
        continuation_enc = whole[len(context_enc):]
    if not continuation_enc:  # nothing to score; lm-eval asserts on it too
        raise ValueError(f"the continuation {continuation!r} after the context ...{context[-30:]!r} "
                         f"has no tokens of its own (the context's encoding covers the whole)")
    return context_enc + continuation_enc, len(continuation_enc)


def rolling_windows(tokens: list[int], bos: int, seq_len: int) -> list[tuple[list[int], int]]:
    """A document's tokens as (sequence of at most seq_len + 1 tokens, number scored at its end),
    every token scored exactly once."""
    windows, done = [], 0
    while done < len(tokens):
        end = min(done + seq_len, len(tokens))
        start = end - seq_len - 1  # the window predicts tokens[done:end] from what precedes them
        sequence = [bos] + tokens[:end] if start < 0 else tokens[start:end]
        windows.append((sequence, end - done))
        done = end
    return windows


class Scorer:
    """`scorer(sequences)` -> [(sum of log p of the scored tokens, all of them greedy), ...] for
    sequences given as (tokens, number of tokens scored at the end)."""

    def __init__(self, model: torch.nn.Module, *, seq_len: int, batch_size: int, device, sharding,
                 step_compiler: str, progress: bool = True):
        self.seq_len, self.batch_size = seq_len, batch_size
        self.device, self.sharding, self.progress = device, sharding, progress

        @torch.no_grad()
        def score(inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            logits = model(inputs).float()
            logp = -token_losses(logits, targets)  # vocab-parallel on logits sharded over tp
            # Greedy: the target's logit is the largest (argmax has no DTensor sharding rule in
            # torch 2.9; the two differ only on an exact tie). [..., 1] as the gather's shape.
            target = logits.gather(-1, targets.unsqueeze(-1))
            greedy = (target >= logits.amax(dim=-1, keepdim=True)).squeeze(-1).to(logp.dtype)
            return torch.stack([logp, greedy])

        state = [*model.parameters(), *model.buffers()]
        self.step = runtime.build_step(step_compiler, score, state, name="score_step", whole=True)

    def __call__(self, sequences: list[tuple[list[int], int]], desc: str = "") -> list[tuple[float, bool]]:
        from tqdm import tqdm

        results = []
        starts = range(0, len(sequences), self.batch_size)
        for start in tqdm(starts, desc=desc, disable=not self.progress, leave=False):
            batch = [self._truncate(*s) for s in sequences[start:start + self.batch_size]]
            inputs = torch.zeros(self.batch_size, self.seq_len, dtype=torch.long)
            targets = torch.zeros_like(inputs)
            for row, (tokens, _) in enumerate(batch):  # rows past the batch stay padding
                inputs[row, :len(tokens) - 1] = torch.tensor(tokens[:-1])
                targets[row, :len(tokens) - 1] = torch.tensor(tokens[1:])
            logp, greedy = runtime.to_host([self.step(*runtime.to_device([inputs, targets], self.device,
                                                                           self.sharding))])[0]
            for row, (tokens, n) in enumerate(batch):
                end = len(tokens) - 1  # scored targets: the n before `end`
                results.append((logp[row, end - n:end].double().sum().item(),
                                bool(greedy[row, end - n:end].all())))
        return results

    def _truncate(self, tokens: list[int], n: int) -> tuple[list[int], int]:
        if n > self.seq_len:
            raise ValueError(f"a continuation of {n} tokens does not fit seq_len {self.seq_len}")
        return tokens[-(self.seq_len + 1):], n
