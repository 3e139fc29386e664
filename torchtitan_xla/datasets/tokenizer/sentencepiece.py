"""Llama 2's tokenizer: a sentencepiece model, BOS/EOS added exactly as Meta's reference does."""

from __future__ import annotations

from torchtitan_xla.datasets.tokenizer.base import Tokenizer
from torchtitan_xla.errors import ConfigError, first_line


class SentencePieceTokenizer(Tokenizer):
    chat_format = "llama2"
    def __init__(self, path: str):
        import sentencepiece as spm

        self.path = path
        try:
            self.sp = spm.SentencePieceProcessor(model_file=path)
        except (RuntimeError, OSError) as e:
            raise ConfigError(
                f"[model] tokenizer_path: {path} is neither a tiktoken BPE file, a HuggingFace "
                f"tokenizer.json nor a sentencepiece model ({first_line(e, typed=False)})") from None
        self.n_words = self.sp.vocab_size()
        self.bos_id = self.sp.bos_id()
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id()

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.sp.encode(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.sp.decode(ids)

    def save_pretrained(self, out_dir) -> None:
        """The model file as tokenizer.model with a tokenizer_config.json naming transformers'
        LlamaTokenizer, which reads it itself (as Meta's Llama 2 HF folders ship it)."""
        import json
        import shutil
        from pathlib import Path

        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.path, out / "tokenizer.model")
        config = {"tokenizer_class": "LlamaTokenizer", "add_bos_token": self.bos_id >= 0,
                  "add_eos_token": False, "legacy": False}
        specials = {"bos_token": self.bos_id, "eos_token": self.eos_id, "unk_token": self.sp.unk_id()}
        for name, i in specials.items():
            if i >= 0:  # a model trained without that token has id -1
                config[name] = self.sp.id_to_piece(i)
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
