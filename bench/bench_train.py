"""Training throughput on this machine: train.py's XLA step against a plain eager PyTorch loop of
the same model on the CPU, alternating in one process pair, with MFU against the XLA fp32 matmul
peak measured in the same rounds.

    python bench/bench_train.py                       # debug model: batch 4 x seq 256, fp32
    python bench/bench_train.py --preset 100m --skip-eager --rounds 5

Two worker processes start and warm up (the XLA one compiles); then each round runs
`--steps-per-round` steps in one worker, then in the other (the order flips every round), so
both see the same machine load. Reported: medians over the rounds of the mean step time of each
round, the ratio of tokens/s, MFU against the median matmul peak (measured by the XLA worker at
the start of each of its rounds), and XLA compiles after warm-up (must be 0).

The XLA worker runs `train.main` itself: each round is a fresh job of 2 x steps-per-round steps
whose second half is timed (`metrics.log_freq` = steps-per-round: one host sync per half, as a
real run logs), so tracing of the next step overlaps execution of the previous one exactly as in
training. The eager worker trains the same model (same init, AdamW, clipping, same batches) with
the loop a PyTorch user would write.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PRESETS = {
    # The debug model as issue 9 measured it before any project code existed.
    "debug": dict(batch=4, seq_len=256, overrides={}),
    # ~100M parameters (85M without embeddings with the debug tokenizer's 2,256 ids).
    "100m": dict(batch=1, seq_len=1024, overrides=dict(dim=768, n_layers=12, n_heads=12)),
}


def xla_matmul_peak(n: int = 2048, reps: int = 8, trials: int = 3) -> float:
    """fp32 FLOP/s of the XLA CPU backend on large square matmuls (one graph of `reps` matmuls)."""
    import torch
    import torch_xla

    dev = torch_xla.device()
    a = torch.randn(n, n, device=dev)
    bs = [torch.randn(n, n, device=dev) for _ in range(reps)]
    torch_xla.sync()

    def run():
        out = sum((a @ b).sum() for b in bs)
        torch_xla.sync()
        out.cpu()

    run()
    times = []
    for _ in range(trials):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return 2 * n**3 * reps / min(times)


def train_args(opts) -> list[str]:
    return ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--job.dump_folder", "/tmp/ttx-bench", "--job.no-print_config",
            "--training.local_batch_size", str(opts.batch), "--training.seq_len", str(opts.seq_len),
            "--training.mixed_precision_param", "float32", "--activation_checkpoint.mode", "none",
            *opts.train_args]


def xla_worker(opts) -> None:
    """Each round: the matmul peak, then a fresh train.main job; prints seconds/step of its
    second half, compiles during the round and the peak."""
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("CPU_NUM_DEVICES", "1")
    import train
    from torchtitan_xla import runtime
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.logging import logger
    from torchtitan_xla.runtime import compile_stats

    # As train.py does, before XLA starts: the matmul peak below starts it, with train.py's flags.
    runtime.configure("replay")
    runtime.init_devices()
    n = opts.steps_per_round
    cfg = parse_args(train_args(opts) + ["--training.steps", str(2 * n), "--metrics.log_freq", str(n)])

    def round_() -> dict:
        peak = xla_matmul_peak()
        before = compile_stats()[0]
        history = train.main(cfg, model_overrides=opts.overrides)
        return dict(step_time=history[-1].step_time, compiles=compile_stats()[0] - before,
                    peak=peak, loss=history[-1].loss)

    round_()  # warm-up: compiles every graph once
    logger.disabled = True
    serve(round_)


def eager_worker(opts) -> None:
    import torch
    import torch.nn.functional as F

    from torchtitan_xla.config import parse_args
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.datasets.packing import PackedTextDataset
    from torchtitan_xla.datasets.sources import load_documents
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer

    cfg = parse_args(train_args(opts))  # the XLA worker's optimizer and clipping settings
    max_norm = cfg.training.max_norm
    tokenizer = build_tokenizer("")
    args = get_model_args("llama3", "debugmodel", vocab_size=tokenizer.n_words,
                          max_seq_len=opts.seq_len, **opts.overrides)
    data = iter(torch.utils.data.DataLoader(PackedTextDataset(
        load_documents("python_docs", ""), tokenizer, opts.seq_len), batch_size=opts.batch))
    batches = [next(data) for _ in range(opts.steps_per_round)]  # the loop times steps, not data
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    o = cfg.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay)

    def round_() -> dict:
        t = time.perf_counter()
        for inputs, labels in batches:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            opt.step()
        return dict(step_time=(time.perf_counter() - t) / len(batches), loss=loss.item())

    round_()  # warm-up: allocator, oneDNN/MKL kernels
    serve(round_)


def serve(round_) -> None:
    """Worker protocol: READY once warm; then one JSON line per 'go' line on stdin."""
    out = sys.__stdout__
    print("READY", file=out, flush=True)
    for _ in sys.stdin:
        print(json.dumps(round_()), file=out, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=PRESETS, default="debug")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps-per-round", type=int, default=6)
    ap.add_argument("--batch", type=int, help="override the preset's batch size")
    ap.add_argument("--seq-len", type=int, help="override the preset's sequence length")
    ap.add_argument("--skip-eager", action="store_true")
    ap.add_argument("--worker", choices=["xla", "eager"], help=argparse.SUPPRESS)
    ap.add_argument("--overrides", type=json.loads, help=argparse.SUPPRESS)
    ap.add_argument("train_args", nargs="*", help="extra train.py options for the XLA worker "
                    "(after --), e.g. -- --model.attention sdpa")
    opts = ap.parse_args()
    preset = PRESETS[opts.preset]
    opts.batch = opts.batch or preset["batch"]
    opts.seq_len = opts.seq_len or preset["seq_len"]
    if opts.overrides is None:
        opts.overrides = preset["overrides"]
    sys.path.insert(0, str(REPO))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if opts.worker == "xla":
        return xla_worker(opts)
    if opts.worker == "eager":
        return eager_worker(opts)

    kinds = ["xla"] + ([] if opts.skip_eager else ["eager"])
    # Both workers get the malloc setting run_train.sh exports on the CPU backend (tcmalloc where
    # installed, glibc's huge pages; docs/performance.md, "Host memory"): the same for both.
    from torchtitan_xla.runtime.xla.process import cpu_features, cpu_malloc_env, cpu_model, vector_features

    malloc_env = cpu_malloc_env(os.environ)
    env = {**os.environ, **malloc_env}
    workers = {}
    for kind in kinds:
        cmd = [sys.executable, __file__, "--worker", kind, "--batch", str(opts.batch),
               "--seq-len", str(opts.seq_len), "--steps-per-round", str(opts.steps_per_round),
               "--overrides", json.dumps(opts.overrides), "--", *opts.train_args]
        workers[kind] = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.DEVNULL, text=True, env=env)
        if workers[kind].stdout.readline().strip() != "READY":
            sys.exit(f"{kind} worker failed to start: run it alone with --worker {kind}")
    results = {kind: [] for kind in kinds}
    for r in range(opts.rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            workers[kind].stdin.write("go\n")
            workers[kind].stdin.flush()
            results[kind].append(json.loads(workers[kind].stdout.readline()))
    for w in workers.values():
        w.stdin.close()
        w.wait()

    import torch

    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.metrics import num_flops_per_token
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer

    args = get_model_args("llama3", "debugmodel", vocab_size=build_tokenizer("").n_words,
                          max_seq_len=opts.seq_len, **opts.overrides)
    with torch.device("meta"):
        model = Transformer(args)
    n_params = model.num_params(exclude_embedding=True)
    tokens = opts.batch * opts.seq_len
    flops = num_flops_per_token(args, n_params, opts.seq_len) * tokens
    peaks = [r["peak"] for r in results["xla"]]
    peak = statistics.median(peaks)
    print(f"machine: {cpu_model()} ({vector_features(cpu_features())}), {os.cpu_count()} cores; "
          f"torch {torch.__version__}; XLA fp32 matmul peak "
          f"{peak / 1e9:.0f} GFLOP/s (median of rounds; range {min(peaks) / 1e9:.0f}-"
          f"{max(peaks) / 1e9:.0f})")
    print(f"model: dim {args.dim}, {args.n_layers} layers, {args.n_heads} heads, "
          f"{n_params / 1e6:.1f}M parameters without embeddings; fp32, batch {opts.batch} x seq "
          f"{opts.seq_len}; {flops / 1e9:.1f} GFLOP per step (6N + 12LHQT)")
    print(f"both workers with {' '.join(f'{k}={v}' for k, v in malloc_env.items())} "
          "(as run_train.sh on CPU)")
    print(f"{opts.rounds} rounds x {opts.steps_per_round} steps, alternating"
          + (f"; train.py options: {' '.join(opts.train_args)}" if opts.train_args else ""))
    print(f"{'loop':<22} {'step (ms)':>10} {'tokens/s':>10} {'MFU':>6}   rounds (ms)")
    medians = {}
    for kind in kinds:
        times = [r["step_time"] for r in results[kind]]
        medians[kind] = t = statistics.median(times)
        name = "XLA (train.py)" if kind == "xla" else "eager PyTorch CPU"
        print(f"{name:<22} {t * 1e3:>10.1f} {tokens / t:>10.0f} {100 * flops / t / peak:>5.1f}%   "
              + " ".join(f"{x * 1e3:.0f}" for x in times))
    recompiles = sum(r["compiles"] for r in results["xla"])
    print(f"XLA compiles after warm-up: {recompiles}")
    if "eager" in medians:
        print(f"XLA / eager tokens/s: {medians['eager'] / medians['xla']:.2f}x")


if __name__ == "__main__":
    main()
