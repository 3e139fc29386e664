"""Zero-shot evaluation (`python -m torchtitan_xla.eval`) against lm-evaluation-harness on the same
exported model and the same local files: identical choices, equal log-likelihoods. The model is
the checkpoint tests' shared run (conftest.py's `straight`), exported to HF at step 6."""

import json
import re
import subprocess
import sys
import textwrap

import pytest
from helpers import REPO, _env, tiny_args

SENTENCES = [
    "The interpreter reads the source file and compiles it to bytecode",
    "A list comprehension builds a new list from an iterable in one expression",
    "Exceptions propagate up the call stack until a handler catches them",
    "The garbage collector frees objects that are no longer referenced",
    "Keyword arguments make a call easier to read than positional ones",
]
MULTIPLE_CHOICE = [
    {"context": "Question: which keyword defines a function in Python?\nAnswer:",
     "choices": ["def", "function", "lambda expression"], "label": 0},
    {"context": "Question: what does len() return for an empty list?\nAnswer:",
     "choices": ["zero", "None", "an error"], "label": 0},
    {"context": "A dictionary maps keys to", "choices": ["values", "lists of modules", "bytes"], "label": 0},
    {"context": "Strings in Python are", "choices": ["immutable", "mutable arrays of characters"], "label": 1},
]
# Context shapes where BPE merges across the context's end once its trailing whitespace moves to the
# continuation (":\n" and ".\n" are one token here): lm-eval scores the context's own encoding.
SHAPED_CHOICE = [
    {"context": "Question: which keyword defines a function?\nAnswer:\n", "choices": ["def", "class", "lambda"], "label": 0},
    {"context": "Question: is a tuple mutable?\n", "choices": ["no", "yes"], "label": 0},
    {"context": "A module is a file of Python code.\n", "choices": ["Packages hold modules", ".py files", "(a) bytes"], "label": 0},
    {"context": "The statement that leaves a loop early is ", "choices": ["break", "continue", "pass"], "label": 0},
    {"context": "", "choices": ["def", ", then", "\nAnswer:"], "label": 0},
    {"context": "Note:", "choices": ["\nno", "... and so on", ": yes"], "label": 0},
    # longer than seq_len (64) tokens: the left end is cut, as lm-eval cuts it
    {"context": ". ".join(SENTENCES) + ".\nAnswer:\n", "choices": ["yes", "no"], "label": 0},
]
SHAPED_LAMBADA = ["Question: what ends an indented block?\n dedent",
                  "The statement that defines a function:\n def", "Files of Python code are modules.\n Packages"]
SHAPED_DOCUMENTS = ["\n" + SENTENCES[1], ":\nAnswer:\n def", "?\n" + ". ".join(SENTENCES * 2)]
LL_TOLERANCE = {"rel": 1e-4, "abs": 1e-4}  # float32 on XLA against float32 in torch (docs/evaluation.md)


def _lines(docs):
    return "".join(json.dumps(d) + "\n" for d in docs)


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tasks")
    files = {"multiple_choice": folder / "mc.jsonl", "lambada": folder / "lambada.jsonl",
             "perplexity": folder / "ppl.jsonl"}
    files["multiple_choice"].write_text(_lines(MULTIPLE_CHOICE + SHAPED_CHOICE))
    files["lambada"].write_text(_lines({"text": s} for s in SENTENCES + SHAPED_LAMBADA))
    # The second document is longer than seq_len (64) tokens: it is scored in several windows.
    files["perplexity"].write_text(_lines([{"text": SENTENCES[0]}, {"text": ". ".join(SENTENCES * 3)}]
                                          + [{"text": d} for d in SHAPED_DOCUMENTS]))
    return files


