"""Zero-shot tasks from local files, scored by log-likelihood as lm-evaluation-harness scores them
(docs/evaluation.md): what each kind reads, the requests it makes, and its metrics.

A request is (context, continuation) text; the scorer returns the continuation's summed
log-probability and whether greedy decoding would have produced it. `perplexity` requests the
whole document's log-likelihood (lm-eval's loglikelihood_rolling) instead.

- `perplexity`: JSON lines {"text": ...} or a .txt file (documents separated by blank lines):
  token, word and byte perplexity and bits per byte (lm-eval's wikitext metrics).
- `lambada`: JSON lines {"text": ...}; the context is all but the last word, the continuation
  " " + the last word: accuracy (greedy) and perplexity (lm-eval's lambada_openai).
- `multiple_choice`: JSON lines {"context": ..., "choices": [...], "label": i}; each continuation
  is " " + choice: acc (highest summed log-likelihood) and acc_norm (divided by the choice's
  length in characters), as lm-eval's multiple_choice tasks (BoolQ, HellaSwag, PIQA).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from torchtitan_xla.errors import ConfigError

KINDS = ("perplexity", "lambada", "multiple_choice")


@dataclass
class Task:
    kind: str
    path: Path
    docs: list[dict]

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.path.name}"


def parse_task(spec: str) -> Task:
    """`kind:path` -> the Task with its documents read and checked (a bad line names file:line)."""
    kind, sep, path = spec.partition(":")
    if not sep or kind not in KINDS:
        raise ConfigError(f"[eval] tasks: {spec!r}: expected kind:path with kind one of {', '.join(KINDS)}")
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"[eval] tasks: {spec!r}: no such file {file}")
    if kind == "perplexity" and file.suffix == ".txt":
        text = file.read_text(encoding="utf-8")
        return Task(kind, file, [{"text": d.strip()} for d in re.split(r"\n\s*\n", text) if d.strip()])
    docs = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                docs.append(_check(kind, line, f"{file}:{number}"))
    if not docs:
        raise ConfigError(f"[eval] tasks: {file}: no documents")
    return Task(kind, file, docs)


def _check(kind: str, line: str, where: str) -> dict:
    try:
        doc = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not a JSON object ({e.msg})") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"{where}: not a JSON object")
    if kind in ("perplexity", "lambada"):
        if not isinstance(doc.get("text"), str) or not doc["text"].strip():
            raise ConfigError(f"{where}: expected a non-empty string \"text\"")
        if kind == "lambada" and " " not in doc["text"].strip():
            raise ConfigError(f"{where}: \"text\" needs a context and a last word")
        return doc
    choices, label = doc.get("choices"), doc.get("label")
    if not isinstance(doc.get("context"), str):
        raise ConfigError(f"{where}: expected a string \"context\"")
    if not (isinstance(choices, list) and len(choices) >= 2
            and all(isinstance(c, str) and c for c in choices)):
        raise ConfigError(f"{where}: expected \"choices\": a list of at least 2 non-empty strings")
    if not (isinstance(label, int) and 0 <= label < len(choices)):
        raise ConfigError(f"{where}: expected \"label\": the index of the right choice "
                          f"(0..{len(choices) - 1})")
    return doc


def requests(task: Task) -> list[tuple[str, str]]:
    """The (context, continuation) pairs to score, in order; perplexity: ("", document)."""
    if task.kind == "perplexity":
        return [("", d["text"]) for d in task.docs]
    if task.kind == "lambada":
        split = (d["text"].strip().rsplit(" ", 1) for d in task.docs)
        return [(context, " " + word) for context, word in split]
    return [(d["context"], " " + choice) for d in task.docs for choice in d["choices"]]


def metrics(task: Task, results: list[tuple[float, bool, int]]) -> dict[str, float]:
    """Aggregate (log-likelihood, greedy, tokens) per request into the task's metrics."""
    if task.kind == "perplexity":
        ll = sum(r[0] for r in results)
        tokens = sum(r[2] for r in results)
        words = sum(len(re.split(r"\s+", d["text"])) for d in task.docs)
        nbytes = sum(len(d["text"].encode("utf-8")) for d in task.docs)
        return {"token_perplexity": math.exp(-ll / tokens), "word_perplexity": math.exp(-ll / words),
                "byte_perplexity": math.exp(-ll / nbytes), "bits_per_byte": -ll / nbytes / math.log(2)}
    if task.kind == "lambada":
        return {"acc": sum(r[1] for r in results) / len(results),
                "perplexity": math.exp(-sum(r[0] for r in results) / len(results))}
    acc = acc_norm = 0
    i = 0
    for d in task.docs:
        lls = [r[0] for r in results[i:i + len(d["choices"])]]
        i += len(d["choices"])
        norm = [ll / len(c) for ll, c in zip(lls, d["choices"])]
        acc += _argmax(lls) == d["label"]
        acc_norm += _argmax(norm) == d["label"]
    return {"acc": acc / len(task.docs), "acc_norm": acc_norm / len(task.docs)}


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # first of ties, as numpy
