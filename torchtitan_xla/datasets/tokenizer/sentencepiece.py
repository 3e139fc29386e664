"""Llama 2's tokenizer: a sentencepiece model, BOS/EOS added exactly as Meta's reference does."""

from __future__ import annotations

from torchtitan_xla.config_manager import ConfigError
from torchtitan_xla.datasets.tokenizer.base import Tokenizer


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, path: str):
        import sentencepiece as spm

        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:
            raise ConfigError(
                f"[model] tokenizer_path: {path} is neither a tiktoken BPE file nor a "
                f"sentencepiece model ({str(e).splitlines()[0]})") from None
        self.n_words = self.sp.vocab_size()
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id()

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)