def _ours(tmp_path, devices: int, checkpoint, task_files, *extra):
    tasks = ",".join(f"{kind}:{path}" for kind, path in task_files.items())
    args = [*tiny_args(tmp_path), "--eval.checkpoint", str(checkpoint), "--eval.tasks", tasks,
            "--eval.batch_size", "4", *extra]
    p = subprocess.run([sys.executable, "-m", "torchtitan_xla.eval", *args], capture_output=True,
                       text=True, env=_env(devices, None), cwd=REPO, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads((tmp_path / "eval_results.json").read_text()), p.stderr


_LM_EVAL = """
import json, sys
import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

hf_dir, include = sys.argv[1:3]
manager = TaskManager(include_path=include)
out = {"arguments": {}}
for tasks, bos in ((["tx_mc", "tx_lambada"], None), (["tx_ppl"], False)):
    lm = HFLM(pretrained=hf_dir, dtype="float32", max_length=64, batch_size=4, device="cpu",
              add_bos_token=bos)
    res = lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=manager, num_fewshot=0,
                                  log_samples=True)
    for task in tasks:
        samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
        out[task] = [res["results"][task], [s["filtered_resps"] for s in samples]]
        out["arguments"][task] = [a for s in samples for a in s["arguments"]]
print("LM_EVAL " + json.dumps(out, default=float))
"""


def _lm_eval(hf_dir, task_files, tmp_path):
    """lm-eval's HF model on the exported folder, float32, max_length 64 as our seq_len; the pairs
    with the tokenizer's BOS (its default), the rolling perplexity without (add_bos_token=False:
    lm-eval's rolling windows prefix BOS themselves). In its own process: lm-eval's imports
    (scipy, pandas, accelerate, ...) left the test process crashing in later in-process XLA tests."""
    pytest.importorskip("lm_eval")
    source = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {path}\ntest_split: test\n"
    yamls = {
        "tx_mc": source.format(path=task_files["multiple_choice"]) + textwrap.dedent("""\
            output_type: multiple_choice
            doc_to_text: "{{context}}"
            doc_to_choice: choices
            doc_to_target: label
            metric_list: [{metric: acc}, {metric: acc_norm}]
            """),
        "tx_lambada": source.format(path=task_files["lambada"]) + textwrap.dedent("""\
            output_type: loglikelihood
            doc_to_text: "{{text.split(' ')[:-1]|join(' ')}}"
            doc_to_target: "{{' '+text.split(' ')[-1]}}"
            target_delimiter: ""
            metric_list:
              - {metric: perplexity, aggregation: perplexity, higher_is_better: false}
              - {metric: acc, aggregation: mean, higher_is_better: true}
            """),
        "tx_ppl": source.format(path=task_files["perplexity"]) + textwrap.dedent("""\
            output_type: loglikelihood_rolling
            doc_to_text: ""
            doc_to_target: "{{text}}"
            metric_list: [{metric: word_perplexity}, {metric: byte_perplexity}, {metric: bits_per_byte}]
            """),
    }
    for name, body in yamls.items():
        (tmp_path / f"{name}.yaml").write_text(f"task: {name}\n{body}")
    p = subprocess.run([sys.executable, "-c", _LM_EVAL, str(hf_dir), str(tmp_path)], capture_output=True,
                       text=True, timeout=600, env=_env(1, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}))
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("LM_EVAL "))[8:])


_LM_EVAL_TOKENS = """
import json, sys
from types import SimpleNamespace
from lm_eval.api.model import LM
from lm_eval.models.huggingface import HFLM
from transformers import AutoTokenizer

hf_dir, max_length, pairs, documents = sys.argv[1], int(sys.argv[2]), *map(json.loads, sys.argv[3:5])
lm = HFLM.__new__(HFLM)  # lm-eval's own loglikelihood(_rolling) and tok_encode, without a model
LM.__init__(lm)
lm.tokenizer = AutoTokenizer.from_pretrained(hf_dir)
lm.add_bos_token, lm.custom_prefix_token_id, lm.enable_thinking = None, None, False
lm._max_length, lm.batch_size_per_gpu = max_length, 1
seen = []
lm._loglikelihood_tokens = lambda requests, **kw: seen.extend(requests) or [(0.0, False)] * len(requests)
lm.loglikelihood([SimpleNamespace(args=tuple(p)) for p in pairs], disable_tqdm=True)
out = {"pairs": [[c, x] for _, c, x in seen], "windows": []}
lm.add_bos_token = False  # as the perplexity comparison runs it
for text in documents:
    seen.clear()
    lm.loglikelihood_rolling([SimpleNamespace(args=(text,))], disable_tqdm=True)
    out["windows"].append([[c, x] for _, c, x in seen])
print("TOKENS " + json.dumps(out))
"""


