"""`opt`: a config field with its default, help text and bounds (one helper for every section
module; torch-free)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str, *, gt: float | None = None, ge: float | None = None,
        le: float | None = None) -> Any:
    """A config field: its default, its help text (shown by --help and docs/config.md) and
    optional numeric bounds that are checked after all sources are merged."""
    meta = {"help": help, "gt": gt, "ge": ge, "le": le}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)
