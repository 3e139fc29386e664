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


CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen's special tokens, at Qwen's order
# Qwen2/3's pre-tokenisation (single digits, unlike Llama 3's runs of three).
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def train_qwen_style_tokenizer(folder: Path, vocab_size: int = 800) -> Path:
    """A byte-level BPE tokenizer.json trained on the embedded corpus as Qwen's is built: Qwen's
    pattern, ChatML's special tokens after the merges, no BOS. Returns the folder holding it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from torchtitan_xla.datasets import python_docs

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=CHATML,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(python_docs.documents(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    return folder