def test_pair_tokens_and_rolling_windows_equal_lm_evals_tokens(tmp_path):
    """lm-eval's own encoding code (HFLM.loglikelihood / loglikelihood_rolling up to the model) on
    the exported tokenizer: our token sequences and scored counts are its context + continuation
    tokens, exactly, on the shapes of issue 35 (no model: a tokenizer-only check)."""
    pytest.importorskip("lm_eval")
    from types import SimpleNamespace

    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.eval.scorer import Scorer, pair_tokens, rolling_windows

    tokenizer = build_tokenizer("")
    tokenizer.save_pretrained(tmp_path)
    pairs = [(c, " " + x) for d in MULTIPLE_CHOICE + SHAPED_CHOICE for c in [d["context"]] for x in d["choices"]]
    pairs += [("Answer:\n", "yes"), ("Answer:", "\n yes"), ("Answer:", ":\n yes"), ("Is it?\n", "\nno"),
              ("x =", "\n ("), ("a.", ".py"), ("Options:\n \n", "no"), ("a b  ", "c"), ("  ", " yes"),
              ("", "\nAnswer:"), ("", ", then"), ("", "."), ("Result:", ", then")]
    documents = [SENTENCES[0], *SHAPED_DOCUMENTS, ".", "\n", "a b c d e f g h", ". ".join(SENTENCES)]
    max_length = 8  # short windows: several per document, contexts cut on the left
    p = subprocess.run([sys.executable, "-c", _LM_EVAL_TOKENS, str(tmp_path), str(max_length),
                        json.dumps(pairs), json.dumps(documents)], capture_output=True, text=True, timeout=300,
                       env=_env(1, {"HF_HUB_OFFLINE": "1"}))
    assert p.returncode == 0, p.stderr[-3000:]
    theirs = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("TOKENS "))[7:])
    cut = SimpleNamespace(seq_len=max_length)  # Scorer._truncate's one attribute
    for (context, continuation), (context_enc, continuation_enc) in zip(pairs, theirs["pairs"], strict=True):
        tokens, n = pair_tokens(tokenizer, context, continuation)
        assert (tokens, n) == (context_enc + continuation_enc, len(continuation_enc)), (context, continuation)
        # lm-eval's _loglikelihood_tokens: (context_enc + continuation_enc)[-(max_length + 1):]
        assert Scorer._truncate(cut, tokens, n) == (tokens[-(max_length + 1):], n)
    with pytest.raises(ValueError, match="no tokens of its own"):  # lm-eval asserts on it
        pair_tokens(tokenizer, "Answer:", "")
    for text, windows in zip(documents, theirs["windows"], strict=True):
        ours = rolling_windows(tokenizer.encode(text, bos=False, eos=False), tokenizer.bos_id, max_length)
        assert ours == [(c + x, len(x)) for c, x in windows], text


@pytest.fixture(scope="module")
def both(straight, task_files, tmp_path_factory):
    folder, _, _ = straight
    hf_dir = folder / "checkpoint" / "step-6-hf"
    ours, log = _ours(tmp_path_factory.mktemp("ours"), 1, hf_dir, task_files)
    reference = _lm_eval(hf_dir, task_files, tmp_path_factory.mktemp("lm_eval"))
    return ours, log, reference


