"""Where the recipes' tokenizers come from: each model family's tokenizer file in its HuggingFace
repository (gated for Llama, Mixtral and Gemma, open for Qwen, DeepSeek and gpt-oss), for the error
a user sees when the file is missing and for `scripts/download_tokenizer.py`, which fetches it.
Nothing here downloads at run time."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath


@dataclass(frozen=True)
class TokenizerSource:
    repo: str  # HuggingFace repository id
    filename: str  # the file inside it
    default_path: str  # where the recipes look for it (their tokenizer_path)
    gated: bool = True  # a licence to accept on the repository's page first

    @property
    def url(self) -> str:
        return f"https://huggingface.co/{self.repo}"


SOURCES = {
    "llama3": TokenizerSource("meta-llama/Llama-3.1-8B", "original/tokenizer.model",
                              "./assets/tokenizer/llama3/tokenizer.model"),
    "llama2": TokenizerSource("meta-llama/Llama-2-7b-hf", "tokenizer.model",
                              "./assets/tokenizer/llama2/tokenizer.model"),
    "mixtral": TokenizerSource("mistralai/Mixtral-8x7B-v0.1", "tokenizer.model",
                               "./assets/tokenizer/mixtral/tokenizer.model"),
    # Qwen3's tokenizer.json is the same in every size, dense and MoE.
    "qwen3": TokenizerSource("Qwen/Qwen3-8B", "tokenizer.json", "./assets/tokenizer/qwen3/tokenizer.json",
                             gated=False),
    # DeepSeek-V3's (129,280 embedding rows), also for the 16B flavor trained from scratch.
    "deepseek_v3": TokenizerSource("deepseek-ai/DeepSeek-V3", "tokenizer.json",
                                   "./assets/tokenizer/deepseek_v3/tokenizer.json", gated=False),
    "deepseek_v2": TokenizerSource("deepseek-ai/DeepSeek-V2-Lite", "tokenizer.json",
                                   "./assets/tokenizer/deepseek_v2/tokenizer.json", gated=False),
    # Gemma 3's is the same for every size (262,144 tokens; the multimodal checkpoints' 64 extra
    # embedding rows have no token); its chat format is read from its <start_of_turn> token.
    "gemma3": TokenizerSource("google/gemma-3-1b-it", "tokenizer.json",
                              "./assets/tokenizer/gemma3/tokenizer.json"),
    # o200k_harmony (201,088 embedding rows); its chat format is read from its <|channel|> token.
    "gpt_oss": TokenizerSource("openai/gpt-oss-20b", "tokenizer.json",
                               "./assets/tokenizer/gpt_oss/tokenizer.json", gated=False),
}


def where_to_get(model: str, path: str) -> str:
    """One sentence on how to get `model`'s tokenizer to `path`; empty for an unknown family."""
    source = SOURCES.get(model)
    if source is None:
        return ""
    if not PurePosixPath(path).suffix:  # a model folder: the file goes in it
        path = f"{path.rstrip('/')}/{PurePosixPath(source.filename).name}"
    download = f"`python scripts/download_tokenizer.py {model} --out {path}`"
    if not source.gated:
        return (f"{model}'s tokenizer is {source.filename} in the HuggingFace repository {source.repo}: "
                f"run {download} (README, 'Tokenizers')")
    return (f"{model}'s tokenizer is {source.filename} in the gated HuggingFace repository "
            f"{source.repo}: accept its licence at {source.url}, then run {download} with HF_TOKEN set "
            f"(README, 'Tokenizers')")
