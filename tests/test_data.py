"""The data pipeline: dataset registry and formats, packing, host sharding, shuffling, exact resume
(also across processes, hosts and workers), the prefetching loader, and bad input."""

import json
import logging
import time

import pytest
import torch
from data_helpers import CharTokenizer, one_window_docs, write_c4, write_jsonl
from helpers import capture_logs

from torchtitan_xla.config import ConfigError, parse_args
from torchtitan_xla.datasets import build_data_loader, check_vocab_size
from torchtitan_xla.datasets.packing import PackedTextDataset
from torchtitan_xla.datasets.sources import _from_generator, _yield_texts, load_documents

DOCS = [f"document {i} " + "x" * (i % 7) for i in range(40)]


def config(*args):
    return parse_args(["--training.seq_len", "15", *args])


def loader(*args, batch_size=1, tokenizer=None, **kw):
    return build_data_loader(config(*args), tokenizer or CharTokenizer(), batch_size=batch_size,
                             **kw)


def take(it, n):
    return [next(it) for _ in range(n)]


def texts_of(batches):
    """Decoded windows, one string per sequence."""
    return [CharTokenizer().decode(row.tolist()) for inputs, _ in batches for row in inputs]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])
                                    for x, y in zip(a, b, strict=True))


def stream(docs, seq_len, **kw):
    return PackedTextDataset(_from_generator(_yield_texts, texts=list(docs)), CharTokenizer(),
                             seq_len, name="test", **kw)


# --------------------------------------------------------------------------------------------
# Packing, epochs, shuffling
# --------------------------------------------------------------------------------------------


def test_windows_are_the_token_stream_cut_into_seq_len_plus_one():
    tokens = [t for d in DOCS for t in CharTokenizer().encode(d, bos=True, eos=True)]
    it = iter(stream(DOCS, 8, infinite=False))
    windows = list(it)
    assert len(windows) == len(tokens) // 9  # the tail shorter than a window is not emitted
    for k, (inputs, labels) in enumerate(windows):
        window = tokens[9 * k: 9 * k + 9]
        assert inputs.tolist() == window[:-1] and labels.tolist() == window[1:]
        assert inputs.dtype == torch.long


def test_end_of_data_reloops_deterministically_and_logs_it():
    with capture_logs() as log:
        docs = one_window_docs(30)
        windows = [CharTokenizer().decode(w[0].tolist()) for w in take(iter(stream(docs, 15)), 75)]
    # Every epoch holds every document once (HF reorders the shards of later epochs by epoch
    # number: deterministic), and re-running gives the same sequence.
    for e in range(2):
        assert sorted(windows[30 * e: 30 * (e + 1)]) == sorted(docs)
    assert windows[:30] == docs
    again = [CharTokenizer().decode(w[0].tolist()) for w in take(iter(stream(docs, 15)), 75)]
    assert again == windows
    messages = log.messages(logging.WARNING)
    for epoch in (1, 2):
        assert (f"dataset test (host 0 of 1): end of data, re-looping from the start "
                f"(epoch {epoch})") in messages


def test_shuffle_is_a_seeded_permutation_of_the_documents():
    docs = one_window_docs(50)

    def order(seed, buffer=16):
        ds = stream(docs, 15, infinite=False, shuffle_buffer=buffer, seed=seed)
        return [CharTokenizer().decode(w[0].tolist()) for w in ds]

    a = order(1)
    assert sorted(a) == sorted(docs) and a != docs
    assert order(1) == a  # deterministic
    assert order(2) != a  # the seed matters
    # A document leaves the buffer only after it was read: at most 16 places early.
    assert all(docs.index(t) <= i + 16 for i, t in enumerate(a))


# --------------------------------------------------------------------------------------------
# Host sharding
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("hosts,workers,files", [(2, 0, 8), (3, 0, 8), (2, 2, 8), (2, 2, 1)])
def test_hosts_together_see_every_document_exactly_once(tmp_path, hosts, workers, files):
    """80 one-window documents in 8 files or 1. Readers (hosts x workers) take whole files when
    their number divides the file count, otherwise every reader keeps one document in n."""
    docs = one_window_docs(80)
    per = 80 // files
    for k in range(files):
        write_jsonl(tmp_path / f"part{k}.jsonl", docs[per * k: per * (k + 1)])
    seen = []
    for rank in range(hosts):
        dl = loader("--training.dataset", "json", "--training.dataset_path", str(tmp_path),
                    "--training.num_workers", str(workers), batch_size=2,
                    host_rank=rank, host_count=hosts, infinite=False)
        seen.append(texts_of(list(dl)))
        dl.close()
    assert sorted(sum(seen, [])) == sorted(docs)  # all of them, none twice
    assert all(abs(len(s) - 80 / hosts) <= 1 for s in seen)  # balanced