def test_multiple_choice_and_lambada_equal_lm_eval(both):
    ours, _, reference = both
    mc_metrics, mc_samples = reference["tx_mc"]
    ours_mc = ours["samples"]["multiple_choice:mc.jsonl"]
    reference_lls = [float(ll) for doc in mc_samples for ll, _ in doc]
    assert len(ours_mc) == len(reference_lls) == sum(len(d["choices"]) for d in MULTIPLE_CHOICE + SHAPED_CHOICE)
    for (ll, _), want in zip(ours_mc, reference_lls):  # float32 on XLA against float32 in torch
        assert ll == pytest.approx(want, rel=1e-4, abs=1e-4)
    for metric in ("acc", "acc_norm"):  # identical choices
        assert ours["results"]["multiple_choice:mc.jsonl"][metric] == mc_metrics[f"{metric},none"]
    lambada_metrics, lambada_samples = reference["tx_lambada"]
    ours_lambada = ours["samples"]["lambada:lambada.jsonl"]
    for (ll, greedy), (want,) in zip(ours_lambada, lambada_samples, strict=True):
        assert ll == pytest.approx(float(want[0]), rel=1e-4, abs=1e-4)
        assert greedy == bool(want[1])
    results = ours["results"]["lambada:lambada.jsonl"]
    assert results["acc"] == lambada_metrics["acc,none"]
    assert results["perplexity"] == pytest.approx(lambada_metrics["perplexity,none"], rel=1e-4)


def test_rolling_perplexity_equals_lm_eval(both):
    ours, _, reference = both
    ppl_metrics, ppl_samples = reference["tx_ppl"]
    ours_ppl = ours["samples"]["perplexity:ppl.jsonl"]
    for (ll, _), want in zip(ours_ppl, ppl_samples, strict=True):
        assert ll == pytest.approx(float(want[0]), rel=1e-4)
    results = ours["results"]["perplexity:ppl.jsonl"]
    for metric in ("word_perplexity", "byte_perplexity", "bits_per_byte"):
        assert results[metric] == pytest.approx(ppl_metrics[f"{metric},none"], rel=1e-4), metric


def test_context_shapes_equal_lm_eval_per_request(both, task_files):
    """Contexts ending in "\\n", ":\\n", "?\\n", ".\\n", a space or empty, continuations starting with
    punctuation or a newline (issue 35): lm-eval's requests, and per request its log-likelihoods
    (LL_TOLERANCE) and greedy flags; some requests' contexts must not encode to a prefix of the whole."""
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.eval import parse_task
    from torchtitan_xla.eval.tasks import requests

    ours, _, reference = both
    tokenizer = build_tokenizer("")
    for kind, task in (("multiple_choice", "tx_mc"), ("lambada", "tx_lambada"), ("perplexity", "tx_ppl")):
        asked = requests(parse_task(f"{kind}:{task_files[kind]}"))
        if kind == "perplexity":
            assert [(text,) for _, text in asked] == [tuple(a) for a in reference["arguments"][task]]
            continue
        assert asked == [tuple(a) for a in reference["arguments"][task]]  # the same requests
        merged = 0
        for context, continuation in asked:
            own = tokenizer.encode(context.rstrip(), bos=True, eos=False)
            merged += tokenizer.encode(context + continuation, bos=True, eos=False)[:len(own)] != own
        assert merged >= 2, kind  # the case of the issue is among them
        theirs = [r for doc in reference[task][1] for r in doc]
        for request, (ll, greedy), (want, want_greedy) in zip(asked, ours["samples"][f"{kind}:{task_files[kind].name}"],
                                                              theirs, strict=True):
            assert ll == pytest.approx(float(want), **LL_TOLERANCE), request
            assert greedy == bool(want_greedy), request


def test_console_table_and_the_checkpoint_on_fsdp4_tp2_give_the_same_scores(both, straight, task_files, tmp_path):
    ours, log, _ = both
    assert "multiple_choice:mc.jsonl" in log and "acc_norm" in log
    folder, _, _ = straight
    sharded, _ = _ours(tmp_path, 8, folder / "checkpoint" / "step-6", task_files,
                       "--parallelism.tensor_parallel_degree", "2")
    assert sharded["results"].keys() == ours["results"].keys()
    for task, samples in ours["samples"].items():
        for (ll, greedy), (ll8, greedy8) in zip(samples, sharded["samples"][task], strict=True):
            assert ll8 == pytest.approx(ll, rel=1e-5, abs=1e-5) and greedy8 == greedy, task


