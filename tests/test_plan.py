"""The plan (torchtitan_xla/plan): its memory model against XLA's buffer assignment of the compiled
step, its collectives theory against the step's optimized HLO, the command on every recipe, and
its error lines. The compiled steps come from two subprocess runs shared by the tests."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO

from torchtitan_xla.plan import memory
from torchtitan_xla.plan.calibrate import audit_point, calibration_shape, grid_point, measure

RECIPES = {"debug_model": "v6e-8", "llama2_7b": "v5p-64", "llama3_8b": "v6e-256",
           "llama3_70b": "v6e-256", "llama3_405b": "v5p-1024", "llama3_8b_sft": "v6e-64",
           "llama3_8b_lora": "v6e-8", "debug_sft": "v6e-8", "debug_lora": "v6e-8",
           "mixtral_8x7b": "v5p-256", "qwen3_8b_sft": "v6e-64", "qwen3_8b_lora": "v6e-8",
           "qwen3_30b_a3b": "v5p-128", "llama3_2_1b": "v6e-8", "deepseek_v3_16b": "v5p-64",
           "deepseek_v3_671b": "v5p-1024", "llama3_8b_128k": "v5p-128", "llama3_405b_2slices": "v6e-256",
           "debug_dpo": "v6e-8", "llama3_8b_dpo": "v6e-64", "qwen3_8b_dpo": "v6e-64",
           "debug_grpo": "v6e-8", "llama3_2_1b_grpo": "v6e-8", "qwen3_8b_grpo": "v5p-8",
           "gemma3_12b_sft": "v6e-64", "gemma3_27b_lora": "v6e-16", "gpt_oss_20b": "v5p-16"}


# The data-parallel degree of the grpo recipes' meshes (their rollouts' rows: local_batch_size x it).
RECIPE_DP = {"debug_grpo": 8, "llama3_2_1b_grpo": 8, "qwen3_8b_grpo": 4}


def _point(mesh, n_layers, dim, heads, seq, batch, vocab, policy, attention, chunk):
    return grid_point(n_layers=n_layers, dim=dim, heads=heads, seq=seq, batch=batch, vocab=vocab,
                      policy=policy, attention=attention, chunk=chunk, mesh=mesh)


# Depth, width, heads, seq, batch, vocabulary, AC policy, attention, loss chunk: each varies (each
# policy, attention and loss once at least; the 393-point grid of docs/plan.md varies them all), in
# the regime of real runs (at least 1024 tokens per device, more per FSDP group than vocabulary).
ONE_DEVICE = [
    _point("1", 2, 256, 16, 512, 2, 2256, "none", "sdpa", 0),
    _point("1", 3, 128, 8, 256, 4, 4096, "full", "blockwise", 0),
    _point("1", 4, 384, 16, 128, 8, 8192, "op", "sdpa", 128),
    _point("1", 2, 256, 8, 512, 2, 2256, "every-2", "blockwise", 128),
    _point("1", 4, 256, 8, 256, 4, 4096, "every-2", "sdpa", 0),
    # Mixtral's 2 MoE blocks, dropless: the dispatch counted from its shapes (memory.moe_excess).
    {**(p := _point("1", 2, 256, 16, 256, 4, 2256, "none", "sdpa", 0)),
     "args": [*p["args"], "--model.name", "mixtral"]},
]
FSDP8 = _point("fsdp8", 2, 256, 16, 256, 4, 2256, "none", "sdpa", 0)
FSDP4_TP2 = _point("fsdp4tp2", 2, 256, 16, 256, 4, 2256, "none", "sdpa", 0)
BROKEN = {**FSDP8, "replicate": ["layers.0.feed_forward.w1.weight"]}
# Context parallelism at one global shape (8 sequences of 1024 tokens): each sequence over 2 devices
# (x fsdp 4) and over all 8.
CP2_FSDP4 = _point("cp2fsdp4", 2, 256, 16, 1024, 2, 2256, "none", "sdpa", 0)
CP8 = _point("cp8", 2, 256, 16, 1024, 8, 2256, "none", "sdpa", 0)
# Pipeline stages, no checkpointing: every iteration's activations counted as blocks.
PP_POINTS = [_point("pp2fsdp4", 4, 256, 16, 256, 4, 2256, "none", "sdpa", 0),
             _point("pp2fsdp4circular", 4, 256, 16, 256, 8, 2256, "none", "sdpa", 0)]
EIGHT_DEVICES = [
    FSDP8, FSDP4_TP2, BROKEN, *PP_POINTS,
    _point("fsdp4tp2", 3, 128, 8, 512, 2, 4096, "full", "sdpa", 128),
    _point("hsdp2x4", 2, 384, 16, 256, 4, 2256, "op", "sdpa", 0),
    CP2_FSDP4, CP8,
]


def _bf16(point: dict) -> dict:
    """The point under bfloat16 autocast (the memory model is fitted in float32: only audited)."""
    return {**point, "args": [*point["args"], "--training.mixed_precision_param", "bfloat16"]}


# Gradients reduced in float32 ([training] mixed_precision_reduce's default) on fsdp=8, in bf16 on
# fsdp=4 x tp=2.
FSDP8_BF16 = _bf16(FSDP8)
FSDP4_TP2_BF16 = {**_bf16(FSDP4_TP2), "args": [*_bf16(FSDP4_TP2)["args"], "--training.mixed_precision_reduce",
                                                "bfloat16"]}


def _guarded(point: dict) -> dict:
    """The point's step with the non-finite guard (the default step)."""
    return {**point, "args": [a for a in point["args"] if a != "--training.no-skip_nonfinite_steps"]}


