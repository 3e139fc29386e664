"""Multi-host launch, as run_train.sh calls it: the same command runs on every host, and XLA SPMD
runs one process per host that drives all of the host's chips.

    python -m torchtitan_xla.launch --exports     [train.py options]  # `export` lines, for eval
    python -m torchtitan_xla.launch --dry-run     [train.py options]  # per host: command + env
    python -m torchtitan_xla.launch --check-hosts [train.py options]  # join the hosts, compare data
    python -m torchtitan_xla.launch --cpu-devices [train.py options]  # virtual CPU devices needed
    python -m torchtitan_xla.launch --dump-folder [train.py options]  # its local output folder

Bad input is one line and exit code 2, before anything starts (docs/multihost.md).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

from torchtitan_xla.config import attributed, parse_args
from torchtitan_xla.errors import run_main
from torchtitan_xla.launch.plan import cpu_device_count, dry_run_text, plan

MODES = ("--cpu-devices", "--exports", "--dry-run", "--check-hosts", "--dump-folder")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in MODES:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    mode, args = argv[0], argv[1:]
    job_config = parse_args(args)
    with attributed(job_config):  # an error names the file or flag that set its key
        _run(mode, args, job_config)
    return 0


def _run(mode: str, args: list[str], job_config) -> None:
    if mode == "--cpu-devices":
        print(cpu_device_count(job_config))
    elif mode == "--dump-folder":
        from torchtitan_xla.storage import local_outputs

        print(local_outputs(job_config.job.dump_folder))  # for the host logs: a local folder
    elif mode == "--exports":
        _, variables = plan(job_config)
        print("\n".join(f"export {k}={shlex.quote(v)}" for k, v in sorted(variables.items())))
    elif mode == "--dry-run":
        command = [sys.executable, str(Path(__file__).resolve().parents[2] / "train.py"), *args]
        print(dry_run_text(job_config, command))
    else:
        import json

        from torchtitan_xla.launch.host_group import check_hosts

        print("CHECK_HOSTS " + json.dumps(check_hosts(job_config)), flush=True)


if __name__ == "__main__":
    sys.exit(run_main(lambda: main(sys.argv[1:])))
