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


def dump_flags(folder: str | Path, *, memory_scheduler: bool = False) -> str:
    """What to add to XLA_FLAGS for XLA to dump every compiled module (and its buffer assignment)
    into `folder`. `memory_scheduler`: the XLA CPU backend's memory-minimising scheduler instead of
    its default concurrency-optimised one, which runs a checkpointed block's recomputation beside
    its forward pass and so hides what activation checkpointing saves."""
    # The module after SPMD partitioning as well: its collectives carry the dtypes the TPU backend
    # gets. The CPU backend's later passes promote every bf16 collective to f32 (it has no bf16
    # all-gather), so the optimized CPU module cannot show a bf16 gather.
    flags = f"--xla_dump_to={folder} --xla_dump_hlo_pass_re=^spmd-partitioning$"
    return flags + " --xla_cpu_enable_concurrency_optimized_scheduler=false" if memory_scheduler else flags


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


def partitioned_hlo(optimized: str | Path) -> str:
    """The text of a dumped module (its optimized text's path) as SPMD partitioning left it (a
    module compiled for one device is not partitioned: its optimized text)."""
    optimized = Path(optimized)
    prefix = optimized.name.split(".cpu_after_optimizations")[0]
    found = list(optimized.parent.glob(f"{prefix}.*.after_spmd-partitioning.*.txt"))
    return (found[0] if found else optimized).read_text()