# The points where the guard moved the temporaries most, also compiled with it.
GUARDED = {1: _guarded(ONE_DEVICE[4]), 8: _guarded(PP_POINTS[1])}


@pytest.fixture(scope="module")
def compiled():
    """{id(point): (point with its device count, what the compiler said)} for every point (and
    the GUARDED ones): one process per device count."""
    out = {}
    for devices, points in ((1, [*ONE_DEVICE, GUARDED[1]]),
                            (8, [*EIGHT_DEVICES, GUARDED[8], FSDP8_BF16, FSDP4_TP2_BF16])):
        for point, result in zip(points, measure(points, devices)):
            out[id(point)] = ({**point, "devices": devices}, result)
    return out


def test_activation_model_within_10_percent_of_the_compiler(compiled):
    """The plan's temporaries (gradients, saved activations, working set, loss, optimizer
    temporaries) against the temp buffer XLA assigned the compiled step, at every grid point."""
    errors = []
    for point in [*ONE_DEVICE, *EIGHT_DEVICES]:
        if point is BROKEN:
            continue
        row, result = compiled[id(point)]
        shape, parameter_bytes = calibration_shape(row)
        predicted = memory.temporaries(shape, parameter_bytes)
        errors.append((predicted / result["temp_bytes"] - 1, row["mesh"], shape))
    worst = max(errors, key=lambda e: abs(e[0]))
    assert abs(worst[0]) <= 0.10, worst


def test_the_nonfinite_guard_adds_no_temporaries_the_plan_leaves_out(compiled):
    """The plan is fitted to the step without the non-finite guard ([training]
    skip_nonfinite_steps); the default step selects every updated tensor back when a step is not
    finite. XLA fuses that selection into the update: its temporaries stay within 1% of the
    unguarded step's (measured 0.90-1.006 over this file's grid; a copy of the weights and the
    optimizer state would add 3x the weights' bytes), here on the points that moved most."""
    for devices, point in ((1, ONE_DEVICE[4]), (8, PP_POINTS[1])):
        skipping, plain = compiled[id(GUARDED[devices])][1], compiled[id(point)][1]
        assert skipping["temp_bytes"] <= 1.01 * plain["temp_bytes"], (point["mesh"], skipping, plain)


def _audit(compiled, point):
    return audit_point(*compiled[id(point)])


def test_fsdp8_collectives_are_the_theory(compiled):
    """Every parameter gathered forward and backward (the embedding forward only) and every
    gradient reduce-scattered, and nothing else of size."""
    found, expected, findings = _audit(compiled, FSDP8)
    assert findings == []
    for kind in ("all-gather", "reduce-scatter"):
        assert found[kind] == pytest.approx(expected[kind], rel=0.05)
    assert expected["all-reduce"] == expected["all-to-all"] == 0
    assert found["all-to-all"] == found["collective-permute"] == 0
    assert found["all-reduce"] < 1e3  # the loss's and the gradient norm's scalars


