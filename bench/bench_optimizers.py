"""Optimizers on the debug model: the loss after 200 steps for AdamW, Muon, Lion and Adafactor at
their recommended settings (same data, same seed, same schedule shape), compiles after warm-up;
and, with --collectives, what each one's step makes XLA communicate on fsdp=4 x tp=2.

    python bench/bench_optimizers.py                  # debug_model.toml, 200 steps each
    python bench/bench_optimizers.py --collectives    # 8 virtual devices, 1 block, from the HLO

Every configuration runs train.py's own loop (train.main) in a fresh process. The collectives are
read from the optimized HLO of the compiled training step (XLA's dump), per device per step.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OPT = "--optimizer."
# Recommended settings: AdamW as debug_model.toml; Muon with Moonshot's lr scale, so AdamW's lr and
# weight decay carry over; Lion with the lr 5x lower and weight decay 10x higher (its paper's
# advice: 3-10x); Adafactor as torch's defaults (relative step size capped at 1e-2, no decay).
OPTIMIZERS = {
    "AdamW": [OPT + "name", "AdamW"],
    "Muon": [OPT + "name", "Muon"],
    "Lion": [OPT + "name", "Lion", OPT + "lr", "1.6e-4", OPT + "beta2", "0.99", OPT + "weight_decay", "1.0"],
    "Adafactor": [OPT + "name", "Adafactor", OPT + "lr", "1e-2", OPT + "weight_decay", "0"],
}


def child(args: list[str], overrides: dict) -> None:
    sys.path.insert(0, str(REPO))
    import train
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.runtime import compile_stats

    history = train.main(parse_args(args), model_overrides=overrides)
    last = history[-5:]
    print("RESULT " + json.dumps({"losses": {s.step: s.loss for s in history},
                                  "last_mean": sum(s.loss for s in last) / len(last),
                                  "compiles": compile_stats()[0]}))


def run(args: list[str], overrides: dict, devices: int = 1, xla_flags: str = "") -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), TF_CPP_MIN_LOG_LEVEL="2")
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(args), json.dumps(overrides)],
                       capture_output=True, text=True, env=env)
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])


def base_args(dump: str, steps: int) -> list[str]:
    return ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--job.dump_folder", dump, "--job.no-print_config", "--training.steps", str(steps)]


def losses(opts) -> None:
    print(f"debug model (debug_model.toml: batch 8 x 256, warmup 20, linear decay to 0.1), "
          f"{opts.steps} steps, seed 42")
    print(f"{'optimizer':<10} {'settings':<58} {'loss @1':>8} {f'loss @{opts.steps}':>9} "
          f"{'mean of last 5 logs':>20} {'compiles':>8}")
    for name, flags in OPTIMIZERS.items():
        with tempfile.TemporaryDirectory() as dump:
            r = run(base_args(dump, opts.steps) + flags, {})
        first, last = r["losses"][min(r["losses"], key=int)], r["losses"][str(opts.steps)]
        print(f"{name:<10} {' '.join(flags[2:]) or '(debug_model.toml)':<58} {first:>8.4f} {last:>9.4f} "
              f"{r['last_mean']:>20.4f} {r['compiles']:>8}", flush=True)


def comms(opts) -> None:
    from torchtitan_xla.runtime.xla.compiled import collectives, dump_flags

    mesh = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2",
            "--training.seq_len", "64"]
    print("debug model cut to 1 block (dim 256), fsdp=4 x tp=2 on 8 virtual devices; the training "
          "step's collectives, per device per step (MiB of results)")
    for name, flags in OPTIMIZERS.items():
        with tempfile.TemporaryDirectory() as dump, tempfile.TemporaryDirectory() as xla:
            run(base_args(dump, 2) + flags + mesh, {"n_layers": 1}, devices=8, xla_flags=dump_flags(xla))
            step = max(Path(xla).glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size)
            found = collectives(step.read_text())
        print(f"{name:<10} " + ", ".join(f"{kind} {n} ({size / 2**20:.2f})"
                                         for kind, (n, size) in sorted(found.items())), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--collectives", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        return child(json.loads(opts.child[0]), json.loads(opts.child[1]))
    sys.path.insert(0, str(REPO))
    (comms if opts.collectives else losses)(opts)


if __name__ == "__main__":
    main()