@pytest.mark.parametrize("content,message", [
    ('{"context": "a", "choices": ["x", "y"], "label": 0}\nnot json\n', r"mc.jsonl:2: not a JSON object"),
    ('{"context": "a", "choices": ["x", "y"], "label": 2}\n', r"mc.jsonl:1: expected \"label\""),
    ('{"context": "a", "choices": ["x"], "label": 0}\n', r"mc.jsonl:1: expected \"choices\""),
])
def test_malformed_task_line_is_one_line_with_file_and_line(tmp_path, content, message):
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.eval import parse_task

    (tmp_path / "mc.jsonl").write_text(content)
    with pytest.raises(ConfigError, match=message):
        parse_task(f"multiple_choice:{tmp_path / 'mc.jsonl'}")


@pytest.mark.parametrize("flags,message", [
    # Each names the flag that set the value (the eval's own entry point attributes its errors).
    (["--eval.tasks", "multiple_choice:/nonexistent/mc.jsonl"],
     r"error: command line: --eval.tasks: .*no such file /nonexistent/mc.jsonl$"),
    (["--eval.tasks", "trivia:x.jsonl"], r"error: command line: --eval.tasks: 'trivia:x.jsonl': expected kind:path"),
    (["--eval.checkpoint", "/nonexistent/step-9"],
     r"error: command line: --eval.checkpoint: /nonexistent/step-9: no such folder"),
    (["--eval.tasks", "generate_until:{gsm}", "--eval.num_fewshot", "2", "--eval.max_gen_toks", "16"],
     r"error: command line: --eval.num_fewshot = 2 needs fewshot_path"),
    (["--eval.tasks", "generate_until:{gsm}", "--eval.max_gen_toks", "60"],
     r"error: command line: --eval.max_gen_toks = 60: leaves no room for a question in \[training\] seq_len 64"),
    (["--eval.tasks", "generate_until:{lambada}"], r"error: .*lambada.jsonl:1: expected a string \"question\""),
    # (QUESTIONS: 5; each question draws its examples from the other 4)
    (["--eval.tasks", "generate_until:{gsm}", "--eval.num_fewshot", "5", "--eval.fewshot_path", "{gsm}",
      "--eval.max_gen_toks", "16"],
     r"error: command line: --eval.num_fewshot = 5: fewshot_path is the task's own file, of 5 questions"),
])
def test_bad_eval_input_is_one_line_exit_2(tmp_path, task_files, flags, message):
    (tmp_path / "gsm.jsonl").write_text(_lines(QUESTIONS))
    flags = [f.format(gsm=tmp_path / "gsm.jsonl", lambada=task_files["lambada"]) for f in flags]
    args = [*tiny_args(tmp_path), "--eval.tasks", f"lambada:{task_files['lambada']}",
            "--eval.checkpoint", str(tmp_path), *flags]
    p = subprocess.run([sys.executable, "-m", "torchtitan_xla.eval", *args], capture_output=True,
                       text=True, env=_env(1, None), cwd=REPO, timeout=300)
    assert p.returncode == 2, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and __import__("re").match(message, lines[0]), p.stderr[-2000:]


def _same_scores(at_end: dict, cli: dict) -> None:
    assert at_end["results"].keys() == cli["results"].keys()
    for task, samples in cli["samples"].items():
        for (ll, greedy), (ll_end, greedy_end) in zip(samples, at_end["samples"][task], strict=True):
            assert ll_end == pytest.approx(ll, rel=1e-6, abs=1e-6) and greedy_end == greedy, task


