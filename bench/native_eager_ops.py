"""The eager ops a native-runtime step dispatches outside compiled code, read from its profiler trace.

    torchrun --standalone --nproc-per-node 1 train.py --job.config_file train_configs/debug_model.toml \
        --runtime.backend native --training.seq_len 64 --training.steps 4 --checkpoint.no-enable \
        --profiling.enable_profiling --profiling.profile_freq 4 --profiling.profiler_active 1
    python bench/native_eager_ops.py outputs/debug_model/profile_traces/iteration_4/*.pt.trace.json

Counts the trace's top-level `aten::` CPU ops (none of them inside another aten op) that do not run
inside a compiled graph (inductor's `## Call CompiledFxGraph` ranges), and the compiled-graph calls.
On TorchTPU each such op is a device dispatch, on a GPU a kernel launch (issue 56, item 2). A
profiler rather than a TorchDispatchMode: in torch 2.9 an active dispatch mode changes the dispatch
keys dynamo's guards see, so the compiled blocks would recompile (pytorch#164992).
"""

from __future__ import annotations

import argparse
import collections
import json

COMPILED = "## Call CompiledFxGraph"


def eager_ops(trace: dict) -> tuple[collections.Counter, int]:
    """({aten op: count} outside compiled graphs, number of compiled-graph calls)."""
    threads: dict[int, list] = collections.defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("ph") == "X":
            threads[e["tid"]].append(e)
    ops, graphs = collections.Counter(), 0
    for events in threads.values():
        events.sort(key=lambda e: (e["ts"], -e["dur"]))
        open_ranges: list[dict] = []
        for e in events:
            while open_ranges and open_ranges[-1]["ts"] + open_ranges[-1]["dur"] <= e["ts"]:
                open_ranges.pop()
            name = e["name"]
            graphs += name.startswith(COMPILED)
            nested = any(r["name"].startswith((COMPILED, "aten::")) for r in open_ranges)
            if name.startswith("aten::") and e.get("cat") == "cpu_op" and not nested:
                ops[name] += 1
            open_ranges.append(e)
    return ops, graphs


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
