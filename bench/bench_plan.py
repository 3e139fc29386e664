"""Calibrate the plan's activation model against XLA's own accounting of the compiled step.

    python bench/bench_plan.py --points 64 --out /tmp/plan_grid.jsonl     # measure (minutes)
    python bench/bench_plan.py --fit /tmp/plan_grid.jsonl                  # fit, print coefficients
    python bench/bench_plan.py --roofline                                  # docs/performance.md's table
    python bench/bench_plan.py --audit                                     # docs/plan.md's audit table

Measuring compiles one training step per point of a seeded random grid (depth, width, heads, seq,
batch, vocabulary, activation-checkpointing policy, attention, chunked loss, mesh) on 1 and on 8
virtual XLA CPU devices and records the temporary bytes of its buffer assignment
(torchtitan_xla/plan/calibrate.py). Fitting solves for `plan.memory.COEFFICIENTS` with the
smallest worst relative error over all points and prints the errors; paste the printed table into
plan/memory.py. The test (tests/test_plan.py) compiles its own, smaller grid.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchtitan_xla.plan.calibrate import calibration_shape, grid_point  # noqa: E402

POLICIES = ("none", "full", "op", "every-2")
MESHES = {1: ["1"], 8: ["fsdp8", "fsdp4tp2", "hsdp2x4"]}
FSDP_DEGREE = {"1": 1, "fsdp8": 8, "fsdp4tp2": 4, "hsdp2x4": 4}
# Programs the audit shows gathering what they should not (docs/plan.md): left out of the fit,
# whose model is of well-partitioned steps. Blockwise attention's products fold batch and heads
# into one dimension, so under fsdp x tp XLA gathers the heads; under HSDP (a batch split over two
# axes) blockwise attention with the chunked loss makes XLA gather the loss loop's [vocabulary,
# tokens] buffers over all devices (sdpa with the chunked loss does not; all of HSDP's chunked
# points are left out all the same).
KNOWN_GATHERS = {("fsdp4tp2", "blockwise"), ("hsdp2x4", True)}


def random_grid(n: int, devices: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    points = []
    while len(points) < n:
        seq, batch, vocab = rng.choice([128, 256, 512]), rng.choice([2, 4, 8]), rng.choice([2256, 4096, 8192])
        mesh = rng.choice(MESHES[devices])
        # The regime of real runs: activations outweigh the (sharded) weights, and an FSDP group
        # holds more tokens than vocabulary entries, so XLA gathers the embedding (with fewer it
        # looks tokens up in the shards instead).
        if seq * batch < 1024 or seq * batch * FSDP_DEGREE[mesh] < vocab:
            continue
        attention, chunk = rng.choice(["sdpa", "blockwise"]), rng.choice([0, 128])
        if (mesh, attention) in KNOWN_GATHERS or (mesh, chunk > 0) in KNOWN_GATHERS:
            continue
        points.append(grid_point(
            n_layers=rng.choice([2, 3, 4]), dim=rng.choice([128, 256, 384]),
            heads=rng.choice([8, 16]), seq=seq, batch=batch, vocab=vocab,
            policy=rng.choice(POLICIES), attention=attention, chunk=chunk, mesh=mesh,
            ffn_multiplier=rng.choice([None, 1.5, 2.0])))
    return points


def measure(n: int, out: Path, seed: int) -> None:
    from torchtitan_xla.plan.calibrate import measure as compile_and_read

    done = [json.loads(line)["devices"] for line in out.read_text().splitlines()] if out.exists() else []
    with out.open("a") as f:
        for devices in (1, 8):  # resumes after the points `out` already has
            points = random_grid(n // 2, devices, seed + devices)[done.count(devices):]
            for i in range(0, len(points), 8):  # a batch per process: a failure loses only 8
                batch = points[i:i + 8]
                for point, result in zip(batch, compile_and_read(batch, devices)):
                    f.write(json.dumps({**point, "devices": devices, **result}) + "\n")
                    f.flush()
                print(f"{devices} devices: {min(i + 8, len(points))}/{len(points)}", flush=True)


def fit(paths: list[Path]) -> None:
    """Per policy, the non-negative coefficients whose worst relative error over the grid is
    smallest (the acceptance is a bound at every point, not an average). Prints the coefficients,
    the errors by policy and mesh, and those of 5-fold cross-validation (what to expect on shapes
    the fit did not see)."""
    import numpy as np
    from scipy.optimize import linprog

    from torchtitan_xla.plan import memory

    rows = [json.loads(line) for path in paths for line in path.read_text().splitlines()]
    shapes = [calibration_shape(r) for r in rows]
    keep = [(r, (s, pb)) for r, (s, pb) in zip(rows, shapes) if not r.get("replicate")
            and not {(r["mesh"], s.attention), (r["mesh"], s.chunk > 0)} & KNOWN_GATHERS]
    rows, shapes = [r for r, _ in keep], [s for _, s in keep]
    y = np.array([r["temp_bytes"] for r in rows], dtype=float)
    x = np.array([memory.features(s, pb) for s, pb in shapes])
    group = np.array([memory.fit_group(s) for s, _ in shapes])

    def solve(index, used):
        """Non-negative coefficients with the smallest worst relative error (a linear program:
        minimise e with -e <= x c / y - 1 <= e)."""
        a = x[np.ix_(index, used)] / y[index, None]
        n, k = a.shape
        ones = np.ones((n, 1))
        r = linprog(np.r_[np.zeros(k), 1.0], A_ub=np.block([[a, -ones], [-a, -ones]]),
                    b_ub=np.r_[np.ones(n), -np.ones(n)], bounds=(0, None), method="highs")
        c = np.zeros(x.shape[1])
        c[used] = r.x[:k]
        return c

    held_out = np.zeros(len(rows))
    memory.COEFFICIENTS.clear()
    for g in sorted(set(group)):
        index, used = np.flatnonzero(group == g), memory.USED[g.split(",")[0]]
        memory.COEFFICIENTS[g] = tuple(float(v) for v in solve(index, used))
        for k in range(5):
            test = index[k::5]
            held_out[test] = x[test] @ solve(np.setdiff1d(index, test), used) / y[test] - 1
    err = np.array([memory.temporaries(s, pb) for s, pb in shapes]) / y - 1
    print("COEFFICIENTS = {")
    for g, c in memory.COEFFICIENTS.items():
        values = textwrap.wrap(", ".join(f"{v:.4g}" for v in c), 88)
        print(f'    "{g}": (\n        ' + "\n        ".join(values) + "),")
    print("}")
    keys = [(s.policy, r["mesh"]) for (s, _), r in zip(shapes, rows)]
    for key in sorted(set(keys)):
        e = [v for v, k in zip(err, keys) if k == key]
        h = [v for v, k in zip(held_out, keys) if k == key]
        print(f"  {key[0]:>8} {key[1]:>9}: {len(e):3d} points, error {min(e):+.1%} .. {max(e):+.1%}, "
              f"held out {min(h):+.1%} .. {max(h):+.1%}")
    i = int(np.argmax(abs(err)))
    print(f"worst relative error {err[i]:+.1%} ({keys[i][0]}, mesh {keys[i][1]}) over {len(rows)} "
          f"points, rms {np.sqrt((err ** 2).mean()):.1%}; 5-fold cross-validation: worst "
          f"{abs(held_out).max():.1%}, rms {np.sqrt((held_out ** 2).mean()):.1%}")


AUDITED = {  # the debug model cut to 2 blocks, seq 256, float32: (mesh, local batch, policy)
    "fsdp=8": ("fsdp8", 4, "none"), "fsdp=4 x tp=2": ("fsdp4tp2", 4, "none"),
    "fsdp=8, full recomputation": ("fsdp8", 4, "full"), "hsdp=2 x 4": ("hsdp2x4", 4, "none"),
}


def audit() -> None:
    """The collectives of the compiled step against the theory, on 8 virtual devices."""
    from torchtitan_xla.plan.calibrate import audit_point
    from torchtitan_xla.plan.calibrate import measure as compile_and_read
    from torchtitan_xla.plan.comms import KINDS

    points = [grid_point(n_layers=2, dim=256, heads=16, seq=256, batch=batch, vocab=2256, policy=policy,
                         attention="sdpa", chunk=0, mesh=mesh) for mesh, batch, policy in AUDITED.values()]
    print("| mesh | " + " | ".join(KINDS[:4]) + " | audit |")
    print("|---|---|---|---|---|---|")
    for name, point, result in zip(AUDITED, points, compile_and_read(points, 8)):
        found, expected, findings = audit_point({**point, "devices": 8}, result)
        cells = " | ".join(f"{found[k] / 1e6:.3f} / {expected[k] / 1e6:.3f}" for k in KINDS[:4])
        print(f"| {name} | {cells} | {'; '.join(findings) or 'nothing'} |")


# Published MFU for the same model and chip (docs/performance.md has the sources): (MaxText, TorchPrime).
PUBLISHED = {("llama3_8b", "v6e-256"): ("45.46%", "45.75%"), ("llama3_70b", "v6e-256"): ("50.33%", "45.16%"),
             ("llama3_405b", "v6e-256"): ("38.55%", "34.96%")}
ROOFLINE = [("llama3_8b", "v6e-256"), ("llama3_8b", "v5p-256"), ("llama3_70b", "v6e-256"),
            ("llama3_70b", "v5p-512"), ("llama3_405b", "v6e-256"), ("llama3_405b", "v5p-1024")]


def roofline() -> None:
    """The plan of each Llama 3 recipe on v6e and v5p slices, as a markdown table."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.plan import build_plan

    print("| recipe | slice | mesh (fsdp x tp) | memory per chip | compute / step | ICI / step "
          "| MFU bound (hidden / serial) | MaxText | TorchPrime |")
    print("|---|---|---|---|---|---|---|---|---|")
    for recipe, tpu in ROOFLINE:
        cfg = parse_args(["--job.config_file", f"train_configs/{recipe}.toml"])
        try:
            p = build_plan(cfg, tpu, with_knobs=False)
        except ConfigError as e:
            print(f"| {recipe} | {tpu} | {e} |")
            continue
        m, r = p.memory, p.roofline
        fit = f"{m.total / 2**30:.1f} / {p.hbm / 2**30:g} GiB" + ("" if p.fits else " (does not fit)")
        mt, tp = PUBLISHED.get((recipe, tpu), ("-", "-"))
        print(f"| {recipe} | {tpu} | {p.mesh['fsdp']} x {p.mesh['tp']} | {fit} | {r.compute_seconds:.2f} s "
              f"| {r.comm_seconds:.2f} s | {r.mfu_bound:.0%} / {r.mfu_serial:.0%} | {mt} | {tp} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--points", type=int, default=64, help="grid points to measure, half per device count")
    ap.add_argument("--out", type=Path, default=Path("plan_grid.jsonl"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fit", type=Path, nargs="+", help="fit the coefficients to measured grids instead")
    ap.add_argument("--roofline", action="store_true", help="print the recipes' roofline table instead")
    ap.add_argument("--audit", action="store_true", help="audit the collectives on 8 devices instead")
    a = ap.parse_args()
    if a.roofline or a.audit:
        roofline() if a.roofline else audit()
    else:
        fit(a.fit) if a.fit else measure(a.points, a.out, a.seed)