def test_evaluation_at_the_end_of_training_equals_the_cli_on_its_export(tmp_path, task_files):
    from checkpoint_helpers import TWO_BLOCKS
    from helpers import train_run

    tasks = ",".join(f"{kind}:{path}" for kind, path in task_files.items())
    train_run(tiny_args(tmp_path / "run", "--training.steps", "3", "--eval.at_end", "--eval.tasks", tasks,
                        "--eval.batch_size", "4", "--checkpoint.last_save_in_hf"), model_overrides=TWO_BLOCKS)
    at_end = json.loads((tmp_path / "run" / "eval_results.json").read_text())
    cli, _ = _ours(tmp_path / "cli", 1, tmp_path / "run" / "checkpoint" / "step-3-hf", task_files)
    _same_scores(at_end, cli)


def test_the_native_runtime_evaluates_at_the_end_as_the_cli_on_its_export(tmp_path, task_files):
    """[runtime] backend = "native" on two processes, tp=2: the logits are sharded over the
    vocabulary and every process builds the same batches of requests. Its scores after training
    equal python -m torchtitan_xla.eval's (the XLA runtime) on its HF export: 1e-7 measured."""
    from checkpoint_helpers import TWO_BLOCKS
    from native_helpers import EAGER, native

    tasks = ",".join(f"{kind}:{path}" for kind, path in task_files.items())
    run = native(tmp_path / "run", 2, *EAGER, "--training.steps", "3", "--parallelism.tensor_parallel_degree", "2",
                 "--eval.at_end", "--eval.tasks", tasks, "--eval.batch_size", "4", "--checkpoint.last_save_in_hf",
                 overrides=TWO_BLOCKS)
    at_end = json.loads((run["folder"] / "eval_results.json").read_text())
    cli, _ = _ours(tmp_path / "cli", 1, run["folder"] / "checkpoint" / "step-3-hf", task_files)
    _same_scores(at_end, cli)


# ---- generate_until ------------------------------------------------------------------------------

QUESTIONS = [
    {"question": "What is 2 plus 3?", "answer": "2 plus 3 is 5.\n#### 5"},
    {"question": "A list has 4 items and gets 2 more. How many items?", "answer": "4 + 2 = 6\n#### 6"},
    {"question": "How many bytes are in a kibibyte?", "answer": "#### 1,024"},
    {"question": "def f(): return 7\nWhat does f() return?", "answer": "It returns 7.\n#### 7"},
    {"question": "Name a loop keyword.", "answer": "for\n#### 0"},
]
SHOTS = [{"question": "Tom has 3 apples and eats 1. How many are left?", "answer": "3 - 1 = 2\n#### 2"},
         {"question": "What is 10 times 10?", "answer": "10 * 10 = 100\n#### 100"}]
# lm-eval's gsm8k (strict-match), on local files, with its first-n few-shot sampler.
GSM8K_YAML = """\
task: tx_gen
dataset_path: json
dataset_kwargs:
  data_files: {{test: {test}, train: {train}}}
test_split: test
fewshot_split: train
fewshot_config: {{sampler: first_n}}
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs: {{until: ["Question:", "</s>", "<|im_end|>"], do_sample: false, temperature: 0.0, max_gen_toks: 16}}
filter_list:
  - name: strict-match
    filter: [{{function: regex, regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"}}, {{function: take_first}}]
metric_list:
  - {{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true,
     ignore_punctuation: false, regexes_to_ignore: [",", "\\\\$", "(?s).*#### ", "\\\\.$"]}}
"""
# Answers that exercise the extraction and the normalisation, scored by lm-eval's own filter and metric.
CRAFTED = [("so the total is #### 1,234.", "#### 1234"), ("#### $5", "#### 5"), ("no number here", "#### 3"),
           ("#### 7 and then #### 8", "#### 8"), ("#### -2.", "x\n#### -2"), ("####  9", "#### 9")]

