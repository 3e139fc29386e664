"""Debug-model training throughput on this machine: train.py's XLA step against a plain eager
PyTorch loop of the same model on the CPU, with MFU against the XLA fp32 matmul peak measured in
the same run.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 python bench/bench_train.py [--steps 40] [--batch 4] [--seq-len 256]

Both loops train the same model (debug flavor, fp32, no activation checkpointing) on the same
batches with AdamW and gradient clipping. Reported step times are medians over the steady steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def xla_matmul_peak(n: int = 2048, reps: int = 8, trials: int = 5) -> float:
    """fp32 FLOP/s of the XLA CPU backend on large square matmuls (one graph of `reps` matmuls)."""
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()  # as train.py does, before any XLA tensor exists
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


def eager_step_times(args, steps: int, batch: int, seq_len: int, lr: float, max_norm: float):
    """The same model and update in plain eager PyTorch on the CPU device."""
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.datasets.text_datasets import PackedTextDataset, load_documents
    from torchtitan_xla.models.llama import Transformer

    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    data = iter(torch.utils.data.DataLoader(PackedTextDataset(
        load_documents("python_docs", ""), build_tokenizer(""), seq_len), batch_size=batch))
    times = []
    for _ in range(steps):
        inputs, labels = next(data)
        t = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        times.append(time.perf_counter() - t)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    ap.add_argument("--skip-eager", action="store_true")
    opts = ap.parse_args()

    import train
    from torchtitan_xla.config_manager import parse_args
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.metrics import num_flops_per_token
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer

    peak = xla_matmul_peak()
    cfg = parse_args([
        "--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
        "--job.dump_folder", "/tmp/ttx-bench", "--job.no-print_config",
        "--training.local_batch_size", str(opts.batch), "--training.seq_len", str(opts.seq_len),
        "--training.steps", str(opts.steps), "--training.mixed_precision_param", "float32",
        "--metrics.log_freq", "1",
        # The CPU has no table entry: the log line's MFU is against the peak measured above.
        "--metrics.peak_flops", str(peak)])
    history = train.main(cfg)
    xla_times = [s.step_time for s in history[opts.warmup:]]

    args = get_model_args("llama3", "debugmodel", vocab_size=build_tokenizer("").n_words,
                          max_seq_len=opts.seq_len)
    with torch.device("meta"):
        n_params = Transformer(args).num_params(exclude_embedding=True)
    flops_per_step = num_flops_per_token(args, n_params, opts.seq_len) * opts.batch * opts.seq_len
    tokens = opts.batch * opts.seq_len

    rows = [("XLA (train.py)", statistics.median(xla_times))]
    if not opts.skip_eager:
        eager = eager_step_times(args, opts.steps, opts.batch, opts.seq_len, cfg.optimizer.lr,
                                 cfg.training.max_norm)
        rows.append(("eager PyTorch CPU", statistics.median(eager[opts.warmup:])))
    print(f"\nmachine: {os.cpu_count()} cores; torch {torch.__version__}; "
          f"XLA fp32 matmul peak {peak / 1e9:.0f} GFLOP/s (measured)")
    print(f"debug model, fp32, batch {opts.batch} x seq {opts.seq_len}, "
          f"{flops_per_step / 1e9:.1f} GFLOP per step (6N + 12LHQT)")
    print(f"{'loop':<20} {'step (ms)':>10} {'tokens/s':>10} {'MFU vs XLA peak':>16}")
    for name, t in rows:
        print(f"{name:<20} {t * 1e3:>10.1f} {tokens / t:>10.0f} {100 * flops_per_step / t / peak:>15.1f}%")
    if len(rows) == 2:
        print(f"XLA / eager tokens/s: {rows[1][1] / rows[0][1]:.2f}x")


if __name__ == "__main__":
    main()
