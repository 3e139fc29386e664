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


# gpt-oss's special tokens (o200k_harmony's, without its reserved ones).
HARMONY = ["<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>",
           "<|end|>", "<|message|>", "<|call|>"]


def train_qwen_style_tokenizer(folder: Path, vocab_size: int = 800, special: list[str] = CHATML) -> Path:
    """A byte-level BPE tokenizer.json trained on the embedded corpus as Qwen's is built: Qwen's
    pattern, ChatML's special tokens (or `special`, e.g. gpt-oss's, whose o200k is byte-level BPE
    too), no BOS. Returns the folder holding it."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from torchtitan_xla.datasets import python_docs

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(python_docs.documents(), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    return folder


# Gemma's special tokens, at its ids (0-3), and its chat turns'.
GEMMA_SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


def train_gemma_style_tokenizer(folder: Path, vocab_size: int = 800) -> Path:
    """A tokenizer.json built as Gemma's is: spaces normalised to "▁", no pre-tokenizer (pieces
    may span a newline or a turn's role and content), BPE with byte fallback, <bos> and <eos>, and
    the chat turns' special tokens; trained on the embedded corpus. Returns the folder holding it."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    from torchtitan_xla.datasets import python_docs

    backend = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "▁")
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    alphabet = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=GEMMA_SPECIAL + alphabet,
                                  show_progress=False)
    # Documents cut into lines (with their newlines) keep the trainer's words short.
    backend.train_from_iterator((line for d in python_docs.documents() for line in d.splitlines(True)), trainer)
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    return folder