_LM_EVAL_GENERATE = """
import json, sys
import lm_eval
from lm_eval.api.metrics import exact_match_hf_evaluate
from lm_eval.filters.extraction import RegexFilter
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

hf_dir, include, crafted = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
lm = HFLM(pretrained=hf_dir, dtype="float32", max_length=64, batch_size=4, device="cpu")
res = lm_eval.simple_evaluate(model=lm, tasks=["tx_gen"], task_manager=TaskManager(include_path=include),
                              num_fewshot=2, log_samples=True)
samples = sorted(res["samples"]["tx_gen"], key=lambda s: s["doc_id"])
regex = RegexFilter(regex_pattern="#### (\\\\-?[0-9\\\\.\\\\,]+)")
extracted = [r[0] for r in regex.apply([[c] for c, _ in crafted], None)]
match = [exact_match_hf_evaluate([e], [ref], ignore_case=True, ignore_punctuation=False,
                                 regexes_to_ignore=[",", "\\\\$", "(?s).*#### ", "\\\\.$"])["exact_match"]
         for e, (_, ref) in zip(extracted, crafted)]
print("LM_EVAL " + json.dumps({"results": res["results"]["tx_gen"], "contexts": [s["arguments"][0][0] for s in samples],
                               "resps": [s["resps"][0][0] for s in samples],
                               "filtered": [s["filtered_resps"][0] for s in samples],
                               "crafted": [extracted, match]}, default=float))
"""


@pytest.fixture(scope="module")
def generated(straight, tmp_path_factory):
    """GSM8K-style questions, 2-shot, on the shared run's export: ours on one device and from its
    checkpoint on fsdp=4 x tp=2 (seq_len 64, 16 new tokens, batches of 4: the second padded), and
    lm-eval's HF model (max_length 64)."""
    pytest.importorskip("lm_eval")
    folder = tmp_path_factory.mktemp("gen")
    (folder / "gsm.jsonl").write_text(_lines(QUESTIONS))
    (folder / "shots.jsonl").write_text(_lines(SHOTS))
    flags = ["--eval.num_fewshot", "2", "--eval.fewshot_path", str(folder / "shots.jsonl"),
             "--eval.fewshot_sampler", "first_n", "--eval.max_gen_toks", "16"]
    task = {"generate_until": folder / "gsm.jsonl"}
    hf_dir = straight[0] / "checkpoint" / "step-6-hf"
    ours, _ = _ours(folder / "one", 1, hf_dir, task, *flags)
    sharded, _ = _ours(folder / "eight", 8, straight[0] / "checkpoint" / "step-6", task, *flags,
                       "--parallelism.tensor_parallel_degree", "2")
    (folder / "tx_gen.yaml").write_text(GSM8K_YAML.format(test=folder / "gsm.jsonl", train=folder / "shots.jsonl"))
    p = subprocess.run([sys.executable, "-c", _LM_EVAL_GENERATE, str(hf_dir), str(folder), json.dumps(CRAFTED)],
                       capture_output=True, text=True, timeout=600,
                       env=_env(1, {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}))
    assert p.returncode == 0, p.stderr[-3000:]
    return ours, sharded, json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("LM_EVAL "))[8:])


def test_generate_until_equals_lm_eval_request_by_request(generated):
    """The prompts (few-shot, left-truncated to 48 tokens as lm-eval cuts them), the greedy
    completions cut at the stop strings, the extracted answers and exact_match: lm-eval's, one
    question at a time; fsdp x tp generates the same text."""
    from torchtitan_xla.eval.tasks import Task, contexts, extract_answer

    ours, sharded, reference = generated
    name = "generate_until:gsm.jsonl"
    assert contexts(Task("generate_until", REPO, QUESTIONS), [SHOTS] * len(QUESTIONS)) == reference["contexts"]
    assert ours["samples"][name] == reference["resps"]
    assert [extract_answer(c) for c in ours["samples"][name]] == reference["filtered"]
    assert ours["results"][name]["exact_match"] == reference["results"]["exact_match,strict-match"]
    assert sharded["samples"][name] == ours["samples"][name]
    assert any(len(c) > 20 for c in reference["resps"])  # something was generated


# lm-eval's stock gsm8k.yaml as to the few-shot examples: no fewshot_config (its default sampler).
STOCK_YAML = """\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files: {{test: {test}, train: {train}}}
test_split: test
fewshot_split: {fewshot_split}
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
num_fewshot: 3
"""


