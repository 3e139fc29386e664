"""HuggingFace tokenizers: a `tokenizer.json` read by the `tokenizers` library, as Qwen3, Llama 3.2
and most models since 2024 ship them, with the `tokenizer_config.json` beside it when there is one
(its BOS, EOS and padding tokens; without it, the names of the Llama 3 and Qwen families).

The chat format follows the special tokens: ChatML (`<|im_start|>` / `<|im_end|>`, Qwen's), Llama
3's headers, Gemma's turns (`<start_of_turn>`) or gpt-oss's harmony (`<|channel|>`;
datasets/chat.py). The file's pre-tokeniser, model and normaliser are used as they are; the
post-processor is not (BOS and EOS are added by `encode`'s flags, as for the other tokenizers),
and special-token text inside a document is encoded as plain text.
"""

from __future__ import annotations

import json
from pathlib import Path

from torchtitan_xla.datasets.tokenizer.base import Tokenizer
from torchtitan_xla.errors import ConfigError, first_line

# ChatML as datasets/chat.py renders it, for exported tokenizers: `apply_chat_template` gives
# render()'s ids (tested on python_docs_chat).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] | trim"
    " + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Gemma 3's chat format as datasets/chat.py renders it (its tokenizer_config.json's template for
# text content: the assistant is "model", a system message opens the first user turn).
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' "
    "else message['role']) + '\n' + (prefix if loop.first else '') + message['content'] | trim "
    "+ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}"
    "{% endif %}")
# gpt-oss's system message, as its chat template writes it by default (model identity, reasoning
# effort "medium", no tools); {date}: today's, YYYY-MM-DD.
HARMONY_SYSTEM = ("You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
                  "Current date: {date}\n\nReasoning: medium\n\n# Valid channels: analysis, commentary, "
                  "final. Channel must be included for every message.")
# gpt-oss's chat format (harmony) as datasets/chat.py renders it: its chat template's text turns,
# with no tools and no reasoning ("thinking") fields.
_DATE = "' + strftime_now('%Y-%m-%d') + '"
HARMONY_TEMPLATE = (
    "{{ '<|start|>system<|message|>" + HARMONY_SYSTEM.replace("{date}", _DATE) + "<|end|>' }}"
    "{% if messages[0]['role'] == 'system' %}{{ '<|start|>developer<|message|># Instructions\n\n' + "
    "messages[0]['content'] + '\n\n<|end|>' }}{% set turns = messages[1:] %}{% else %}"
    "{% set turns = messages %}{% endif %}{% for message in turns %}{% if message['role'] == 'assistant' %}"
    "{{ '<|start|>assistant<|channel|>final<|message|>' + message['content'] + ('<|return|>' if loop.last "
    "and not add_generation_prompt else '<|end|>') }}{% else %}{{ '<|start|>' + message['role'] + "
    "'<|message|>' + message['content'] + '<|end|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}")
CHAT_FORMATS = {"<|im_start|>": "chatml", "<|start_header_id|>": "llama3", "<start_of_turn>": "gemma",
                "<|channel|>": "harmony"}
# By family, when no tokenizer_config.json names them: (BOS, EOS, padding), first found wins.
KNOWN = {"bos": ["<|begin_of_text|>", "<bos>"], "eos": ["<|end_of_text|>", "<|endoftext|>", "<eos>"],
         "pad": ["<|finetune_right_pad_id|>", "<|endoftext|>", "<pad>"]}


def is_tokenizer_json(path: Path) -> bool:
    """A JSON object's first byte (tiktoken rank files and sentencepiece protobufs never start so)."""
    with path.open("rb") as fh:
        return fh.read(64).lstrip()[:1] == b"{"


def _config_token(config: dict, key: str):
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


class HFTokenizer(Tokenizer):
    def __init__(self, path: str):
        from tokenizers import Tokenizer as Backend

        self.path = path
        try:
            self.backend = Backend.from_file(path)
        except Exception as e:  # the Rust parser's own exception type
            raise ConfigError(f"[model] tokenizer_path: {path} is not a HuggingFace tokenizer.json "
                              f"({first_line(e, typed=False)})") from None
        self.backend.encode_special_tokens = True  # documents cannot inject control tokens
        self.special_tokens = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items()
                               if t.special}
        config_file = Path(path).with_name("tokenizer_config.json")
        config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        ids = {}
        for role, names in KNOWN.items():
            named = _config_token(config, f"{role}_token") if config else None
            found = [n for n in ([named] if named else names) if self.backend.token_to_id(n) is not None]
            ids[role] = self.backend.token_to_id(found[0]) if found else -1
        self.bos_id, self.eos_id, self.pad_id = ids["bos"], ids["eos"], ids["pad"]
        if self.eos_id < 0:
            raise ConfigError(f"[model] tokenizer_path: {path} has no end-of-text token (looked for "
                              f"{KNOWN['eos']}); put the model's tokenizer_config.json, which names "
                              f"its eos_token, beside it")
        self.n_words = self.backend.get_vocab_size(with_added_tokens=True)
        self.chat_format = next((f for t, f in CHAT_FORMATS.items() if t in self.special_tokens), None)

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos and self.bos_id >= 0 else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def save_pretrained(self, out_dir) -> None:
        """The tokenizer.json with a post-processor adding BOS where the family has one (as
        `encode(text, bos=True, eos=False)`), its special tokens, and the chat template of its
        format, through transformers' own PreTrainedTokenizerFast."""
        from tokenizers import Tokenizer as Backend
        from tokenizers import processors
        from transformers import PreTrainedTokenizerFast

        from torchtitan_xla.datasets.tokenizer.tiktoken import LLAMA3_CHAT_TEMPLATE

        backend = Backend.from_str(self.backend.to_str())
        backend.encode_special_tokens = False  # AutoTokenizer's default: chat templates need them
        token = {i: backend.id_to_token(i) if i >= 0 else None
                 for i in (self.bos_id, self.eos_id, self.pad_id)}
        bos = token[self.bos_id]
        if bos:  # (a family without BOS keeps the file's own post-processor)
            backend.post_processor = processors.TemplateProcessing(
                single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        template = {"chatml": CHATML_TEMPLATE, "llama3": LLAMA3_CHAT_TEMPLATE,
                    "gemma": GEMMA_TEMPLATE, "harmony": HARMONY_TEMPLATE}.get(self.chat_format)
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=token[self.eos_id],
                                     pad_token=token[self.pad_id], chat_template=template)
        hf.save_pretrained(str(out_dir))
