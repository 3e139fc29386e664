"""Rollouts: the batch source of online RL. Each rollout takes the step's prompts, samples
`num_generations` completions of each with the policy's current weights (generate/: the KV-cached
prefill and decode graphs on the training mesh, colocated: no second engine), scores them with the
rewards, turns the rewards into advantages, and hands the training loop a Batch, as the data
loader does. A rollout serves `num_iterations` consecutive steps.

A completion's row is its prompt then its tokens (with the EOS or end-of-turn token that ended
it), right-padded to seq_len: inputs are the row, labels the next tokens, counted on the
completion's tokens only. Rows are [this data rank's prompts x num_generations], a prompt's
completions consecutive (a group never spans two ranks).

Which prompts a rollout takes and how it samples are functions of its index (prompt order: a
permutation per pass over the set, seeded by [debug] seed; sampling: [grpo] seed + the index,
hashed, not drawn from a device's generator: generate/sampling.py), so a resumed run repeats the
interrupted one's rollouts, and one device, a mesh and either runtime sample the same ones; a
rollout still to be reused is saved whole.
"""

from __future__ import annotations

import math
import time

import torch

from torchtitan_xla import runtime
from torchtitan_xla.batch import Batch
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.generate import Generator, Sampling
from torchtitan_xla.grpo.data import encode_prompt, prompt_of
from torchtitan_xla.grpo.objective import advantages
from torchtitan_xla.grpo.rewards import Rewards
from torchtitan_xla.losses import IGNORE_INDEX

_BATCH_FIELDS = ("inputs", "labels", "advantages", "old_logps")


def completion_rows(prompts: list[list[int]], completions: list[list[int]], seq_len: int,
                    pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels) [rows, seq_len]: each prompt then its completion, right-padded; labels are
    the next tokens on the completion's tokens only (IGNORE_INDEX elsewhere)."""
    inputs = torch.full((len(prompts), seq_len), pad_id, dtype=torch.long)
    labels = torch.full_like(inputs, IGNORE_INDEX)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        full = list(prompt) + list(completion)
        inputs[row, :len(full) - 1] = torch.tensor(full[:-1])
        labels[row, len(prompt) - 1:len(full) - 1] = torch.tensor(full[len(prompt):])
    return inputs, labels


