"""XLA's own accounting of the programs it compiled: the buffer assignment it dumps for each
module (every allocation, what lives in it, the total), read back from `--xla_dump_to`.

The dump is switched on by XLA_FLAGS before XLA starts (`dump_flags`), so a measurement runs in a
fresh process; bench/ and the tests do that.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

_ALLOCATION = re.compile(r"^allocation \d+: size (\d+), (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=\d+\): (.*)$")
_TOTAL = re.compile(r"^Total bytes used: (\d+)")


def dump_flags(folder: str | Path) -> str:
    """What to add to XLA_FLAGS for XLA to dump every compiled module (and its buffer assignment)
    into `folder`."""
    return f"--xla_dump_to={folder}"


@dataclass
class BufferAssignment:
    """One compiled module's memory as XLA assigned it."""

    module: str
    total_bytes: int  # every allocation: parameters, outputs, constants, temporaries
    temp_bytes: int  # the preallocated temporary buffer: what the program needs beyond its inputs
    parameter_bytes: int
    temporaries: list[tuple[int, str, str]] = field(default_factory=list)  # (bytes, name, shape)

    def largest_temporary(self) -> tuple[int, str, str]:
        return max(self.temporaries, default=(0, "", ""))


def parse_buffer_assignment(text: str, module: str = "") -> BufferAssignment:
    total = temp = params = 0
    temporaries, in_temp = [], False
    for line in text.splitlines():
        if m := _ALLOCATION.match(line):
            size, kind = int(m.group(1)), m.group(2)
            in_temp = "preallocated-temp" in kind
            temp += size if in_temp else 0
            params += size if kind.startswith("parameter") else 0
        elif in_temp and (m := _VALUE.match(line)):
            temporaries.append((int(m.group(2)), m.group(1), m.group(3)))
        elif m := _TOTAL.match(line):
            total = int(m.group(1))
    return BufferAssignment(module, total, temp, params, temporaries)


def read_buffer_assignments(folder: str | Path) -> list[BufferAssignment]:
    """Every module XLA dumped into `folder`, in compile order."""
    files = sorted(Path(folder).glob("*after_optimizations-buffer-assignment.txt"))
    return [parse_buffer_assignment(f.read_text(), f.name.split(".cpu_")[0]) for f in files]


_COLLECTIVE = re.compile(
    r"= (\(?[a-z0-9]+\[[0-9,]*\][^ ]*(?:, [a-z0-9]+\[[0-9,]*\][^ ]*)*\)?) "
    r"(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+)(\d*)\[([0-9,]*)\]")


def _shape_bytes(shape: str) -> int:
    total = 0
    for kind, bits, dims in _SHAPE.findall(shape):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        width = 1 if kind == "pred" else int(bits or 32) // 8
        total += n * width
    return total


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes of their results per device)} of an optimized HLO module's text:
    what one device receives (all-gather) or holds after each collective."""
    out: dict[str, tuple[int, int]] = {}
    for shape, kind in _COLLECTIVE.findall(hlo_text):
        count, size = out.get(kind, (0, 0))
        out[kind] = (count + 1, size + _shape_bytes(shape))
    return out
