"""torchrun for the native runtime's processes, with one line when they stop on bad input.

    python -m torchtitan_xla.launch.torchrun [torchrun options] train.py [train.py options]

Each of one process per device would print the same error line, and torchrun then prints its own
page (a ChildFailedError traceback and a table). run_train.sh gives the processes an empty folder
(`TTX_ERROR_DIR`) where they write their error line instead (errors.run_main), and LOGLEVEL=CRITICAL
for torchrun's agent; once torchrun reports the failure, the lowest rank's line is printed, once,
and the exit code is that process's (2: bad input, 1: the run failed); the folder is deleted. A
process that crashed (a bug) keeps its traceback; then one line says which one failed. Anything
the launcher could check before starting the processes it checked already (launch/plan.py).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from torchtitan_xla.errors import ERROR_DIR_VAR


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    errors = Path(os.environ[ERROR_DIR_VAR]) if os.environ.get(ERROR_DIR_VAR) else None
    logs = tempfile.mkdtemp(prefix="ttx-torchrun-logs-")
    if not any(a in ("-r", "--redirects") or a.startswith("--redirects=") for a in argv):
        # The processes log on stderr; their stdout holds only gloo's "[Gloo] Rank 0 is connected
        # to ..." per process group (printed by torch 2.9's gloo whatever the log level).
        argv = ["--redirects", "1", "--log-dir", logs, *argv]
    try:
        run(parse_args(argv))
        return 0
    except ChildFailedError as e:
        reported = sorted(errors.iterdir(), key=lambda p: int(p.name)) if errors else []
        if reported:
            code, _, line = reported[0].read_text().partition(" ")
            print(line, file=sys.stderr)
            return int(code)
        rank, failure = min(e.failures.items())
        print(f"error: process {rank} failed with exit code {failure.exitcode} (its output is above)",
              file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(logs, ignore_errors=True)
        if errors:
            shutil.rmtree(errors, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
