"""Generation speed on this machine: prefill and decode tokens/s of torchtitan_xla.generate's
Generator on the Llama 3 debug model (random weights, 2,256-token vocabulary), on the XLA runtime
(compiled prefill and decode graphs) and on the native runtime (eager PyTorch, and each call one
torch.compile'd graph), one process each, in one invocation so the ratios compare the same machine
state.

    python bench/bench_generate.py                      # batch 4, prompts of 32, 64 new tokens
    python bench/bench_generate.py --batch 8 --new-tokens 128

Each worker generates once to warm up (XLA compiles there), then `--rounds` times; reported:
the medians over rounds of prefill and decode tokens/s (decode: new tokens after the first, over
the decode loop's wall time, its host reads included), and XLA compiles after warm-up (must be 0).
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


def worker(opts) -> None:
    import torch

    sys.path.insert(0, str(REPO))
    from torchtitan_xla import runtime

    backend, step_compiler = RUNS[opts.worker]
    runtime.use(backend)
    runtime.configure(step_compiler)
    from torchtitan_xla.generate import Generator
    from torchtitan_xla.models import get_model_args, get_model_class

    device = runtime.init_devices()
    cache = opts.prompt_len + opts.new_tokens + 16
    args = get_model_args("llama3", "debugmodel", vocab_size=2256, max_seq_len=cache)
    torch.manual_seed(0)
    model = get_model_class("llama3")(args)
    model.init_weights()
    model = model.to(device).eval()
    runtime.materialise()
    gen = Generator(model, cache_size=cache, batch_size=opts.batch, device=device, eos_ids=[], pad_id=0,
                    step_compiler=step_compiler)
    prompts = torch.randint(1, 2256, (opts.batch, opts.prompt_len)).tolist()
    gen(prompts, opts.new_tokens)  # warm-up: the compiles
    compiles = runtime.compile_stats()[0]
    rows = []
    for _ in range(opts.rounds):
        gen.stats = type(gen.stats)()
        t0 = time.perf_counter()
        gen(prompts, opts.new_tokens)
        s = gen.stats
        rows.append({"prefill": s.prefill_tokens / s.prefill_seconds,
                     "decode": s.decode_tokens / s.decode_seconds, "wall": time.perf_counter() - t0})
    print(json.dumps({"rounds": rows, "compiles_after_warmup": runtime.compile_stats()[0] - compiles}))


# name: (runtime, step compiler)
RUNS = {"xla": ("xla", "lazy"), "native": ("native", "eager"), "native-compile": ("native", "compile")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", choices=list(RUNS), help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.worker:
        return worker(opts)
    sys.path.insert(0, str(REPO))
    from torchtitan_xla.runtime.xla.process import cpu_features, cpu_model, vector_features

    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    results = {}
    for kind in RUNS:
        out = subprocess.run([sys.executable, __file__, "--worker", kind, *sys.argv[1:]], env=env,
                             capture_output=True, text=True, check=True).stdout
        results[kind] = json.loads(out.strip().splitlines()[-1])
    print(f"machine: {cpu_model()} ({vector_features(cpu_features())}), {os.cpu_count()} cores; "
          f"debug model, batch {opts.batch}, prompts of {opts.prompt_len} tokens, "
          f"{opts.new_tokens} new tokens")
    med = {k: {m: statistics.median(r[m] for r in v["rounds"]) for m in ("prefill", "decode")}
           for k, v in results.items()}
    for kind, m in med.items():
        print(f"{kind:>14}: prefill {m['prefill']:,.0f} tokens/s, decode {m['decode']:,.1f} tokens/s "
              f"(compiles after warm-up: {results[kind]['compiles_after_warmup']})")
    for kind in ("xla", "native-compile"):
        print(f"decode, {kind} / native eager: {med[kind]['decode'] / med['native']['decode']:.2f}x")


if __name__ == "__main__":
    main()
