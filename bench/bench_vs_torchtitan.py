"""torchtitan and this project's native runtime side by side: the same Llama shape, sequence,
batch, precision and parallelism, in alternating rounds of one run; tokens/s per device and peak
memory of each, and their ratio.

    python bench/bench_vs_torchtitan.py                  # CPU: 1 process, and fsdp=2 over 2 (gloo)
    python bench/bench_vs_torchtitan.py --download-wheels .whl       # here, for an offline GPU box
    python3 bench/bench_vs_torchtitan.py --device cuda --wheels .whl --out $OUT/vs-torchtitan

torchtitan is installed into an environment of its own (--env), never into this project's:
- CPU: torchtitan 0.2.2 with torch 2.13.0+cpu (--torch). torchtitan 0.3.0 trains its Llama only
  with compiled FlexAttention, whose backward CPU Inductor does not have (pytorch#148752), and
  neither release picks the CPU as its device: the worker below points torchtitan's device
  helpers at the CPU (`torch.cpu`, gloo; its memory monitor reads the process's peak RSS).
- CUDA: a folder on PYTHONPATH beside the machine's own torch, installed without dependencies
  from --wheels (the packages the GPU image lacks, fetched here by --download-wheels for Python
  3.12) or the registry. 0.3.0 needs torch >= 2.12 (its FSDP imports DataParallelMeshDims); this
  bench drives 0.2.2, the release for torch 2.10 and 2.11, and says so. Not run on a GPU yet.

Both sides: torch.compile on (torchtitan: each block and the loss; this project: the whole
step), fused AdamW, gradient clipping at 1.0, no activation checkpointing, causal attention
through torch's scaled_dot_product_attention (torchtitan's sdpa; here `--model.attention
flash`), parameters float32 (CPU: float32 compute; CUDA: bf16 autocast, as torchtitan on one
GPU). Text: the embedded Python-docs corpus, as JSON lines for torchtitan with a byte-level BPE
trained on it; each side's vocabulary is set to this project's tokenizer's 2,256 ids so the
models are the same size (the tokens differ; throughput does not depend on them).

This project runs twice per round: on torchtitan's torch (the same torch, so the ratio measures
the frameworks) and in its own environment (torch 2.9, as a user runs it). Each job's tokens/s
is the median of its per-step figures after --warmup steps (both log tokens / step time / devices,
per step); peak memory is the largest peak over the job's processes: resident set size on the
CPU (getrusage), torch.cuda.max_memory_reserved on a GPU. MFU (GPU): one formula for both, 6 x
parameters without the embedding + 12 x layers x dim x seq FLOPs per token, over the H200's
989 TFLOP/s dense bf16. Results: OUT/results.json and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TORCHTITAN = "0.2.2"
VOCAB = 2256  # this project's embedded tokenizer: 2,000 BPE ids and 256 reserved specials
SHAPES = {  # ModelArgs fields, both sides
    "cpu": {"dim": 256, "n_layers": 6, "n_heads": 16, "vocab_size": VOCAB, "rope_theta": 500000},
    # Llama 3.2 1B's shape, untied (torchtitan 0.2.2's Llama has no tied output).
    "cuda": {"dim": 2048, "n_layers": 16, "n_heads": 32, "n_kv_heads": 8, "ffn_dim_multiplier": 1.5,
             "multiple_of": 256, "vocab_size": 128256, "rope_theta": 500000},
}
RUNS = {  # (processes, sequence, local batch, steps)
    "cpu": {"1 process": (1, 256, 8), "fsdp=2, 2 processes": (2, 256, 8)},
    "cuda": {"1 GPU, seq 8192": (1, 8192, 1)},
}
H200_PEAK = 989e12  # dense bf16 FLOP/s, torchtitan's figure for H100 and H200
TT_LINE = re.compile(r"step:\s*(\d+)\s+loss:.*?tps:\s*([\d,]+)")
OUR_LINE = re.compile(r"step:\s+(\d+) .*?tps: ([\d,]+)")
# Packages of torchtitan 0.2.2 (and this project's pure-Python needs) the GPU image lacks.
GPU_WHEELS = ["torchtitan==0.2.2", "torchdata==0.11.0", "datasets==4.0.0", "dill==0.3.8",
              "multiprocess==0.70.16", "tyro", "docstring-parser", "typeguard", "tomli", "tomli-w"]


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)


def ensure_env(env: Path, device: str, torch_spec: str, wheels: Path | None) -> tuple[Path, str]:
    """torchtitan's environment, made once: its python and the PYTHONPATH its jobs need. CPU: a
    virtual environment with its own torch. CUDA: a folder beside the machine's own torch (a venv
    made from the image's venv would not see it), installed from --wheels without dependencies."""
    if device == "cuda":
        if not (env / "torchtitan").is_dir():
            source = sorted(Path(wheels).glob("*.whl")) if wheels else GPU_WHEELS
            pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", env]
            _setup([pip + source], env)
        return Path(sys.executable), str(env)
    python = env / "bin" / "python"
    if python.exists() and not run([python, "-c", "import torchtitan"]).returncode:
        return python, ""
    pip = [python, "-m", "pip", "install", "-q"] + (["--no-index", "--find-links", wheels] if wheels else [])
    # Its own torch, and triton: torchtitan imports it unconditionally. This project's own pure-Python
    # needs too, for its jobs on the same torch.
    _setup([[sys.executable, "-m", "venv", env], pip + [torch_spec, "triton"],
            pip + [f"torchtitan=={TORCHTITAN}", "tiktoken", "sentencepiece", "tomli-w", "safetensors"]], env)
    return python, ""


