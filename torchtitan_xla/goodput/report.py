"""Goodput over every attempt of a run, from its ledger (ledger.py): the share of the
time from the first attempt's start to the last one's last event that went into training steps
that were kept, and where the rest went (MaxText's ml-goodput-measurement categories, named for
this trainer). A step is kept unless a later attempt resumed from a checkpoint before it: then
its time is wasted progress, and it is trained again."""

from __future__ import annotations

from dataclasses import dataclass, field

from .ledger import Ledger, read_attempts

BADPUT = ("initialization", "preparation", "checkpoint restore", "compile", "data loading",
          "checkpoint save", "other", "wasted progress", "between attempts")


@dataclass
class Report:
    total: float = 0.0
    productive: float = 0.0
    badput: dict[str, float] = field(default_factory=lambda: dict.fromkeys(BADPUT, 0.0))
    attempts: int = 0
    # (attempt number, the last step it finished, the step the next attempt resumed after)
    restarts: list[tuple[int, int, int]] = field(default_factory=list)
    wasted_steps: int = 0
    last_step: int = 0

    @property
    def goodput(self) -> float:
        return self.productive / self.total if self.total > 0 else 0.0

    def scalars(self) -> dict[str, float]:
        """For TensorBoard: goodput and each badput category, in % of the total time."""
        share = {"goodput/goodput(%)": 100 * self.goodput, "goodput/wasted_steps": self.wasted_steps}
        for name, seconds in self.badput.items():
            share[f"goodput/badput_{name.replace(' ', '_')}(%)"] = self.percent(seconds)
        return share

    def percent(self, seconds: float) -> float:
        return 100 * seconds / self.total if self.total > 0 else 0.0

    def __str__(self) -> str:
        lines = [f"goodput: {100 * self.goodput:.1f}% of {self.total:.1f} s over {self.attempts} attempt(s), "
                 f"up to step {self.last_step}",
                 f"  productive steps       {self.productive:10.1f} s  {100 * self.goodput:5.1f}%", "badput:"]
        for name, seconds in self.badput.items():
            lines.append(f"  {name:<22} {seconds:10.1f} s  {self.percent(seconds):5.1f}%")
        for attempt, done, resumed in self.restarts:
            lost = f"steps {resumed + 1}-{done} lost" if done > resumed else "nothing lost"
            lines.append(f"restart: attempt {attempt} stopped after step {done}, attempt {attempt + 1} "
                         f"resumed after step {resumed} ({lost})")
        return "\n".join(lines)


def _resumed_after(later: list[list[dict]]) -> int | None:
    """The step the next attempt that reached its first step resumed after; None if none did."""
    for events in later:
        for e in events:
            if e["event"] == "ready":
                return e["step"] - 1
    return None


def compute(attempts: list[list[dict]]) -> Report:
    r = Report(attempts=len(attempts))
    r.total = attempts[-1][-1]["t"] - attempts[0][0]["t"]
    for i, events in enumerate(attempts):
        resumed = _resumed_after(attempts[i + 1:])
        first = {}
        for e in events:
            first.setdefault(e["event"], e)
        start, stop = events[0]["t"], events[-1]["t"]
        accounted = 0.0
        devices = first.get("devices", {"t": stop})
        r.badput["initialization"] += devices["t"] - start
        accounted += devices["t"] - start
        for e in events:
            kind = e["event"]
            if kind == "step":
                seconds = e["end"] - e["start"]
                work = seconds - e["data"] - e["compile"]
                r.badput["data loading"] += e["data"]
                r.badput["compile"] += e["compile"]
                if resumed is not None and e["step"] > resumed:
                    r.badput["wasted progress"] += work
                    r.wasted_steps += 1
                else:
                    r.productive += work
                r.last_step = max(r.last_step, e["step"])
                accounted += seconds
            elif kind in ("restore", "save", "other"):
                name = {"restore": "checkpoint restore", "save": "checkpoint save", "other": "other"}[kind]
                r.badput[name] += e["seconds"]
                accounted += e["seconds"]
        # Preparation: until the first step, or the attempt's end if it never reached one.
        ready = first.get("ready", {"t": stop})
        restore = sum(e["seconds"] for e in events if e["event"] == "restore")
        r.badput["preparation"] += max(ready["t"] - devices["t"] - restore, 0.0)
        accounted += max(ready["t"] - devices["t"] - restore, 0.0)
        # The rest of the attempt: between steps, and after the last one (closing, exports).
        r.badput["other"] += max(stop - start - accounted, 0.0)
        if i + 1 < len(attempts):
            r.badput["between attempts"] += attempts[i + 1][0]["t"] - stop
            done = max((e["step"] for e in events if e["event"] == "step"), default=0)
            if resumed is not None:
                r.restarts.append((i + 1, done, resumed))
    return r


def goodput(dump_folder: str) -> Report:
    return compute(read_attempts(dump_folder))


def so_far(ledger: Ledger) -> Report:
    """The run's goodput up to now: its earlier attempts and this one's events."""
    return compute([*ledger.earlier, ledger.attempt()])
