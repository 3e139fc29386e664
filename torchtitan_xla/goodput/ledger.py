"""The goodput ledger: what each attempt of a run spent its time on, written as it happens into
<dump_folder>/goodput/, one file per attempt, so that a restart never touches an earlier attempt's
record. `python -m torchtitan_xla.goodput DUMP_FOLDER` adds the attempts up (report.py).

Each line is one JSON event with its wall-clock time "t" (seconds since the epoch):
  start    train.main began (before torch's import)
  devices  the devices and process groups are up
  restore  reading the checkpoint resumed from, or the initial weights: "seconds"
  ready    the first step starts: "step", its number (so the step this attempt resumed after)
  step     one training step: "step", "start", "end", "data" (seconds waiting for its batch),
           "compile" (seconds compiling)
  save     a checkpoint's blocking part: "step", "seconds"
  other    validation: "what", "seconds" (the end's evaluation and exports lie between the last
           step and "end")
  end      the run returned: "step", the last step
A process killed while writing leaves at most its last line incomplete; the reader skips it.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from contextlib import contextmanager

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.logging import logger
from torchtitan_xla.storage import is_url, join, listdir, makedirs, read_text, write_text

LEDGER_FOLDER = "goodput"
# An object store cannot append: the attempt's object is rewritten whole (atomically) at most this
# often, and at every checkpoint save and at the end.
BUCKET_FLUSH_S = 30.0


class Ledger:
    """This attempt's events. Until `open` (once the run's inputs are checked and it starts writing)
    they wait in memory; then a local file takes each as it comes (nothing kept in memory), an
    object store's copy is rewritten from memory. `writer=False` (every process but the first):
    nothing is kept."""

    def __init__(self, started: float, *, writer: bool = True):
        self.events: list[dict] = []
        self.writer = writer
        self.path: str | None = None
        self._file = None
        self._flushed = 0.0
        self.earlier: list[list[dict]] = []  # the run's earlier attempts, read at `open`
        self.record("start", t=started, pid=os.getpid())

    def open(self, dump_folder: str) -> None:
        if not self.writer:
            return
        folder = join(dump_folder, LEDGER_FOLDER)
        makedirs(folder)
        self.earlier = read_attempts(dump_folder, missing_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(self.events[0]["t"]))
        # Unique even for two attempts of one process in the same second (tests run several).
        self.path = join(folder, f"attempt-{stamp}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl")
        if not is_url(self.path):
            self._file = open(self.path, "x", encoding="utf-8")  # noqa: SIM115 (open for the run)
        self._write(self.events, force=True)
        if self._file is not None:
            self.events = []

    def record(self, event: str, *, t: float | None = None, **fields) -> None:
        entry = {"event": event, "t": time.time() if t is None else t, **fields}
        if self._file is not None:  # a local file: the events are read back from it, not kept
            self._write([entry], force=True)
        elif self.writer:
            self.events.append(entry)
            if self.path is not None:
                self._write([entry], force=event in ("save", "end"))

    def attempt(self) -> list[dict]:
        """This attempt's events so far."""
        return _parse(read_text(self.path)) if self._file is not None else self.events

    @contextmanager
    def span(self, event: str, **fields):
        """Record `event` with the seconds its block took (also when the block raises)."""
        start = time.time()
        try:
            yield
        finally:
            self.record(event, seconds=time.time() - start, **fields)

    def _write(self, entries: list[dict], *, force: bool) -> None:
        try:
            if self._file is not None:
                # One write per event: a kill leaves every earlier line whole (no fsync: the page
                # cache outlives the process; only the machine's crash could lose them).
                self._file.write("".join(json.dumps(e) + "\n" for e in entries))
                self._file.flush()
            elif force or time.time() - self._flushed >= BUCKET_FLUSH_S:
                write_text(self.path, "".join(json.dumps(e) + "\n" for e in self.events))
                self._flushed = time.time()
        except OSError as e:  # a full disk or a lost bucket must not stop the training
            logger.warning(f"goodput ledger {self.path}: {e}; no more events are recorded")
            self.writer, self._file = False, None

    def close(self, step: int) -> None:
        self.record("end", step=step)
        if self._file is not None:
            self._file.close()
        self.writer, self._file = False, None  # nothing after the end


def read_attempts(dump_folder: str, *, missing_ok: bool = False) -> list[list[dict]]:
    """Each attempt's events, oldest attempt first. A line cut short by a kill is skipped."""
    folder = join(dump_folder, LEDGER_FOLDER)
    names = [n for n in listdir(folder) if n.startswith("attempt-") and n.endswith(".jsonl")]
    attempts = []
    for n in names:
        events = _parse(read_text(join(folder, n)))
        if events and events[0]["event"] == "start":
            attempts.append(events)
    if not attempts and not missing_ok:
        raise ConfigError(f"{dump_folder}: no goodput ledger ({LEDGER_FOLDER}/attempt-*.jsonl); is it "
                          f"a run's [job] dump_folder, run with [metrics] goodput = true?")
    return sorted(attempts, key=lambda events: events[0]["t"])


def _parse(text: str) -> list[dict]:
    events = []
    for line in text.splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a process killed while writing it
            continue
    return events
