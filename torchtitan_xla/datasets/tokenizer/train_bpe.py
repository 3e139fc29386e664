"""Train the project's small Llama-3-format tokenizer from the embedded corpus.

    python -m torchtitan_xla.datasets.tokenizer.train_bpe --out tokenizer.model [--vocab-size 2000]

Byte-level BPE with Llama 3's pre-tokenisation regex, trained by HuggingFace `tokenizers` and written
in tiktoken's rank-file format (ids in merge order, all 256 bytes present), so `TikTokenizer` reads
it exactly like Meta's file. Training is deterministic for a given corpus and vocab size; the default
tokenizer is trained on first use and cached, keyed by the corpus fingerprint.
"""

from __future__ import annotations

import argparse
import base64
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from torchtitan_xla.datasets.tokenizer.tiktoken import LLAMA3_PATTERN

DEFAULT_VOCAB_SIZE = 2000  # + 256 special tokens = 2256 ids, torchtitan's debug tokenizer size


def _byte_decoder() -> dict[str, int]:
    """Inverse of the byte-level alphabet: printable stand-in character -> byte value."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps printable latin-1 bytes to themselves and the rest to chr(256 + k) in
    # byte order (GPT-2's scheme); rebuild that mapping and check it covers the alphabet.
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    assert set(chars) == set(alphabet), "unexpected byte-level alphabet"
    return chars


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> dict[bytes, int]:
    """Ranks {token bytes: rank} of a byte-level BPE trained on `texts`."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False, special_tokens=[])
    tok.train_from_iterator(list(texts), trainer)
    decoder = _byte_decoder()
    ranks = {bytes(decoder[c] for c in token): rank for token, rank in tok.get_vocab().items()}
    assert sorted(ranks.values()) == list(range(len(ranks)))
    return ranks


def write_ranks(ranks: dict[bytes, int], path: Path) -> None:
    """Write a tiktoken rank file atomically (concurrent first runs cannot see a partial file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    by_rank = sorted(ranks.items(), key=lambda kv: kv[1])
    lines = [f"{base64.b64encode(tok).decode()} {rank}\n" for tok, rank in by_rank]
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    with os.fdopen(fd, "w") as fh:
        fh.writelines(lines)
    os.replace(tmp, path)


def cache_dir() -> Path:
    root = os.environ.get("TORCHTITAN_XLA_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "torchtitan_xla")
    return Path(root)


def default_tokenizer_path(vocab_size: int = DEFAULT_VOCAB_SIZE) -> Path:
    """The debug tokenizer for the embedded corpus, trained on first use (about a second)."""
    from torchtitan_xla.datasets import python_docs

    path = cache_dir() / f"python_docs_bpe{vocab_size}_{python_docs.fingerprint()}.tiktoken"
    if not path.is_file():
        write_ranks(train_bpe(python_docs.documents(), vocab_size), path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="rank file to write")
    ap.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    ap.add_argument("--input", type=Path, help="a text file to train on instead of the embedded corpus")
    args = ap.parse_args()
    if args.input:
        texts = [args.input.read_text()]
    else:
        from torchtitan_xla.datasets import python_docs

        texts = python_docs.documents()
    write_ranks(train_bpe(texts, args.vocab_size), args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
