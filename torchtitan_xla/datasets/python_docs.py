"""The embedded default corpus: the Python standard library's own documentation text.

`pydoc_data.topics` ships with every CPython (it backs `help("topics")`): about 465k characters
of real English prose in 79 topics, so the default job and the tests run offline on a fresh
machine without copying a corpus into this repository. Each topic is one document.
`conversations()` makes the python_docs_chat set from them: short questions and answers per
topic, for trying instruction tuning offline.
"""

from __future__ import annotations

import hashlib
import re
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


# --------------------------------------------------------------------------------------------
# python_docs_chat: a question/answer set made from the topics (instruction tuning, offline)
# --------------------------------------------------------------------------------------------

QUESTIONS = ("What does the Python reference say about {}?", "Explain {} in Python.",
             "Can you summarise {} for me?", "I'm learning Python. What should I know about {}?")
SYSTEM_PROMPTS = ("You are a concise assistant who answers questions about the Python language.",
                  "Answer with the relevant passage of the Python documentation.")
FOLLOW_UP = "Tell me more."
MAX_ANSWER_CHARS = 200  # short answers: several conversations fit a 256-token sequence
CONVERSATIONS_PER_TOPIC = 8


@lru_cache(maxsize=1)
def conversations() -> tuple[tuple[list[dict[str, str]], ...], ...]:
    """Per topic (in documents() order), up to CONVERSATIONS_PER_TOPIC conversations over its
    paragraphs in order: a user asks about the topic (one of four phrasings) and the assistant
    answers with the next paragraph. Every third conversation starts with a system message; every
    other one asks FOLLOW_UP, answered with the paragraph after."""
    out = []
    k = 0  # conversations so far: varies phrasing, system message and follow-up
    for doc in documents():
        title, answers = _title(doc), _paragraphs(doc)
        topic, j = [], 0
        while j < len(answers) and len(topic) < CONVERSATIONS_PER_TOPIC:
            messages = [{"role": "system", "content": SYSTEM_PROMPTS[k // 3 % 2]}] if k % 3 == 0 else []
            messages += [{"role": "user", "content": QUESTIONS[k % len(QUESTIONS)].format(title)},
                         {"role": "assistant", "content": _shorten(answers[j])}]
            j += 1
            if k % 2 == 1 and j < len(answers):
                messages += [{"role": "user", "content": FOLLOW_UP},
                             {"role": "assistant", "content": _shorten(answers[j])}]
                j += 1
            topic.append(messages)
            k += 1
        out.append(tuple(topic))
    return tuple(out)


def _title(doc: str) -> str:
    """The topic's heading, lower-cased to read inside a question ("the "assert" statement")."""
    return " ".join(w if w == "Python" else w.lower() for w in doc.split("\n", 1)[0].split())


def _paragraphs(doc: str) -> list[str]:
    """The topic's prose paragraphs (lines re-joined), each with the indented code or grammar
    block that follows it; headings, version notes and the title are skipped."""
    out: list[str] = []
    for block in re.split(r"\n\s*\n", doc)[1:]:
        if not block.strip():
            continue
        lines = block.rstrip().split("\n")
        if block[0].isspace():
            if out:
                out[-1] += "\n\n" + "\n".join(lines)
        elif not (len(lines) > 1 and set(lines[1]) <= set("=-*^")
                  or block.startswith(("New in version", "Changed in version", "Deprecated since",
                                       "**Source code:**"))):
            out.append(" ".join(line.strip() for line in lines))
    return out


def _shorten(text: str) -> str:
    """At most MAX_ANSWER_CHARS, cut after a sentence or at a line end."""
    if len(text) <= MAX_ANSWER_CHARS:
        return text
    head = text[:MAX_ANSWER_CHARS]
    cut = max(head.rfind(". "), head.rfind(".\n")) + 1
    if cut < MAX_ANSWER_CHARS // 2:
        cut = head.rfind("\n")
    return head[:cut].rstrip() if cut > 0 else head[:head.rfind(" ")] + " ..."
