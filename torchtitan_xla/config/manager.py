"""Reading a JobConfig: defaults, then the TOML file, then command-line flags, then checks.

Every mistake a user can make in a config is a `ConfigError` whose message is one line naming the
file (or the command line), the key and what was expected.

This module imports neither torch nor torch_xla, so launch scripts can read a config cheaply.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from torchtitan_xla.config.checks import check_combinations
from torchtitan_xla.config.job_config import JobConfig
from torchtitan_xla.config.schema import fields_of, optional_inner, sections, type_name
from torchtitan_xla.config.sources import COMMAND_LINE, Sources, attributed
from torchtitan_xla.errors import ConfigError, run_main

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _from_toml(value: Any, tp: Any) -> Any:
    """Check a TOML value against the field type; raises ValueError with what was expected."""
    inner = optional_inner(tp)
    if inner is not None:
        return _from_toml(value, inner)
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"expected one of {', '.join(map(repr, typing.get_args(tp)))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {value!r}")
        return [_from_toml(v, typing.get_args(tp)[0]) for v in value]
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp}")  # a bug in this file, not user input


def _from_text(text: str, tp: Any) -> Any:
    """Parse a command-line string into the field type; raises ValueError."""
    inner = optional_inner(tp)
    if inner is not None:
        return None if text.lower() in ("", "none", "null") else _from_text(text, inner)
    origin = typing.get_origin(tp)
    if origin is list:
        return [_from_text(t.strip(), typing.get_args(tp)[0]) for t in text.split(",") if t.strip()]
    if origin is Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if str(c) == text:
                return c
        raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {text!r}")
    if tp is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    return text


def _check_bounds(value: Any, f: dataclasses.Field) -> str | None:
    if value is None or isinstance(value, (bool, str, list)):
        return None
    m = f.metadata
    if m.get("gt") is not None and not value > m["gt"]:
        return f"must be > {m['gt']:g}"
    if m.get("ge") is not None and not value >= m["ge"]:
        return f"must be >= {m['ge']:g}"
    if m.get("le") is not None and not value <= m["le"]:
        return f"must be <= {m['le']:g}"
    return None


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


def _load_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason})") from None


def _apply_toml(cfg: JobConfig, data: dict[str, Any], path: str, sources: Sources) -> None:
    known = sections()
    for sname, svalues in data.items():
        if sname not in known:
            raise ConfigError(f"{path}: unknown section [{sname}]{_did_you_mean(sname, list(known))}")
        if not isinstance(svalues, dict):
            raise ConfigError(f"{path}: [{sname}] must be a table, got {svalues!r}")
        fields = fields_of(known[sname])
        section = getattr(cfg, sname)
        for key, value in svalues.items():
            if key not in fields:
                raise ConfigError(
                    f"{path}: unknown key [{sname}] {key}{_did_you_mean(key, list(fields))}")
            tp, _ = fields[key]
            try:
                setattr(section, key, _from_toml(value, tp))
            except ValueError as e:
                raise ConfigError(f"{path}: [{sname}] {key}: {e}") from None
            sources.set(sname, key, path)


def _all_flags() -> dict[str, tuple[str, str, Any]]:
    """'section.key' -> (section, key, type) for every option."""
    out = {}
    for sname, scls in sections().items():
        for key, (tp, _) in fields_of(scls).items():
            out[f"{sname}.{key}"] = (sname, key, tp)
    return out


def _split_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """Turn argv into (flag, value-or-None) pairs; a bare boolean flag has value None."""
    flags = _all_flags()
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            raise ConfigError(
                f"command line: unexpected argument {tok!r} (options look like --section.key value)")
        name, eq, inline = tok[2:].partition("=")
        section, dot, key = name.partition(".")
        key = key.replace("-", "_")
        section = section.replace("-", "_")
        flag = f"{section}.{key}"
        negated = flag not in flags and key.startswith("no_") and f"{section}.{key[3:]}" in flags
        if negated:
            flag = f"{section}.{key[3:]}"
            if flags[flag][2] is not bool:
                raise ConfigError(f"command line: --{name} is only valid for boolean options")
            if eq:
                raise ConfigError(f"command line: --{name} takes no value")
            pairs.append((flag, "false"))
            i += 1
            continue
        if flag not in flags:
            close = difflib.get_close_matches(flag, list(flags), n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            raise ConfigError(f"command line: unknown option --{name}{hint}")
        tp = flags[flag][2]
        if eq:
            pairs.append((flag, inline))
            i += 1
        elif tp is bool:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and nxt.lower() in _TRUE | _FALSE:
                pairs.append((flag, nxt))
                i += 2
            else:
                pairs.append((flag, None))
                i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: --{name} needs a value ({type_name(tp)})")
            pairs.append((flag, argv[i + 1]))
            i += 2
    return pairs


def _validate(cfg: JobConfig, sources: Sources) -> None:
    for sname, scls in sections().items():
        section = getattr(cfg, sname)
        for key, (_, f) in fields_of(scls).items():
            problem = _check_bounds(getattr(section, key), f)
            if problem:
                raise ConfigError(f"{sources.describe(sname, key)} = {getattr(section, key)!r}: {problem}")
    check_combinations(cfg, sources)


def parse_args(argv: list[str] | None = None, *, usage: str | None = None) -> JobConfig:
    """Build the JobConfig from defaults, then the TOML file, then command-line flags. `-h` /
    `--help` prints every option under `usage` (the entry point's own; train.py's by default)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        from torchtitan_xla.config.reference import TRAIN_USAGE, help_text

        print(help_text(usage or TRAIN_USAGE))
        raise SystemExit(0)
    pairs = _split_cli(argv)
    cfg = JobConfig()
    sources = Sources()
    config_file = next((v for f, v in pairs if f == "job.config_file"), None)
    if config_file:
        _apply_toml(cfg, _load_toml(config_file), config_file, sources)
    flags = _all_flags()
    for flag, text in pairs:
        sname, key, tp = flags[flag]
        try:
            value = True if text is None else _from_text(text, tp)
        except ValueError as e:
            raise ConfigError(f"command line: --{flag}: {e}") from None
        setattr(getattr(cfg, sname), key, value)
        sources.set(sname, key, COMMAND_LINE)
    _validate(cfg, sources)
    cfg._sources = sources  # for errors found after parsing (config/sources.py)
    return cfg


def run_command(main, usage: str) -> int:
    """A `python -m torchtitan_xla.<command>` entry point: `main(job_config)` on the command line's
    config, an error naming the file or flag that set its key; returns the exit code."""
    def cli() -> None:
        job_config = parse_args(usage=usage)
        with attributed(job_config):
            main(job_config)

    return run_main(cli)