_COLLECTIVE = re.compile(
    r"= (\([^()]*\)|[a-z0-9]+\[[0-9,]*\]\S*) "
    r"(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"([a-z]+)(\d*)\[([0-9,]*)\]")


def _shape_bytes(shape: str) -> int:
    total = 0
    for kind, bits, dims in _SHAPE.findall(shape):
        total += _elements(dims) * (1 if kind == "pred" else int(bits or 32) // 8)
    return total


_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?(%[\w.-]+) = (\([^()]*\)|\S+) ")
_OPERAND = re.compile(r"%[\w.-]+")


def collective_ops(hlo_text: str) -> list[tuple[str, int, int, str]]:
    """Every collective of an optimized HLO module's text: (kind, bytes of its result per device,
    devices in its group, result shape).

    XLA CPU emits no reduce-scatter: it all-reduces and has each user keep its device's slice
    (indexed by partition-id), where TPU's pipeline makes one reduce-scatter of the pattern. Such
    an all-reduce is reported as the reduce-scatter, with the slice as its result."""
    lines = hlo_text.splitlines()
    users: dict[str, list[str]] = {}
    for line in lines:
        if m := _INSTRUCTION.match(line):
            for name in set(_OPERAND.findall(line[m.end():])):
                users.setdefault(name, []).append(line)
    out = []
    for line in lines:
        m = _COLLECTIVE.search(line)
        if not m:
            continue
        if g := _GROUPS_IOTA.search(line):
            group = int(g.group(2))
        elif g := _GROUPS_LIST.search(line):
            group = len(g.group(1).split(","))
        else:  # collective-permute has source_target_pairs, not groups
            group = 2
        kind, shape, size = m.group(2), m.group(1), _shape_bytes(m.group(1))
        name = _INSTRUCTION.match(line).group(1)
        if kind == "all-reduce" and group > 1 and _keeps_slices(users.get(name, []), size // group):
            kind, size = "reduce-scatter", size // group
        out.append((kind, size, group, shape))
    return out


def _keeps_slices(user_lines: list[str], slice_bytes: int) -> bool:
    """Whether every user indexes by partition-id and produces no more than one slice."""
    return bool(user_lines) and all(
        "%partition-id" in u and _shape_bytes(_INSTRUCTION.match(u).group(2)) <= slice_bytes
        for u in user_lines)


def collectives(hlo_text: str) -> dict[str, tuple[int, int]]:
    """{kind: (count, bytes of their results per device)} of an optimized HLO module's text
    (`collective_ops`): what one device receives (all-gather) or holds after each collective."""
    out: dict[str, tuple[int, int]] = {}
    for kind, size, _, _ in collective_ops(hlo_text):
        count, total = out.get(kind, (0, 0))
        out[kind] = (count + 1, total + size)
    return out


def with_partitioned_dtypes(ops: list[tuple[str, int, int, str]],
                            partitioned_text: str) -> list[tuple[str, int, int, str]]:
    """`collective_ops` of an optimized CPU module, each in the dtype SPMD partitioning gave it
    (`partitioned_hlo`), which is what the TPU backend moves: the CPU backend promotes bf16
    collectives to f32. Collectives are matched by kind (a reduction to a reduction), group and
    dimensions (else element count; a reduce-scatter's shape is the whole before the slice): where
    both modules hold as many of a match, in program order; else where the partitioned ones agree
    on one dtype. Collectives of a broadcast (zeros that later passes fold away) are left out."""
    broadcasts = {m.group(1) for line in partitioned_text.splitlines()
                  if (m := _INSTRUCTION.match(line)) and " broadcast(" in line}
    lines = [line for line in partitioned_text.splitlines() if _COLLECTIVE.search(line)]
    dtypes: dict[tuple, list[str]] = {}
    for (kind, _, group, shape), line in zip(collective_ops(partitioned_text), lines):
        operands = _OPERAND.findall(line.split("(", 1)[1].split(")", 1)[0])
        if shape.startswith("(") or (operands and all(o in broadcasts for o in operands)):
            continue
        for key in _keys(kind, shape, group):
            dtypes.setdefault(key, []).append(shape.split("[")[0])
    keys = [None if s.startswith("(") else next((k for k in _keys(kind, s, g) if k in dtypes), None)
            for kind, _, g, s in ops]
    taken: dict[tuple, int] = {}
    out = []
    for (kind, size, group, shape), key in zip(ops, keys):
        found = dtypes.get(key, [])
        if len(found) == keys.count(key):
            dtype = found[taken.setdefault(key, 0)]
            taken[key] += 1
        else:
            dtype = found[0] if found and len(set(found)) == 1 else None
        if dtype is not None:
            retyped = dtype + shape[shape.index("["):]
            size, shape = size * _shape_bytes(retyped) // _shape_bytes(shape), retyped
        out.append((kind, size, group, shape))
    return out


def _keys(kind: str, shape: str, group: int) -> tuple[tuple, tuple]:
    """A collective's match keys, the closer first: by dimensions, by element count."""
    dims = _SHAPE.match(shape).group(3)
    family = "reduce" if kind in ("all-reduce", "reduce-scatter") else kind
    return (family, dims, group), (family, _elements(dims), group)


def _elements(dims: str) -> int:
    n = 1
    for d in filter(None, dims.split(",")):
        n *= int(d)
    return n


_GROUPS_EXPLICIT = re.compile(r"(?:replica_groups|source_target_pairs)=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")
_GROUPS_IOTA_FULL = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?")


def _device_groups(line: str) -> list[list[int]]:
    """The device groups of one collective's line (a permute's (source, target) pairs)."""
    import numpy as np

    if m := _GROUPS_EXPLICIT.search(line):
        return [[int(d) for d in g.split(",") if d] for g in re.findall(r"\{([0-9,]*)\}", m.group(1))]
    if m := _GROUPS_IOTA_FULL.search(line):
        dims = [int(d) for d in m.group(3).split(",")]
        ids = np.arange(int(np.prod(dims))).reshape(dims)
        if m.group(4):
            ids = ids.transpose([int(p) for p in m.group(4).split(",")])
        return ids.reshape(int(m.group(1)), int(m.group(2))).tolist()
    return []


def collective_ops_on_mesh(hlo_text: str, mesh_shape: tuple[int, ...],
                           axis_names: tuple[str, ...]) -> list[tuple[str, int, str, frozenset]]:
    """`collective_ops`, each with the mesh axes its device groups span: (kind, bytes per device,
    result shape, axes). A device's mesh coordinates are its id unravelled over `mesh_shape` (the
    CPU backend's mesh; devices in order)."""
    import numpy as np

    lines = [line for line in hlo_text.splitlines() if _COLLECTIVE.search(line)]
    out = []
    for (kind, size, _, shape), line in zip(collective_ops(hlo_text), lines):
        axes = set()
        for group in _device_groups(line):
            coords = np.array(np.unravel_index(group, mesh_shape)).T
            axes |= {axis_names[i] for i in np.flatnonzero((coords != coords[0]).any(0))}
        out.append((kind, size, shape, frozenset(axes)))
    return out
