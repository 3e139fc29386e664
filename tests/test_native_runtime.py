"""The native runtime (`[runtime] backend = "native"`): real processes on the CPU with gloo, each a
device of one DeviceMesh, against one process and against the XLA runtime.

Every run trains the debug model at the test size (two layers: LAYERS) on synthetic data, whose
global batch is the same whatever the number of processes (datasets/packing.py), so losses can be
compared step by step.
Starting torch on several processes costs more than a small job's training: the jobs that need the
same number of processes run in one set of them (module fixtures), and the tests read their
results. Across hosts: test_native_hosts.py."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, run_train, tiny_args, train_many, train_run
from native_helpers import EAGER, close, native_jobs
from test_grpo import GRPO_FLAGS, SMALL, _log_rewards

from torchtitan_xla.checkpoint import committed_steps
from torchtitan_xla.goodput import read_attempts

EXPORT = ["--checkpoint.last_save_in_hf", "true"]  # after the last step, into checkpoint/step-10-hf
SYNTHETIC = ["--training.dataset", "synthetic", "--training.global_batch_size", "8"]
SAVE_AT_5 = ["--checkpoint.enable", "--checkpoint.interval", "5"]
BF16 = ["--training.mixed_precision_param", "bfloat16"]
# The runtimes' bf16 losses: 4e-6 to 2.1e-5 apart over 4 steps (bf16 rounds at other points in
# XLA's fusions than in eager kernels); bf16 against float32 moved step 4's by 1.2e-4.
TOL_BF16 = 5e-5
XLA_MESH = ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2",
            "--training.local_batch_size", "2"]
NATIVE_MESH = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
               "--training.local_batch_size", "4"]
MESHES = {
    "fsdp=8": ["--training.local_batch_size", "1"],
    "fsdp=4 x tp=2": [*XLA_MESH, *EXPORT],
    "dp_replicate=2 x fsdp=4": ["--training.local_batch_size", "1",
                                "--parallelism.data_parallel_replicate_degree", "2",
                                "--parallelism.data_parallel_shard_degree", "4"],
}
OPTIMIZER_MESHES = {"Lion": ["--parallelism.tensor_parallel_degree", "2"],
                    "Adafactor": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
                    "Muon": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]}
CHAT = ["--training.dataset", "python_docs_chat", "--training.packing", "true"]  # document masks
CHUNKED = ["--loss.chunk_size", "32", "--loss.label_smoothing", "0.1", "--loss.z_loss_weight", "1e-4"]
LORA = ["--lora.rank", "4", "--lora.alpha", "8", "--optimizer.lr", "3e-3"]
# Preference pairs of up to 192 tokens, 4 rows per microbatch.
PREFERENCE = ["--training.dataset", "python_docs_preference", "--training.seq_len", "192",
              "--training.global_batch_size", "8", "--training.local_batch_size", "4", "--preference.beta", "0.1"]
HELD_OUT = ["--validation.enable", "--validation.freq", "3", "--validation.steps", "2"]  # after steps 3, 6
CHUNKED_MESHES = {"tp=2": ["--parallelism.tensor_parallel_degree", "2"],
                  "fsdp=2": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]}
PROFILED = ["--profiling.enable_profiling", "--profiling.profile_freq", "3", "--profiling.profiler_active", "2"]
# Mixtral's debug model (8 experts, top 2) at the recipe's capacity (tokens past an expert's slots dropped).
MOE = ["--model.name", "mixtral", "--moe.capacity_factor", "1.25"]
# Two blocks, one feeding the other, show every layout a block has; each block more costs each
# eager step about 18 collectives and 300 DTensor ops per process, and 8 processes share 2 cores.
LAYERS = {"n_layers": 2}
QWEN3 = ["--model.name", "qwen3"]  # its debug model: tied embedding, query/key norms
# Its debug model cut to 2 blocks: one dense, one with 16 experts, a shared one and the expert bias.
DEEPSEEK = ["--model.name", "deepseek_v3"]
# Their debug models cut to 2 blocks: Gemma 3's both local (16 tokens); gpt-oss's one local (8
# tokens), one global, both with sinks, biases and biased experts (einsum attention: the sinks').
GEMMA3, GPT_OSS = ["--model.name", "gemma3"], ["--model.name", "gpt_oss", "--model.attention", "sdpa"]
NO_RECOMPILES = ["--debug.on_recompile", "error"]  # a graph compiled after step 2 stops the run
# At AdamW's default eps (1e-8) a weight whose gradient is near zero moves by about lr whatever that
# gradient's rounding: float32 reorderings (a fused kernel, compiled sums) parted runs by 4e-5 at
# step 4 and 4e-4 at step 10, eager against eager as much as compiled against eager. At 1e-5 the
# for-loop and fused AdamW, both eager, gave the same bits over 6 steps.
ADAM_EPS = ["--optimizer.eps", "1e-5"]
TEN_BLOCKS = {"n_layers": 10}  # more than dynamo's recompile limit (8): the blocks must share graphs
# At lr 1e3 step 2's loss is in the millions and from step 5 on every gradient norm is NaN.
DIVERGING = ["--training.local_batch_size", "8", "--optimizer.lr", "1e3", "--checkpoint.enable",
             "--checkpoint.interval", "4", "--checkpoint.keep_latest_k", "3",
             "--training.max_consecutive_nonfinite", "0"]


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> dict[str, Path]:
    """Seed checkpoints (the initial weights alone) written by the XLA runtime, in one process:
    {"dense": the debug model's, "moe": Mixtral's debug model's}."""
    folder = tmp_path_factory.mktemp("seeds")
    train_many({name: tiny_args(folder / name, *flags, "--checkpoint.create_seed_checkpoint")
                for name, flags in (("dense", []), ("moe", MOE))}, devices=1, model_overrides=LAYERS)
    return {name: folder / name / "checkpoint" / "step-0" for name in ("dense", "moe")}


@pytest.fixture(scope="module")
def seed(seeds) -> Path:
    return seeds["dense"]


@pytest.fixture(scope="module")
def moe_seed(seeds) -> Path:
    return seeds["moe"]


def from_seed(seed: Path, steps: int = 10) -> list[str]:
    return ["--checkpoint.initial_load_path", str(seed), "--training.steps", str(steps)]


def optimizer_job(seed: Path, optimizer: str) -> list[str]:
    return [*from_seed(seed, steps=6), "--optimizer.name", optimizer, "--training.local_batch_size", "8"]


def optimizer_offload_job(seed: Path) -> list[str]:
    """AdamW on the host, fsdp=2, 10 steps from the seed checkpoint, saving step 5."""
    return [*EAGER, *from_seed(seed), "--training.local_batch_size", "4", "--parallelism.data_parallel_shard_degree",
            "2", "--optimizer.offload", *SAVE_AT_5]


def chunked_job(seed: Path) -> list[str]:
    return [*from_seed(seed, steps=6), *CHUNKED, "--training.local_batch_size", "8"]


def float8_job(seed: Path) -> list[str]:
    return [*from_seed(seed, steps=6), "--float8.enable_float8_linear", "--training.local_batch_size", "8"]


def preference_job(seed: Path, flags: list[str]) -> list[str]:
    """A preference objective from the seed checkpoint, its reference (dpo, ipo) the same weights."""
    return [*from_seed(seed, steps=6), *PREFERENCE, *flags]


# name: (the job's flags, its native mesh). DPO on packed pairs (384-token rows, about two pairs
# each); IPO with LoRA on a pair's two padded rows: the reference is the adapters switched off.
PREFERENCE_JOBS = {"dpo": (["--training.objective", "dpo", *HELD_OUT, "--training.packing", "true",
                            "--training.seq_len", "384", "--training.global_batch_size", "4",
                            "--training.local_batch_size", "2"],
                           ["--parallelism.tensor_parallel_degree", "2"]),
                   "ipo lora": (["--training.objective", "ipo", *LORA, "--training.no-packing"],
                                ["--parallelism.data_parallel_shard_degree", "2"])}


def grpo_job(seed: Path) -> list[str]:
    """GRPO (test_grpo.py's SMALL: 2 updates a rollout, the KL to a reference copy) from the seed
    checkpoint, 8 completions a step in 2 microbatches."""
    return [*GRPO_FLAGS, *SMALL, *from_seed(seed, steps=6), "--training.local_batch_size", "4"]


def chat_job(seed: Path) -> list[str]:
    return [*from_seed(seed, steps=6), *CHAT, "--training.global_batch_size", "8", "--training.local_batch_size", "8"]


@pytest.fixture(scope="module")
def one_process(seed, tmp_path_factory) -> dict:
    """The references on one process: the global batch at once from the seed checkpoint, 10 steps
    (exported to HF after the last step), the eager
    ten-block model for the per-block compiled step; and 6 steps with the profiler on. "whole": the
    default step, compiled whole, 20 steps from the seed checkpoint, step 10 traced, against
    "eager eps" (both at ADAM_EPS)."""
    return native_jobs(tmp_path_factory.mktemp("one"), 1, {
        "mesh": [*EAGER, *from_seed(seed), "--training.local_batch_size", "8", *EXPORT],
        "eager eps": [*EAGER, *from_seed(seed, steps=20), "--training.local_batch_size", "8", *ADAM_EPS],
        "whole": [*from_seed(seed, steps=20), "--training.local_batch_size", "8", *ADAM_EPS, *NO_RECOMPILES,
                  "--profiling.enable_profiling", "--profiling.profile_freq", "10"],
        "ten blocks": [*EAGER, "--training.local_batch_size", "8"],
        "profiled": [*EAGER, "--training.local_batch_size", "8", "--training.steps", "6", *PROFILED],
        "qwen3": [*EAGER, *QWEN3, "--training.local_batch_size", "8"],
        "deepseek": [*EAGER, *DEEPSEEK, "--training.local_batch_size", "8", "--training.steps", "5"],
        "gemma3": [*EAGER, *GEMMA3, "--training.local_batch_size", "8"],
        "gpt_oss": [*EAGER, *GPT_OSS, "--training.local_batch_size", "8"]},
        model=LAYERS, overrides={"ten blocks": TEN_BLOCKS})


@pytest.fixture(scope="module")
def eight_processes(seed, moe_seed, xla_eight, tmp_path_factory) -> dict:
    """On eight processes, eager: each of MESHES from the seed checkpoint; "lora", resuming the
    XLA runtime's LoRA run (fsdp=4 x tp=2) at step 5 (adapters start random: each runtime draws
    its own); "moe", Mixtral on ep=4 x fsdp=2; Gemma 3 on fsdp=4 x tp=2, gpt-oss on ep=2 x fsdp=2 x
    tp=2."""
    folder = tmp_path_factory.mktemp("eight")
    copy_step(xla_eight["lora"]["folder"], folder / "lora", 5)
    jobs = {mesh: [*EAGER, *from_seed(seed), *flags] for mesh, flags in MESHES.items()}
    jobs["bf16"] = [*EAGER, *bf16_job(seed)]
    moe = [*EAGER, *from_seed(moe_seed, steps=5), *MOE, "--parallelism.expert_parallel_degree", "4",
           "--training.local_batch_size", "1"]
    jobs["gemma3"] = [*EAGER, *GEMMA3, *XLA_MESH]  # fsdp=4 x tp=2
    jobs["gpt_oss"] = [*EAGER, *GPT_OSS, "--parallelism.expert_parallel_degree", "2",
                       "--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "2"]
    # Six eager jobs on eight processes sharing two cores, beside the other test worker: time enough.
    return native_jobs(folder, 8, jobs | {"lora": [*EAGER, *lora_job(seed)], "moe": moe}, model=LAYERS, timeout=1800)


@pytest.fixture(scope="module")
def two_processes(seed, tmp_path_factory) -> dict:
    """On two processes: the per-block compiled step of the ten-block model on tp=2, first (its
    compile counts are this process's first); "whole", the default step compiled whole on fsdp=2,
    20 steps from the seed checkpoint (eight processes compiling it at once on two cores took
    324 s of the eight-process set's 450, alone); accumulation with activation checkpointing; every
    optimizer beyond AdamW; packed chat data (through torch's fused attention) and float8 on tp=2; PREFERENCE_JOBS; the chunked loss
    on each of CHUNKED_MESHES."""
    jobs = {"compiled": ["--compile.step", "blocks", "--training.local_batch_size", "8",
                         "--parallelism.tensor_parallel_degree", "2", *NO_RECOMPILES],
            "whole": [*from_seed(seed, steps=20), "--parallelism.data_parallel_shard_degree", "2",
                      "--training.local_batch_size", "4", *ADAM_EPS, *NO_RECOMPILES],
            "accumulation": [*EAGER, *from_seed(seed), "--training.local_batch_size", "4",
                             "--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full"]}
    jobs["offload"] = [*EAGER, *from_seed(seed), "--training.local_batch_size", "4",
                       "--parallelism.tensor_parallel_degree", "2", "--activation_checkpoint.mode", "full",
                       "--activation_checkpoint.offload", "decoder_layer_input,qkv_proj"]
    jobs["optimizer offload"] = optimizer_offload_job(seed)
    jobs |= {name: [*EAGER, *optimizer_job(seed, name), *flags] for name, flags in OPTIMIZER_MESHES.items()}
    jobs["chat"] = [*EAGER, *chat_job(seed), "--parallelism.tensor_parallel_degree", "2", "--model.attention", "flash"]
    jobs["grpo"] = [*EAGER, *grpo_job(seed), "--parallelism.tensor_parallel_degree", "2"]
    jobs["float8"] = [*EAGER, *float8_job(seed), "--parallelism.tensor_parallel_degree", "2"]
    jobs |= {name: [*EAGER, *preference_job(seed, flags), *mesh] for name, (flags, mesh) in PREFERENCE_JOBS.items()}
    jobs["qwen3"] = [*EAGER, *QWEN3, "--training.local_batch_size", "8", "--parallelism.tensor_parallel_degree", "2"]
    jobs["deepseek"] = [*EAGER, *DEEPSEEK, "--training.local_batch_size", "8", "--training.steps", "5",
                        "--parallelism.tensor_parallel_degree", "2"]
    jobs["gpt_oss ep"] = [*EAGER, *GPT_OSS, "--training.local_batch_size", "4", "--parallelism.expert_parallel_degree", "2"]
    jobs |= {f"chunked {mesh}": [*EAGER, *chunked_job(seed), *flags] for mesh, flags in CHUNKED_MESHES.items()}
    jobs["diverging"] = [*EAGER, *DIVERGING, "--parallelism.tensor_parallel_degree", "2"]
    jobs["diverging, applied"] = [*jobs["diverging"], "--training.no-skip_nonfinite_steps"]
    return native_jobs(tmp_path_factory.mktemp("two"), 2, jobs, model=LAYERS, overrides={"compiled": TEN_BLOCKS})


@pytest.fixture(scope="module")
def xla_eight(seed, tmp_path_factory) -> dict:
    """The XLA runtime on fsdp=4 x tp=2 (eight devices, one process), from the seed checkpoint:
    "mesh", 10 steps saving step 5; "lora", adapters trained 10 steps saving step 5. Each run's
    losses, and its folder."""
    folder = tmp_path_factory.mktemp("xla")
    runs = {"mesh": [*SYNTHETIC, *from_seed(seed), *SAVE_AT_5, *XLA_MESH], "lora": lora_job(seed),
            "bf16": bf16_job(seed)}
    results = train_many({name: tiny_args(folder / name, *flags) for name, flags in runs.items()}, devices=8,
                         model_overrides=LAYERS)
    return {name: result | {"folder": folder / name} for name, result in results.items()}


def bf16_job(seed: Path) -> list[str]:
    """fsdp=4 x tp=2 under bfloat16 autocast, 4 steps from the seed checkpoint."""
    return [*SYNTHETIC, *from_seed(seed, steps=4), *XLA_MESH, *BF16]


def lora_job(seed: Path) -> list[str]:
    return [*SYNTHETIC, *from_seed(seed, steps=10), *LORA, *XLA_MESH, "--checkpoint.enable",
            "--checkpoint.interval", "5"]


def copy_step(src: Path, folder: Path, step: int) -> Path:
    """`folder` with checkpoint step `step` of the run in `src` (which then resumes from it)."""
    shutil.copytree(src / "checkpoint" / f"step-{step}", folder / "checkpoint" / f"step-{step}")
    return folder


def expected_placements(spec: list, sizes: dict[str, int]) -> list[str]:
    """DTensor placements of a partition spec on the mesh: one per axis of more than one device
    (in MESH_AXES order; the runtime's DeviceMesh leaves out the others), Shard(d) for an axis on
    dimension d, Replicate otherwise."""
    from torchtitan_xla.parallelisms import MESH_AXES

    out = []
    for axis in (a for a in MESH_AXES if sizes[a] > 1):
        dims = [d for d, a in enumerate(spec) if a == axis or (isinstance(a, list) and axis in a)]
        out.append(f"Shard(dim={dims[0]})" if dims else "Replicate()")
    return out


@pytest.mark.parametrize("mesh", MESHES)
def test_eight_processes_give_the_one_process_losses_with_each_parameter_sharded_by_its_spec(
        mesh, one_process, eight_processes):
    import torch

    from torchtitan_xla.models import get_model_args, get_model_class
    from torchtitan_xla.parallelisms import ParallelDims
    from torchtitan_xla.parallelisms.parallelize_llama import param_specs

    run, one = eight_processes[mesh], one_process["mesh"]
    # float32, the same sums in another order (reductions across processes): 1.2e-7 measured.
    close(run["losses"], one["losses"], rtol=1e-6)
    close(run["grad_norms"], one["grad_norms"], rtol=1e-6)

    flags = dict(zip(MESHES[mesh][::2], MESHES[mesh][1::2]))
    rep = int(flags.get("--parallelism.data_parallel_replicate_degree", 1))
    tp = int(flags.get("--parallelism.tensor_parallel_degree", 1))
    dims = ParallelDims(dp_replicate=rep, dp_shard=8 // (rep * tp), tp=tp)
    sizes = dict(zip(("pp", "dp_replicate", "fsdp", "ep", "cp", "tp"), dims.mesh_shape))
    with torch.device("meta"):
        model = get_model_class("llama3")(get_model_args("llama3", "debugmodel", vocab_size=2256,
                                                          max_seq_len=64, **LAYERS))
    specs = param_specs(model, dims)
    layout = run["layout"]
    assert layout.keys() == specs.keys()
    for name, spec in specs.items():
        got = layout[name]
        assert got["spec"] == [list(a) if isinstance(a, tuple) else a for a in spec], name
        assert got["placements"] == expected_placements(got["spec"], sizes), name
        # The block each process holds: the spec really splits the tensor.
        shards = [1] * len(got["shape"])
        for axis, size in sizes.items():
            for d, a in enumerate(got["spec"]):
                if size > 1 and (a == axis or (isinstance(a, list) and axis in a)):
                    shards[d] *= size
        assert got["local"] == [n // s for n, s in zip(got["shape"], shards)], name
    assert any(s > 1 for got in layout.values() for s in
               [n // m for n, m in zip(got["shape"], got["local"])])
    if "--checkpoint.last_save_in_hf" in flags:
        # The HF export after training: every process gathers, process 0 writes the whole weights.
        from safetensors.torch import load_file

        def weights(folder: Path) -> dict:
            return {k: v for f in sorted((folder / "checkpoint" / "step-10-hf").glob("*.safetensors"))
                    for k, v in load_file(f).items()}

        got, want = weights(run["folder"]), weights(one["folder"])
        assert got.keys() == want.keys() and len(got) == len(layout)
        # After 10 AdamW steps: the 8 processes' sums round otherwise, and Adam's normalised update
        # turns that into a few millionths on a few elements; a block gathered to the wrong place
        # would be off by the weights' own size (0.02-5).
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


def test_the_profiler_traces_exactly_the_configured_windows(one_process):
    """Every 3 steps, the last 2 traced (steps 2-3 and 5-6): one torch.profiler trace per window
    (TensorBoard's trace format), holding two optimizer steps (torch.optim's own markers) and the
    model's matmuls."""
    run = one_process["profiled"]
    traces = run["folder"] / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_3", "iteration_6"]
    for window in ("iteration_3", "iteration_6"):
        files = list((traces / window).rglob("*.pt.trace.json"))
        assert len(files) == 1, files
        names = [e.get("name", "") for e in json.loads(files[0].read_text())["traceEvents"]]
        assert sum(n.startswith("Optimizer.step#AdamW.step") for n in names) == 2, window
        assert "aten::mm" in names, window
    assert "Profiler: steps 2-3 traced to" in run["log"] and "Profiler: steps 5-6 traced to" in run["log"]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@pytest.mark.skipif(not _cuda(), reason="no CUDA GPU on this machine: the native runtime's CUDA path "
                                        "runs only where torch sees one")
def test_one_gpu_gives_the_cpus_losses_eager_and_compiled(seed, one_process, tmp_path):
    """`[runtime] device = "cuda"`, one process, 10 steps from the seed checkpoint, eager and
    compiled: the CPU process's losses (float32; bench/bench_native_gpu.py measured 1.2e-7 over
    20 steps on an H200 with torch 2.11; this test has not run on a GPU yet)."""
    cpu = one_process["mesh"]["losses"]
    runs = native_jobs(tmp_path, 1, {kind: [*from_seed(seed, 10), "--training.local_batch_size", "8",
                                            "--runtime.device", "cuda", "--compile.step", kind]
                                     for kind in ("eager", "compile")}, model=LAYERS)
    close(runs["eager"]["losses"], cpu, rtol=1e-6)
    close(runs["compile"]["losses"], cpu, rtol=2e-5)  # inductor's fusions round otherwise


def test_gradient_accumulation_and_activation_checkpointing_keep_the_one_process_losses(
        one_process, two_processes):
    """tp=2 on two processes, the global batch of 8 as two microbatches of 4, every block
    recomputed in the backward (full activation checkpointing): the one-process losses and
    gradient norms (batch 8 at once, nothing recomputed) within float32 reordering."""
    run, one = two_processes["accumulation"], one_process["mesh"]
    assert "2 accumulation step(s)" in run["log"] and "Activation checkpointing: full" in run["log"]
    close(run["losses"], one["losses"], rtol=1e-6)
    close(run["grad_norms"], one["grad_norms"], rtol=1e-6)


def test_offloaded_block_inputs_keep_the_one_process_losses(one_process, two_processes):
    """`offload = ["decoder_layer_input", "qkv_proj"]` (torch's reentrant checkpoint, its saved block
    inputs through the host hooks, the projections' outputs taken back as DTensors sharded over tp)
    on tp=2 with two microbatches: the one-process losses over its 10 steps, as the accumulation
    job above."""
    run, one = two_processes["offload"], one_process["mesh"]
    assert "Activation checkpointing: full, offloaded to the host: decoder_layer_input, qkv_proj" in run["log"]
    close(run["losses"], one["losses"], rtol=1e-6)
    close(run["grad_norms"], one["grad_norms"], rtol=1e-6)


def test_offload_moves_exactly_the_named_activations_and_keeps_the_gradients(monkeypatch):
    """In one process (4 blocks, 2 KV heads), in float32 and under bfloat16 autocast: the tensors
    autograd keeps on the host are exactly each block's input ([2, 16, 64]: 32 KiB in all) and its
    query, key and value projections ([2, 16, 64], [2, 16, 32] x 2), as named; the recomputation
    then runs 12 matmuls fewer (3 per block) in the backward pass; the gradients are full checkpointing's and no
    checkpointing's, bit for bit."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan_xla import runtime
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.models.llama import ModelArgs, Transformer
    from torchtitan_xla.parallelisms.activation_checkpoint import apply_ac
    from torchtitan_xla.runtime.native import kernels

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMatmuls.count += func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(runtime, "_backend", "native")
    offloaded = []
    offload = kernels.offload
    monkeypatch.setattr(kernels, "offload", lambda t: offloaded.append(t) or offload(t))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ac = "--activation_checkpoint."
    runs = {"none": [ac + "mode", "none"], "full": [ac + "mode", "full"],
            "input": [ac + "mode", "full", ac + "offload", "decoder_layer_input"],
            "qkv": [ac + "mode", "full", ac + "offload", "qkv_proj"],
            "both": [ac + "mode", "full", ac + "offload", "decoder_layer_input,qkv_proj"]}
    shapes = {"none": [], "full": [], "input": [(2, 16, 64)] * 4, "qkv": [(2, 16, 64), (2, 16, 32), (2, 16, 32)] * 4,
              "both": [(2, 16, 64), (2, 16, 32), (2, 16, 32), (2, 16, 64)] * 4}  # the input saved after its run
    for autocast in (False, True):
        grads, matmuls = {}, {}
        for name, argv in runs.items():
            torch.manual_seed(0)
            model = Transformer(ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64,
                                          multiple_of=32, max_seq_len=16))
            model.init_weights()
            apply_ac(model, parse_args(argv).activation_checkpoint)
            inputs = []
            for block in model.layers.values():
                block.register_forward_pre_hook(lambda _, args, inputs=inputs: inputs.append(args[0]))
            offloaded.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
            CountMatmuls.count = 0
            with CountMatmuls():
                loss.backward()
            grads[name], matmuls[name] = {n: p.grad for n, p in model.named_parameters()}, CountMatmuls.count
            assert [tuple(t.shape) for t in offloaded] == shapes[name], name
            if name in ("input", "both"):  # the block inputs themselves, each once
                assert [t for t in offloaded if any(t is i for i in inputs)] == inputs[:4]
        # (against the same reentrant checkpoint: "full" is torch's non-reentrant one, which stops
        # recomputing a block once it has what the backward needs)
        assert matmuls["input"] - matmuls["qkv"] == matmuls["input"] - matmuls["both"] == 12
        for name in ("full", "input", "qkv", "both"):
            assert all(torch.equal(grads[name][n], g) for n, g in grads["none"].items()), (name, autocast)


def test_the_optimizer_on_the_host_keeps_the_losses_and_resumes_exactly(seed, one_process, two_processes, tmp_path):
    """`[optimizer] offload` on fsdp=2: the one-process losses (its AdamW on the device, torch's
    single-tensor kernel; on the host the fused one: one grad norm in ten 1 ulp apart, measured);
    resumed from its step 5, steps 6-10 bit for bit; and its checkpoint resumed without offload
    within the same tolerance (the state dict is the same either way)."""
    run, one = two_processes["optimizer offload"], one_process["mesh"]
    assert "its state on the device: none" in run["log"]
    close(run["losses"], one["losses"], rtol=1e-6)
    close(run["grad_norms"], one["grad_norms"], rtol=1e-6)
    job = optimizer_offload_job(seed)
    jobs = {"offload": job, "plain": [f for f in job if f != "--optimizer.offload"]}
    for name in jobs:
        copy_step(run["folder"], tmp_path / name, 5)
    resumed = native_jobs(tmp_path, 2, jobs, model=LAYERS)
    after_5 = {key: {s: v for s, v in run[key].items() if int(s) > 5} for key in ("losses", "grad_norms")}
    for name, rtol in (("offload", 0), ("plain", 1e-6)):
        assert "(step 5)" in resumed[name]["log"] and sorted(map(int, resumed[name]["losses"])) == list(range(6, 11))
        for key in ("losses", "grad_norms"):
            if rtol:
                close(resumed[name][key], after_5[key], rtol=rtol)
            else:
                assert resumed[name][key] == after_5[key], key


def test_qwen3_with_its_tied_embedding_on_tp2_gives_the_one_process_losses(one_process, two_processes):
    """Qwen3's debug model (query/key norms, heads wider than dim / n_heads, one matrix for the
    embedding and the output) on tp=2: the one-process losses and gradient norms, from the same
    initial weights (the native runtime draws each one whole, whatever the mesh). The tied matrix's
    gradient sums its embedding and output parts, each reduced in another order over tp: 1.5e-6
    measured at step 10 (steps 1-9 within 1e-6)."""
    run, one = two_processes["qwen3"], one_process["qwen3"]
    assert len(one["losses"]) == 10 and abs(one["losses"]["1"] - one_process["ten blocks"]["losses"]["1"]) > 1e-3
    close(run["losses"], one["losses"], rtol=5e-6)
    close(run["grad_norms"], one["grad_norms"], rtol=5e-6)


@pytest.mark.parametrize("model, job, processes", [("gemma3", "gemma3", "eight_processes"),
                                                   ("gpt_oss", "gpt_oss", "eight_processes"),
                                                   ("gpt_oss", "gpt_oss ep", "two_processes")])
def test_gemma3_and_gpt_oss_on_meshes_give_the_one_process_losses(one_process, model, job, processes, request):
    """Gemma 3's debug model on fsdp=4 x tp=2 (sliding windows, sandwich norms, GeGLU); gpt-oss's on
    ep=2 x fsdp=2 x tp=2 (the sinks and the attention's biases split by head: the sinks reach the
    attention by keyword; the experts and their biases split) and on ep=2 alone: one process's
    losses within 1e-6, 10 steps."""
    run, one = request.getfixturevalue(processes)[job], one_process[model]
    assert len(one["losses"]) == 10
    close(run["losses"], one["losses"], rtol=1e-6)
    if job == "gpt_oss":
        assert run["layout"]["layers.0.attention.sinks"]["placements"][-1] == "Shard(dim=0)"
        # ep splits the experts (fsdp and tp their other dimensions).
        assert run["layout"]["layers.0.feed_forward.w1"]["local"][0] == 4  # 8 experts over ep=2


COMPILES = re.compile(r"step:\s+(\d+) .* compiles: (\d+)")


def test_deepseek_on_tp2_gives_the_one_process_losses_and_bias(one_process, two_processes):
    """DeepSeek-V3's debug model (latent attention split by head, the bias updated inside the step
    from DTensor counts) on tp=2: one process's losses (5 steps) and, exactly, its expert bias,
    which moved by whole steps of the rate."""
    run, one = two_processes["deepseek"], one_process["deepseek"]
    close(run["losses"], one["losses"], rtol=5e-6)
    assert run["expert_bias"] == one["expert_bias"]
    steps = [round(b / 1e-3, 3) for b in one["expert_bias"]["layers.1.feed_forward.expert_bias"]]
    assert all(s == int(s) and abs(s) <= 5 for s in steps) and any(steps), steps
    assert run["layout"]["layers.1.attention.wkv_b.weight"]["placements"][-1] == "Shard(dim=0)"


def test_per_block_compile_gives_the_eager_losses_and_compiles_nothing_after_warm_up(one_process, two_processes):
    """`[compile] step = "blocks"`: torch.compile per block, here on two processes (tp=2) against
    one eager process. Ten blocks, more than dynamo's recompile limit (8): the blocks must share
    their graphs. A compile after step 2 would stop the run (on_recompile = "error")."""
    run = two_processes["compiled"]
    assert "Compiling 10 blocks (torch.compile)" in run["log"]
    # Inductor fuses the blocks' element-wise ops (other roundings).
    close(run["losses"], one_process["ten blocks"]["losses"], rtol=2e-5)
    compiles = {int(s): int(n) for s, n in COMPILES.findall(run["log"])}
    assert compiles[1] > 0 and len(set(c for s, c in compiles.items() if s >= 2)) == 1, compiles


# A step of "whole" (one process, steps 10 and 20 traced, the same): 6 compiled-graph calls (the
# microbatch's forward-backward, the update's graphs) and 41 eager aten ops, where the eager step
# of this 2-block model dispatches 1,682 ("profiled") and the per-block step of the 8-block debug
# model 2,960 (docs/performance.md). Left: one detach per parameter (21) and two more where the
# compiled graphs take their DTensor inputs; backward's seed gradient; the fused AdamW kernel with
# its step count's add and its `found_inf` sub; the lr and the log line's few ops.
WHOLE_STEP_GRAPHS = 6
WHOLE_STEP_EAGER_OPS = {"aten::detach": 23, "aten::to": 4, "aten::resolve_conj": 2, "aten::resolve_neg": 2,
                        "aten::view_as": 1, "aten::empty": 1, "aten::lift_fresh": 1, "aten::detach_": 1,
                        "aten::ones_like": 1, "aten::add": 1, "aten::select": 1, "aten::_foreach_add_": 1,
                        "aten::_fused_adamw_": 1, "aten::_foreach_sub_": 1}


@pytest.mark.parametrize("processes", ["one_process", "two_processes"])
def test_the_step_compiled_whole_gives_the_eager_losses_and_compiles_nothing_after_warm_up(
        processes, one_process, request):
    """The default step on the native runtime, on one process and on fsdp=2: each
    microbatch's forward, loss and backward one compiled graph, the update compiled around torch's
    fused AdamW. Its losses equal the eager one-process step's over 20 steps within 1e-6 (1.2e-7
    measured on one process, 1.2e-7 on fsdp=2: inductor's fusions round otherwise), and it
    compiles nothing after step 2 (on_recompile = "error" would stop the run; the counts are asserted)."""
    run, eager = request.getfixturevalue(processes)["whole"], one_process["eager eps"]
    assert "Compiling" not in run["log"] and "compile step" in run["log"]
    close(run["losses"], eager["losses"], rtol=1e-6)
    # The compiled norm sums its squares in another order: 6.9e-5 from eager's on one process,
    # 2.7e-5 on fsdp=2.
    close(run["grad_norms"], eager["grad_norms"], rtol=1e-4)
    compiles = {int(s): int(n) for s, n in COMPILES.findall(run["log"])}
    assert len(compiles) == 20 and compiles[1] > 0, compiles
    assert len(set(c for s, c in compiles.items() if s >= 2)) == 1, compiles
    # The goodput ledger (process 0's) has every step, and the compile seconds the runtime reports
    # (dynamo's and AOTAutograd's) at the first two steps only.
    [attempt] = read_attempts(str(run["folder"]))
    compiled = {e["step"]: e["compile"] for e in attempt if e["event"] == "step"}
    assert sorted(compiled) == list(range(1, 21)) and compiled[1] > 1
    assert not any(seconds for step, seconds in compiled.items() if step > 2), compiled


def test_the_step_compiled_whole_dispatches_a_handful_of_programs(one_process):
    """What a step of the whole-compiled default dispatches outside compiled code, from its
    profiler trace (torchtitan_xla.profiling.eager_ops): the compiled graphs and a few eager ops,
    not one op per parameter and operation."""
    from torchtitan_xla.profiling import eager_ops

    [trace] = (one_process["whole"]["folder"] / "profile_traces" / "iteration_10").glob("*.pt.trace.json")
    ops, graphs = eager_ops(json.loads(trace.read_text()))
    assert graphs == WHOLE_STEP_GRAPHS, graphs
    assert dict(ops) == WHOLE_STEP_EAGER_OPS, ops


def test_both_runtimes_give_the_same_losses_from_one_seed_checkpoint(one_process, eight_processes, xla_eight):
    """XLA on fsdp=4 x tp=2 against native on one process and on fsdp=4 x tp=2, 10 steps from the
    same initial weights."""
    xla = xla_eight["mesh"]["losses"]
    assert len(xla) == 10
    # XLA CPU and eager PyTorch round float32 differently (fusions, dot kernels).
    close(one_process["mesh"]["losses"], xla, rtol=1e-5)
    close(eight_processes["fsdp=4 x tp=2"]["losses"], xla, rtol=1e-5)


def test_both_runtimes_give_the_same_bfloat16_losses_from_one_seed_checkpoint(eight_processes, xla_eight):
    """Under bfloat16 autocast on fsdp=4 x tp=2 (weights gathered in bf16, gradients reduced in
    float32), 4 steps from the same initial weights: the runtimes' losses within TOL_BF16."""
    close(eight_processes["bf16"]["losses"], xla_eight["bf16"]["losses"], rtol=TOL_BF16)


def test_lora_on_fsdp4_tp2_gives_the_xla_runtimes_losses(eight_processes, xla_eight):
    """LoRA adapters (rank 4) on fsdp=4 x tp=2: the native runtime, resuming the XLA runtime's
    step 5 (frozen base, adapters and their optimizer state), gives its steps 6-10."""
    run = eight_processes["lora"]
    assert "Resumed from" in run["log"] and "(step 5)" in run["log"]
    close(run["losses"], {s: v for s, v in xla_eight["lora"]["losses"].items() if s > 5}, rtol=1e-5)


def test_nonfinite_steps_are_skipped_on_sharded_parameters_and_never_checkpointed(two_processes):
    """tp=2: the skipped steps 5-10 leave every weight and optimizer tensor (DTensors, half on
    each process) as step 4 left them; applied, the weights turn NaN and are not saved; the finite
    steps are the same to the last bit either way. (XLA: test_nonfinite.py.)"""
    from checkpoint_helpers import all_tensors

    skipped, applied = two_processes["diverging"], two_processes["diverging, applied"]
    assert all(math.isnan(skipped["grad_norms"][str(s)]) for s in range(5, 11)), skipped["grad_norms"]
    assert "skipped steps: 6" in skipped["log"]
    for key in ("losses", "grad_norms"):
        assert [skipped[key][str(s)] for s in range(1, 5)] == [applied[key][str(s)] for s in range(1, 5)]
    four, eight = (all_tensors(skipped["folder"] / "checkpoint" / f"step-{s}") for s in (4, 8))
    assert {k for k in four if not torch.equal(four[k], eight[k])} <= {"train_state.torch_rng",
                                                                        "train_state.xla_rng"}
    assert "checkpoint step-8 not written" in applied["log"]
    assert committed_steps(applied["folder"] / "checkpoint") == [4]


@pytest.fixture(scope="module")
def four_processes_dtensor(tmp_path_factory) -> dict:
    """tests/native_loss_worker.py on fsdp=2 x tp=2 (four processes): its report."""
    out = tmp_path_factory.mktemp("dtensor") / "report.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_"))}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        str(REPO / "tests" / "native_loss_worker.py")], capture_output=True, text=True,
                       env=dict(env, NATIVE_OUT=str(out)), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_loss_is_vocab_parallel_on_sharded_logits(four_processes_dtensor):
    """token_losses on logits sharded over the vocabulary (fsdp=2 x tp=2, four processes) equals
    F.cross_entropy (with label smoothing, z-loss, ignored labels) on the whole logits in float64,
    values and gradients, for three shapes; and runs only all-reduces of per-token values: the
    logits are never gathered."""
    for case in four_processes_dtensor["loss"]:
        assert case["placements"] == "(Shard(dim=0), Shard(dim=2))"
        assert case["value"] <= 1e-14 * case["scale"] and case["grad"] <= 1e-14, case
        assert case["collectives"] == ["c10d_functional.all_reduce"], case