class Rollouts:
    """`Rollouts(...)` reads and checks the prompts and the rewards; `sample_from(model, loss_fn)`
    then gives it the policy to generate with; iterating gives Batches."""

    def __init__(self, job_config, *, records: list[dict], tokenizer, rewards: Rewards, rows: int,
                 data_rank: int, data_count: int, device, input_sharding):
        g, t = job_config.grpo, job_config.training
        self.job_config, self.cfg, self.seq_len, self.tokenizer = job_config, g, t.seq_len, tokenizer
        self.records, self.rewards, self.generator, self.old_policy = records, rewards, None, None
        self.prompts = [encode_prompt(r, tokenizer) for r in records]
        longest = max(range(len(records)), key=lambda i: len(self.prompts[i]))
        if len(self.prompts[longest]) > g.max_prompt_length:
            raise ConfigError(f"[grpo] max_prompt_length = {g.max_prompt_length}: prompt {longest} of "
                              f"{t.dataset_path or t.dataset} has {len(self.prompts[longest])} tokens; "
                              f"raise it or shorten the prompt")
        if rows % g.num_generations:
            raise ConfigError(f"[training] local_batch_size: the {rows} rows of each data rank's batch must "
                              f"hold whole groups of [grpo] num_generations = {g.num_generations}")
        self.per_rank = rows // g.num_generations  # prompts per rollout on this data rank
        self.data_rank, self.data_count = data_rank, data_count
        self.device, self.input_sharding = device, input_sharding
        self.seed = job_config.debug.seed or 0
        self._orders: dict[int, list[int]] = {}
        self.sampling = dict(temperature=g.temperature, top_k=g.top_k, top_p=g.top_p)
        self.index, self.uses_left, self.saved = 0, 0, None  # rollouts made; steps left on the last
        self.batch, self._metrics = None, {}

    def sample_from(self, model: torch.nn.Module, loss_fn=None) -> None:
        """Generate with `model` (the policy, its weights as they are at each rollout); with more
        than one update per rollout, record its log-probabilities (`loss_fn`'s) at the rollout."""
        from torchtitan_xla.datasets.chat import end_of_turn_ids, pad_id
        from torchtitan_xla.reference import scoring_step

        tok, g = self.tokenizer, self.cfg
        self.model = model
        self.generator = Generator(model, cache_size=self.seq_len,
                                   batch_size=self.per_rank * g.num_generations, device=self.device,
                                   eos_ids=[tok.eos_id, *end_of_turn_ids(tok)],
                                   pad_id=pad_id(tok), bucket=g.max_prompt_length,
                                   step_compiler=self.job_config.compile.step, decode_text=tok.decode,
                                   first_row=self.data_rank * self.per_rank * g.num_generations)
        if g.num_iterations > 1 and loss_fn is not None:
            import contextlib

            self.old_policy = scoring_step(model, loss_fn, contextlib.nullcontext, self.job_config)

    def __iter__(self) -> Rollouts:
        return self

    def __next__(self) -> Batch:
        if self.uses_left == 0:
            self.batch, self.saved = self._rollout(), None
            self.index, self.uses_left = self.index + 1, self.cfg.num_iterations
        self.uses_left -= 1
        return self.batch

    def metrics(self) -> dict[str, float]:
        """The last rollout's figures, as TRL names them."""
        return dict(self._metrics)

    def _prompt_order(self, rollout: int) -> list[int]:
        """The indices of the prompts this rank takes in `rollout`."""
        per_step = self.per_rank * self.data_count
        start = rollout * per_step + self.data_rank * self.per_rank
        out = []
        for k in range(start, start + self.per_rank):
            epoch, i = divmod(k, len(self.records))
            if epoch not in self._orders:
                rng = torch.Generator().manual_seed(self.seed + epoch)
                self._orders = {epoch: torch.randperm(len(self.records), generator=rng).tolist()}
            out.append(self._orders[epoch][i])
        return out

    def _sample(self, chosen: list[int], seed: int):
        """Completions of the prompts `chosen` (indices) drawn with `seed`, scored: (completions,
        their trained tokens, [completion, function] rewards, weighted sums)."""
        g = self.cfg
        self.model.eval()  # no dropout (LoRA's) in the sampling policy
        try:
            completions = self.generator([self.prompts[i] for i in chosen], g.max_completion_length,
                                         Sampling(**self.sampling, seed=seed), g.stop)
        finally:
            self.model.train()
        texts, ids = zip(*(self._cut(c) for c in completions))
        records = [self.records[i] for i in chosen]
        columns = {k: [r.get(k) for r in records] for k in records[0] if k not in ("prompt", "messages")}
        per_function, totals = self.rewards([prompt_of(r) for r in records], list(texts),
                                            [list(x) for x in ids], columns)
        return completions, [list(x) for x in ids], per_function, totals

    def _rollout(self) -> Batch:
        g = self.cfg
        t0 = time.perf_counter()
        chosen = [i for i in self._prompt_order(self.index) for _ in range(g.num_generations)]
        completions, ids, per_function, totals = self._sample(chosen, g.seed + self.index)
        generated = time.perf_counter() - t0  # with the rewards: they wait for the tokens anyway
        rewards = torch.tensor(totals, dtype=torch.float32)
        adv = advantages(rewards, g.num_generations, g.scale_rewards)
        inputs, labels = completion_rows([self.prompts[i] for i in chosen], ids, self.seq_len,
                                         self.generator.pad_id)
        self._metrics = self._figures(rewards, per_function, adv, [len(x) for x in ids], completions,
                                      generated, time.perf_counter() - t0)
        return self._to_device({"inputs": inputs, "labels": labels, "advantages": adv})

    def evaluate(self) -> dict[str, float]:
        """Every prompt's `num_generations` completions, sampled with [grpo] seed (the same draws at
        each call): the mean reward, each function's, and the mean completion length."""
        g = self.cfg
        _, ids, per_function, totals = self._sample(
            [i for i in range(len(self.records)) for _ in range(g.num_generations)], g.seed)
        out = {"reward": sum(totals) / len(totals),
               "completions/mean_length": sum(len(x) for x in ids) / len(ids)}
        for k, name in enumerate(self.rewards.labels):
            values = [r[k] for r in per_function if not math.isnan(r[k])]
            out[f"rewards/{name}/mean"] = sum(values) / len(values) if values else math.nan
        return out

    def _cut(self, completion) -> tuple[str, list[int]]:
        """The completion's text for the rewards (before its earliest stop string) and the tokens
        trained on: those that hold the stop string, else through the EOS that ended it. (A row
        that met a stop string decodes on until every row has stopped: its later tokens go.)"""
        tokens = list(completion.tokens)
        text = self.tokenizer.decode(tokens)
        found = [text.index(stop) for stop in self.cfg.stop if stop in text]
        if found:
            cut = min(found)
            stop = next(s for s in self.cfg.stop if s in text and text.index(s) == cut)
            end = next(k for k in range(1, len(tokens) + 1)
                       if stop in self.tokenizer.decode(tokens[:k]))
            return text[:cut], tokens[:end]
        if completion.eos is not None:
            return text, tokens + [completion.eos]
        return text, tokens

    def _to_device(self, host: dict[str, torch.Tensor]) -> Batch:
        names = list(host)
        on_device = runtime.to_device([host[n] for n in names], self.device, self.input_sharding)
        batch = Batch(**dict(zip(names, on_device)))
        if self.old_policy is not None:  # its own graph, before any update on this rollout
            batch = batch.replace(old_logps=self.old_policy(batch))
        return batch

    def _figures(self, rewards, per_function, adv, lengths, completions, generated,
                 seconds) -> dict[str, float]:
        groups = rewards.view(-1, self.cfg.num_generations)
        out = {"reward": rewards.mean().item(), "reward_std": groups.std(-1).mean().item(),
               "frac_reward_zero_std": (groups.std(-1) == 0).float().mean().item(),
               "advantage_std": adv.std().item() if adv.numel() > 1 else 0.0}
        for k, name in enumerate(self.rewards.labels):
            values = torch.tensor([r[k] for r in per_function])
            values = values[~values.isnan()]
            out[f"rewards/{name}/mean"] = values.mean().item() if values.numel() else math.nan
            out[f"rewards/{name}/std"] = values.std().item() if values.numel() > 1 else 0.0
        n = torch.tensor(lengths, dtype=torch.float32)
        clipped = sum(c.finish == "length" for c in completions) / len(completions)
        out |= {"completions/mean_length": n.mean().item(), "completions/max_length": n.max().item(),
                "completions/min_length": n.min().item(), "completions/clipped_ratio": clipped,
                "rollout/seconds": seconds, "rollout/generation_seconds": generated,
                "rollout/tokens_per_second": n.sum().item() / generated if generated else 0.0}
        return out

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        state = {"rollouts": self.index, "uses_left": self.uses_left, "metrics": self._metrics}
        if self.uses_left:  # the rollout the next steps reuse, whole: new weights would not repeat it
            rows = self.per_rank * self.cfg.num_generations
            state["batch"] = {}
            for name in _BATCH_FIELDS:
                if getattr(self.batch, name) is not None:
                    t = runtime.to_host([getattr(self.batch, name)])[0]
                    # This rank's rows (a native DTensor comes to the host whole: every rank's).
                    state["batch"][name] = t.narrow(0, self.data_rank * rows, rows) if len(t) > rows else t
        return state

    def load_state_dict(self, state: dict) -> None:
        self.index, self.uses_left, self._metrics = state["rollouts"], state["uses_left"], state["metrics"]
        if self.uses_left:
            host = state["batch"]
            on_device = runtime.to_device(list(host.values()), self.device, self.input_sharding)
            self.batch = Batch(**dict(zip(host, on_device)))

    @property
    def reshardable(self) -> bool:
        return self.uses_left == 0

    def close(self) -> None:
        pass
