"""The tokenizer interface the data pipeline and the model rely on."""

from __future__ import annotations

from abc import ABC, abstractmethod


class Tokenizer(ABC):
    n_words: int  # vocabulary size including special tokens; the model's vocab_size
    bos_id: int  # -1 for a family without one (Qwen)
    eos_id: int
    chat_format: str | None = None  # datasets/chat.py: "llama3", "llama2" or "chatml"

    @property
    def prefix_id(self) -> int:
        """What an evaluation's context starts with: BOS, or EOS where there is none (lm-eval's
        prefix token)."""
        return self.bos_id if self.bos_id >= 0 else self.eos_id

    @abstractmethod
    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        """Token ids of `text`, optionally framed by BOS / EOS. Text that looks like a special
        token is encoded as ordinary text: documents cannot inject control tokens."""

    @abstractmethod
    def decode(self, ids: list[int]) -> str: ...

    @abstractmethod
    def save_pretrained(self, out_dir) -> None:
        """Write the tokenizer files `transformers.AutoTokenizer.from_pretrained(out_dir)` loads
        into a tokenizer that gives the same ids as `encode(text, bos=True, eos=False)`."""
