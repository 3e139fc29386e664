"""The eager ops a native-runtime step dispatches outside compiled code, read from its profiler trace.

    torchrun --standalone --nproc-per-node 1 train.py --job.config_file train_configs/debug_model.toml \
        --runtime.backend native --training.seq_len 64 --training.steps 8 --checkpoint.no-enable \
        --profiling.enable_profiling --profiling.profile_freq 4 --profiling.profiler_active 1 \
        [--compile.step blocks]
    python bench/native_eager_ops.py outputs/debug_model/profile_traces/iteration_4/*.pt.trace.json

Counts the trace's top-level `aten::` CPU ops (none of them inside another aten op) that do not run
inside a compiled graph (inductor's `## Call CompiledFxGraph` ranges), and the compiled-graph calls
(torchtitan_xla.profiling.eager_ops; tests/test_native_runtime.py keeps the count).
On TorchTPU each such op is a device dispatch, on a GPU a kernel launch (issue 56, item 2). A
profiler rather than a TorchDispatchMode: in torch 2.9 an active dispatch mode changes the dispatch
keys dynamo's guards see, so the compiled blocks would recompile (pytorch#164992).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from torchtitan_xla.profiling import eager_ops  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="a native process's Chrome trace (*.pt.trace.json) of one step")
    ap.add_argument("--top", type=int, default=12)
    a = ap.parse_args()
    with open(a.trace) as f:
        ops, graphs = eager_ops(json.load(f))
    print(f"eager aten ops: {sum(ops.values())}, compiled-graph calls: {graphs}")
    for name, n in ops.most_common(a.top):
        print(f"  {n:6d}  {name}")


if __name__ == "__main__":
    main()