@pytest.mark.parametrize("fewshot_split", ["train", "test"], ids=["own file", "the task's file"])
def test_the_default_sampler_draws_lm_evals_examples_for_every_question(fewshot_split, tmp_path):
    """lm-eval's default sampler (the stock gsm8k task's): random examples per question from the
    seeded generator lm-eval's evaluator gives each task (1234): every prompt equals lm-eval's
    built requests', with the examples from their own file and from the task's own file (drawn one
    more, the question itself dropped). first_n gives every question the file's first examples."""
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.eval.tasks import contexts, fewshot_docs, fewshot_for_each, parse_task

    questions = [{"question": f"What is {i} plus {i + 1}?", "answer": f"{2 * i + 1}\n#### {2 * i + 1}"}
                 for i in range(12)]
    pool = [{"question": f"Count to {i}.", "answer": f"#### {i}"} for i in range(9)]
    (tmp_path / "test.jsonl").write_text(_lines(questions))
    (tmp_path / "train.jsonl").write_text(_lines(pool))
    (tmp_path / "stock.yaml").write_text(STOCK_YAML.format(
        name="stock", test=tmp_path / "test.jsonl", train=tmp_path / "train.jsonl", fewshot_split=fewshot_split))
    task = lm_eval_tasks.TaskManager(include_path=str(tmp_path)).load_task_or_group(["stock"])["stock"]
    task.set_fewshot_seed(seed=1234)  # as lm_eval.simple_evaluate does for every task
    task.build_all_requests(rank=0, world_size=1)
    reference = [i.arguments[0] for i in sorted(task.instances, key=lambda i: i.doc_id)]

    shots = tmp_path / ("train.jsonl" if fewshot_split == "train" else "test.jsonl")
    cfg = parse_args(["--eval.num_fewshot", "3", "--eval.fewshot_path", str(shots)])
    ours = parse_task(f"generate_until:{tmp_path / 'test.jsonl'}")
    drawn = fewshot_for_each(cfg.eval, ours, fewshot_docs(cfg.eval, cfg.training.seq_len))
    assert contexts(ours, drawn) == reference
    assert len({tuple(s["question"] for s in d) for d in drawn}) > 6  # random per question
    if fewshot_split == "test":
        assert all(doc not in d for doc, d in zip(questions, drawn))
        many = parse_args(["--eval.num_fewshot", "12", "--eval.fewshot_path", str(shots)]).eval
        with pytest.raises(ConfigError, match=re.escape(
                "[eval] num_fewshot = 12: fewshot_path is the task's own file, of 12 questions")):
            fewshot_for_each(many, ours, fewshot_docs(many, 2048))
    first = parse_args(["--eval.num_fewshot", "3", "--eval.fewshot_path", str(shots),
                        "--eval.fewshot_sampler", "first_n"]).eval
    assert fewshot_for_each(first, ours, fewshot_docs(first, 2048)) == [(pool if fewshot_split == "train"
                                                                          else questions)[:3]] * 12


def test_answer_extraction_and_exact_match_equal_lm_evals_filter_and_metric(generated):
    from torchtitan_xla.eval.tasks import exact_match, extract_answer

    extracted, matches = generated[2]["crafted"]
    assert [extract_answer(c) for c, _ in CRAFTED] == extracted
    assert [float(exact_match(e, ref)) for e, (_, ref) in zip(extracted, CRAFTED)] == matches
    assert 0 < sum(matches) < len(matches) and "[invalid]" in extracted  # both outcomes exercised


def test_generation_stops_at_the_eos_ids_of_the_hf_folders_generation_config(tmp_path):
    """transformers' generate stops at every id of generation_config.json's eos_token_id (else
    config.json's): those are the ids generate_until stops at for a HuggingFace folder."""
    from torchtitan_xla.inference import hf_eos_ids

    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert hf_eos_ids(tmp_path) == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert hf_eos_ids(tmp_path) == [128001, 128009]
