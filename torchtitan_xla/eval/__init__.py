"""Zero-shot evaluation (`[eval]`): tasks from local files (tasks.py) scored by the model's
log-likelihoods (scorer.py), from `python -m torchtitan_xla.eval` on a checkpoint or HF folder,
or by train.py after its last step (`at_end`). docs/evaluation.md."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from torchtitan_xla import storage
from torchtitan_xla.config import JobConfig
from torchtitan_xla.errors import ConfigError
from torchtitan_xla.eval.scorer import Scorer, pair_tokens, rolling_windows
from torchtitan_xla.eval.tasks import (
    GENERATIVE,
    Task,
    contexts,
    fewshot_docs,
    fewshot_for_each,
    metrics,
    parse_task,
    requests,
)
from torchtitan_xla.logging import logger

__all__ = ["Task", "evaluate", "parse_task", "write_results"]


def evaluate(model: torch.nn.Module, tokenizer, job_config: JobConfig, tasks: list[Task], *,
             dp_degree: int, device, sharding, progress: bool = True,
             eos_ids: list[int] | None = None) -> dict:
    """{"results": {task: {metric: value}}, "samples": {task: [[log-likelihood, greedy], ...]}}
    (generate_until: {task: [completion, ...]}; `eos_ids`: what ends a completion besides the
    tokenizer's EOS, as an HF folder's generation config says)."""
    e, seq_len = job_config.eval, job_config.training.seq_len
    if e.batch_size % dp_degree:
        raise ConfigError(f"[eval] batch_size = {e.batch_size}: must be a multiple of the "
                          f"data-parallel degree ({dp_degree})")
    scorer = Scorer(model, seq_len=seq_len, batch_size=e.batch_size, device=device, sharding=sharding,
                    step_compiler=job_config.compile.step, progress=progress)
    out = {"results": {}, "samples": {}}
    for task in tasks:
        if task.kind in GENERATIVE:
            completions = generate_until(model, tokenizer, job_config, task, device=device,
                                         eos_ids=eos_ids or [])
            out["results"][task.name] = metrics(task, completions)
            out["samples"][task.name] = completions
            continue
        if task.kind == "perplexity":
            documents = [tokenizer.encode(text, bos=False, eos=False) for _, text in requests(task)]
            windows = [rolling_windows(tokens, tokenizer.prefix_id, seq_len) for tokens in documents]
            scored = iter(scorer([w for doc in windows for w in doc], desc=task.name))
            results = []
            for tokens, doc in zip(documents, windows):
                parts = [next(scored) for _ in doc]
                results.append((sum(p[0] for p in parts), all(p[1] for p in parts), len(tokens)))
        else:
            pairs = [pair_tokens(tokenizer, c, x) for c, x in requests(task)]
            results = [(ll, greedy, n) for (ll, greedy), (_, n) in zip(scorer(pairs, desc=task.name), pairs)]
        out["results"][task.name] = metrics(task, results)
        out["samples"][task.name] = [[ll, greedy] for ll, greedy, _ in results]
    return out


def generate_until(model, tokenizer, job_config: JobConfig, task: Task, *, device,
                   eos_ids: list[int]) -> list[str]:
    """Each question's greedy completion, cut before the first stop string, as lm-eval's HF model
    makes it: the context encoded with BOS and left-truncated to seq_len - max_gen_toks tokens
    (here rounded down to the generator's 16-token buckets), EOS ends a completion."""
    from torchtitan_xla.datasets.chat import pad_id
    from torchtitan_xla.generate import Generator

    e, seq_len = job_config.eval, job_config.training.seq_len
    room = (seq_len - e.max_gen_toks) // 16 * 16
    shots = fewshot_for_each(e, task, fewshot_docs(e, seq_len))
    encoded = [tokenizer.encode(c, bos=True, eos=False) for c in contexts(task, shots)]
    if any(len(p) > room for p in encoded):
        logger.warning(f"{task.name}: {sum(len(p) > room for p in encoded)} prompt(s) longer than "
                       f"{room} tokens (seq_len - max_gen_toks, in 16s) lose their left end")
    prompts = [p[-room:] for p in encoded]
    generator = Generator(model, cache_size=seq_len, batch_size=e.batch_size, device=device,
                          eos_ids=sorted({tokenizer.eos_id, *eos_ids}), pad_id=pad_id(tokenizer),
                          step_compiler=job_config.compile.step, decode_text=tokenizer.decode)
    # The text without special tokens, as lm-eval decodes it (skip_special_tokens=True).
    special = {tokenizer.bos_id, tokenizer.eos_id,
               *(getattr(tokenizer, "special_tokens", None) or {}).values()}
    completions = []
    for completion in generator(prompts, e.max_gen_toks, stop=e.until):
        text = tokenizer.decode([t for t in completion.tokens if t not in special])
        for stop in e.until:
            text = text.split(stop)[0]
        completions.append(text)
    logger.info(f"{task.name}: {len(prompts)} completions, {generator.stats.summary()}")
    return completions


def write_results(out: dict, path: str | Path) -> None:
    """The table on the console, everything in `path` (JSON)."""
    rows = [(task, name, value) for task, ms in out["results"].items() for name, value in ms.items()]
    width = max(len(t) for t, _, _ in rows)
    lines = [f"{'task':<{width}}  {'metric':<16} value"]
    lines += [f"{t:<{width}}  {n:<16} {v:.4f}" for t, n, v in rows]
    logger.info("Evaluation:\n" + "\n".join(lines))
    storage.makedirs(os.path.dirname(str(path)))
    storage.write_text(str(path), json.dumps(out, indent=1))
    logger.info(f"Evaluation results written to {path}")
