"""How fast the XLA CPU backend runs the debug model's two kinds of matmul, on one core and on all.

    python bench/bench_dots.py              # runs itself twice: pinned to one core, then unpinned

The debug step's dense matmuls (`[1024, 256] @ [256, 256]`, the projections) and its attention
matmuls (per batch x head: `[64, E] @ [E, 16]` and back, head_dim 16, E keys of a query block)
are timed as chains of dots inside one compiled graph, so nothing but the dots runs and no output
is allocated per dot. A third chain splits the attention chain into two independent halves: if the
runtime ran independent ops side by side, it would gain from the second core.

Measured here (docs/performance.md): the dense chain nearly doubles with the second core, the
attention chains do not move at all, split or not. XLA CPU runs a batched dot as a loop of small
Eigen calls on one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CHAIN = 16  # dots per graph: enough to amortise the launch


def child() -> None:
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    device = torch_xla.device()

    def bench(name: str, fn, shapes, flops: float) -> None:
        xs = [torch.randn(s, device=device) * 0.1 for s in shapes]
        step = torch_xla.compile(fn)
        times = []
        for i in range(43):
            t = time.perf_counter()
            step(*xs)
            torch_xla.sync()
            xm.wait_device_ops()
            if i >= 3:  # the first runs compile and warm up
                times.append(time.perf_counter() - t)
        t = sorted(times)[len(times) // 2]
        print(f"  {name:44s} {t * 1e3:8.2f} ms {flops / t / 1e9:7.1f} GFLOP/s", flush=True)

    def dense(a, w):
        for _ in range(CHAIN):
            a = a @ w
        return a[:1]

    bench("dense [1024,256] @ [256,256]", dense, [(1024, 256), (256, 256)], 2 * 1024 * 256 * 256 * CHAIN)

    def attention(p, v, w):  # P @ V, then (P @ V) @ K^T-shaped: both attention dot shapes
        for _ in range(CHAIN):
            p = (p @ v) @ w
        return p[:, :1, :1]

    def attention_split(p, v, w):  # the same work as two independent chains
        ps, vs, ws = (list(t.chunk(2)) for t in (p, v, w))
        for _ in range(CHAIN):
            for g in range(2):
                ps[g] = (ps[g] @ vs[g]) @ ws[g]
        return torch.cat(ps)[:, :1, :1]

    for keys in (64, 256):
        shapes = [(64, 64, keys), (64, keys, 16), (64, 16, keys)]
        flops = 2 * 2 * 64 * 64 * keys * 16 * CHAIN
        bench(f"attention, batch 64, E={keys}", attention, shapes, flops)
        bench(f"attention, two independent halves, E={keys}", attention_split, shapes, flops)


def main() -> None:
    if "--child" in sys.argv:
        child()
        return
    sys.path.insert(0, str(REPO))
    from torchtitan_xla.runtime.xla.process import cpu_malloc_env

    # As run_train.sh on the CPU backend: the malloc variables you set win.
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
           **cpu_malloc_env(os.environ)}
    cores = sorted(os.sched_getaffinity(0))
    for label, prefix in (("one core", ["taskset", "-c", str(cores[0])]), (f"{len(cores)} cores", [])):
        print(f"{label}:", flush=True)
        subprocess.run(prefix + [sys.executable, __file__, "--child"], env=env, check=True,
                       stderr=subprocess.DEVNULL)


if __name__ == "__main__":
    main()
