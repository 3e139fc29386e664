"""Data pipeline throughput against what training consumes, memory over a long stream, and the
time the training loop waits for data.

    PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 python bench/bench_data.py [--seconds 8] [--long-seconds 40]

1. Pipeline tokens/s (documents -> tokens -> packed [8, 256] batches, host side, what train.py's
   loader does minus the device copy) on the embedded corpus and on a local C4-layout copy of it
   (.json.gz files), for the debug tokenizer and a 128k-rank Llama 3 tiktoken file, with 0 and 1
   worker processes.
2. The debug model's training tokens/s in the same run (train.py, debug_model.toml), and the ratio.
3. Resident memory while the pipeline streams for --long-seconds (it must stay flat).
4. The data-wait share of the training step, as train.py logs it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("CPU_NUM_DEVICES", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

BATCH, SEQ_LEN = 8, 256  # train_configs/debug_model.toml


def rss_mib(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def config(*extra: str):
    from torchtitan_xla.config import parse_args

    return parse_args(["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
                       "--training.local_batch_size", str(BATCH), "--training.seq_len",
                       str(SEQ_LEN), *extra])


def pipeline_rate(tokenizer, seconds: float, *extra: str) -> float:
    """Training tokens per second the host loader delivers (after a warm-up of 20 batches)."""
    from torchtitan_xla.datasets import build_data_loader

    dl = build_data_loader(config(*extra), tokenizer, batch_size=BATCH)
    it = iter(dl)
    for _ in range(20):
        next(it)
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        next(it)
        n += 1
    rate = n * BATCH * SEQ_LEN / (time.perf_counter() - start)
    dl.close()
    return rate


def memory_over_long_stream(tokenizer, seconds: float,
                            *extra: str) -> list[tuple[float, float, int]]:
    """(elapsed s, RSS MiB, tokens so far) every tenth of the run."""
    from torchtitan_xla.datasets import build_data_loader

    dl = build_data_loader(config(*extra), tokenizer, batch_size=BATCH)
    it = iter(dl)
    for _ in range(50):
        next(it)
    samples, n, start, next_sample = [], 0, time.perf_counter(), 0.0
    while (elapsed := time.perf_counter() - start) < seconds:
        if elapsed >= next_sample:
            samples.append((elapsed, rss_mib(), n * BATCH * SEQ_LEN))
            next_sample += seconds / 10
        next(it)
        n += 1
    samples.append((time.perf_counter() - start, rss_mib(), n * BATCH * SEQ_LEN))
    dl.close()
    return samples


def write_local_c4(root: Path) -> Path:
    """The embedded corpus, one paragraph per document, in allenai/c4's file layout."""
    import gzip
    import json

    from torchtitan_xla.datasets import python_docs

    paragraphs = [p for doc in python_docs.documents() for p in doc.split("\n\n") if p.strip()]
    per = -(-len(paragraphs) // 8)
    for k in range(8):
        path = root / "en" / f"c4-train.{k:05d}-of-01024.json.gz"
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            for p in paragraphs[k * per:(k + 1) * per]:
                fh.write(json.dumps({"text": p, "timestamp": "", "url": ""}) + "\n")
    return root


def llama3_tokenizer():
    """Meta's 128k Llama 3 file from llama-models when installed; otherwise a synthetic file of
    128,000 ranks (the 2k BPE plus filler byte strings that never match: the rank count and
    file size are real, the merges beyond 2k are not)."""
    from torchtitan_xla.config import ConfigError
    from torchtitan_xla.datasets import build_tokenizer

    try:
        return build_tokenizer("llama3"), "Meta's Llama 3 tokenizer.model (llama-models package)"
    except ConfigError:
        pass
    from torchtitan_xla.datasets.tokenizer.tiktoken import read_ranks
    from torchtitan_xla.datasets.tokenizer.train_bpe import default_tokenizer_path, write_ranks

    ranks = read_ranks(str(default_tokenizer_path()))
    filler = (f"\x00{i:06d}\x00".encode() for i in range(10**6))
    while len(ranks) < 128_000:
        ranks.setdefault(next(filler), len(ranks))
    path = Path(tempfile.mkdtemp()) / "synthetic128k.tiktoken"
    write_ranks(ranks, path)
    return build_tokenizer(str(path)), "synthetic 128,000-rank file (llama-models not installed)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=8.0, help="per pipeline measurement")
    ap.add_argument("--long-seconds", type=float, default=40.0, help="memory-flatness stream")
    ap.add_argument("--train-steps", type=int, default=60)
    opts = ap.parse_args()

    import torch

    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.logging import init_logger

    init_logger()
    debug_tok = build_tokenizer("")
    big_tok, big_name = llama3_tokenizer()
    c4 = write_local_c4(Path(tempfile.mkdtemp(prefix="bench-c4-")))
    sources = {"python_docs": [], "local c4 (.json.gz)": ["--training.dataset", "c4",
                                                         "--training.dataset_path", str(c4)]}
    rows = []
    for tok_name, tok in [(f"debug ({debug_tok.n_words:,} ids)", debug_tok),
                          (f"llama3 ({big_tok.n_words:,} ids)", big_tok)]:
        for src, args in sources.items():
            for workers in (0, 1):
                rate = pipeline_rate(tok, opts.seconds, *args, "--training.num_workers",
                                     str(workers))
                rows.append((tok_name, src, workers, rate))
                print(f"  {tok_name:<22} {src:<22} workers={workers}: {rate:,.0f} tokens/s",
                      flush=True)

    memory = memory_over_long_stream(debug_tok, opts.long_seconds, "--training.dataset", "c4",
                                     "--training.dataset_path", str(c4))

    # Training in the same run: train.py's own loop and logging.
    import train

    history = []
    for workers in (0, 1):
        cfg = config("--job.dump_folder", tempfile.mkdtemp(prefix="bench-train-"),
                     "--job.no-print_config", "--training.steps", str(opts.train_steps),
                     "--metrics.log_freq", "5", "--training.num_workers", str(workers))
        history.append(train.main(cfg))
    # Against the faster of the two training runs (the machine is shared: the conservative ratio).
    step_times = [statistics.median(s.step_time for s in h if s.step > 10) for h in history]
    step_time = min(step_times)
    train_tps = BATCH * SEQ_LEN / step_time

    print(f"\nmachine: {os.cpu_count()} cores, {platform_cpu()}; torch {torch.__version__}")
    print(f"batches of {BATCH} x {SEQ_LEN} tokens; 128k tokenizer: {big_name}")
    print("\n| tokenizer | source | workers | pipeline tokens/s | x training |")
    print("|---|---|---|---|---|")
    for tok_name, src, workers, rate in rows:
        print(f"| {tok_name} | {src} | {workers} | {rate:,.0f} | {rate / train_tps:.0f}x |")
    print(f"\ntraining (debug model, fp32, 1 device): {train_tps:,.0f} tokens/s, the faster of "
          f"two runs (median step over steps 11-{opts.train_steps}: "
          f"{', '.join(f'{t * 1e3:.0f} ms' for t in step_times)} with num_workers 0, 1)")
    print("\ndata wait per step (train.py's data_wait / step_time, log intervals after step 10):")
    for workers, hist in zip((0, 1), history, strict=True):
        shares = [s.data_wait / s.step_time for s in hist if s.step > 10]
        print(f"  num_workers={workers}: median {100 * statistics.median(shares):.2f}%, "
              f"max {100 * max(shares):.2f}%")
    _, r0, _ = memory[0]
    t1, r1, n1 = memory[-1]
    print(f"\nmemory over a {t1:.0f} s stream of {n1 / 1e6:.1f}M tokens (debug tokenizer, local "
          f"c4, 0 workers): RSS {r0:.0f} MiB -> {r1:.0f} MiB "
          f"(samples: {', '.join(f'{r:.0f}' for _, r, _ in memory)})")


def platform_cpu() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