def test_fsdp4_tp2_collectives_are_the_theory(compiled):
    """FSDP's gathers and reduce-scatters of the tensor-parallel shards, plus sequence parallelism's
    gathers and reduce-scatters of [tokens, dim] and the embedding's all-to-all; no head gathered."""
    found, expected, findings = _audit(compiled, FSDP4_TP2)
    assert findings == []
    for kind in ("all-gather", "reduce-scatter", "all-to-all"):
        assert expected[kind] > 0
        assert found[kind] == pytest.approx(expected[kind], rel=0.05)
    assert found["collective-permute"] == 0


@pytest.mark.parametrize("point, fsdp", [(FSDP8_BF16, 8), (FSDP4_TP2_BF16, 4)],
                         ids=["fsdp8-reduce-f32", "fsdp4tp2-reduce-bf16"])
def test_fsdp_gathers_bfloat16_weights_under_autocast(compiled, point, fsdp):
    """Under bf16 autocast, in the module as SPMD partitioning hands it to TPU (the CPU backend
    then promotes bf16 collectives to f32): FSDP gathers every weight matrix in bfloat16, the
    embedding's too (cast where it is sharded), and the norms in float32; the weights' gradients
    are reduce-scattered in float32 by default and in bfloat16 when asked (mixed_precision_reduce),
    the embedding's in float32 either way; sequence parallelism gathers bf16 but for the final
    norm's output; and every kind's bytes equal the theory within 5%."""
    row, result = compiled[id(point)]
    ops = [tuple(op) for op in result["collectives"]]
    fsdp_ops = [(kind, shape.split("[")[0], shape.split("[")[1].split("]")[0].split(","))
                for kind, _, group, shape in ops if group == fsdp]
    gathers = [(dtype, len(dims)) for kind, dtype, dims in fsdp_ops if kind == "all-gather"]
    assert sum(rank == 2 for _, rank in gathers) >= 15, gathers  # 7 a block and the two tables
    assert all(dtype == ("bf16" if rank == 2 else "f32") for dtype, rank in gathers), gathers
    vocab, dim = 2256, 256 // (8 // fsdp)  # the table's [vocab, dim / tp]
    reduced = {(dtype, tuple(map(int, dims))) for kind, dtype, dims in fsdp_ops
               if kind == "reduce-scatter" and len(dims) == 2}
    if fsdp == 8:  # attention's, w1 and w3's, w2's, the tables'
        assert reduced == {("f32", s) for s in [(256, 256), (768, 256), (256, 768), (vocab, dim)]}, reduced
    else:
        assert [shape for d, shape in reduced if d == "f32"] == [(vocab, dim)] and len(reduced) == 6, reduced
    if fsdp == 4:  # sequence parallelism (tp = 2): per block the norms' outputs, cast and then
        # gathered, and the row-parallel outputs' gradients, in bf16; the final norm's in float32
        sequence = sorted(shape.split("[")[0] for kind, _, group, shape in ops if kind == "all-gather" and group == 2)
        assert sequence == ["bf16"] * 8 + ["f32"], sequence
    found, expected, findings = _audit(compiled, point)
    assert findings == []
    _, f32_expected, _ = _audit(compiled, FSDP8 if fsdp == 8 else FSDP4_TP2)
    for kind in ("all-gather", "reduce-scatter"):
        assert found[kind] == pytest.approx(expected[kind], rel=0.05)
    assert expected["all-gather"] < 0.7 * f32_expected["all-gather"]


def test_audit_names_a_parameter_left_out_of_fsdp(compiled):
    """With one weight replicated instead of sharded, the audit names its gradient's all-reduce."""
    found, expected, findings = _audit(compiled, BROKEN)
    assert any(line.startswith("all-reduce f32[") and "layers.0.feed_forward.w1.weight" in line
               for line in findings), findings
    assert found["all-gather"] < expected["all-gather"]  # the replicated weight is not gathered