# --------------------------------------------------------------------------------------------
# Exact resume
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra", [[], ["--training.shuffle_buffer", "7"]])
def test_resume_in_process_through_the_prefetching_loader(extra):
    args = ["--training.dataset", "python_docs", "--training.seq_len", "64", *extra]
    full = take(iter(loader(*args, batch_size=2)), 30)
    dl = loader(*args, batch_size=2)
    it = iter(dl)
    first = take(it, 11)
    time.sleep(0.3)  # the prefetch thread is now ahead of the 11 batches taken
    state = dl.state_dict()
    dl.close()
    resumed = loader(*args, batch_size=2)
    resumed.load_state_dict(state)
    assert same(first + take(iter(resumed), 19), full)


RESUME_DRIVER = """
import json, pickle, sys, time
sys.path[:0] = {paths!r}
from data_helpers import CharTokenizer
from torchtitan_xla.config import parse_args
from torchtitan_xla.datasets import build_data_loader

mode, state_file = sys.argv[1:3]
k, m, hosts = map(int, sys.argv[3:6])
cfg = parse_args(sys.argv[6:])
def build(rank):
    return build_data_loader(cfg, CharTokenizer(), batch_size=2, host_rank=rank, host_count=hosts)
def rows(dl, n):
    it = iter(dl)
    return [[x.tolist() for x in next(it)] for _ in range(n)]
out = {{}}
if mode == "save":
    states = {{}}
    for rank in range(hosts):
        full = build(rank)
        out[f"full{{rank}}"] = rows(full, k + m)
        full.close()
        dl = build(rank)
        out[f"first{{rank}}"] = rows(dl, k)
        time.sleep(0.5)  # let the prefetcher run ahead
        states[rank] = dl.state_dict()
        dl.close()
    pickle.dump(states, open(state_file, "wb"))
else:
    states = pickle.load(open(state_file, "rb"))
    for rank in range(hosts):
        dl = build(rank)
        dl.load_state_dict(states[rank])
        out[f"rest{{rank}}"] = rows(dl, m)
        dl.close()
print("OUT " + json.dumps(out))
"""


