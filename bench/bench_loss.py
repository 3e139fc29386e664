"""The chunked (cut) cross-entropy against the full-logits loss with Llama 3's 128,256-token
vocabulary: the compiled training step's memory, as XLA assigned it, and its time.

    python bench/bench_loss.py [--seq-len 1024] [--chunks 64,128,256] [--steps 12]

One block of dim 256 (a shape that fits this machine; the logits dominate it as they do a real
Llama 3 step), float32, one device. Each configuration runs train.py's loop (train.main) in a fresh
process with XLA dumping its buffer assignments (runtime/compiled.py): "temp" is the compiled
step's preallocated temporary buffer, everything it needs beyond parameters and optimizer state.
The full-logits part is separated by fitting temp = base + k * chunk over the chunk sizes: the
chunk-independent base (gradients of the embeddings and output, activations) is what no loss
choice removes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VOCAB = 128_256


def child(args: list[str]) -> None:
    sys.path.insert(0, str(REPO))
    import train
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.runtime import compile_stats

    history = train.main(parse_args(args), model_overrides={"n_layers": 1, "vocab_size": VOCAB})
    steady = [s.step_time for s in history[2:]]
    print("RESULT " + json.dumps({"step_s": statistics.median(steady), "loss": history[-1].loss,
                                  "compiles": compile_stats()[0]}))


def run(opts, chunk: int) -> dict:
    from torchtitan_xla.runtime.xla.compiled import dump_flags, read_buffer_assignments

    with tempfile.TemporaryDirectory() as dump, tempfile.TemporaryDirectory() as xla:
        args = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
                "--job.dump_folder", dump, "--job.no-print_config", "--training.steps", str(opts.steps),
                "--metrics.log_freq", "1", "--training.seq_len", str(opts.seq_len),
                "--training.local_batch_size", "1", "--loss.chunk_size", str(chunk)]
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1", TF_CPP_MIN_LOG_LEVEL="2",
                   XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(xla)}".strip())
        p = subprocess.run([sys.executable, __file__, "--child", json.dumps(args)], capture_output=True,
                           text=True, env=env)
        if p.returncode:
            raise RuntimeError(p.stderr[-3000:])
        result = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))[7:])
        step = max(read_buffer_assignments(xla), key=lambda b: b.temp_bytes)
    result.update(temp=step.temp_bytes, total=step.total_bytes, largest=step.largest_temporary())
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--chunks", default="64,128,256")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    opts = ap.parse_args()
    if opts.child:
        return child(json.loads(opts.child))
    sys.path.insert(0, str(REPO))
    from torchtitan_xla.runtime.xla.process import cpu_features, cpu_model, vector_features

    chunks = [int(c) for c in opts.chunks.split(",")]
    results = {c: run(opts, c) for c in [0, *chunks]}
    # temp = base + k * chunk, least squares over the chunk sizes.
    xs, ys = chunks, [results[c]["temp"] for c in chunks]
    mx, my = statistics.mean(xs), statistics.mean(ys)
    k = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    base = my - k * mx
    mib = 2**20
    print(f"machine: {cpu_model()} ({vector_features(cpu_features())}); one block, dim 256, vocab "
          f"{VOCAB:,}, {opts.seq_len} tokens per step, float32; full logits "
          f"{opts.seq_len * VOCAB * 4 / mib:.0f} MiB")
    print(f"fitted: temp = {base / mib:.0f} MiB + {k / mib:.3f} MiB x chunk tokens")
    print(f"{'loss':<16} {'temp (MiB)':>10} {'logits part':>12} {'vs full':>8} {'largest temporary':>40} "
          f"{'step (ms)':>10} {'loss @' + str(opts.steps):>10} {'compiles':>8}")
    full_part = results[0]["temp"] - base
    for c, r in results.items():
        part = r["temp"] - base
        size, _, shape = r["largest"]
        print(f"{'full logits' if c == 0 else f'chunk {c}':<16} {r['temp'] / mib:>10.0f} {part / mib:>12.0f} "
              f"{full_part / part:>7.1f}x {f'{shape} {size / mib:.0f} MiB':>40} {r['step_s'] * 1e3:>10.1f} "
              f"{r['loss']:>10.4f} {r['compiles']:>8}", flush=True)


if __name__ == "__main__":
    main()
