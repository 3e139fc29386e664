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
- `generate_until`: JSON lines {"question": ..., "answer": ...} (GSM8K's fields). Each question
  is asked as lm-eval's gsm8k task asks it: `[eval] num_fewshot` solved examples (from
  `fewshot_path`, drawn as lm-eval's `fewshot_sampler` draws them) then
  "Question: {question}\nAnswer:", answered by greedy generation until a
  stop string (`[eval] until`) or EOS; the answer is the first number after "#### " ("[invalid]"
  when there is none) and its exact_match is GSM8K's strict-match (",", "$", a trailing "." and
  all up to "#### " ignored, case ignored).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from pathlib import Path

from torchtitan_xla.errors import ConfigError

KINDS = ("perplexity", "lambada", "multiple_choice", "generate_until")
GENERATIVE = ("generate_until",)
# GSM8K's strict-match: the answer's regex, and what exact_match ignores in both strings.
ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
IGNORED = (",", "\\$", "(?s).*#### ", "\\.$")
INVALID = "[invalid]"


@dataclass
class Task:
    kind: str
    path: Path
    docs: list[dict]

    @property
    def name(self) -> str:
        return f"{self.kind}:{self.path.name}"


def read_docs(kind: str, file: Path) -> list[dict]:
    """The checked JSON-lines documents of a task file (or a few-shot file of its kind)."""
    docs = []
    with file.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                docs.append(_check(kind, line, f"{file}:{number}"))
    if not docs:
        raise ConfigError(f"[eval] tasks: {file}: no documents")
    return docs


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
    return Task(kind, file, read_docs(kind, file))


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
    if kind == "generate_until":
        for key in ("question", "answer"):
            if not isinstance(doc.get(key), str):
                raise ConfigError(f"{where}: expected a string \"{key}\"")
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


def fewshot_docs(e, seq_len: int) -> list[dict]:
    """generate_until's solved examples (`e`: [eval]), checked: all of fewshot_path, at least
    num_fewshot of them, and room for a question beside max_gen_toks in seq_len."""
    if e.max_gen_toks + 16 > seq_len:
        raise ConfigError(f"[eval] max_gen_toks = {e.max_gen_toks}: leaves no room for a question "
                          f"in [training] seq_len {seq_len} (at least 16 tokens)")
    if not e.num_fewshot:
        return []
    if not e.fewshot_path:
        raise ConfigError(f"[eval] num_fewshot = {e.num_fewshot} needs fewshot_path (JSON lines "
                          f"of solved examples)")
    file = Path(e.fewshot_path)
    if not file.is_file():
        raise ConfigError(f"[eval] fewshot_path: no such file {file}")
    docs = read_docs("generate_until", file)
    if len(docs) < e.num_fewshot:
        raise ConfigError(f"[eval] num_fewshot = {e.num_fewshot}: {file} has {len(docs)} examples")
    return docs


def fewshot_for_each(e, task: Task, pool: list[dict]) -> list[list[dict]]:
    """Each question's solved examples, as lm-eval 0.4's samplers draw them from `pool`
    (`fewshot_docs`): first_n, its first num_fewshot; default, `random.Random(fewshot_seed)
    .sample(pool, num_fewshot)` for each question in turn, one generator for the task. Where the
    pool is the task's own file (lm-eval: fewshot split = test split) it draws one more and drops
    the question itself. Python's own `random`, as lm-eval's: the same seed draws the same examples."""
    n = e.num_fewshot
    if not n or e.fewshot_sampler == "first_n":
        return [pool[:n]] * len(task.docs)
    rnd = random.Random(e.fewshot_seed)
    if Path(e.fewshot_path).resolve() != task.path.resolve():
        return [rnd.sample(pool, n) for _ in task.docs]
    if len(pool) <= n:
        raise ConfigError(f"[eval] num_fewshot = {n}: fewshot_path is the task's own file, of {len(pool)} "
                          f"questions; each question's examples are drawn from the others")
    out = []
    for doc in task.docs:
        shots = [x for x in rnd.sample(pool, n + 1) if x != doc][:n]
        out.append(shots if len(shots) == n else rnd.sample([x for x in pool if x != doc], n))
    return out


def contexts(task: Task, fewshot: list[list[dict]]) -> list[str]:
    """generate_until: each question's prompt, after its solved examples (`fewshot_for_each`;
    lm-eval's gsm8k: doc_to_text, target delimiter " ", few-shot delimiter "\\n\\n")."""
    return ["".join(f"Question: {s['question']}\nAnswer: {s['answer']}\n\n" for s in shots)
            + f"Question: {d['question']}\nAnswer:" for d, shots in zip(task.docs, fewshot, strict=True)]


def extract_answer(completion: str) -> str:
    """lm-eval's regex filter then take_first: the first match's group, stripped."""
    found = ANSWER.findall(completion)
    return found[0].strip() if found else INVALID


def exact_match(prediction: str, reference: str) -> bool:
    def normalise(text: str) -> str:
        for pattern in IGNORED:
            text = re.sub(pattern, "", text)
        return text.lower()

    return normalise(prediction) == normalise(reference)


def metrics(task: Task, results: list) -> dict[str, float]:
    """Aggregate (log-likelihood, greedy, tokens) per request into the task's metrics."""
    if task.kind == "perplexity":
        ll = sum(r[0] for r in results)
        tokens = sum(r[2] for r in results)
        words = sum(len(re.split(r"\s+", d["text"])) for d in task.docs)
        nbytes = sum(len(d["text"].encode("utf-8")) for d in task.docs)
        return {"token_perplexity": math.exp(-ll / tokens), "word_perplexity": math.exp(-ll / words),
                "byte_perplexity": math.exp(-ll / nbytes), "bits_per_byte": -ll / nbytes / math.log(2)}
    if task.kind == "generate_until":  # results: the completions
        hits = [exact_match(extract_answer(c), d["answer"]) for c, d in zip(results, task.docs)]
        return {"exact_match": sum(hits) / len(hits)}
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
