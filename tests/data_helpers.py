"""Small corpora and a character tokenizer for the data tests (importable by DataLoader workers,
which unpickle the tokenizer in their own process)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path


class CharTokenizer:
    """One id per character (code point mod 256), BOS 256, EOS 257: windows read back as text."""

    n_words, bos_id, eos_id, chat_format = 258, 256, 257, None

    def encode(self, text, *, bos, eos):
        return [self.bos_id] * bos + [ord(c) % 256 for c in text] + [self.eos_id] * eos

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i < 256)


def one_window_docs(n: int, seq_len: int = 15) -> list[str]:
    """`n` distinct documents that encode (BOS + text + EOS) to exactly one seq_len+1 window."""
    return [f"d{i:04d}".ljust(seq_len - 1, ".") for i in range(n)]


def write_jsonl(path: Path, texts: list[str], *, gz: bool = False,
                extra: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = "".join(json.dumps({"text": t, **(extra or {})}) + "\n" for t in texts)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            fh.write(lines)
    else:
        path.write_text(lines)
    return path


def write_c4(root: Path, texts: list[str], files: int, split: str = "train") -> Path:
    """`texts` spread over `files` files in allenai/c4's layout:
    en/c4-<split>.NNNNN-of-01024.json.gz, with C4's other fields."""
    per = -(-len(texts) // files)
    for k in range(files):
        write_jsonl(root / "en" / f"c4-{split}.{k:05d}-of-01024.json.gz",
                    texts[k * per:(k + 1) * per], gz=True,
                    extra={"timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.com/{k}"})
    return root