def test_resume_in_a_fresh_process_matches_an_uninterrupted_run(tmp_path):
    """K batches, save, new process, load, M batches == K + M uninterrupted. Case 1: one host,
    no workers, shuffling; case 2: two hosts with two workers each, local C4 layout. Both cross
    an epoch boundary."""
    import subprocess
    import sys

    from helpers import REPO

    corpus = [f"Document {i}. " + "Lorem ipsum dolor sit amet. " * (1 + i % 5) for i in range(24)]
    write_c4(tmp_path / "c4", corpus, files=4)
    cases = {
        "one_host": (1, ["--training.dataset", "c4", "--training.dataset_path",
                         str(tmp_path / "c4"), "--training.shuffle_buffer", "5"]),
        "two_hosts_workers": (2, ["--training.dataset", "c4", "--training.dataset_path",
                                  str(tmp_path / "c4"), "--training.num_workers", "2"]),
    }
    k, m = 60, 50  # 24 documents ~ 2,300 tokens ~ 70 batches of 2 x 16 per epoch per host
    paths = [str(REPO), str(REPO / "tests")]
    script = RESUME_DRIVER.format(paths=paths)

    def start(mode, name):
        hosts, args = cases[name]
        return subprocess.Popen(
            [sys.executable, "-c", script, mode, str(tmp_path / f"{name}.pkl"), str(k), str(m),
             str(hosts), "--training.seq_len", "15", *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def finish(p):
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
        return json.loads(next(ln for ln in out.splitlines() if ln.startswith("OUT "))[4:])

    saved = {name: finish(p) for name, p in [(n, start("save", n)) for n in cases]}
    loaded = {name: finish(p) for name, p in [(n, start("load", n)) for n in cases]}
    for name, (hosts, _) in cases.items():
        for rank in range(hosts):
            full = saved[name][f"full{rank}"]
            assert saved[name][f"first{rank}"] == full[:k], (name, rank)
            assert loaded[name][f"rest{rank}"] == full[k:], (name, rank)
        if hosts == 2:
            assert saved[name]["full0"] != saved[name]["full1"]


def test_restoring_with_another_host_count_or_worker_count_is_refused(tmp_path):
    for k in range(2):
        write_jsonl(tmp_path / f"p{k}.jsonl", DOCS)
    args = ["--training.dataset", "json", "--training.dataset_path", str(tmp_path)]
    dl = loader(*args, host_rank=1, host_count=2)
    take(iter(dl), 3)
    state = dl.state_dict()
    dl.close()
    assert (state["host_rank"], state["host_count"], state["num_workers"]) == (1, 2, 0)
    with pytest.raises(ConfigError, match=r"^data loader checkpoint: saved by host 1 of 2, "
                                          r"restored on host 0 of 1; the data stream cannot be "
                                          r"re-split across a different number of hosts$"):
        loader(*args).load_state_dict(state)
    with pytest.raises(ConfigError, match=r"^\[training\] num_workers = 2: the data loader "
                                          r"checkpoint was saved with num_workers = 0; resume"):
        dl = loader(*args, "--training.num_workers", "2", host_rank=1, host_count=2)
        dl.load_state_dict(state)


# --------------------------------------------------------------------------------------------
# The registry and file formats
# --------------------------------------------------------------------------------------------


def docs_of(ds):
    return [row["text"] for row in ds]


def test_python_docs_holds_out_every_tenth_topic_for_validation():
    from torchtitan_xla.datasets import python_docs

    train = docs_of(load_documents("python_docs"))
    val = docs_of(load_documents("python_docs", "", "validation"))
    assert len(train) + len(val) == len(python_docs.documents()) and len(val) == 7
    assert not set(train) & set(val)
    assert val[0] == python_docs.documents()[9]


def test_local_c4_layout_and_its_validation_split(tmp_path):
    write_c4(tmp_path, ["a", "b", "c", "d", "e"], files=3)
    write_c4(tmp_path, ["v1", "v2"], files=1, split="validation")
    assert docs_of(load_documents("c4", str(tmp_path))) == ["a", "b", "c", "d", "e"]
    assert docs_of(load_documents("c4", str(tmp_path / "en"), "validation")) == ["v1", "v2"]
    assert load_documents("c4", str(tmp_path)).num_shards == 3


def test_json_parquet_text_and_saved_hf_datasets(tmp_path):
    import datasets

    write_jsonl(tmp_path / "j" / "a.jsonl", ["j1", "j2"])
    write_jsonl(tmp_path / "j" / "b.json.gz", ["j3"], gz=True)
    assert docs_of(load_documents("json", str(tmp_path / "j"))) == ["j1", "j2", "j3"]
    assert docs_of(load_documents("json", str(tmp_path / "j" / "*.gz"))) == ["j3"]

    parquet = datasets.Dataset.from_dict({"text": ["p1", "p2"], "id": [1, 2]})
    parquet.to_parquet(str(tmp_path / "p.parquet"))
    assert docs_of(load_documents("parquet", str(tmp_path / "p.parquet"))) == ["p1", "p2"]

    (tmp_path / "t.txt").write_text("First paragraph\nstill first.\n\n\nSecond.\n")
    assert docs_of(load_documents("text", str(tmp_path / "t.txt"))) == [
        "First paragraph\nstill first.", "Second."]
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"text": ["h1", "h2", "h3"]}),
        "validation": datasets.Dataset.from_dict({"text": ["hv"]}),
    }).save_to_disk(str(tmp_path / "hf"))
    assert docs_of(load_documents("hf", str(tmp_path / "hf"))) == ["h1", "h2", "h3"]
    assert docs_of(load_documents("hf", str(tmp_path / "hf"), "validation")) == ["hv"]