@pytest.mark.parametrize("reduce", ["float32", "bfloat16"])
def test_fsdp_gathers_bfloat16_weights_under_autocast(four_processes_dtensor, reduce):
    """The debug model (2 blocks) on fsdp=2 x tp=2 under bfloat16 autocast, one forward and
    backward: FSDP gathers each of its 16 weight matrices in bfloat16 (cast where sharded, as
    torchtitan's param_dtype and as the XLA runtime: test_plan.py) and the norms in float32; the
    matrices' gradients are reduce-scattered in [training] mixed_precision_reduce's dtype, the
    embedding's in float32 either way. The loss is one process's (bf16 rounding of the partial
    gradients: 4e-5 measured on the loss, each gradient within 0.94% of its largest element)."""
    step = four_processes_dtensor["bf16_steps"][reduce]
    ops = [(op, dtype, tuple(shape)) for op, dtype, shape in step["collectives"]]
    gathers = [dtype for op, dtype, shape in ops if op == "all_gather_into_tensor" and len(shape) == 2]
    assert gathers == ["bfloat16"] * 16
    assert {dtype for op, dtype, shape in ops if len(shape) == 1} == {"float32"}
    reduced = [(dtype, shape) for op, dtype, shape in ops if op == "reduce_scatter_tensor" and len(shape) == 2]
    vocab, dim = step["shapes"]["tok_embeddings.weight"]
    assert ("float32", (vocab, dim // 2)) in reduced and len(reduced) == 16
    assert [d for d, _ in reduced].count(reduce) == (16 if reduce == "float32" else 15), reduced
    # Sequence parallelism: per block the two norms' outputs gathered in bfloat16 (cast first:
    # parallelisms/compute_dtype.py) and the two row-parallel outputs' gradients; in float32 the
    # final norm's output and the embedding's, moved to sequence shards (gloo: by a gather) and
    # its gradient back.
    sequence = [dtype for op, dtype, shape in ops if op == "all_gather_into_tensor" and len(shape) == 3]
    assert sorted(sequence) == ["bfloat16"] * 8 + ["float32"] * 3, sequence
    assert abs(step["loss"] - step["want"]) <= 1e-4 * step["want"]
    assert max(step["grads"].values()) <= 2e-2, step["grads"]


def test_the_sharding_rules_the_runtime_adds_give_the_plain_tensors_values(four_processes_dtensor):
    """select (torch 2.9's rewrote a replicated input's shape) and logsumexp (no rule in 2.9) on a
    float64 tensor in four layouts of fsdp=2 x tp=2, replicated, sharded on the selected or reduced
    dimension or on another: the plain tensor's values exactly, and the input still itself after."""
    rules = four_processes_dtensor["rules"]
    assert len(rules) == 4 * 5
    for case in rules:
        assert case["shape"] and case["error"] is not None and case["error"] <= 1e-15, case
    # A dimension neither selected nor reduced stays sharded (no gather).
    out = {(c["layout"], c["op"]): c["placements"] for c in rules}
    row_sharded, last_sharded = "[Shard(dim=0), Replicate()]", "[Replicate(), Shard(dim=2)]"
    assert out[row_sharded, "x[..., 0]"] == out[row_sharded, "logsumexp(-1)"] == "(Shard(dim=0), Replicate())"
    assert out[last_sharded, "x.select(1, 2)"] == "(Replicate(), Shard(dim=1))"
    assert out[last_sharded, "logsumexp((0, 1), keepdim)"] == "(Replicate(), Shard(dim=2))"


def test_float8_dots_multiply_blocks_where_they_lie(four_processes_dtensor):
    """The float8 dot's DTensor rule on fsdp=2 x tp=2, for the layouts of a column- and a
    row-parallel linear's forward and of a weight gradient: each process multiplies its own blocks
    (no collective inside the op), the output sharded or partial as the contraction says, and the
    whole op's values (float32 partial sums in another order: 1e-7 measured)."""
    got = {c["case"]: c for c in four_processes_dtensor["float8"]}
    assert {name: c["placements"] for name, c in got.items()} == {
        "column-parallel": "(Shard(dim=0), Shard(dim=2))", "row-parallel": "(Shard(dim=0), Partial(sum))",
        "replicated": "(Replicate(), Replicate())", "weight gradient": "(Partial(sum), Shard(dim=0))"}
    for case in got.values():
        assert case["collectives"] == [] and case["error"] <= 1e-6, case


@pytest.fixture(scope="module")
def xla_one_device(seed, moe_seed, tmp_path_factory) -> dict:
    """The XLA runtime on one device (one process): each of OPTIMIZER_MESHES' optimizers, packed
    chat data, the chunked loss, float8, PREFERENCE_JOBS, and Mixtral."""
    folder = tmp_path_factory.mktemp("xla_one")
    runs = {name: [*SYNTHETIC, *optimizer_job(seed, name)] for name in OPTIMIZER_MESHES}
    runs |= {"chat": chat_job(seed), "grpo": grpo_job(seed), "chunked": [*SYNTHETIC, *chunked_job(seed)],
             "float8": [*SYNTHETIC, *float8_job(seed)],
             **{name: preference_job(seed, flags) for name, (flags, _) in PREFERENCE_JOBS.items()},
             "moe": [*SYNTHETIC, *from_seed(moe_seed, steps=5), *MOE, "--training.local_batch_size", "8"]}
    return train_many({name: tiny_args(folder / name, *flags) for name, flags in runs.items()}, devices=1,
                      model_overrides=LAYERS)


@pytest.mark.parametrize("optimizer", OPTIMIZER_MESHES)
def test_every_optimizer_gives_the_xla_runtimes_losses(optimizer, two_processes, xla_one_device):
    """Beyond AdamW: each optimizer, 6 steps from one seed checkpoint, on two native processes
    (sharded moments, factored statistics over split dimensions, Newton-Schulz products of
    FSDP-sharded matrices) against the XLA runtime on one device. Measured: 2.3e-7 (all three also
    on fsdp=2 x tp=2, by hand)."""
    close(two_processes[optimizer]["losses"], xla_one_device[optimizer]["losses"], rtol=1e-5)


def test_packed_chat_data_gives_the_xla_runtimes_losses(one_process, two_processes, xla_one_device):
    """Conversations packed into rows (each row's documents masked from one another, positions
    restarting per document, prompts not trained on), tp=2 on two processes (tensor-parallel peers
    load the same block: the XLA device's batches), 6 steps from one seed checkpoint: the XLA
    runtime's losses. The native run's attention is torch's fused kernel (`flash`, on each
    process's heads of the DTensors, masked by document), the XLA run's blockwise."""
    run, xla = two_processes["chat"], xla_one_device["chat"]["losses"]
    assert "Attention: torch's fused scaled_dot_product_attention" in run["log"]
    close(run["losses"], xla, rtol=1e-5)
    # The same initial weights as the synthetic runs: another first loss, other data.
    assert abs(run["losses"]["1"] - one_process["mesh"]["losses"]["1"]) > 1e-3


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("documents", ["causal", "documents and padding"])
def test_native_flash_attention_equals_the_models_own_attention(documents, kv_heads):
    """`[model] attention = flash` on the native runtime (torch's scaled_dot_product_attention)
    against the model's einsum attention: outputs and the gradients of q, k and v within float32
    rounding (measured: at most 3.9e-7 of the largest value), plain causal and packed (documents of
    several lengths, a row ending in padding), with as many kv heads as query heads and grouped."""
    from torchtitan_xla.models.llama.layers import ScaledDotProductAttention, repeat_kv
    from torchtitan_xla.runtime.native.kernels import attention_kernel, flash_attention

    assert attention_kernel("flash", "CPU") and attention_kernel("splash", "CUDA") is None
    torch.manual_seed(0)
    b, h, s, d = 2, 4, 24, 16
    q, k, v = (torch.randn(b, n, s, d, dtype=torch.float64).float().requires_grad_()
               for n in (h, kv_heads, kv_heads))
    mask = ()
    if documents != "causal":
        ids = torch.tensor([[1] * 10 + [2] * 14, [3] * 5 + [4] * 11 + [0] * 8])
        starts = torch.cat([torch.ones(b, 1, dtype=torch.bool), ids[:, 1:] != ids[:, :-1]], 1)
        index = torch.arange(s).expand(b, s)
        positions = index - torch.cummax(torch.where(starts, index, 0), 1).values
        mask = (ids, positions)
    grad = torch.randn(b, h, s, d)
    results = []
    for attention in (lambda: ScaledDotProductAttention()(q, k, v, *mask),
                      lambda: flash_attention(q, repeat_kv(k, h), repeat_kv(v, h),
                                              segment_ids=mask[0] if mask else None)):
        out = attention()
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    for ref, got in zip(*results):
        scale = ref.abs().max()
        assert (got - ref).abs().max() <= 2e-6 * scale, (got - ref).abs().max() / scale


def test_float8_linears_give_the_xla_runtimes_losses(two_processes, xla_one_device):
    """Float8 linears (tensorwise scales from whole-tensor maxima, operands rounded to float8 and
    multiplied in float32: the CPU emulation the XLA runtime runs) on tp=2, two processes, 6 steps
    from one seed checkpoint: the XLA runtime's losses on one device."""
    run = two_processes["float8"]
    assert re.search(r"Float8 \(tensorwise\): \d+ of \d+ linear layers", run["log"]), run["log"][-2000:]
    xla = xla_one_device["float8"]
    # Float8 rounds operands to 3 mantissa bits (2 for gradients): the runtimes' float32
    # reorderings (1e-7) flip some roundings. Measured: 3.3e-6 over 6 steps.
    close(run["losses"], xla["losses"], rtol=5e-5)
    # Step 1's gradient norm (the same weights, no update yet) tells float8 from float32 where the
    # losses cannot: 1.6e-7 from the XLA runtime's float8, 1.25e-4 from float32 (measured).
    float8, float32 = (r["grad_norms"]["1"] for r in (run, two_processes["accumulation"]))
    assert abs(float8 - xla["grad_norms"]["1"]) <= 2e-6 * float8
    assert abs(float32 - xla["grad_norms"]["1"]) > 2e-5 * float8


def test_dpo_gives_the_xla_runtimes_losses_and_held_out_rewards(two_processes, xla_one_device):
    """DPO on packed pairs on tp=2 (a frozen reference copy, sharded as the policy), two processes,
    6 steps from one seed checkpoint in 2 microbatches: the XLA runtime's losses on one device, and
    its held-out loss and rewards after steps 3 and 6."""
    run, xla = two_processes["dpo"], xla_one_device["dpo"]
    assert run["losses"]["1"] == pytest.approx(0.6931472, rel=1e-6)  # -log sigmoid(0): policy = reference
    close(run["losses"], xla["losses"], rtol=1e-5)
    validation = {int(step): metrics for step, metrics in run["validation_metrics"].items()}
    assert validation.keys() == xla["validation_metrics"].keys() == {3, 6}
    # A reward is beta times a difference of sums of up to 192 log-probabilities of about -8 each:
    # the runtimes' float32 roundings of those sums (1e-7 relative) reach it as about 1e-5 absolute
    # (measured: 1.5e-6 in a margin of 3.6e-3).
    for step, metrics in xla["validation_metrics"].items():
        assert validation[step].keys() == metrics.keys(), step
        for name, value in metrics.items():
            assert validation[step][name] == pytest.approx(value, rel=1e-5, abs=1e-5), (step, name)


def test_grpo_samples_the_xla_runtimes_completions_and_gives_its_losses(two_processes, xla_one_device):
    """GRPO on tp=2, two processes: its rollouts are the XLA runtime's on one device (the sampling
    noise is hashed, not drawn from either runtime's generator: the same rewards at every step),
    and so are its losses (each rollout's second update against the recorded old log-probs, the
    KL to the reference copy), within 1e-5."""
    run, xla = two_processes["grpo"], xla_one_device["grpo"]
    assert _log_rewards(run["log"]) == {step: round(f["reward"], 3) for step, f in xla["objective"].items()}
    assert sorted(int(s) for s in run["losses"]) == sorted(xla["losses"]) == list(range(1, 7))
    for step, loss in xla["losses"].items():
        assert run["losses"][str(step)] == pytest.approx(loss, abs=1e-5), step


def test_lora_ipo_uses_the_base_model_as_its_reference_as_the_xla_runtime_does(two_processes, xla_one_device):
    """IPO with LoRA on fsdp=2, as on the XLA runtime: the reference is the policy with its
    adapters switched off. The first loss is (1 / 2 beta)^2 = 25 (B starts at zero, so the policy
    is its base); then the policy moves and the base does not, so the loss leaves 25, where a
    reference that kept its adapters would hold it there. The two runtimes' losses are not
    compared: each draws LoRA's A from its own generator (XLA's and the CPU's), so their policies
    differ from step 2 (test_lora_on_fsdp4_tp2_gives_the_xla_runtimes_losses compares LoRA from
    the same adapters)."""
    for run in (two_processes["ipo lora"]["losses"], xla_one_device["ipo lora"]["losses"]):
        run = {int(step): loss for step, loss in run.items()}
        assert run[1] == pytest.approx(25, rel=1e-6), run
        assert max(abs(run[step] - 25) for step in range(2, 7)) > 1e-2, run


@pytest.mark.parametrize("mesh", CHUNKED_MESHES)
def test_the_chunked_loss_gives_the_xla_runtimes_losses(mesh, two_processes, xla_one_device):
    """The chunked loss (32 tokens at a time, label smoothing and z-loss), 6 steps from one seed
    checkpoint on two processes, each looping over its own rows with the whole output weight: with
    tp=2 (the vocabulary-sharded weight gathered, its gradient the same on both) and fsdp=2 (the
    weight's gradient summed over the two halves of the batch). The XLA runtime's losses on one
    device."""
    close(two_processes[f"chunked {mesh}"]["losses"], xla_one_device["chunked"]["losses"], rtol=1e-5)


def test_mixture_of_experts_on_ep4_fsdp2_gives_the_xla_runtimes_losses(eight_processes, xla_one_device):
    """Mixtral's debug model on eight processes, ep=4 x fsdp=2: each process holds 2 of the 8
    experts (their weights split over fsdp), the tokens' expert slots go to the experts' processes
    and back (DTensor's all-to-all; gloo's is an all-gather and a slice), capacity 1.25 dropping
    per sequence as on one device, router losses in the gradient. 5 steps from one seed checkpoint:
    the XLA runtime's losses on one device."""
    run = eight_processes["moe"]
    close(run["losses"], xla_one_device["moe"]["losses"], rtol=1e-5)
    # ep (the mesh's fsdp, ep: its axes of more than one device) splits the expert dimension,
    # fsdp the next one.
    w1 = run["layout"]["layers.0.feed_forward.w1"]
    assert w1["placements"] == ["Shard(dim=1)", "Shard(dim=0)"], w1
    assert w1["local"] == [2, w1["shape"][1] // 2, w1["shape"][2]], w1
    assert any(float(d) > 0 for d in re.findall(r"dropped: ([\d.]+)%", run["log"])), run["log"][-2000:]


BAD = [
    (["--runtime.device", "tpu"], r"--runtime\.device.* = \"tpu\": torch-tpu is not installed"),
    (["--runtime.device", "cuda"], r"--runtime\.device.* = \"cuda\": torch sees no CUDA GPU"),
    (["--parallelism.tensor_parallel_degree", "2"],
     r"tensor_parallel_degree \(2\) = 2 does not divide the 1 devices \(tensor_parallel_degree from "
     r"the command line\)"),
    (["--compile.step", "lazy"], r"--compile\.step = \"lazy\" is torch_xla's; with \[runtime\] backend"),
    (["--compile.scan_layers"], r"--compile\.scan_layers = True is not available with \[runtime\] backend"),
    (["--moe.grouped_mm", "--model.name", "mixtral"], r"--moe\.grouped_mm = True is not available with \[runtime\] backend.*Pallas"),
    (["--activation_checkpoint.mode", "full", "--activation_checkpoint.offload", "decoder_layer_input"],
     r"--activation_checkpoint\.offload = \['decoder_layer_input'\] runs with \[compile\] step = \"eager\" on the "
     r"native runtime, not 'compile': .* reentrant one, which torch.compile cannot trace"),
]


@pytest.mark.parametrize("kind", ["compile", "blocks", "eager"])
def test_the_native_step_compilers_are_refused_on_the_xla_runtime_in_one_line(kind):
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(
            f'--compile.step = {kind!r} is the native runtime\'s; with [runtime] backend = "xla" use '
            f'replay or lazy')):
        parse_args(tiny_args(Path("unused"), "--compile.step", kind))


@pytest.mark.parametrize("flags,message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_native_input_is_one_line_before_any_model_is_built(flags, message, tmp_path):
    if "cuda" in flags:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    p = run_train(tiny_args(tmp_path, "--runtime.backend", "native", *flags), env={"XLA_USE_SPMD": None})
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert re.search(message, lines[-1]), lines[-1]
    assert not any("Traceback" in line or "Model llama3" in line for line in lines), p.stderr


@pytest.mark.parametrize("nproc,flags,message", [
    ("3", ["--parallelism.tensor_parallel_degree", "3"],
     "command line: --training.seq_len (64) must be a multiple of tensor_parallel_degree (3): sequence "
     "parallelism splits the sequence over the TP devices (tensor_parallel_degree from the command line)"),
    ("2", ["--training.dataset", "json", "--training.dataset_path", "EMPTY"],
     "command line: --training.dataset_path: EMPTY: no documents for host 0 of 2 (the dataset is empty) "
     "(dataset from the command line)")], ids=["found by the launcher", "found by the processes"])
def test_run_train_sh_stops_native_processes_on_bad_input_with_one_line(tmp_path, nproc, flags, message):
    """What one process per device would each print, and torchrun's page after it: one line, exit
    2, nothing written. The mesh, batch and model checks run before torchrun starts anything; what
    only the processes can find (their data) is printed once, by the launcher."""
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    flags = [str(empty) if f == "EMPTY" else f for f in flags]
    p = run_train([*tiny_args(tmp_path / "out", "--runtime.backend", "native", *flags)[2:]],
                  script="run_train.sh", env={"NPROC_PER_NODE": nproc, "CPU_NUM_DEVICES": None})
    assert p.returncode == 2, p.stderr[-3000:]
    assert [ln for ln in p.stderr.splitlines() if "rror" in ln] == [
        "error: " + message.replace("EMPTY", str(empty))]
    assert "Traceback" not in p.stderr and "[Gloo]" not in p.stdout
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_resumes_on_the_other_runtime_as_if_never_interrupted(seed, xla_eight, tmp_path):
    """XLA (fsdp=4 x tp=2) saves step 5, the native runtime (fsdp=2 x tp=2, four processes)
    resumes it; and the reverse, native (fsdp=2 x tp=2, saving asynchronously) to XLA (fsdp=4 x
    tp=2). Steps 6-10 equal the uninterrupted run's. The data loader's state moves too, from one
    data-parallel rank (XLA's one host loads the global batch) to two, and back: synthetic data
    continues at its global batch on any layout (datasets/loader.py)."""
    xla = xla_eight["mesh"]
    job = [*EAGER, *from_seed(seed), *SAVE_AT_5, *NATIVE_MESH]
    copy_step(xla["folder"], tmp_path / "native" / "on_native", 5)
    # Asynchronous saves: a device copy of each block, written while training goes on.
    runs = native_jobs(tmp_path / "native", 4, {"on_native": job, "async": [*job, "--checkpoint.async_mode", "async"]},
                       model=LAYERS)
    on_native, base = runs["on_native"], runs["async"]
    assert "Resumed from" in on_native["log"] and "(step 5)" in on_native["log"]
    assert sorted(map(int, on_native["losses"])) == list(range(6, 11))
    close(on_native["losses"], {s: v for s, v in xla["losses"].items() if s > 5}, rtol=1e-5)

    assert "Checkpoint step-5: staged" in base["log"]
    on_xla, _ = train_run(tiny_args(copy_step(base["folder"], tmp_path / "on_xla", 5), *SYNTHETIC, *from_seed(seed),
                                    *SAVE_AT_5, *XLA_MESH), devices=8, model_overrides=LAYERS)
    assert sorted(on_xla) == list(range(6, 11))
    close(on_xla, {s: v for s, v in base["losses"].items() if int(s) > 5}, rtol=1e-5)