def _setup(steps: list, env: Path) -> None:
    for cmd in steps:
        print("$", " ".join(map(str, cmd)), flush=True)
        p = run(cmd)
        if p.returncode:
            sys.exit(f"setting up {env} failed:\n{p.stderr[-3000:]}")


def make_assets(work: Path) -> tuple[Path, Path]:
    """torchtitan's dataset folder (data.json lines of the corpus) and tokenizer folder."""
    sys.path.insert(0, str(REPO))
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from torchtitan_xla.datasets.sources import load_documents

    data, tok_dir = work / "data", work / "tokenizer"
    data.mkdir(parents=True, exist_ok=True)
    tok_dir.mkdir(parents=True, exist_ok=True)
    docs = [d["text"] for d in load_documents("python_docs", "", "train")]
    (data / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in docs))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.train_from_iterator(docs, trainers.BpeTrainer(vocab_size=2000, special_tokens=specials,
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tok_dir / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[1]}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return data, tok_dir


def torchtitan_flags(device: str, seq: int, batch: int, steps: int, data: Path, tok: Path, out: Path) -> list:
    # debugmodel: torchtitan's Llama 3 with sdpa causal attention; the worker sets its shape.
    return ["--model.name", "llama3", "--model.flavor", "debugmodel", "--model.hf_assets_path", tok,
            "--training.dataset", "c4_test", "--training.dataset_path", data, "--training.steps", steps,
            "--training.seq_len", seq, "--training.local_batch_size", batch, "--training.max_norm", "1.0",
            "--training.mixed_precision_param", "float32" if device == "cpu" else "bfloat16",
            "--optimizer.name", "AdamW", "--optimizer.lr", "8e-4", "--optimizer.implementation", "fused",
            "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
            "--job.dump_folder", out, "--compile.enable", "--activation_checkpoint.mode", "none"]


def our_flags(device: str, seq: int, batch: int, processes: int, steps: int, out: Path) -> list:
    return ["--job.config_file", REPO / "train_configs" / "debug_model.toml", "--job.no-print_config",
            "--runtime.backend", "native", "--runtime.device", device, "--model.attention", "flash",
            "--training.seq_len", seq, "--training.local_batch_size", batch,
            "--training.global_batch_size", batch * processes, "--training.steps", steps,
            "--training.mixed_precision_param", "float32" if device == "cpu" else "bfloat16",
            "--compile.step", "compile", "--lr_scheduler.warmup_steps", "2", "--metrics.log_freq", "1",
            "--job.dump_folder", out]


def job(python: Path, path: str, side: str, processes: int, flags: list, out: Path, device: str,
        shape: dict) -> dict:
    """One torchrun job through this file's worker: per-step tokens/s and the peak memory."""
    out.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_"))}
    env |= {"BENCH_PEAK": str(out / "peak"), "BENCH_DEVICE": device, "BENCH_SHAPE": json.dumps(shape),
            "PYTORCH_ALLOC_CONF": "expandable_segments:True"}  # torchtitan's run_train.sh sets it
    if path:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", processes,
           "--local-ranks-filter", "0", __file__, "--worker", side, *flags]
    p = run(cmd, env=env, cwd=out)
    (out / "log.txt").write_text(p.stdout + p.stderr)
    if p.returncode:
        return {"error": (p.stdout + p.stderr)[-2500:]}
    steps = (TT_LINE if side == "torchtitan" else OUR_LINE).findall(p.stdout + p.stderr)
    peaks = [int(f.read_text()) for f in out.glob("peak.*")]
    return {"tps": {int(s): float(t.replace(",", "")) for s, t in steps}, "peak_bytes": max(peaks)}


