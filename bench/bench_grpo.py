"""GRPO's step on this machine: how much of it is the rollout (sampling completions with the KV
cache's prefill and decode graphs, scoring them) and how much the update (the compiled training
step), on the debug model, one XLA CPU device.

    python bench/bench_grpo.py                       # debug_grpo.toml's shapes, random weights
    python bench/bench_grpo.py --steps 20 -- --grpo.num_generations 16

train.main runs `--steps` steps of train_configs/debug_grpo.toml from random weights (no export
needed; no reference model: beta 0), logging every step, so that each step's update finishes
before the next rollout starts (the log line reads the step's results). Reported: the medians
over the steps after warm-up (3 on) of the step time, the rollout's seconds (as the loop waits
for its batch), its share of the step, the update's seconds (the rest), and the completion tokens
generated per second of generation. Extra arguments after `--` go to train.py.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("extra", nargs="*")
    opts = parser.parse_args()
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "1")
    sys.path.insert(0, str(REPO))
    from bench_moe import cpu_model  # this folder is the script's, first on sys.path

    import train
    from torchtitan_xla.config import parse_args

    with tempfile.TemporaryDirectory(prefix="ttx-bench-grpo-") as dump:
        config = parse_args([
            "--job.config_file", str(REPO / "train_configs" / "debug_grpo.toml"), "--job.dump_folder", dump,
            "--checkpoint.no-enable", "--checkpoint.initial_load_path", "",
            "--checkpoint.no-initial_load_in_hf",
            "--grpo.beta", "0", "--validation.no-enable", "--metrics.log_freq", "1",
            "--training.steps", str(opts.steps), "--job.no-print_config", *opts.extra])
        history = train.main(config)
    rows = [h for h in history if h.step >= 3]

    def median(values):
        return statistics.median(values)

    step = median([h.step_time for h in rows])
    rollout = median([h.objective["rollout/seconds"] for h in rows])
    result = {"cpu": cpu_model(), "steps": opts.steps,
              "rows": config.training.local_batch_size, "num_generations": config.grpo.num_generations,
              "max_completion_length": config.grpo.max_completion_length,
              "step_s": round(step, 3), "rollout_s": round(rollout, 3),
              "rollout_share": round(rollout / step, 3), "update_s": round(step - rollout, 3),
              "generated_tokens_per_s": round(median([h.objective["rollout/tokens_per_second"]
                                                      for h in rows]), 1),
              "completion_mean_length": round(median([h.objective["completions/mean_length"]
                                                      for h in rows]), 1)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
