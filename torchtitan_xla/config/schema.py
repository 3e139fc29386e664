"""The schema's shape, read from the dataclasses of job_config.py: its sections, each section's
fields with their types, and how a type is named in messages and the reference. Shared by the
reader (manager.py) and the reference (reference.py), so neither imports the other."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal

from torchtitan_xla.config.job_config import JobConfig


def sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def fields_of(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(section_cls, include_extras=True)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def optional_inner(tp: Any) -> Any | None:
    """The T in Optional[T], or None if `tp` is not optional."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_name(tp: Any) -> str:
    inner = optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} (optional)"
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return tp.__name__
