"""What the compiler says: compile the training step of small configurations and read back XLA's
buffer assignment (temporary bytes per device) and the collectives of its optimized HLO.

    python -m torchtitan_xla.plan.calibrate POINTS.json --dump XLA_DUMP --run RUN_FOLDER
    python -m torchtitan_xla.plan.calibrate --cp   # docs/plan.md's context-parallel tables

Each point is {"args": [train.py flags], "model": {ModelArgs overrides}}; every point runs one
step of train.main in this process (one process per device count, since XLA fixes it at start)
and prints one JSON line. XLA's memory-minimising scheduler is used (`dump_flags`): with the CPU
backend's default one, activation checkpointing saves nothing in the compiled program.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CP, _TP = "--parallelism.context_parallel_degree", "--parallelism.tensor_parallel_degree"
_PP = "--parallelism.pipeline_parallel_degree"
MESH_FLAGS = {  # mesh name -> the [parallelism] flags that build it (data_parallel_shard_degree -1)
    "1": [], "fsdp8": [], "fsdp4tp2": [_TP, "2"],
    "hsdp2x4": ["--parallelism.data_parallel_replicate_degree", "2"],
    # Context parallelism (sdpa attention only; seq a multiple of 2 x cp x tp): on 8 devices, and
    # cp alone on 2 and 4.
    "cp2fsdp4": [_CP, "2"], "cp4fsdp2": [_CP, "4"], "cp8": [_CP, "8"], "cp2fsdp2tp2": [_CP, "2", _TP, "2"],
    "cp2": [_CP, "2"], "cp4": [_CP, "4"],
    # Pipeline stages (sdpa; the batch a multiple of the microbatches): GPipe with 2 microbatches,
    # circular with 4 microbatches of 2 rounds.
    "pp2fsdp4": [_PP, "2"],
    "pp2fsdp4circular": [_PP, "2", "--parallelism.pipeline_microbatches", "4",
                         "--parallelism.pipeline_schedule", "circular"],
}


def grid_point(*, n_layers: int, dim: int, heads: int, seq: int, batch: int, vocab: int, policy: str,
               attention: str, chunk: int, mesh: str, ffn_multiplier: float | None = None) -> dict:
    """A calibration point: the debug recipe in float32 with these sizes and options. `policy` is
    none, full, op or every-N; `ffn_multiplier` scales the FFN's hidden size (ModelArgs'
    ffn_dim_multiplier), so that it does not grow in step with dim. The step is compiled without the
    non-finite guard, as the fit's grid was (the guard's selection leaves XLA's temporaries at
    0.90-1.006 of these: tests/test_plan.py, docs/plan.md)."""
    ac = ({"none": ["none"], "full": ["full"]}.get(policy)
          or ["selective", "--activation_checkpoint.selective_ac_option", policy.removeprefix("every-")])
    args = ["--job.config_file", "train_configs/debug_model.toml",
            "--model.attention", attention, "--activation_checkpoint.mode", *ac,
            "--training.seq_len", str(seq), "--training.local_batch_size", str(batch),
            "--loss.chunk_size", str(chunk), "--training.no-skip_nonfinite_steps", *MESH_FLAGS[mesh]]
    model = {"n_layers": n_layers, "dim": dim, "n_heads": heads, "vocab_size": vocab,
             "ffn_dim_multiplier": ffn_multiplier}
    return {"args": args, "model": model, "mesh": mesh}


REPO = Path(__file__).resolve().parents[2]


def repo_args(args: list[str]) -> list[str]:
    """A point's train.py flags with its config file (relative to the repository) made absolute."""
    i = args.index("--job.config_file") + 1
    return [*args[:i], str(REPO / args[i]), *args[i + 1:]]


