"""Where each config value came from (the TOML file, the command line, or the default), so that an
error found long after parsing still names the file and key, or the flag, the user wrote.

Code that builds the run raises `ConfigError("[section] key: ...")`: it knows the key, not where its
value came from. The entry points run inside `attributed(job_config)`, which rewrites that leading
`[section] key` into `file: [section] key` or `command line: --section.key`. Imports nothing heavy.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from torchtitan_xla.errors import ConfigError

COMMAND_LINE = "command line"
_KEY = re.compile(r"\[(\w+)\] (\w+)(?=\W|$)")


class Sources:
    """(section, key) -> the file (or "command line") that set it; unset keys are defaults."""

    def __init__(self) -> None:
        self._where: dict[tuple[str, str], str] = {}

    def set(self, section: str, key: str, where: str) -> None:
        self._where[(section, key)] = where

    def keys(self) -> list[tuple[str, str]]:
        return list(self._where)

    def origin(self, section: str, key: str) -> str | None:
        return self._where.get((section, key))

    def describe(self, section: str, key: str) -> str:
        where = self.origin(section, key)
        if where == COMMAND_LINE:
            return f"command line: --{section}.{key}"
        return f"{where or 'default'}: [{section}] {key}"


def sources_of(job_config: Any) -> Sources:
    """The Sources that parse_args recorded on `job_config` (empty for a config built in code)."""
    return getattr(job_config, "_sources", None) or Sources()


def where(job_config: Any, section: str, key: str) -> str:
    """`file: [section] key`, `command line: --section.key`, or `[section] key` for a default."""
    sources = sources_of(job_config)
    return sources.describe(section, key) if sources.origin(section, key) else f"[{section}] {key}"


def attribute(message: str, job_config: Any) -> str:
    """`message` with a leading `[section] key` replaced by where that key's value was set, and the
    origins of the other keys it names (`x (64) must divide y (3)`) added at the end: any set key of
    the same section, and of other sections those whose names cannot be plain words (`seq_len`)."""
    m = _KEY.match(message)
    if not m:
        return _attribute_path(message, job_config)
    section, key = m.group(1), m.group(2)
    rest = message[m.end():]
    sources = sources_of(job_config)
    found = [(hit.start(), k, sources.origin(s, k)) for (s, k) in sources.keys()
             if (s == section and k != key or s != section and "_" in k)
             and (hit := re.search(rf"\b{k}\b", rest))]
    named = [f"{k} from {'the command line' if o == COMMAND_LINE else o}" for _, k, o in sorted(found)]
    return where(job_config, section, key) + rest + (f" ({'; '.join(named)})" if named else "")


def _attribute_path(message: str, job_config: Any) -> str:
    """`message` that starts with a path or URL a key was set to (storage errors know the URL, not
    the key) with where that key was set in front."""
    sources = sources_of(job_config)
    paths = [(value, s, k) for s, k in sources.keys() if (s, k) != ("job", "config_file")
             and isinstance(value := getattr(getattr(job_config, s, None), k, None), str)
             and ("/" in value or "://" in value) and message.startswith(value)]
    if not paths:
        return message
    _, section, key = max(paths, key=lambda p: len(p[0]))
    return f"{where(job_config, section, key)}: {message}"


@contextmanager
def attributed(job_config: Any) -> Iterator[None]:
    """ConfigErrors raised inside name the file or flag their key came from."""
    try:
        yield
    except ConfigError as e:
        raise ConfigError(attribute(str(e), job_config)) from None


@contextmanager
def renamed_keys(names: dict[tuple[str, str], tuple[str, str]]) -> Iterator[None]:
    """ConfigErrors raised inside about key `(section, key)` name `names[(section, key)]` instead: for
    code that reads one section's values from another's keys (validation data built as training's)."""
    try:
        yield
    except ConfigError as e:
        m, text = _KEY.match(str(e)), str(e)
        if m and (m.group(1), m.group(2)) in names:
            section, key = names[(m.group(1), m.group(2))]
            raise ConfigError(f"[{section}] {key}{text[m.end():]}") from None
        raise
