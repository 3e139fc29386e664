"""The two kinds of error a user sees as one line, and the one place that turns them into exit codes.

- `ConfigError`: bad input (a config key, a file, a launcher variable). Exit code 2, raised as early
  as the mistake can be known, before the run writes anything.
- `RunError`: the run itself failed (a full disk under a checkpoint, a loss that stays NaN). Exit
  code 1; what was written before is kept.

This module imports nothing heavy: the launcher and config validation use it before torch starts.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# Where a process started by launch/torchrun.py writes its error line (a file named by its RANK),
# for the launcher to print once instead of every process printing it.
ERROR_DIR_VAR = "TTX_ERROR_DIR"


class ConfigError(ValueError):
    """A user-facing input error: one line, reported without a traceback and exit code 2."""


class RunError(RuntimeError):
    """A failure of the run, not of its input (a full disk, a folder it may not write, a loss that
    stays non-finite): one line, reported without a traceback and exit code 1."""


def first_line(e: BaseException, *, typed: bool = True, limit: int = 300) -> str:
    """`Type: first line of the message` (an exception's text can be a whole traceback); without
    the type when `typed` is false, unless the message is empty."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if typed or not first:
        first = f"{type(e).__name__}: {first}" if first else type(e).__name__
    return first[:limit]


def exit_code_of(e: BaseException) -> int | None:
    """2 for bad input, 1 for a failed run, None for anything else (a bug: keep its traceback)."""
    if isinstance(e, ConfigError):
        return 2
    if isinstance(e, RunError):
        return 1
    return None


def run_main(main: Callable[[], int | None]) -> int:
    """Run a command-line entry point: a ConfigError or RunError becomes `error: <line>` on stderr
    and its exit code; the entry point's own return value is the exit code otherwise."""
    try:
        return main() or 0
    except (ConfigError, RunError) as e:
        code, line = exit_code_of(e), f"error: {e}"
        if os.environ.get(ERROR_DIR_VAR):
            with open(os.path.join(os.environ[ERROR_DIR_VAR], os.environ.get("RANK", "0")), "w") as fh:
                fh.write(f"{code} {line}")
        else:
            print(line, file=sys.stderr)
        return code  # type: ignore[return-value]
