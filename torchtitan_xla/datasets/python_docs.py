"""The embedded default corpus: the Python standard library's own documentation text.

`pydoc_data.topics` ships with every CPython (it backs `help("topics")`): about 465k characters
of real English prose in 79 topics, so the default job and the tests run offline on a fresh
machine without copying a corpus into this repository. Each topic is one document.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache


@lru_cache(maxsize=1)
def documents() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    # Sorted by topic name, so the order (and everything trained on it) is deterministic.
    return tuple(topics[name] for name in sorted(topics))


def fingerprint() -> str:
    """A short hash of the corpus; caches derived from it (the tokenizer) are keyed by it."""
    h = hashlib.sha256()
    for doc in documents():
        h.update(doc.encode())
        h.update(b"\0")
    return h.hexdigest()[:12]
