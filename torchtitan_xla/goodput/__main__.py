"""python -m torchtitan_xla.goodput DUMP_FOLDER [--json]: a run's goodput over all its attempts."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from torchtitan_xla.errors import run_main

from .report import goodput


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtitan_xla.goodput", description=__doc__)
    parser.add_argument("dump_folder", help="the run's [job] dump_folder (a local folder, gs:// or s3://)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    report = goodput(args.dump_folder)
    print(json.dumps(asdict(report) | {"goodput": report.goodput}) if args.json else report)
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
