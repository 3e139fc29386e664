"""torchrun for the native runtime's processes, with one line when they stop on bad input.

    python -m torchtitan_xla.launch.torchrun [torchrun options] train.py [train.py options]

Each of one process per device would print the same error line, and torchrun then prints its own
page (a ChildFailedError traceback and a table). Here the processes write their error line to a
folder instead (`ERROR_DIR_VAR`, read by errors.run_main); once torchrun reports the failure, the
lowest rank's line is printed, once, and the exit code is that process's (2: bad input, 1: the run
failed). A process that crashed (a bug) keeps its traceback; then one line says which one failed.
Anything the launcher could check before starting the processes it checked already
(launch/plan.py).
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from torchtitan_xla.errors import ERROR_DIR_VAR


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    folder = Path(tempfile.mkdtemp(prefix="ttx-torchrun-"))
    errors = folder / "errors"
    errors.mkdir()
    os.environ[ERROR_DIR_VAR] = str(errors)  # the processes inherit it
    # torchrun's agent logs each failed process at ERROR level: the line below says it once.
    os.environ.setdefault("LOGLEVEL", "CRITICAL")
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    if not any(a in ("-r", "--redirects") or a.startswith("--redirects=") for a in argv):
        # The processes log on stderr; their stdout holds only gloo's "[Gloo] Rank 0 is connected
        # to ..." per process group (printed by torch 2.9's gloo whatever the log level).
        argv = ["--redirects", "1", "--log-dir", str(folder / "logs"), *argv]
    try:
        run(parse_args(argv))
        return 0
    except ChildFailedError as e:
        reported = sorted(errors.iterdir(), key=lambda p: int(p.name))
        if reported:
            code, _, line = reported[0].read_text().partition(" ")
            print(line, file=sys.stderr)
            return int(code)
        rank, failure = min(e.failures.items())
        print(f"error: process {rank} failed with exit code {failure.exitcode} (its output is above)",
              file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
