"""The native runtime on one CUDA GPU: its losses against the CPU's from the same weights, a
checkpoint resumed on the GPU and on the CPU, then tokens/s, MFU and memory, compiled and eager.

    # here (no GPU): a seed checkpoint and the CPU's losses from it, into a folder
    python bench/bench_native_gpu.py --reference /tmp/gpu-ref
    # on the GPU machine, with that folder (its torch; this package's dependencies importable)
    python bench/bench_native_gpu.py --reference /tmp/gpu-ref --out /tmp/gpu-out

Every job is train.main through tests/native_driver.py on one torchrun process (exact losses, not
the log's four digits), the debug model at the test size (seq 64, global batch 8) on synthetic
data, 20 steps from the seed. Numerics: the largest relative difference per step from the CPU's
eager float32 losses. The speed jobs train a ~1B Llama 3 (dim 2048, 16 layers) at seq 2048 in
bf16 autocast (torch's fused attention: `--model.attention flash`) on the same synthetic data;
each job's figures are medians of its step lines from step 5 on (the first steps compile).
Results: OUT/results.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEST_SIZE = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--job.no-print_config",
             "--training.seq_len", "64", "--metrics.log_freq", "1", "--lr_scheduler.warmup_steps", "2",
             "--runtime.backend", "native", "--training.dataset", "synthetic",
             "--training.global_batch_size", "8", "--training.local_batch_size", "8",
             "--training.steps", "20"]
EAGER, COMPILED = ["--compile.step", "eager"], ["--compile.step", "compile", "--debug.on_recompile", "error"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
NUMERICS = {"eager fp32": EAGER, "compiled fp32": COMPILED, "compiled bf16": COMPILED + BF16}
ONE_B = {"dim": 2048, "n_layers": 16, "n_heads": 16, "n_kv_heads": 8}
SPEED = ["--training.seq_len", "2048", "--training.local_batch_size", "4",
         "--training.global_batch_size", "4", "--training.steps", "20", "--model.attention", "flash", *BF16]
LINE = re.compile(r"step:\s+(\d+) .*?memory: +([\d.]+)(?:/[\d.]+)?GiB\(([^,]+), peak ([\d.]+)\).*?"
                  r"tps: ([\d,]+) .*?mfu: ([\d.]+%|n/a)")


def job(folder: Path, device: str, *flags: str, overrides: dict | None = None) -> dict:
    """train.main on one torchrun process: losses by step, and the log."""
    folder.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_"))}
    env |= {"NATIVE_OUT": str(folder / "result.json"), "NATIVE_OVERRIDES": json.dumps(overrides or {})}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(REPO / "tests" / "native_driver.py"), *TEST_SIZE, "--job.dump_folder", str(folder),
           "--runtime.device", device, *flags]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    (folder / "log.txt").write_text(p.stderr)
    if p.returncode:
        return {"error": p.stderr[-3000:]}
    return {"losses": json.loads((folder / "result.json").read_text())["losses"], "log": p.stderr}


def worst(got: dict, expected: dict) -> float:
    """The largest relative difference per step (inf when the steps differ)."""
    if got.keys() != expected.keys():
        return float("inf")
    return max(abs(got[s] - v) / abs(v) for s, v in expected.items())


def make_reference(ref: Path) -> None:
    seed = job(ref / "seed", "cpu", *EAGER, "--checkpoint.create_seed_checkpoint")
    assert "error" not in seed, seed["error"]
    cpu = job(ref / "cpu", "cpu", *EAGER, *start(ref))
    assert "error" not in cpu, cpu["error"]
    (ref / "reference.json").write_text(json.dumps({"losses": cpu["losses"]}))
    shutil.rmtree(ref / "cpu")
    print(f"seed checkpoint and CPU losses in {ref}")


def start(ref: Path) -> list[str]:
    return ["--checkpoint.initial_load_path", str(ref / "seed" / "checkpoint" / "step-0")]


def speed(log: str) -> dict:
    rows = [m for m in LINE.findall(log) if int(m[0]) >= 5]
    if not rows:
        return {}
    mfu = [float(m[5].rstrip("%")) for m in rows if m[5] != "n/a"]
    return {"tokens/s": statistics.median(float(m[4].replace(",", "")) for m in rows),
            "mfu %": statistics.median(mfu) if mfu else None, "memory": rows[-1][2],
            "peak GiB": max(float(m[3]) for m in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", default="cuda", help="cpu: the script's own dry run")
    opts = parser.parse_args()
    if opts.out is None:
        return make_reference(opts.reference)
    import torch

    out, work = opts.out, Path("/tmp/ttx-bench-native-gpu")
    out.mkdir(parents=True, exist_ok=True)
    results = {"torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if opts.device == "cuda" else opts.device}
    expected = json.loads((opts.reference / "reference.json").read_text())["losses"]

    def record(name: str, value) -> None:
        results[name] = value
        (out / "results.json").write_text(json.dumps(results, indent=1))
        print(f"{name}: {value if not isinstance(value, dict) else json.dumps(value)}", flush=True)

    runs = {}
    for name, flags in NUMERICS.items():
        runs[name] = job(work / name.replace(" ", "_"), opts.device, *flags, *start(opts.reference))
        if "error" in runs[name]:
            record(name, {"error": runs[name]["error"]})
            continue
        record(name, {"max rel diff from CPU": worst(runs[name]["losses"], expected),
                      "losses": runs[name]["losses"]})
    if "error" not in runs["eager fp32"] and "error" not in runs["compiled fp32"]:
        record("compiled vs eager fp32", worst(runs["compiled fp32"]["losses"], runs["eager fp32"]["losses"]))

    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "10", *start(opts.reference)]
    full = job(work / "full", opts.device, *ckpt, *COMPILED)
    if "error" in full:
        record("resume", {"error": full["error"]})
    else:
        step10 = work / "full" / "checkpoint" / "step-10"
        after = {s: v for s, v in full["losses"].items() if int(s) > 10}
        for name, device, flags in [("resume", opts.device, COMPILED), ("resume on the CPU", "cpu", EAGER)]:
            folder = work / name.replace(" ", "_")
            shutil.copytree(step10, folder / "checkpoint" / "step-10")
            resumed = job(folder, device, *ckpt, *flags)
            record(name, resumed if "error" in resumed else {
                "steps": sorted(map(int, resumed["losses"])),
                "max rel diff from uninterrupted": worst(resumed["losses"], after)})

    for name, flags in {"1B bf16 compiled": COMPILED, "1B bf16 eager": EAGER}.items():
        run = job(work / name.replace(" ", "_"), opts.device, *flags, *SPEED, overrides=ONE_B)
        record(name, run if "error" in run else speed(run["log"]))


if __name__ == "__main__":
    main()