def test_cp8_collectives_are_the_theory(compiled):
    """Context parallelism over all 8 devices: per block the keys and values [batch, seq, kv heads,
    head_dim] all-gathered over cp and their gradients reduce-scattered, each weight gathered once
    (einsum projections), the embedding looked up in each device's rows; nothing else of size."""
    found, expected, findings = _audit(compiled, CP8)
    assert findings == []
    for kind in ("all-gather", "reduce-scatter"):
        assert found[kind] == pytest.approx(expected[kind], rel=0.05)
    ops = compiled[id(CP8)][1]["collectives"]
    kv = [op for op in ops if op[0] == "all-gather" and op[2] == 8 and op[3].startswith("f32[8,1024,16,16]")]
    assert len(kv) == 2 * 2  # k and v of 2 blocks
    grads = [op for op in ops if op[0] == "reduce-scatter" and op[3].split("{")[0] in
             ("f32[8,16,1024,16]", "f32[8,16,16,1024]")]
    assert len(grads) == 2 * 2


def test_cp2_fsdp4_collectives(compiled):
    """cp=2 x fsdp=4: the gathers (weights over all 8, keys and values over cp) and the embedding's
    permutes are the theory's; XLA CPU reduces each weight gradient in two steps, whole over cp, then
    over fsdp (docs/plan.md), which the audit names; nothing else."""
    found, expected, findings = _audit(compiled, CP2_FSDP4)
    for kind in ("all-gather", "collective-permute"):
        assert expected[kind] > 0
        assert found[kind] == pytest.approx(expected[kind], rel=0.05)
    assert all(line.startswith(("reduce-scatter: ", "all-reduce: ")) or " over 2 devices: a whole gradient" in line
               for line in findings), findings
    assert found["reduce-scatter"] + found["all-reduce"] >= 0.95 * expected["reduce-scatter"]


