"""Goodput: where a run's time goes over all its attempts. `Ledger` records one attempt's events
(ledger.py); `goodput(dump_folder)` adds them up (report.py); `python -m torchtitan_xla.goodput
DUMP_FOLDER` prints it."""

from .ledger import Ledger, read_attempts
from .report import BADPUT, Report, compute, goodput, so_far

__all__ = ["BADPUT", "Ledger", "Report", "compute", "goodput", "read_attempts", "so_far"]