@pytest.mark.parametrize("kind", ["json", "parquet", "text", "hf"])
def test_every_format_resumes_exactly_on_the_second_host(tmp_path, kind):
    import datasets

    texts = [f"Text number {i}, " + "words " * (i % 4) for i in range(30)]
    for k in range(3):
        part = texts[10 * k: 10 * (k + 1)]
        if kind == "json":
            write_jsonl(tmp_path / f"{k}.jsonl", part)
        elif kind == "parquet":
            datasets.Dataset.from_dict({"text": part}).to_parquet(str(tmp_path / f"{k}.parquet"))
        elif kind == "text":
            (tmp_path / f"{k}.txt").write_text("\n\n".join(part))
    if kind == "hf":
        datasets.Dataset.from_dict({"text": texts}).save_to_disk(str(tmp_path / "hf"))
    args = ["--training.dataset", kind, "--training.dataset_path",
            str(tmp_path / "hf" if kind == "hf" else tmp_path)]
    full = take(iter(loader(*args, host_rank=1, host_count=2)), 40)  # > 1 epoch (~33)
    dl = loader(*args, host_rank=1, host_count=2)
    first = take(iter(dl), 17)
    state = dl.state_dict()
    dl.close()
    resumed = loader(*args, host_rank=1, host_count=2)
    resumed.load_state_dict(state)
    assert same(first + take(iter(resumed), 23), full)


def test_synthetic_tokens_are_deterministic_per_host_and_resumable():
    args = ["--training.dataset", "synthetic", "--training.seq_len", "32"]
    tok = CharTokenizer()
    a = take(iter(loader(*args, batch_size=4, tokenizer=tok)), 6)
    assert same(a, take(iter(loader(*args, batch_size=4, tokenizer=tok)), 6))
    assert all(0 <= int(x[0].min()) and int(x[0].max()) < tok.n_words for x in a)
    assert torch.equal(a[0][0][:, 1:], a[0][1][:, :-1])  # labels are inputs shifted by one
    # The global batch is the same however many hosts (or native-runtime processes) and loader
    # workers split it: host r holds rows [2r, 2r + 2) of each step's 4.
    halves = [take(iter(loader(*args, batch_size=2, tokenizer=tok, host_rank=r, host_count=2)), 6)
              for r in (0, 1)]
    assert not torch.equal(halves[1][0][0], halves[0][0][0])
    for step in range(6):
        assert torch.equal(torch.cat([halves[0][step][0], halves[1][step][0]]), a[step][0])
    workers = loader(*args, "--training.num_workers", "2", batch_size=4, tokenizer=tok)
    assert same(take(iter(workers), 6), a)
    workers.close()
    dl = loader(*args, batch_size=4, tokenizer=tok)
    take(iter(dl), 2)
    state = dl.state_dict()
    dl.close()
    resumed = loader(*args, batch_size=4, tokenizer=tok)
    resumed.load_state_dict(state)
    assert same(take(iter(resumed), 4), a[2:])
    # Resumed on another number of data-parallel ranks (another mesh or runtime): the global batch
    # continues where the state counted, from one host's 4 rows to two hosts' 2 and back.
    for r in (0, 1):
        half = loader(*args, batch_size=2, tokenizer=tok, host_rank=r, host_count=2)
        half.load_state_dict(state)
        assert all(torch.equal(got[0], want[0][2 * r:2 * r + 2])
                   for got, want in zip(take(iter(half), 3), a[2:5]))
        later = half.state_dict()
        half.close()
    whole = loader(*args, batch_size=4, tokenizer=tok)
    whole.load_state_dict(later)
    assert same(take(iter(whole), 1), a[5:6])


# --------------------------------------------------------------------------------------------
# Bad input: one line each
# --------------------------------------------------------------------------------------------


def first_batch_error(*args, within=1):
    """The error the run stops with: when its loader is built (what can be known then is checked
    then), or when the loop asks for one of the first `within` batches."""
    dl = None
    try:
        with pytest.raises(ConfigError) as e:
            dl = loader(*args)
            take(iter(dl), within)
    finally:
        if dl is not None:
            dl.close()
    return str(e.value)


