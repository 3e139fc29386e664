"""Tokenizers: Llama 3's tiktoken BPE format and Llama 2's sentencepiece, behind one interface."""

from __future__ import annotations

from pathlib import Path

from torchtitan_xla.config_manager import ConfigError
from torchtitan_xla.datasets.tokenizer.base import Tokenizer

__all__ = ["Tokenizer", "build_tokenizer"]


def _looks_like_tiktoken(path: Path) -> bool:
    """A tiktoken BPE file is text lines of `<base64 token> <rank>`."""
    with path.open("rb") as fh:
        first = fh.readline().split()
    return len(first) == 2 and first[1].isdigit()


def build_tokenizer(tokenizer_path: str) -> Tokenizer:
    """The tokenizer at `tokenizer_path`, its format detected from the file; an empty path
    gives the project's debug tokenizer (trained from the embedded corpus, cached)."""
    if not tokenizer_path:
        from torchtitan_xla.datasets.tokenizer.train_bpe import default_tokenizer_path

        tokenizer_path = str(default_tokenizer_path())
    path = Path(tokenizer_path)
    if not path.is_file():
        raise ConfigError(f"[model] tokenizer_path: file not found: {tokenizer_path}")
    if _looks_like_tiktoken(path):
        from torchtitan_xla.datasets.tokenizer.tiktoken import TikTokenizer

        return TikTokenizer(str(path))
    from torchtitan_xla.datasets.tokenizer.sentencepiece import SentencePieceTokenizer

    return SentencePieceTokenizer(str(path))
