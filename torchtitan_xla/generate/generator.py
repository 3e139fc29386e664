"""Generation on the shared model: a batch of prompts is left-padded to a length bucket and
prefilled in one call, then each new token is one decode call; both are compiled graphs that
the next batch (of the same bucket) and every position reuse.

The decode graph's inputs are the last tokens, their positions, the slot they go to and the step
index, all device tensors, so nothing in it depends on the position as a Python number: one
compile per cache size. Which rows are finished (EOS), the tokens so far and the counters stay on
the device; the host reads them every `check_every` tokens to stop early and to look for stop
strings, and once at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from torchtitan_xla import runtime
from torchtitan_xla.generate.cache import KVCache
from torchtitan_xla.generate.sampling import Sampling, next_tokens


@dataclass
class Completion:
    tokens: list[int]  # generated, without the stop that ended them (EOS; a stop string is cut on text)
    finish: str  # "eos", "stop" or "length"
    eos: int | None = None  # the EOS (or end-of-turn) id that ended it


@dataclass
class Stats:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0

    def summary(self) -> str:
        """Tokens per second of each phase (the prefill's include its first compile)."""
        def rate(tokens, seconds):
            return f"{tokens / seconds:,.1f}" if seconds else "-"
        return (f"prefill {self.prefill_tokens} tokens, {rate(self.prefill_tokens, self.prefill_seconds)} "
                f"tokens/s; decode {self.decode_tokens} tokens, "
                f"{rate(self.decode_tokens, self.decode_seconds)} tokens/s")


GREEDY = Sampling()


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def check_fits(prompt_lengths: Sequence[int], max_new_tokens: int, cache_size: int, bucket: int = 16,
               where: str = "[generate]") -> None:
    """Raises ValueError when a prompt is empty or a prompt and its completion cannot fit the cache."""
    if not prompt_lengths or not min(prompt_lengths):
        raise ValueError(f"{where} prompts: an empty prompt (nothing to condition on)")
    longest = max(prompt_lengths)
    padded = _round_up(longest, bucket)
    if padded + max_new_tokens > cache_size:
        raise ValueError(f"{where} max_new_tokens = {max_new_tokens}: with the longest prompt, {longest} "
                         f"tokens (padded to {padded}), it needs {padded + max_new_tokens} KV cache slots; "
                         f"the cache has [training] seq_len = {cache_size}: raise seq_len or shorten them")


class Generator:
    """`Generator(model, ...)(prompts, max_new_tokens, sampling)` -> one Completion per prompt."""

    def __init__(self, model: torch.nn.Module, *, cache_size: int, batch_size: int, device,
                 eos_ids: Sequence[int], pad_id: int, bucket: int = 16, step_compiler: str = "lazy",
                 check_every: int = 16, decode_text: Callable[[list[int]], str] | None = None,
                 first_row: int = 0):
        self.model, self.cache_size, self.batch_size = model, cache_size, batch_size
        self.device, self.bucket, self.check_every = device, bucket, check_every
        self.eos_ids, self.pad_id, self.decode_text = list(eos_ids), pad_id, decode_text
        self.n_layers = len(model.layers)
        # This process's first row in the whole batch (a data rank's): its sampling noise is that
        # of the same rows on one device (sampling.py).
        self.first_row = first_row
        self.stats = Stats()
        # `step_compiler` is [compile] step's. Each call one graph: torch_xla.compile'd ("lazy"; a
        # host read inside is an error, not a second graph; "replay" is lazy here, as there is no
        # training state to rebind), or torch.compile'd whole on the native runtime ("compile").
        kind = "lazy" if step_compiler == "replay" else step_compiler
        self._prefill_step = runtime.build_step(kind, self._prefill, [], name="prefill", whole=True)
        self._decode_step = runtime.build_step(kind, self._decode, [], name="decode", whole=True)

    def check(self, prompt_lengths: Sequence[int], max_new_tokens: int) -> None:
        check_fits(prompt_lengths, max_new_tokens, self.cache_size, self.bucket)

    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = GREEDY,
                 stop: Sequence[str] = ()) -> list[Completion]:
        self.check([len(p) for p in prompts], max_new_tokens)
        sampling.check()
        out = []
        for n, start in enumerate(range(0, len(prompts), self.batch_size)):
            # Each batch's draws from its own key (sampling.py): the seed's, then the batch's number.
            key = (sampling.seed * 1_000_003 + n) % (1 << 31)
            out += self._batch(prompts[start:start + self.batch_size], max_new_tokens, sampling, stop, key)
        return out

    def _batch(self, prompts, max_new_tokens, sampling, stop, key: int) -> list[Completion]:
        rows, width = self.batch_size, _round_up(max(len(p) for p in prompts), self.bucket)
        tokens = torch.full((rows, width), self.pad_id, dtype=torch.long)
        documents = torch.zeros_like(tokens)
        positions = torch.zeros_like(tokens)
        for row, prompt in enumerate(prompts):  # rows past the prompts stay padding
            tokens[row, width - len(prompt):] = torch.tensor(prompt)
            documents[row, width - len(prompt):] = 1
            positions[row, width - len(prompt):] = torch.arange(len(prompt))
        eos = torch.tensor(self.eos_ids or [-1], dtype=torch.long)
        # The decode state's counters start as data of their own, not views of the prompt's
        # tensors (a view made the first decode step a graph of its own).
        last, slot, step = positions[:, -1].clone(), torch.tensor([width - 1]), torch.tensor([0])
        key = torch.tensor([key], dtype=torch.int32)
        tokens, documents, positions, eos, last, slot, step, key = runtime.to_device(
            [tokens, documents, positions, eos, last, slot, step, key], self.device)
        t0 = time.perf_counter()
        cache, state = self._prefill_step(tokens, positions, documents, last, slot, step, eos, key, sampling)
        runtime.materialise()
        self.stats.prefill_tokens += sum(len(p) for p in prompts)
        self.stats.prefill_seconds += time.perf_counter() - t0

        t0, n = time.perf_counter(), max_new_tokens
        for i in range(1, max_new_tokens):
            state = self._decode_step(cache, *state, eos, key, sampling)
            if (i + 1) % self.check_every == 0 and self._finished(state, len(prompts), i + 1, stop):
                n = i + 1
                break
        host = runtime.to_host([state[-1]])[0][:len(prompts), :n].tolist()
        self.stats.decode_tokens += len(prompts) * (n - 1)
        self.stats.decode_seconds += time.perf_counter() - t0
        return [self._completion(row, stop) for row in host]

    # The decode state, all on the device: (last token [batch], its position [batch], its slot [1],
    # its index among the new tokens [1], rows finished [batch], new tokens [batch, cache size]).

    @torch.no_grad()
    def _prefill(self, tokens, positions, documents, last, slot, step, eos, key, sampling):
        # The cache and the new tokens' buffer are made here, in the prefill's graph (made before
        # it they would be a graph of their own). The latter is as wide as the cache, whatever
        # max_new_tokens is: the decode graph's shapes are the cache's.
        rows = tokens.shape[0]
        cache = KVCache(self.n_layers, rows, self.cache_size, tokens.device)
        generated = torch.full((rows, self.cache_size), self.pad_id, dtype=torch.long, device=tokens.device)
        cache.write(torch.arange(tokens.shape[1], device=tokens.device), positions, documents)
        hidden = self.model.hidden_states(tokens, positions, documents, cache)
        logits = self.model.output(hidden[:, -1:])[:, 0]
        done = torch.zeros_like(last, dtype=torch.bool)
        return cache, self._next(logits, last, slot, step, done, generated, eos, key, sampling)

    @torch.no_grad()
    def _decode(self, cache, token, position, slot, step, done, generated, eos, key, sampling):
        position, slot, step = position + 1, slot + 1, step + 1
        documents = torch.ones_like(token)[:, None]
        cache.write(slot, position[:, None], documents)
        logits = self.model(token[:, None], position[:, None], documents, cache)[:, 0]
        return self._next(logits, position, slot, step, done, generated, eos, key, sampling)

    def _next(self, logits, position, slot, step, done, generated, eos, key, sampling):
        # The whole logits (a DTensor's gathered: argmax and sort have no DTensor rule)
        token = next_tokens(runtime.whole([logits.float()])[0], sampling, key, step, self.first_row)
        token = torch.where(done, torch.full_like(token, self.pad_id), token)
        done = done | (token[:, None] == eos[None, :]).any(-1)
        generated = generated.index_copy(1, step, token[:, None])
        return token, position, slot, step, done, generated

    def _finished(self, state, n_prompts: int, n: int, stop) -> bool:
        """Every real row has ended (EOS, or a stop string in the text of its first `n` tokens):
        a host read of the whole state (a slice would be a graph of its own)."""
        done, generated = runtime.to_host([state[4], state[5]])
        for row in range(n_prompts):
            if done[row]:
                continue
            if not stop or self.decode_text is None:
                return False
            text = self.decode_text(generated[row, :n].tolist())
            if not any(s in text for s in stop):
                return False
        return True

    def _completion(self, tokens: list[int], stop) -> Completion:
        for i, t in enumerate(tokens):
            if t in self.eos_ids:
                return Completion(tokens[:i], "eos", t)
        if stop and self.decode_text is not None and any(s in self.decode_text(tokens) for s in stop):
            return Completion(tokens, "stop")
        return Completion(tokens, "length")
