"""How fast XLA CPU runs one batched product of the attention shapes in each of its orientations.

    python bench/bench_dot_orientations.py            # batch 512, keys E = 256, head_dim 16
    python bench/bench_dot_orientations.py --keys 64

For out[M, N] = lhs[M, K] @ rhs[K, N] with {M, N, K} the three attention sizes (query block 64,
keys E, head_dim 16), each operand stored as given or transposed: 6 x 4 cases, one jitted
`lax.dot_general` each. XLA CPU hands every batch element to Eigen as one matrix product in the
operands' layout, so the orientation alone changes the speed; blockwise_attention.py writes its
backward so that XLA is given the fast ones (docs/performance.md).

Through jaxlib's XLA CPU (the jax that scan_layers needs), not torch_xla's build of it: torch_xla
returns the product as a graph output, and its copy would dominate the timings. The same Eigen
runtime; the in-graph profile in docs/performance.md agrees on which orientations are slow.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--keys", type=int, default=256)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.child:
        # As run_train.sh on the CPU backend: without its malloc setting every run faults in the
        # product's temporary buffer afresh, which swamps the largest outputs' timings.
        sys.path.insert(0, str(REPO))
        from torchtitan_xla.runtime.xla.process import cpu_malloc_env

        env = {**os.environ, "JAX_PLATFORMS": "cpu", **cpu_malloc_env(os.environ)}
        sys.exit(subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env=env).returncode)

    import jax
    from jax import lax

    key = jax.random.PRNGKey(0)
    b = args.batch
    print(f"batch {b}, out[M, N] = lhs @ rhs contracting K; median of {args.reps} runs")
    for m, n, k in itertools.permutations((64, args.keys, 16)):
        for lhs_t, rhs_t in itertools.product((False, True), repeat=2):
            lhs = jax.random.normal(key, (b, k, m) if lhs_t else (b, m, k))
            rhs = jax.random.normal(key, (b, n, k) if rhs_t else (b, k, n))
            dims = (((1 if lhs_t else 2,), (2 if rhs_t else 1,)), ((0,), (0,)))
            # Only a corner of the product leaves the graph: no output copy is timed.
            fn = jax.jit(lambda x, y, dims=dims: lax.dot_general(x, y, dims)[:, :1, :1].sum())
            fn(lhs, rhs).block_until_ready()
            times = []
            for _ in range(args.reps):
                t = time.perf_counter()
                fn(lhs, rhs).block_until_ready()
                times.append(time.perf_counter() - t)
            t = sorted(times)[len(times) // 2]
            fast = "" if lhs_t or rhs_t else "  <- both row-major"
            print(f"M={m:4d} N={n:4d} K={k:4d}  lhs stored {'[K,M]' if lhs_t else '[M,K]'}  rhs stored "
                  f"{'[N,K]' if rhs_t else '[K,N]'}  {t * 1e3:7.2f} ms {2 * b * m * n * k / t / 1e9:6.1f} "
                  f"GFLOP/s{fast}", flush=True)


if __name__ == "__main__":
    main()
