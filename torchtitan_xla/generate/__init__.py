"""Generation with a KV cache on the shared model (generator.py, cache.py, sampling.py) and its
command, `python -m torchtitan_xla.generate` (__main__.py; docs/generation.md)."""

from torchtitan_xla.generate.cache import KVCache
from torchtitan_xla.generate.generator import Completion, Generator, check_fits
from torchtitan_xla.generate.sampling import Sampling, next_tokens

__all__ = ["Completion", "Generator", "KVCache", "Sampling", "check_fits", "next_tokens"]
