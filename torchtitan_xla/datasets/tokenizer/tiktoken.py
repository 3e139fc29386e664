"""Llama 3's tokenizer format: a tiktoken BPE rank file plus 256 special tokens.

Works with Meta's Llama 3 `tokenizer.model` and with the project's own small rank files; the
special-token layout (ids right after the base vocabulary) and the BOS/EOS handling follow Meta's
reference tokenizer.
"""

from __future__ import annotations

import base64
import binascii
from pathlib import Path

from torchtitan_xla.datasets.tokenizer.base import Tokenizer
from torchtitan_xla.errors import ConfigError

# The Llama 3 chat format (datasets/chat.py's render) as a transformers chat template (Jinja),
# written into exported tokenizers: `apply_chat_template` then gives render()'s ids (tested on
# python_docs_chat).
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + "
    "'<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Llama 3's pre-tokenisation regex.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RESERVED_SPECIAL_TOKENS = 256


def llama3_special_tokens() -> list[str]:
    """The 256 special tokens, named as Meta's current reference (Llama 3.1 onwards; Llama 3.0
    called ids 4, 5, 8, 10, 11 reserved tokens: the ids of BOS, EOS, headers and EOT agree)."""
    named = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
             "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
             "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>",
             "<|python_tag|>", "<|image|>"]
    rest = [f"<|reserved_special_token_{2 + i}|>"
            for i in range(NUM_RESERVED_SPECIAL_TOKENS - len(named))]
    return named + rest


def read_ranks(path: str) -> dict[bytes, int]:
    """Parse a `<base64 token> <rank>` file.

    Not tiktoken's `load_tiktoken_bpe`: that caches every file by its *path* under the temp dir,
    so a tokenizer file changed in place would silently keep its old contents."""
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error):
            raise ConfigError(
                f"[model] tokenizer_path: {path}: line {lineno} is not '<base64 token> <rank>'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ConfigError(f"[model] tokenizer_path: {path}: ranks must be 0..{len(ranks) - 1} without gaps")
    return ranks


class TikTokenizer(Tokenizer):
    chat_format = "llama3"
    # tiktoken's Rust core slows down badly on very long inputs and runs of one character
    # class; encode in pieces that respect both limits (same limits as Meta's tokenizer).
    MAX_ENCODE_CHARS = 400_000
    MAX_RUN_CHARS = 25_000

    def __init__(self, path: str):
        import tiktoken

        self.path = path
        ranks = read_ranks(path)
        specials = llama3_special_tokens()
        self.special_tokens = {tok: len(ranks) + i for i, tok in enumerate(specials)}
        self.model = tiktoken.Encoding(
            name=Path(path).name, pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks,
            special_tokens=self.special_tokens)
        self.n_words = len(ranks) + len(specials)
        self.bos_id = self.special_tokens["<|begin_of_text|>"]
        self.eos_id = self.special_tokens["<|end_of_text|>"]
        self.eot_id = self.special_tokens["<|eot_id|>"]
        self.pad_id = self.special_tokens["<|finetune_right_pad_id|>"]

    def encode(self, text: str, *, bos: bool, eos: bool) -> list[int]:
        ids = [self.bos_id] if bos else []
        for start in range(0, len(text), self.MAX_ENCODE_CHARS):
            for piece in _split_long_runs(text[start:start + self.MAX_ENCODE_CHARS], self.MAX_RUN_CHARS):
                # Special-token text inside a document is plain text, never a control token.
                ids.extend(self.model.encode(piece, allowed_special=set(), disallowed_special=()))
        if eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.model.decode(ids)

    def save_pretrained(self, out_dir) -> None:
        """tokenizer.json (byte-level BPE with Llama 3's pattern, converted by transformers' own
        TikTokenConverter, and the special tokens at their ids), tokenizer_config.json and the Llama
        3 chat template (chat_template.jinja); BOS is added as Llama 3's HF tokenizers add it."""
        import tempfile

        from tokenizers import AddedToken, processors
        from transformers import PreTrainedTokenizerFast
        from transformers.convert_slow_tokenizer import TikTokenConverter

        with tempfile.TemporaryDirectory() as tmp:
            # The converter reads the file with tiktoken's loader, which caches files by path
            # (see read_ranks): a new path cannot give a stale copy.
            ranks = Path(tmp) / "ranks.tiktoken"
            ranks.write_bytes(Path(self.path).read_bytes())
            backend = TikTokenConverter(vocab_file=str(ranks), pattern=LLAMA3_PATTERN).converted()
        # Appended after the ranks, in order: the ids Meta's layout gives them.
        specials = [AddedToken(t, special=True, normalized=False) for t in self.special_tokens]
        backend.add_special_tokens(specials)
        moved = [t for t, i in self.special_tokens.items() if backend.token_to_id(t) != i]
        if moved:
            raise RuntimeError(f"HF tokenizer export: special tokens at the wrong ids ({moved[:3]})")
        bos = "<|begin_of_text|>"
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, self.bos_id)])
        hf = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos,
                                     eos_token="<|end_of_text|>", pad_token="<|finetune_right_pad_id|>",
                                     chat_template=LLAMA3_CHAT_TEMPLATE)
        hf.save_pretrained(str(out_dir))


def _split_long_runs(text: str, max_run: int):
    """Yield consecutive pieces of `text` such that no piece holds more than `max_run`
    consecutive whitespace or consecutive non-whitespace characters."""
    start = 0
    run = 0
    prev_space = None
    for i, ch in enumerate(text):
        space = ch.isspace()
        run = run + 1 if space == prev_space else 1
        prev_space = space
        if run > max_run:
            yield text[start:i]
            start, run = i, 1
    yield text[start:]