def calibration_shape(row: dict):
    """(memory.Shape, parameter bytes per device) of a calibration point (`grid_point` with the
    device count it ran on)."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.parallelisms import ParallelDims

    from .memory import BYTES_PARAM, activation_shape, build_meta_model, local_parameters

    cfg = parse_args(repo_args(row["args"]))
    dims = ParallelDims.from_config(cfg.parallelism, row["devices"])
    args, model = build_meta_model(cfg, **row["model"])
    elements, _ = local_parameters(model, dims)
    return activation_shape(cfg, args, dims, cfg.training.local_batch_size), elements * BYTES_PARAM


def measure(points: list[dict], devices: int, *, timeout: int = 1200) -> list[dict]:
    """[{"temp_bytes": int, "collectives": [[kind, result_bytes, group_size, shape], ...]}] per
    point, each from its own compiled step on `devices` virtual XLA CPU devices (the collectives
    of its optimized module, in the dtypes SPMD partitioning gave them: `with_partitioned_dtypes`)."""
    from torchtitan_xla import runtime

    dump_flags = runtime.compiled.dump_flags

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp, "points.json")
        spec.write_text(json.dumps(points))
        flags = f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(Path(tmp, 'xla'), memory_scheduler=True)}"
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), XLA_FLAGS=flags.strip())
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        p = subprocess.run([sys.executable, "-m", "torchtitan_xla.plan.calibrate", str(spec),
                            "--dump", str(Path(tmp, "xla")), "--run", str(Path(tmp, "run"))],
                           capture_output=True, text=True, env=env, timeout=timeout)
        results = [json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")]
        if p.returncode or len(results) != len(points):
            raise RuntimeError(f"calibration run failed ({p.returncode}):\n{p.stderr[-4000:]}")
        return results


def audit_point(row: dict, result: dict) -> tuple[dict, dict, list[str]]:
    """(bytes sent by kind as compiled, as the theory says, the audit's findings) of a measured
    point (`grid_point` with its device count and what `measure` returned for it)."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.parallelisms import ParallelDims

    from . import comms
    from .memory import activation_shape, build_meta_model

    cfg = parse_args(repo_args(row["args"]))
    dims = ParallelDims.from_config(cfg.parallelism, row["devices"])
    args, model = build_meta_model(cfg, **row["model"])
    t = cfg.training
    policy = activation_shape(cfg, args, dims, t.local_batch_size).policy
    act_bytes, reduce_bytes = comms.dtype_bytes(t)
    expected = comms.theory(model, dims, tokens=t.local_batch_size * t.seq_len, seq_len=t.seq_len,
                            microbatches=1, policy=policy, act_bytes=act_bytes, reduce_bytes=reduce_bytes)
    ops = [tuple(op) for op in result["collectives"]]
    findings = comms.audit(ops, expected, parameters=comms.parameters_by_shape(model))
    return comms.measured(ops), expected, findings


def _run(points: list[dict], dump: Path, run_folder: Path) -> None:
    sys.path.insert(0, str(REPO))
    import train
    from torchtitan_xla import runtime
    from torchtitan_xla.config import parse_args

    collective_ops, parse_buffer_assignment = (runtime.compiled.collective_ops,
                                               runtime.compiled.parse_buffer_assignment)

    seen: set[Path] = set()
    for point in points:
        args = [*repo_args(point["args"]), "--job.dump_folder", str(run_folder), "--job.no-print_config",
                "--training.steps", "1", "--metrics.log_freq", "1", "--checkpoint.no-enable"]
        with _left_out_of_fsdp(point.get("replicate", [])):
            train.main(parse_args(args), model_overrides=point.get("model", {}))
        new = sorted(set(dump.glob("*after_optimizations-buffer-assignment.txt")) - seen)
        seen.update(new)
        # The training step is the largest program a run compiles (the init graph is smaller).
        assignments = [(parse_buffer_assignment(f.read_text()), f) for f in new]
        step, path = max(assignments, key=lambda a: a[0].temp_bytes)
        optimized = Path(str(path).replace("-buffer-assignment.txt", ".txt"))
        # In the dtypes TPU moves (the CPU backend promotes bf16 collectives to f32).
        ops = runtime.compiled.with_partitioned_dtypes(collective_ops(optimized.read_text()),
                                                       runtime.compiled.partitioned_hlo(optimized))
        print("RESULT " + json.dumps({"temp_bytes": step.temp_bytes, "collectives": ops}), flush=True)


@contextlib.contextmanager
def _left_out_of_fsdp(names: list[str]):
    """Replicate these parameters instead of sharding them over `fsdp`: a broken sharding, for the
    test that the collectives audit names what it costs."""
    pl = importlib.import_module("torchtitan_xla.parallelisms.parallelize_llama")
    original = pl.apply_fsdp

    def apply_fsdp(model, mesh, parallel_dims):
        original(model, mesh, parallel_dims)
        for name, param in model.named_parameters():
            if name in names:
                spec = tuple(None if axis == "fsdp" or isinstance(axis, tuple) and "fsdp" in axis
                             else axis for axis in pl.partition_spec(param))
                pl.shard_param(param, mesh, spec)

    pl.apply_fsdp = apply_fsdp
    try:
        yield
    finally:
        pl.apply_fsdp = original


def context_parallel_tables(seq: int = 1024) -> str:
    """docs/plan.md's context-parallel tables (markdown), from 9 compiled steps of the debug model
    cut to 2 blocks (dim 256, 16 heads, vocabulary 2256, AC none, sdpa, float32): temporaries per
    device, compiled and planned, for 2 sequences of `seq` tokens split over cp = 1, 2, 4, 8 devices
    (one process per device count), and for 8 sequences on 8 devices as fsdp=8, cp=2 x fsdp=4,
    cp=4 x fsdp=2 and cp=8, with their collectives, compiled / theory."""
    from .comms import KINDS
    from .memory import temporaries

    def point(mesh: str, batch: int) -> dict:
        return grid_point(n_layers=2, dim=256, heads=16, seq=seq, batch=batch, vocab=2256, policy="none",
                          attention="sdpa", chunk=0, mesh=mesh)

    def rows(points: list[dict], devices: list[int], results: list[dict]) -> list[str]:
        out, first = [], None
        for p, n, result in zip(points, devices, results):
            shape, parameter_bytes = calibration_shape({**p, "devices": n})
            planned, temp = temporaries(shape, parameter_bytes), result["temp_bytes"]
            # Activations: beyond the gradients (float32, as the parameters).
            now = (temp - parameter_bytes, planned - parameter_bytes)
            first = first or now
            batch = p["args"][p["args"].index("--training.local_batch_size") + 1]
            out.append(f"| {p['mesh']} | {n} | {batch} | {temp / 1e6:.1f} | {now[0] / 1e6:.1f} "
                       f"| {now[0] / first[0]:.3f} | {planned / 1e6:.1f} | {now[1] / first[1]:.3f} "
                       f"| {planned / temp:.3f} |")
        return out

    head = ["| mesh | devices | sequences per rank | compiled temp MB | activations MB (temp - gradients) "
            "| factor | plan MB | plan's factor | plan / compiled |", "|---" * 9 + "|"]
    cps = [1, 2, 4, 8]
    alone = [point(f"cp{cp}" if cp > 1 else "1", 2) for cp in cps]
    lines = [f"One global shape, 2 sequences of {seq} tokens, split over cp devices:", "", *head,
             *rows(alone, cps, [measure([p], cp)[0] for p, cp in zip(alone, cps)])]
    meshes = [("fsdp8", 1), ("cp2fsdp4", 2), ("cp4fsdp2", 4), ("cp8", 8)]
    points = [point(mesh, batch) for mesh, batch in meshes]
    results = measure(points, 8)
    lines += ["", f"8 sequences of {seq} tokens on 8 devices:", "", *head, *rows(points, [8] * 4, results)]
    lines += ["", "MB sent per device, compiled / theory:", "",
              "| mesh | " + " | ".join(KINDS) + " | findings |", "|---" * (len(KINDS) + 2) + "|"]
    for p, r in zip(points, results):
        found, expected, findings = audit_point({**p, "devices": 8}, r)
        volumes = " | ".join(f"{found[k] / 1e6:.3f} / {expected[k] / 1e6:.3f}" for k in KINDS)
        whole = [f.split(" over ")[1].split(":")[0] for f in findings if "a whole gradient" in f]
        named = [f for f in findings if "a whole gradient" not in f and ": " in f and " MB " not in f]
        whole = [f"{whole.count(g)} whole gradients all-reduced over {g}" for g in sorted(set(whole))]
        summary = ", ".join([*whole, *named]) or "nothing"
        lines.append(f"| {p['mesh']} | {volumes} | {summary} |")
    return "\n".join(lines)


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("points", nargs="?")
    ap.add_argument("--dump", help="the folder XLA_FLAGS' --xla_dump_to names")
    ap.add_argument("--run", help="dump_folder for the runs")
    ap.add_argument("--cp", action="store_true", help="print docs/plan.md's context-parallel tables instead")
    a = ap.parse_args()
    if a.cp:
        print(context_parallel_tables())
    elif not (a.points and a.dump and a.run):
        ap.error("POINTS, --dump and --run are needed (or --cp)")
    else:
        _run(json.loads(Path(a.points).read_text()), Path(a.dump), Path(a.run))
