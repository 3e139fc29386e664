"""Published per-chip figures of the TPU generations a plan can target, and slice names.

Every figure is Google Cloud's own, from the page in `source` (read 2026-11): HBM capacity and the
bidirectional inter-chip-interconnect (ICI) bandwidth per chip, the chips and DRAM of a whole host
(read 2026-12: "Chips per host" and "DRAM per host"; v5p's from "VM, host and slice properties");
the bf16 peaks are the MFU's (`peak_flops.PEAK_BF16_FLOPS`, same pages). The pages give no
bandwidth between a chip and its host's memory, so the plan does not time host offload.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torchtitan_xla.errors import ConfigError
from torchtitan_xla.peak_flops import PEAK_BF16_FLOPS

GiB = 2**30


@dataclass(frozen=True)
class Chip:
    name: str
    hbm_bytes: int
    peak_bf16_flops: float
    ici_bytes_per_s: float  # bidirectional, per chip
    cores_per_chip: int  # a slice name counts TensorCores on v4 / v5p, chips on v5e / v6e
    chips_per_host: int  # a whole host's (smaller v5e / v6e slices have smaller hosts)
    host_bytes: int  # DRAM of a whole host
    source: str


CHIPS = {
    name: Chip(name, hbm, PEAK_BF16_FLOPS[name], ici, cores, chips, dram,
               f"https://cloud.google.com/tpu/docs/{name}")
    for name, hbm, ici, cores, chips, dram in [("v5e", 16 * GiB, 400e9, 1, 8, 512 * GiB),
                                                ("v5p", 95 * GiB, 1200e9, 2, 4, 448 * 10**9),
                                                ("v6e", 32 * GiB, 800e9, 1, 8, 1536 * GiB)]
}
_ALIASES = {"v5litepod": "v5e", "v6lite": "v6e"}


@dataclass(frozen=True)
class Slice:
    name: str  # as given: "v5p-256"
    chip: Chip
    chips: int


def parse_slice(name: str) -> Slice:
    """"v5p-256" -> 128 v5p chips (v5p counts TensorCores); "v6e-256" -> 256 v6e chips."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", name.strip().lower())
    generation = _ALIASES.get(m.group(1), m.group(1)) if m else None
    if generation not in CHIPS:
        raise ConfigError(f"[plan] tpu = {name!r}: unknown TPU slice; expected <generation>-<size> with "
                          f"generation one of {', '.join(CHIPS)} (e.g. v5p-256, v6e-256)")
    chip, size = CHIPS[generation], int(m.group(2))
    if size % chip.cores_per_chip or size == 0:
        raise ConfigError(f"[plan] tpu = {name!r}: a {generation} slice size counts TensorCores, "
                          f"{chip.cores_per_chip} per chip")
    return Slice(name, chip, size // chip.cores_per_chip)
