"""Tokenizers: Llama 3's tiktoken BPE format, Llama 2's sentencepiece and HuggingFace's
tokenizer.json (Qwen3, Llama 3.2), behind one interface."""

from __future__ import annotations

from pathlib import Path

from torchtitan_xla.datasets.tokenizer.base import Tokenizer
from torchtitan_xla.errors import ConfigError

__all__ = ["Tokenizer", "build_tokenizer", "check_vocab_size", "find_llama3_tokenizer"]

LLAMA3 = "llama3"  # tokenizer_path value: Meta's file as shipped by the llama-models package


def _looks_like_tiktoken(path: Path) -> bool:
    """A tiktoken BPE file is text lines of `<base64 token> <rank>`."""
    with path.open("rb") as fh:
        first = fh.readline().split()
    return len(first) == 2 and first[1].isdigit()


def build_tokenizer(tokenizer_path: str, model: str = "") -> Tokenizer:
    """The tokenizer at `tokenizer_path` (a file, or a HuggingFace model folder holding a
    tokenizer.json), its format detected from the file. An empty path gives
    the project's debug tokenizer (trained from the embedded corpus, cached); "llama3" gives
    Meta's Llama 3 tokenizer from the llama-models package, when that is installed. A missing
    file's error says where `model`'s tokenizer comes from."""
    if not tokenizer_path:
        from torchtitan_xla.datasets.tokenizer.train_bpe import default_tokenizer_path

        tokenizer_path = str(default_tokenizer_path())
    path = Path(tokenizer_path)
    if path.is_dir() and (path / "tokenizer.json").is_file():  # a HuggingFace model folder
        path = path / "tokenizer.json"
    if not path.is_file() and tokenizer_path == LLAMA3:
        path = find_llama3_tokenizer()
    if not path.is_file():
        from torchtitan_xla.datasets.tokenizer.hub import where_to_get

        hint = where_to_get(model, tokenizer_path)
        raise ConfigError(f"[model] tokenizer_path: file not found: {tokenizer_path}"
                          + (f"; {hint}" if hint else ""))
    from torchtitan_xla.datasets.tokenizer.hf import HFTokenizer, is_tokenizer_json

    if is_tokenizer_json(path):
        return HFTokenizer(str(path))
    if _looks_like_tiktoken(path):
        from torchtitan_xla.datasets.tokenizer.tiktoken import TikTokenizer

        return TikTokenizer(str(path))
    from torchtitan_xla.datasets.tokenizer.sentencepiece import SentencePieceTokenizer

    return SentencePieceTokenizer(str(path))


def find_llama3_tokenizer() -> Path:
    """Meta's Llama 3 `tokenizer.model` inside the installed llama-models package (found without
    importing it: the package pulls in heavy dependencies, the file is all we need)."""
    import importlib.util

    spec = importlib.util.find_spec("llama_models")
    locations = list(spec.submodule_search_locations or []) if spec else []
    for root in locations:
        path = Path(root) / "llama3" / "tokenizer.model"
        if path.is_file():
            return path
    raise ConfigError(
        f"[model] tokenizer_path = {LLAMA3!r} means the Llama 3 tokenizer.model shipped by the "
        f"llama-models package, which is not installed (pip install --no-deps llama-models); "
        f"or give the path of your tokenizer.model")


def check_vocab_size(tokenizer: Tokenizer, vocab_size: int) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding."""
    if tokenizer.n_words > vocab_size:
        raise ConfigError(
            f"[model] tokenizer_path: the tokenizer has {tokenizer.n_words:,} ids (BOS "
            f"{tokenizer.bos_id}, EOS {tokenizer.eos_id}) but the model's vocab_size is "
            f"{vocab_size:,}; use the model's own tokenizer or a model with a larger vocabulary")
