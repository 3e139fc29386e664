"""Packing documents into training windows, host sharding and exact resume."""

import json

import pytest
import torch

from torchtitan_xla.config_manager import ConfigError
from torchtitan_xla.datasets.text_datasets import PackedTextDataset, load_documents


class CharTokenizer:
    """One id per character: makes windows easy to check by eye."""

    n_words, bos_id, eos_id = 258, 256, 257

    def encode(self, text, *, bos, eos):
        return [self.bos_id] * bos + [ord(c) % 256 for c in text] + [self.eos_id] * eos

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i < 256)


DOCS = [f"document {i} " + "x" * (i % 7) for i in range(40)]


def stream(docs, seq_len, host_rank=0, host_count=1):
    return PackedTextDataset(docs, CharTokenizer(), seq_len, host_rank=host_rank, host_count=host_count,
                             name="test")


def test_windows_are_the_token_stream_cut_into_seq_len_plus_one():
    ds = stream(DOCS, 8)
    tokens = [t for d in DOCS for t in CharTokenizer().encode(d, bos=True, eos=True)]
    it = iter(ds)
    for k in range(len(tokens) // 9):
        inputs, labels = next(it)
        window = tokens[9 * k: 9 * k + 9]
        assert inputs.tolist() == window[:-1] and labels.tolist() == window[1:]
        assert inputs.dtype == torch.long


def test_hosts_read_disjoint_documents_covering_all():
    seen = []
    for rank in range(3):
        ds = stream(DOCS, 4, rank, 3)
        seen.append([DOCS[i] for i in ds._indices])
    assert sorted(sum(seen, [])) == sorted(DOCS)
    assert not set(seen[0]) & set(seen[1])


def test_resume_gives_the_batches_of_an_uninterrupted_run():
    from torchdata.stateful_dataloader import StatefulDataLoader

    full = [b for _, b in zip(range(30), StatefulDataLoader(stream(DOCS, 16), batch_size=2))]
    loader = StatefulDataLoader(stream(DOCS, 16), batch_size=2)
    it = iter(loader)
    first = [next(it) for _ in range(11)]
    state = loader.state_dict()
    resumed = StatefulDataLoader(stream(DOCS, 16), batch_size=2)
    resumed.load_state_dict(state)
    rest = [b for _, b in zip(range(19), resumed)]
    for a, b in zip(first + rest, full):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_end_of_data_starts_a_new_epoch_deterministically():
    ds = stream(DOCS[:3], 4)
    n = sum(len(CharTokenizer().encode(d, bos=True, eos=True)) for d in DOCS[:3])
    it = iter(ds)
    windows = [next(it)[0] for _ in range(2 * n // 5 + 2)]
    assert ds.state_dict()["epoch"] >= 1
    assert torch.equal(windows[0], stream(DOCS[:3], 4).__iter__().__next__()[0])


def test_json_lines_dataset(tmp_path):
    path = tmp_path / "c4-train.00000-of-01024.json"
    path.write_text("".join(json.dumps({"text": t, "url": "u"}) + "\n" for t in ["alpha", "beta"]))
    docs = load_documents("json", str(path))
    assert len(docs) == 2 and docs[1] == "beta"
    bad = tmp_path / "nofield.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ConfigError, match=r"has no 'text' field \(fields: content\)"):
        load_documents("json", str(bad))
    with pytest.raises(ConfigError, match="unknown dataset 'c5'"):
        load_documents("c5", "")