def test_missing_paths_and_unknown_names(tmp_path):
    with pytest.raises(ConfigError, match=r"^\[training\] dataset_path: not found: .*nope$"):
        load_documents("json", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"^\[training\] dataset_path: the 'json' dataset needs"):
        load_documents("json", "")
    with pytest.raises(ConfigError, match=r"^\[training\] dataset_path: no en/c4-train.NNNNN-of-"
                                          r"NNNNN.json.gz files in .* \(expected the layout of "
                                          r"allenai/c4\)"):
        load_documents("c4", str(tmp_path))
    with pytest.raises(ConfigError, match=r"^\[training\] dataset: unknown dataset 'c5'; expected "
                                          r"one of: python_docs, c4, json, parquet, text, hf, "
                                          r"synthetic"):
        load_documents("c5")
    with pytest.raises(ConfigError, match=r"^\[training\] dataset_split: 'json' reads exactly the "
                                          r"files at dataset_path and has no 'validation' split"):
        load_documents("json", str(tmp_path), "validation")
    with pytest.raises(ConfigError, match=r"command line: --training.dataset: expected one of"):
        parse_args(["--training.dataset", "c5"])


def test_c4_from_the_hub_fails_in_one_line_when_offline():
    # conftest sets HF_HUB_OFFLINE=1; online this streams allenai/c4 (not verified here).
    with pytest.raises(ConfigError, match=r"^\[training\] dataset: cannot stream allenai/c4/en "
                                          r"split 'train' from the Hugging Face Hub \(.*\); for "
                                          r"offline use, set \[training\] dataset_path to a local "
                                          r"copy$"):
        load_documents("c4")