def worker(side: str, args: list) -> None:
    """Inside torchrun: the peak memory of this process written at exit, torchtitan's device
    helpers pointed at the CPU there, the model's shape set, then the trainer."""
    import atexit
    import resource
    import runpy
    import types

    import torch

    device, shape = os.environ["BENCH_DEVICE"], json.loads(os.environ["BENCH_SHAPE"])

    def peak() -> int:
        if device == "cuda":
            return torch.cuda.max_memory_reserved()
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    atexit.register(lambda: Path(f"{os.environ['BENCH_PEAK']}.{os.environ['RANK']}").write_text(str(peak())))
    if side == "ours":
        sys.path.insert(0, str(REPO))
        import train
        from torchtitan_xla.config import parse_args

        train.main(parse_args(args), model_overrides=shape)
        return
    # Before torchtitan's import: its config manager takes sys.argv as a default argument.
    sys.argv = ["torchtitan.train", *args]
    if device == "cpu":
        import torch._utils

        torch._utils._get_available_device_type = lambda: "cpu"
        cpu = torch.cpu
        cpu.current_device = lambda: 0  # barrier(device_ids=[...]) takes an int
        cpu.get_device_name = lambda device=None: platform.processor() or "cpu"
        cpu.get_device_properties = lambda device=None: types.SimpleNamespace(
            total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        cpu.memory_stats = lambda device=None: {f"{kind}_bytes.all.peak": peak()
                                                for kind in ("reserved", "active")}
        cpu.reset_peak_memory_stats = lambda device=None: None
        cpu.empty_cache = lambda: None
        # FSDP2 reduce-scatters with PREMUL_SUM(1/factor) (torchtitan divides by 1.0 itself), which
        # gloo lacks; a plain SUM, then the division, as FSDP does on MTIA.
        from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

        factors = collectives._get_gradient_divide_factors
        collectives._get_gradient_divide_factors = lambda *a: factors(*a[:5], True)
    from torchtitan.models.llama3 import llama3_args

    for key, value in shape.items():
        setattr(llama3_args["debugmodel"], key, value)
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


def summary(result: dict, warmup: int) -> dict:
    if "error" in result:
        return result
    after = [t for s, t in sorted(result["tps"].items()) if s > warmup]
    return {"tokens/s": statistics.median(after) if after else None, "steps timed": len(after),
            "peak GiB": round(result["peak_bytes"] / 2**30, 3)}


def flops_per_token(shape: dict, seq: int) -> float:
    """6 x parameters without the embedding + 12 x layers x dim x seq (torchtitan's formula)."""
    dim, layers, heads = shape["dim"], shape["n_layers"], shape["n_heads"]
    kv, multiple = shape.get("n_kv_heads", heads), shape.get("multiple_of", 256)
    hidden = int(shape.get("ffn_dim_multiplier", 1) * int(2 * 4 * dim / 3))  # both models' SwiGLU width
    hidden = multiple * -(-hidden // multiple)
    per_layer = 2 * dim * dim + 2 * dim * (dim // heads) * kv + 3 * dim * hidden + 2 * dim
    params = layers * per_layer + dim + dim * shape["vocab_size"]  # + output; not the input embedding
    return 6 * params + 12 * layers * dim * seq


def download_wheels(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in (17, 27, 28)]
    p = run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
             "3.12", "--implementation", "cp", *platforms, "-d", folder, *GPU_WHEELS])
    print(p.stdout[-2000:], p.stderr[-2000:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5, help="steps not timed (compilation)")
    parser.add_argument("--env", type=Path, default=Path.home() / ".cache" / "torchtitan_xla" /
                        f"bench-torchtitan-{TORCHTITAN}")
    parser.add_argument("--torch", default="torch==2.13.0+cpu", help="pip requirement for the CPU env")
    parser.add_argument("--wheels", type=Path, help="install torchtitan offline from this folder")
    parser.add_argument("--download-wheels", type=Path, help="fetch the GPU image's wheels here and stop")
    parser.add_argument("--out", type=Path, default=Path("/tmp/ttx-bench-vs-torchtitan"))
    parser.add_argument("--worker", choices=("torchtitan", "ours"), help=argparse.SUPPRESS)
    opts, rest = parser.parse_known_args()
    if opts.worker:
        return worker(opts.worker, rest)
    if opts.download_wheels:
        return download_wheels(opts.download_wheels)
    tt_python, tt_path = ensure_env(opts.env, opts.device, opts.torch, opts.wheels)
    versions = {name: run([py, "-c", "import torch; print(torch.__version__)"]).stdout.strip()
                for name, py in (("torchtitan env", tt_python), ("this project", sys.executable))}
    print(f"torchtitan {TORCHTITAN} (0.3.0 needs torch >= 2.12 and trains its Llama only with compiled "
          f"FlexAttention, which has no CPU backward); torch: {versions}", flush=True)
    out = opts.out
    if tt_path:  # this process reads the corpus with the folder's packages too
        sys.path.insert(0, tt_path)
    data, tok = make_assets(out / "assets")
    shape = SHAPES[opts.device]
    # On a GPU both run on the machine's torch; on the CPU this project also on torchtitan's.
    sides = {"torchtitan": ("torchtitan", tt_python, tt_path), "ours": ("ours", tt_python, tt_path)}
    if opts.device == "cpu":
        sides = {"torchtitan": sides["torchtitan"], "ours, torchtitan's torch": sides["ours"],
                 "ours, own torch": ("ours", Path(sys.executable), "")}
    results = {"machine": machine(opts.device), "torch": versions, "torchtitan": TORCHTITAN, "shape": shape,
               "rounds": {}}
    for run_name, (processes, seq, batch) in RUNS[opts.device].items():
        rounds = results["rounds"][run_name] = []
        for r in range(opts.rounds):
            row = {}
            for name, (side, python, path) in sides.items():
                folder = out / re.sub(r"\W+", "_", f"{run_name} {name} {r}")
                if side == "torchtitan":
                    flags = torchtitan_flags(opts.device, seq, batch, opts.steps, data, tok, folder)
                else:
                    flags = our_flags(opts.device, seq, batch, processes, opts.steps, folder)
                result = job(python, path, side, processes, flags, folder, opts.device, shape)
                row[name] = summary(result, opts.warmup)
                print(f"{run_name}, round {r + 1}, {name}: {row[name]}", flush=True)
            rounds.append(row)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    report(results, shape, opts.device)
    (out / "results.json").write_text(json.dumps(results, indent=1))


def machine(device: str) -> str:
    if device == "cuda":
        import torch

        return torch.cuda.get_device_name(0)
    model = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    flags = Path("/proc/cpuinfo").read_text()
    return (f"{model.group(1) if model else platform.processor()}, {os.cpu_count()} cores, "
            f"{'AVX-512' if 'avx512f' in flags else 'AVX2 only' if 'avx2' in flags else 'no AVX2'}")


def report(results: dict, shape: dict, device: str) -> None:
    print(f"\n{results['machine']}; torch {results['torch']}; torchtitan {results['torchtitan']}")
    print("| run | side | tokens/s per device (median of rounds) | peak GiB | ratio to torchtitan |"
          + (" MFU |" if device == "cuda" else ""))
    for run_name, rounds in results["rounds"].items():
        seq = RUNS[device][run_name][1]
        medians = {}
        for name in rounds[0]:
            tps = [r[name].get("tokens/s") for r in rounds if r[name].get("tokens/s")]
            peak = [r[name]["peak GiB"] for r in rounds if "peak GiB" in r[name]]
            medians[name] = (statistics.median(tps) if tps else None, max(peak) if peak else None)
        base = medians["torchtitan"][0]
        for name, (tps, peak) in medians.items():
            ratio = f"{tps / base:.3f}" if tps and base else "-"
            mfu = ""
            if device == "cuda" and tps:
                mfu = f" {100 * tps * flops_per_token(shape, seq) / H200_PEAK:.1f}% |"
            shown = "-" if tps is None else f"{tps:,.0f}"
            print(f"| {run_name} | {name} | {shown} | {peak} | {ratio} |{mfu}")
            results.setdefault("summary", {}).setdefault(run_name, {})[name] = {
                "tokens/s": tps, "peak GiB": peak, "ratio": ratio}


if __name__ == "__main__":
    main()