def _plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torchtitan_xla.plan", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def recipe_plans() -> dict[str, tuple[int, str]]:
    """Every recipe's plan, in one process (torch imported once): {recipe: (exit code, output)}."""
    code = (
        "import contextlib, io, json, sys\n"
        "from torchtitan_xla.plan.__main__ import main\n"
        "out = {}\n"
        "for recipe in sys.argv[1:]:\n"
        "    buffer = io.StringIO()\n"
        "    with contextlib.redirect_stdout(buffer):\n"
        "        rc = main(['--job.config_file', f'train_configs/{recipe}.toml'])\n"
        "    out[recipe] = (rc, buffer.getvalue())\n"
        "print(json.dumps(out))\n")
    p = subprocess.run([sys.executable, "-c", code, *RECIPES], cwd=REPO, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return {k: tuple(v) for k, v in json.loads(p.stdout.splitlines()[-1]).items()}


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_fits_its_slice(recipe, recipe_plans):
    """The plan of each recipe prints a verdict for the recipe's own slice: each recipe fits it."""
    rc, out = recipe_plans[recipe]
    assert rc == 0, out
    assert out.strip().splitlines()[-1] == f"verdict: FITS on {RECIPES[recipe]}"
    assert "MFU at most" in out
    # Which runtime the recipe is meant for; whether the native one (TorchTPU) runs it too.
    other = 'the native runtime (TorchTPU) runs it too ([runtime] backend = "native"; not verified on a TPU)'
    if recipe == "llama3_8b_128k":
        other = ("not on the native runtime yet: [parallelism] context_parallel_degree = 64, its key and value "
                 "gathers are sharding annotations for XLA SPMD")
    if recipe == "llama3_405b_2slices":
        other = ("not on the native runtime yet: [parallelism] pipeline_parallel_degree = 2, its stages are one "
                 "SPMD program (vmapped over a pp-split dimension)")
        assert "bubble 6.7% of the step" in out
    if recipe.endswith("_dpo"):
        # The frozen reference model is counted: a float32 copy of the weights, sharded as they are.
        parameters, reference = out.splitlines()[3].split(), out.splitlines()[6].split()
        assert reference[:3] == ["reference", parameters[1], "GiB"] and parameters[0] == "parameters"
        assert out.splitlines()[6].endswith("(dpo's frozen reference model, float32)")
    if recipe.endswith("_grpo"):
        # The rollouts' KV cache: every row of the step's rollout on every chip, heads over tp.
        from torchtitan_xla.config import parse_args
        from torchtitan_xla.plan.memory import model_args

        cfg = parse_args(["--job.config_file", f"train_configs/{recipe}.toml"])
        args, tp = model_args(cfg), cfg.parallelism.tensor_parallel_degree
        rows = cfg.training.local_batch_size * RECIPE_DP[recipe]
        cache = args.n_layers * rows * cfg.training.seq_len * 2 * (args.kv_heads // tp) * args.head_dim * 4
        line = next(ln for ln in out.splitlines() if ln.startswith("  kv cache"))
        assert line.split()[2] == f"{cache / 2**30:.2f}", (line, cache)
    assert out.splitlines()[1] == f"runtime: xla (torch_xla SPMD: one process per host); {other}"


def test_run_train_sh_plan_prints_the_recipes_plan(recipe_plans):
    """`CONFIG_FILE=... ./run_train.sh --plan`, as a user types it, prints what the plan prints."""
    p = subprocess.run([str(REPO / "run_train.sh"), "--plan"], cwd=REPO, capture_output=True,
                       text=True, timeout=300, env={**os.environ, "CONFIG_FILE": "qwen3_30b_a3b.toml"})
    assert (p.returncode, p.stdout) == recipe_plans["qwen3_30b_a3b"]


def test_plan_allocates_nothing_and_suggests_what_fits():
    """405B on too small a slice, in-process: no XLA device is touched and the process stays
    small (the model is on the meta device); the knob it names makes the job fit."""
    code = (
        "import resource, sys\n"
        "from torchtitan_xla.plan.__main__ import main\n"
        "rc = main(sys.argv[1:])\n"
        "print('torch_xla loaded:', 'torch_xla' in sys.modules)\n"
        "print('maxrss_kib:', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
        "sys.exit(rc)\n")
    args = ["--job.config_file", "train_configs/llama3_8b.toml", "--activation_checkpoint.mode", "none",
            "--model.attention", "sdpa"]
    p = subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "torch_xla loaded: False" in p.stdout
    assert int(p.stdout.split("maxrss_kib:")[1].split()[0]) < 3 * 2**20  # < 3 GiB: 8B in float32 is 32
    assert "does not fit by" in p.stdout
    knobs = p.stdout.split("would fit with:\n")[1].splitlines()
    knob = knobs[0].split("   (")[0].split()
    assert _plan(*args, *knob).returncode == 0
    # Each block's input on the host: 32 blocks x 8192 tokens x 4096 x 2 bytes = 2 GiB per chip,
    # 16 GiB for a v6e host's 8 chips; the device keeps 31 of the 32 inputs fewer than full
    # checkpointing alone (1.94 GiB).
    full = next(k for k in knobs if k.startswith("    --activation_checkpoint.mode full   ("))
    offload = next(k for k in knobs if "--activation_checkpoint.offload decoder_layer_input" in k)
    assert offload.endswith("GiB; 16.00 GiB on each host)"), offload
    device = {k: float(k.split("   (")[1].split(" GiB")[0]) for k in (full, offload)}
    assert device[full] - device[offload] == pytest.approx(31 / 32 * 2, abs=0.01)


def test_offloaded_block_inputs_leave_the_device_count_for_the_hosts():
    """The accounting on the debug model (8 blocks, dim 256, batch 8 x 256 tokens, bfloat16
    compute) on one device: each block's input (8 x 256 x 256 x 2 bytes = 1 MiB) is on the host;
    the device counts 7 of the 8 fewer (one comes back for its recomputation). Its attention
    projections (query, key and value: 256 features a token each) add to the host's count only:
    full checkpointing keeps none of them on the device."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.parallelisms import ParallelDims

    base = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--activation_checkpoint.mode", "full", "--training.mixed_precision_param", "bfloat16"]
    runs = {}
    for name, extra in {"full": [], "offload": ["--activation_checkpoint.offload", "decoder_layer_input"],
                        "both": ["--activation_checkpoint.offload", "decoder_layer_input,qkv_proj"]}.items():
        cfg = parse_args([*base, *extra])
        runs[name] = memory.estimate(cfg, ParallelDims.from_config(cfg.parallelism, 1))
    t = parse_args(base).training
    block_input = t.local_batch_size * t.seq_len * 256 * 2
    assert runs["full"].host == 0
    assert runs["offload"].host == 8 * block_input
    assert runs["full"].temporaries - runs["offload"].temporaries == 7 * block_input
    assert runs["full"].parameters == runs["offload"].parameters
    args = memory.model_args(parse_args(base))
    features = args.n_heads * args.head_dim + 2 * args.kv_heads * args.head_dim
    assert runs["both"].host - runs["offload"].host == 8 * t.local_batch_size * t.seq_len * features * 2
    assert runs["both"].total == runs["offload"].total


def test_optimizer_offload_leaves_the_device_count_for_the_hosts():
    """The accounting on the debug model on one device: with `[optimizer] offload` the device
    counts no optimizer state; the host counts AdamW's two state tensors, the float32 copy of the
    weights and the gradients' landing buffer: 16 bytes per trained element."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.parallelisms import ParallelDims

    base = ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--runtime.backend", "native"]
    runs = {}
    for name, extra in {"device": [], "host": ["--optimizer.offload"]}.items():
        cfg = parse_args([*base, *extra])
        runs[name] = memory.estimate(cfg, ParallelDims.from_config(cfg.parallelism, 1))
    trained = runs["device"].gradients // 4
    assert runs["device"].optimizer == 8 * trained and runs["device"].host == 0
    assert runs["host"].optimizer == 0 and runs["host"].host == 16 * trained
    assert runs["device"].total - runs["host"].total == 8 * trained


def test_the_405b_plan_that_does_not_fit_offers_the_optimizer_on_the_host():
    """llama3_405b on a v6e-256 (a quarter of its recipe's chips' HBM): no single knob fits; the
    memory savers together with the optimizer on the host (the native runtime's) do, and the line
    says what each host then keeps: 16 bytes per trained element for 8 chips."""
    from torchtitan_xla.plan.__main__ import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["--job.config_file", str(REPO / "train_configs" / "llama3_405b.toml"), "--plan.tpu", "v6e-256"])
    text = out.getvalue()
    assert rc == 1 and "does not fit by" in text
    params = float(text.split("  parameters")[1].split("GiB")[0])
    knob = text.split("would fit with:\n")[1].splitlines()[0]
    assert "--runtime.backend native --optimizer.offload   (" in knob, knob
    host = float(knob.split("; ")[1].split(" GiB on each host")[0])
    assert host == pytest.approx(8 * 4 * params, abs=32 * 0.005)  # (the parameters line: to 0.01 GiB)


@pytest.mark.parametrize("args, message", [
    # Each error names where the bad value came from: the flag, or the file and key.
    (["--plan.tpu", "v9z-64"],
     "error: command line: --plan.tpu = 'v9z-64': unknown TPU slice; expected"),
    (["--plan.tpu", "v5p-3"],
     "error: command line: --plan.tpu = 'v5p-3': a v5p slice size counts TensorCores"),
    (["--plan.tpu", "v5p-256", "--parallelism.num_slices", "2", "--parallelism.data_parallel_replicate_degree", "2"],
     "error: command line: --parallelism.num_slices = 2: the plan covers one slice"),
    (["--plan.tpu", "v5p-256", "--parallelism.data_parallel_shard_degree", "64"],
     "error: train_configs/llama3_70b.toml: [parallelism] "
     "data_parallel_replicate_degree (1) x data_parallel_shard_degree (64) x tensor_parallel_degree "
     "(4) = 256, but there are 128 devices (on v5p-256: 128 chips, one device each) "
     "(data_parallel_shard_degree from the command line; tensor_parallel_degree from "
     "train_configs/llama3_70b.toml)"),
    (["--plan.tpu", ""], "error: command line: --plan.tpu is not set"),
])
def test_bad_input_is_one_line_exit_2(args, message):
    p = _plan("--job.config_file", "train_configs/llama3_70b.toml", *args)
    assert p.returncode == 2
    assert p.stderr.startswith(message) and p.stderr.count("\n") == 1, p.stderr
    assert p.stdout == ""