def test_empty_dataset(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    msg = first_batch_error("--training.dataset", "json", "--training.dataset_path", str(tmp_path))
    assert msg == f"[training] dataset_path: {tmp_path}: no documents for host 0 of 1 (the dataset is empty)"


def test_a_line_that_is_not_json_stops_with_file_and_line(tmp_path):
    path = write_jsonl(tmp_path / "c4-train.00000-of-01024.json", ["ok", "fine"])
    with path.open("a") as fh:
        fh.write('{"text": "cut off\n{"text": "next"}\n')
    msg = first_batch_error("--training.dataset", "json", "--training.dataset_path", str(path))
    assert msg == f"{path}:3: not a JSON object (Invalid control character at)"


def test_a_bad_line_read_by_a_worker_process_is_still_one_line(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", ["ok"])
    with path.open("a") as fh:
        fh.write("[1, 2]\n")
    msg = first_batch_error("--training.dataset", "json", "--training.dataset_path", str(path),
                            "--training.num_workers", "1")
    assert msg == f"{path}:2: no 'text' string field (found: list)"


def test_no_text_column(tmp_path):
    import datasets

    write_jsonl(tmp_path / "a.jsonl", [])
    (tmp_path / "a.jsonl").write_text(json.dumps({"content": "x", "url": "u"}) + "\n")
    msg = first_batch_error("--training.dataset", "json", "--training.dataset_path", str(tmp_path))
    assert msg == f"{tmp_path / 'a.jsonl'}:1: no 'text' string field (found: content, url)"
    datasets.Dataset.from_dict({"content": ["x"]}).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(ConfigError, match=r"^\[training\] dataset_path: .*p.parquet has no 'text' "
                                          r"column \(columns: content\)$"):
        load_documents("parquet", str(tmp_path / "p.parquet"))


def test_truncated_gzip(tmp_path):
    path = write_jsonl(tmp_path / "x.jsonl.gz", DOCS * 50, gz=True)
    path.write_bytes(path.read_bytes()[:-200])
    msg = first_batch_error("--training.dataset", "json", "--training.dataset_path", str(path),
                            within=10_000)
    assert msg.startswith(f"{path}: unreadable after line ")
    assert "Compressed file ended before the end-of-stream marker was reached" in msg


def test_tokenizer_larger_than_the_model_vocabulary():
    check_vocab_size(CharTokenizer(), 258)
    with pytest.raises(ConfigError, match=r"^\[model\] tokenizer_path: the tokenizer has 258 "
                                          r"ids \(BOS 256, EOS 257\) but the model's vocab_size "
                                          r"is 200;"):
        check_vocab_size(CharTokenizer(), 200)


# --------------------------------------------------------------------------------------------
# Onto the device mesh; errors through train.py
# --------------------------------------------------------------------------------------------

DEVICE_DRIVER = """
import sys
sys.path[:0] = {paths!r}
import torch, torch_xla, torch_xla.runtime as xr, torch_xla.distributed.spmd as xs
from data_helpers import CharTokenizer
from torchtitan_xla.config import parse_args
from torchtitan_xla.datasets import build_data_loader
from torchtitan_xla.parallelisms import BATCH_AXES, ParallelDims

xr.use_spmd()
cfg = parse_args(["--training.seq_len", "16", "--parallelism.data_parallel_replicate_degree", "2",
                  "--parallelism.data_parallel_shard_degree", "2", "--training.num_workers", "1"])
mesh = ParallelDims.from_config(cfg.parallelism, 4).build_mesh()
spec = xs.ShardingSpec(mesh, (BATCH_AXES, None), minibatch=False)
on_device = build_data_loader(cfg, CharTokenizer(), batch_size=8, device=torch_xla.device(),
                              input_sharding=spec)
on_host = build_data_loader(cfg, CharTokenizer(), batch_size=8)
for (inputs, labels), (host_in, host_lab) in zip([next(iter(on_device)) for _ in range(3)],
                                                  [next(iter(on_host)) for _ in range(3)]):
    assert torch.equal(inputs.cpu(), host_in) and torch.equal(labels.cpu(), host_lab)
    for t, host in ((inputs, host_in), (labels, host_lab)):
        assert torch_xla._XLAC._get_xla_sharding_spec(t) == "{{devices=[4,1]0,1,2,3}}"
        shards = torch_xla._XLAC._get_local_shards([t])[0]
        assert len(shards) == 4
        for k, (shard, device) in enumerate(shards):
            assert device == f"CPU:{{k}}" and torch.equal(shard.cpu(), host[2 * k: 2 * k + 2])
on_device.close()
on_host.close()
print("DEVICE OK")
"""


def test_batches_arrive_sharded_over_the_batch_axes_one_slice_per_device():
    """4 devices, dp_replicate 2 x fsdp 2: each device holds only its 2 of the 8 rows (no
    full-batch copy per device), and the rows are the host loader's, in order."""
    import subprocess
    import sys

    from helpers import REPO, _env

    script = DEVICE_DRIVER.format(paths=[str(REPO), str(REPO / "tests")])
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=_env(4, None), timeout=300)
    assert p.returncode == 0 and "DEVICE OK" in p.stdout, p.stderr[-3000:]


def test_a_bad_document_line_stops_train_py_with_one_line(tmp_path):
    from helpers import run_train, tiny_args

    path = write_jsonl(tmp_path / "data.jsonl", ["fine"] * 3)
    with path.open("a") as fh:
        fh.write("not json\n")
    run = run_train(tiny_args(tmp_path / "out", "--training.dataset", "json",
                              "--training.dataset_path", str(path)))
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: command line: --training.dataset_path: {path}:4: not a JSON object (Expecting value)")
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("texts,workers", [([], 0), (["only one"], 2)], ids=["empty", "fewer than readers"])
def test_a_dataset_without_documents_stops_train_py_before_anything_is_written(tmp_path, texts, workers):
    """Found with the other data checks, before the config is printed or the dump folder made, not
    at the first batch: an empty file, and a file with fewer documents than the host's readers."""
    from helpers import run_train, tiny_args

    path = write_jsonl(tmp_path / "data.jsonl", texts)
    run = run_train(tiny_args(tmp_path / "out", "--training.dataset", "json", "--training.dataset_path",
                              str(path), "--training.num_workers", str(workers), "--job.print_config"))
    assert run.returncode == 2
    reader, why = (("host 0 of 1", "is empty") if not workers
                   else ("host 0 of 1, worker 1 of 2", "has fewer documents than its 2 readers"))
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: command line: --training.dataset_path: {path}: no documents for {reader} "
        f"(the dataset {why}) (dataset from the command line)")
    assert "Traceback" not in run.stderr and "Effective config" not in run.stderr
    assert not (tmp_path / "out").exists()


def test_the_config_offers_exactly_the_registered_datasets():
    """The data registry's datasets, then grpo's prompt sets (grpo/data.py reads those)."""
    import typing

    from torchtitan_xla.config.job_config import PROMPT_DATASETS, Training
    from torchtitan_xla.datasets.sources import DATASET_NAMES
    from torchtitan_xla.grpo.data import load_prompts

    choices = typing.get_args(typing.get_type_hints(Training)["dataset"])
    assert choices == DATASET_NAMES + PROMPT_DATASETS
    assert len(load_prompts("larger_numbers", "", "train")) == 81
