"""Parallelisms on 8 virtual devices: every mesh gives the losses of one device, every parameter
and its Adam state carry exactly the sharding asked for, activation checkpointing and scan change
no numbers (but do recompute), and impossible degrees fail before anything compiles."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import REPO, _env, tiny_args, train_many

from torchtitan_xla.config import ConfigError, parse_args
from torchtitan_xla.parallelisms import ParallelDims
from torchtitan_xla.parallelisms.parallelize_llama import fsdp_spec, tp_spec

P = "--parallelism."
AC = "--activation_checkpoint."
# Every run trains on the same global batch of 8 sequences: local_batch_size x data-parallel degree.
MESHES = {
    "fsdp8": ["--training.local_batch_size", "1"],
    "fsdp4_tp2": ["--training.local_batch_size", "2", P + "tensor_parallel_degree", "2"],
    "hsdp2_fsdp4": ["--training.local_batch_size", "1", P + "data_parallel_replicate_degree", "2"],
    "tp8_sp": ["--training.local_batch_size", "8", P + "tensor_parallel_degree", "8"],
    "slices2": ["--training.local_batch_size", "1", P + "data_parallel_replicate_degree", "2",
                P + "num_slices", "2"],
    # The transforms compose: TP + FSDP with op-level checkpointing, and with scan.
    "fsdp4_tp2_ac_op": ["--training.local_batch_size", "2", P + "tensor_parallel_degree", "2",
                        AC + "mode", "selective", AC + "selective_ac_option", "op"],
    "fsdp4_tp2_scan": ["--training.local_batch_size", "2", P + "tensor_parallel_degree", "2",
                       "--compile.scan_layers"],
}
ONE_DEVICE = {
    "none": ["--training.local_batch_size", "8"],
    "full": ["--training.local_batch_size", "8", AC + "mode", "full"],
    # Each block's input and its attention projections kept on the host (the XLA CPU backend
    # leaves them in place), the projections then taken back instead of recomputed.
    "full_offload": ["--training.local_batch_size", "8", AC + "mode", "full", AC + "offload",
                     "decoder_layer_input,qkv_proj"],
    "selective_2": ["--training.local_batch_size", "8", AC + "mode", "selective",
                    AC + "selective_ac_option", "2"],
    "selective_op": ["--training.local_batch_size", "8", AC + "mode", "selective",
                     AC + "selective_ac_option", "op"],
    "scan": ["--training.local_batch_size", "8", "--compile.scan_layers"],
    "scan_op": ["--training.local_batch_size", "8", "--compile.scan_layers", AC + "mode",
                "selective", AC + "selective_ac_option", "op"],
    # debug_model.toml computes attention blockwise; plain SDPA must give the same losses...
    "sdpa": ["--training.local_batch_size", "8", "--model.attention", "sdpa"],
    # ...and a Pallas kernel asked for on CPU falls back to sdpa (one warning): the same graph.
    "flash_on_cpu": ["--training.local_batch_size", "8", "--model.attention", "flash"],
    # Gradient accumulation: 2 microbatches of 4 = one batch of 8.
    "accumulate_2x4": ["--training.local_batch_size", "4", "--training.global_batch_size", "8"],
}
# Only the order of floating-point reductions differs between meshes: measured max relative
# difference 2.5e-7 over the 5 steps.
MESH_RTOL = 2e-6
# The debug model cut to 2 blocks: every sharding rule is exercised, compiles are 4x faster.
TWO_BLOCKS = {"n_layers": 2}
# Qwen3's debug model (per-head query/key norms, heads wider than dim / n_heads), beside Llama's.
QWEN3 = {"qwen3": ["--model.name", "qwen3", "--training.local_batch_size", "8"]}
QWEN3_MESH = {"qwen3_fsdp4_tp2": ["--model.name", "qwen3", *MESHES["fsdp4_tp2"]]}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return train_many({k: tiny_args(out, *v) for k, v in (ONE_DEVICE | QWEN3).items()}, devices=1,
                      model_overrides=TWO_BLOCKS)


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    out = tmp_path_factory.mktemp("eight")
    return train_many({k: tiny_args(out, *v) for k, v in (MESHES | QWEN3_MESH).items()}, devices=8,
                      model_overrides=TWO_BLOCKS)


@pytest.mark.parametrize("mesh", MESHES)
def test_mesh_losses_equal_one_device(mesh, eight_devices, one_device):
    reference = one_device["none"]["losses"]
    losses = eight_devices[mesh]["losses"]
    assert losses.keys() == reference.keys() == {1, 2, 3, 4, 5}
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=MESH_RTOL), (mesh, step)


def test_qwen3_on_fsdp4_tp2_equals_one_device_with_its_norms_whole_over_tp(eight_devices, one_device):
    """Qwen3's query/key norms act within each head: tensor parallelism splits the heads (wq's
    rows), each head's norm weight stays whole over tp; the tied embedding stays one parameter."""
    reference, losses = one_device["qwen3"]["losses"], eight_devices["qwen3_fsdp4_tp2"]["losses"]
    assert losses.keys() == reference.keys() == {1, 2, 3, 4, 5}
    assert abs(reference[1] - one_device["none"]["losses"][1]) > 1e-3  # another model
    for step, loss in reference.items():
        assert losses[step] == pytest.approx(loss, rel=MESH_RTOL), step
    params = eight_devices["qwen3_fsdp4_tp2"]["params"]
    assert params["layers.0.attention.wq.weight"]["partition_spec"] == ["tp", "fsdp"]
    # The debug model ties its embeddings: one matrix, sharded once, is the output projection too.
    assert "output.weight" not in params
    assert params["tok_embeddings.weight"]["partition_spec"] == ["fsdp", "tp"]
    for norm in ("q_norm", "k_norm"):
        p = params[f"layers.1.attention.{norm}.weight"]
        assert "tp" not in p["partition_spec"] and p["actual"] == p["expected"], p


def _expected_partition_spec(mesh: str, name: str, ndim: int):
    """Written out independently of the code's plan: what each mesh must do to each parameter."""
    tp = "tp" in mesh
    if not tp:
        # FSDP only: the largest dimension; the embedding [2256, 256] and output [2256, 256]
        # split the vocabulary, square and wide matrices their first/larger dimension.
        if ndim == 1:
            return ["fsdp"]
        if name.endswith("feed_forward.w2.weight"):  # [256, 768]
            return [None, "fsdp"]
        return ["fsdp", None]
    column = ("wq", "wk", "wv", "w1", "w3", "output")
    row = ("wo", "w2", "tok_embeddings")
    leaf = name.split(".")[-2]
    fsdp = "fsdp" if "fsdp" in mesh else None
    if ndim == 1:
        return [fsdp]
    if leaf in column:
        return ["tp", fsdp]
    assert leaf in row, name
    return [fsdp, "tp"]


@pytest.mark.parametrize("mesh", MESHES)
def test_every_parameter_and_adam_state_carries_the_requested_sharding(mesh, eight_devices):
    params = eight_devices[mesh]["params"]
    assert len(params) == 2 + 2 * 9 + 1
    for name, p in params.items():
        assert p["partition_spec"] == _expected_partition_spec(mesh, name, len(p["partition_spec"])), name
        # What XLA holds after 5 optimizer steps is what a fresh tensor with that spec gets,
        # and Adam's moments are sharded like their parameter.
        assert p["actual"] == p["expected"] == p["exp_avg"] == p["exp_avg_sq"], (name, p)
        assert p["actual"] != "{replicated}" or mesh == "tp8_sp" and name.endswith("norm.weight")


def test_sharding_strings_match_the_reference_layouts(eight_devices):
    """Literal XLA shardings (the device order of the mesh matters as much as the split)."""
    fsdp8 = eight_devices["fsdp8"]["params"]
    assert fsdp8["layers.0.attention.wq.weight"]["actual"] == "{devices=[8,1]0,1,2,3,4,5,6,7}"
    tp = eight_devices["fsdp4_tp2"]["params"]
    assert tp["layers.0.attention.wq.weight"]["actual"] == "{devices=[2,4]0,2,4,6,1,3,5,7}"
    assert tp["layers.0.attention.wo.weight"]["actual"] == "{devices=[4,2]0,1,2,3,4,5,6,7}"
    hsdp = eight_devices["hsdp2_fsdp4"]["params"]
    # Shard i lives on device i of each replica group {0..3}, {4..7}.
    assert hsdp["output.weight"]["actual"] == "{devices=[4,1,2]0,4,1,5,2,6,3,7 last_tile_dim_replicate}"
    assert eight_devices["tp8_sp"]["params"]["layers.1.ffn_norm.weight"]["actual"] == "{replicated}"


@pytest.mark.parametrize("mode", [m for m in ONE_DEVICE if m != "none"])
def test_activation_checkpointing_scan_and_accumulation_keep_the_losses(mode, one_device):
    reference = one_device["none"]["losses"]
    losses = one_device[mode]["losses"]
    if mode in ("full", "full_offload", "selective_2", "selective_op"):
        assert losses == reference  # recomputation is bit-identical here
    elif mode == "flash_on_cpu":
        assert losses == one_device["sdpa"]["losses"]  # the fallback is exactly sdpa
    else:
        # scan fuses the block differently; accumulation sums two half-batch means; sdpa sums
        # the softmax over the whole row instead of the visible keys: measured relative
        # differences up to 1.2e-7.
        for step, loss in reference.items():
            assert losses[step] == pytest.approx(loss, rel=1e-6), (mode, step)


def test_no_configuration_compiles_more_than_init_and_one_step(one_device, eight_devices):
    # The loop itself stops on any compile after step 2 (debug.on_recompile = "error"), so each
    # finished run had none; this also pins the number of graphs per run.
    for name, r in {**one_device, **eight_devices}.items():
        assert r["compiles"] <= 2, (name, r["compiles"])


_TO_HOST = """
import json, sys
sys.path.insert(0, {repo!r})
import numpy as np, torch, torch_xla
import torch_xla.debug.metrics as met, torch_xla.distributed.spmd as xs, torch_xla.runtime as xr
from torchtitan_xla.runtime.xla.device import to_host
xr.use_spmd()
mesh = xs.Mesh(np.arange(8), (2, 2, 2), ("a", "b", "c"))
# Split evenly, padded (255 rows over 4, 129 columns over 2), partly replicated, over one axis
# of three, bfloat16, not sharded, a scalar.
cases = [((256, 128), ("b", None)), ((255, 129), (("a", "b"), "c")), ((9, 10, 3), ("c", None, ("a", "b"))),
         ((7,), ("a",)), ((64, 32), None), ((), None)]
host, device = [], []
for i, (shape, spec) in enumerate(cases):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(i))
    t = t.bfloat16() if len(shape) == 1 else t
    d = t.to(torch_xla.device())
    if spec:
        xs.mark_sharding(d, mesh, spec)
    host.append(t * 2)
    device.append(d * 2)  # pending: to_host runs it first
def compiles():
    return (met.metric_data("CompileTime") or [0])[0]
before = compiles()
first = to_host(device)
between = compiles()
again = to_host(device)
same = [torch.equal(a, b) and a.dtype == b.dtype and a.shape == b.shape for a, b in zip(first, host)]
print("RESULT " + json.dumps([same, between - before, compiles() - between,
                              [bool(torch.equal(a, b)) for a, b in zip(again, host)]]))
"""


def test_sharded_tensors_come_to_the_host_whole_without_a_compile():
    """runtime.to_host on 8 devices: each tensor bit-exact whatever its sharding (padded shards,
    partial replication, bfloat16), its pending values run in one graph and the transfer compiling
    nothing (torch_xla replicating a sharded tensor to fetch it whole compiled a program per
    tensor, at every call: 75 for one HuggingFace export of the debug model)."""
    p = subprocess.run([sys.executable, "-c", _TO_HOST.format(repo=str(REPO))], capture_output=True, text=True,
                       env=_env(8, None), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    same, first, again, equal_again = json.loads(p.stdout.split("RESULT ", 1)[1])
    assert same == [True] * 6 and equal_again == [True] * 6
    assert (first, again) == (1, 0)  # the pending graph; nothing for the transfer, nothing on the repeat


# ---- activation checkpointing really recomputes ------------------------------------------------


def _step_hlo(xla_device, mode: str, option: str = "2") -> str:
    import torch_xla

    from torchtitan_xla.models.llama import ModelArgs, Transformer
    from torchtitan_xla.parallelisms.parallelize_llama import apply_ac

    args = ModelArgs(dim=64, n_layers=4, n_heads=4, vocab_size=64, multiple_of=32, max_seq_len=16)
    model = Transformer(args)
    model.init_weights()
    model.to(xla_device)
    cfg = parse_args([AC + "mode", mode, AC + "selective_ac_option", option]).activation_checkpoint
    apply_ac(model, cfg)
    tokens = torch.randint(0, 64, (2, 16)).to(xla_device)
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
    loss.backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss] + [p.grad for p in model.parameters()])
    torch_xla.sync()
    return hlo


def test_checkpointing_recomputes_inside_an_optimization_barrier(xla_device):
    """Recomputation is fenced by opt-barriers (else XLA would merge it with the forward pass) and
    adds forward work: RMSNorm's rsqrt appears once per norm per recomputation."""
    counts = {}
    for mode, option in [("none", "2"), ("full", "2"), ("selective", "2"), ("selective", "op")]:
        hlo = _step_hlo(xla_device, mode, option)
        counts[(mode, option)] = (hlo.count("opt-barrier("), hlo.count(" rsqrt("))
    barriers = {k: v[0] for k, v in counts.items()}
    rsqrt = {k: v[1] for k, v in counts.items()}
    assert barriers[("none", "2")] == 0
    assert barriers[("full", "2")] == 4  # one per block
    assert barriers[("selective", "2")] == 2  # blocks 2 and 4
    assert barriers[("selective", "op")] == 4
    base = rsqrt[("none", "2")]
    assert rsqrt[("full", "2")] == base + 8  # 2 norms per block recomputed in 4 blocks
    assert rsqrt[("selective", "2")] == base + 4
    assert rsqrt[("selective", "op")] == base + 8  # norms are recomputed, not saved


_OFFLOADED_STEP = """
import glob, json, os, sys
sys.path.insert(0, {repo!r})
import torch, torch_xla
from torchtitan_xla.config import parse_args
from torchtitan_xla.models.llama import ModelArgs, Transformer
from torchtitan_xla.parallelisms.activation_checkpoint import apply_ac
model = Transformer(ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=32,
                              max_seq_len=16))
model.init_weights()
model.to(torch_xla.device())
apply_ac(model, parse_args(sys.argv[1:]).activation_checkpoint)
tokens = torch.randint(0, 64, (2, 16)).to(torch_xla.device())
loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
loss.backward()
outputs = [loss] + [p.grad for p in model.parameters()]
print("TRACED " + json.dumps(torch_xla._XLAC._get_xla_tensors_hlo(outputs)), flush=True)
torch_xla._XLAC._xla_warm_up_cache(outputs, [])  # compiles, never runs
"""


def _placements(hlo: str) -> list[tuple[str, str]]:
    """(shape, placement) of each host-offload custom call in `hlo`, in order."""
    import re

    return re.findall(r"= (\w+\[[\d,]*\])\S* custom-call\([^)]*\), "
                      r"custom_call_target=\"annotate_device_placement\".*?_xla_buffer_placement=\"(\w+)\"", hlo)


def test_offloaded_activations_carry_host_placements_in_the_optimized_hlo(tmp_path):
    """`offload = ["decoder_layer_input", "qkv_proj"]`: each of the 4 blocks' input ([2, 16, 64])
    and its query ([2, 16, 64]), key and value ([2, 16, 32]: 2 KV heads) projections go to pinned
    host memory after the forward pass and come back to the device for the recomputation, and
    nothing else does, in the graph torch_xla traces and in the HLO XLA optimizes from it. XLA's CPU
    compiler keeps the custom calls (it has no host-offload pass) and then aborts the process while
    compiling them, after writing its optimized HLO: so only that is read (runs on the CPU leave the
    values in place: the "full_offload" losses above)."""
    from collections import Counter

    from torchtitan_xla.runtime.xla.kernels import PLACE_ON_CPU_BACKEND

    dump = tmp_path / "dump"
    env = _env(1, {PLACE_ON_CPU_BACKEND: "1", "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text"})
    p = subprocess.run([sys.executable, "-c", _OFFLOADED_STEP.format(repo=str(REPO)), AC + "mode", "full",
                        AC + "offload", "decoder_layer_input,qkv_proj"], capture_output=True, text=True, env=env)
    traced = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("TRACED "))[7:])
    # Per block: its input and query [2, 16, 64], its key and value [2, 16, 32]; each way.
    expected = Counter({(shape, where): 8 for shape in ("f32[2,16,64]", "f32[2,16,32]")
                        for where in ("pinned_host", "device")})
    assert Counter(_placements(traced)) == expected, p.stderr[-2000:]
    optimized = [f.read_text() for f in dump.glob("*after_optimizations.txt")]
    assert len(optimized) == 1, (p.returncode, p.stderr[-2000:])
    assert Counter(_placements(optimized[0])) == expected


# ---- plans and validation ---------------------------------------------------------------------


def test_plan_functions():
    assert tp_spec("layers.3.attention.wk.weight", 2) == ("tp", None)
    assert tp_spec("layers.3.feed_forward.w2.weight", 2) == (None, "tp")
    assert tp_spec("norm.weight", 1) == (None,)
    assert fsdp_spec(torch.Size([256, 768]), (None, None), 8) == (None, "fsdp")
    assert fsdp_spec(torch.Size([12, 7]), (None, None), 8) == (None, None)  # nothing divides
    assert fsdp_spec(torch.Size([64, 64]), ("tp", None), 4) == ("tp", "fsdp")
    assert fsdp_spec(torch.Size([64, 64]), (None, None), 4) == ("fsdp", None)  # tie: first dim


def _dims(argv, devices):
    return ParallelDims.from_config(parse_args(argv).parallelism, devices)


def test_degree_resolution():
    # (dp_replicate, fsdp, ep, cp, tp)
    assert _dims([], 8).mesh_shape == (1, 1, 8, 1, 1, 1)
    assert _dims([P + "tensor_parallel_degree", "2"], 8).mesh_shape == (1, 1, 4, 1, 1, 2)
    assert _dims([P + "data_parallel_replicate_degree", "2", P + "num_slices", "2"], 8).mesh_shape == (1, 2, 4, 1, 1, 1)
    moe = ["--model.name", "mixtral"]
    ep = _dims([*moe, P + "expert_parallel_degree", "2", P + "tensor_parallel_degree", "2"], 8)
    assert (ep.mesh_shape, ep.dp_degree, ep.shard_degree) == ((1, 1, 2, 2, 1, 2), 4, 4)
    # Context parallel devices split sequences, not the batch; they shard the weights (FSDP).
    cp = _dims([P + "context_parallel_degree", "2", P + "tensor_parallel_degree", "2"], 8)
    assert (cp.mesh_shape, cp.dp_degree, cp.shard_degree, cp.seq_axis) == ((1, 1, 2, 1, 2, 2), 2, 4, "cp")


BAD = [
    ([P + "data_parallel_shard_degree", "3"], 8,
     r"data_parallel_replicate_degree \(1\) x data_parallel_shard_degree \(3\) x tensor_parallel_degree \(1\) = 3, but there are 8 devices"),
    ([P + "tensor_parallel_degree", "3"], 8,
     r"data_parallel_replicate_degree \(1\) x tensor_parallel_degree \(3\) = 3 does not divide the 8 devices"),
    (["--model.name", "mixtral", P + "expert_parallel_degree", "4", P + "data_parallel_shard_degree", "4"], 8,
     r"data_parallel_replicate_degree \(1\) x data_parallel_shard_degree \(4\) x expert_parallel_degree \(4\) x "
     r"tensor_parallel_degree \(1\) = 16, but there are 8 devices"),
    ([P + "num_slices", "2"], 8,
     r"data_parallel_replicate_degree \(1\) must be a multiple of num_slices \(2\)"),
]


@pytest.mark.parametrize("argv,devices,message", BAD)
def test_impossible_degrees(argv, devices, message):
    with pytest.raises(ConfigError, match=message):
        _dims(argv, devices)


def test_model_and_batch_checks():
    dims = _dims([P + "tensor_parallel_degree", "3"], 6)
    with pytest.raises(ConfigError, match=r"tensor_parallel_degree \(3\) must divide the model's n_heads \(16\)"):
        dims.check_model(16, 16, 256, 768)
    with pytest.raises(ConfigError, match=r"must divide the model's n_kv_heads \(8\)"):
        _dims([P + "tensor_parallel_degree", "16"], 16).check_model(64, 8, 8192, 28672)
    # A model read from a checkpoint (eval) is checked against the expert degree too.
    ep4 = _dims(["--model.name", "mixtral", P + "expert_parallel_degree", "4"], 8)
    ep4.check_model(16, 8, 256, 768, num_experts=8)
    for experts in (6, 0):
        with pytest.raises(ConfigError, match=rf"expert_parallel_degree \(4\) must divide the model's num_experts \({experts}\)"):
            ep4.check_model(16, 8, 256, 768, num_experts=experts)
    fsdp8 = _dims([], 8)
    with pytest.raises(ConfigError, match=r"global_batch_size \(12\) must be a multiple of local_batch_size \(1\) x data-parallel degree \(8\) = 8"):
        fsdp8.check_batch(12, 1, 64, 1)
    assert fsdp8.check_batch(32, 2, 64, 1) == 2  # accumulation steps
    with pytest.raises(ConfigError, match=r"seq_len \(65\) must be a multiple of tensor_parallel_degree \(2\)"):
        _dims([P + "tensor_parallel_degree", "2"], 8).check_batch(8, 2, 65, 1)


@pytest.mark.parametrize("argv,message", [
    ([AC + "mode", "partial"], r"--activation_checkpoint.mode: expected one of none, full, selective, got 'partial'"),
    ([AC + "selective_ac_option", "every2"], r"selective_ac_option = 'every2': expected 'op' or a positive integer N"),
    (["--compile.scan_layers", AC + "mode", "full"], r"scan_layers = true cannot be combined with \[activation_checkpoint\] mode = 'full'"),
    (["--training.global_batch_size", "0"], r"global_batch_size = 0: must be -1 \(no accumulation\) or > 0"),
    ([AC + "offload", "wq"], r"--activation_checkpoint.offload: expected one of decoder_layer_input, qkv_proj, "
     r"got 'wq'"),
    ([AC + "offload", "qkv_proj", AC + "mode", "full", "--float8.enable_float8_linear"],
     r"^command line: --activation_checkpoint.offload = \['qkv_proj'\] keeps the outputs of plain wq, wk and wv "
     r"linear layers; not with command line: --float8.enable_float8_linear = True \(float8 projections\)$"),
    ([AC + "offload", "qkv_proj", AC + "mode", "full", "--lora.rank", "4"],
     r"not with .*\[lora\] target_modules = \['wk', 'wq', 'wv'\] \(adapters on the projections\)$"),
    ([AC + "offload", "qkv_proj", AC + "mode", "full", "--model.name", "deepseek_v3"],
     r"not with command line: --model.name = 'deepseek_v3' \(latent attention"),
    ([AC + "offload", "decoder_layer_input"], r"offload = \['decoder_layer_input'\] needs \[activation_checkpoint\] "
     r"mode = \"full\" \(each block recomputed in the backward pass from what it kept\), not 'selective'"),
    ([AC + "offload", "decoder_layer_input", AC + "mode", "full", P + "pipeline_parallel_degree", "2"],
     r"cannot be combined with \[parallelism\] pipeline_parallel_degree = 2: the pipeline stages"),
])
def test_bad_parallelism_options(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)


DEBUG_TOML = REPO / "train_configs" / "debug_model.toml"


# Each names where its keys were set: the recipe's file, or the command line.
@pytest.mark.parametrize("argv,devices,message", [
    ([P + "data_parallel_shard_degree", "3"], 8,
     f"error: {DEBUG_TOML}: [parallelism] data_parallel_replicate_degree (1) x data_parallel_shard_degree "
     f"(3) x tensor_parallel_degree (1) = 3, but there are 8 devices (data_parallel_shard_degree from "
     f"the command line; tensor_parallel_degree from {DEBUG_TOML})"),
    ([P + "tensor_parallel_degree", "3", "--training.seq_len", "48"], 6,
     "error: command line: --parallelism.tensor_parallel_degree (3) must divide the model's n_heads (16)"),
    (["--training.global_batch_size", "12"], 8,
     "error: command line: --training.global_batch_size (12) must be a multiple of local_batch_size (8) x "
     f"data-parallel degree (8) = 64 (local_batch_size from {DEBUG_TOML})"),
])
def test_bad_degrees_stop_train_py_before_compiling(tmp_path, argv, devices, message):
    import os

    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices), PT_XLA_DEBUG_LEVEL="1")
    p = subprocess.run([sys.executable, str(REPO / "train.py"), *tiny_args(tmp_path / "o"), *argv],
                       capture_output=True, text=True, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert [ln for ln in p.stderr.splitlines() if ln.startswith("error:")] == [message]
    assert "Traceback" not in p.stderr
    # PT_XLA_DEBUG_LEVEL=1 reports every compilation: there must be none.
    assert "Compilation Analysis" not in p.stderr + p.stdout


def test_tpu_mesh_uses_hybrid_mesh(monkeypatch):
    """On TPU the mesh comes from xs.HybridMesh: ICI shape within a slice, slices over DCN."""
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    calls = {}
    monkeypatch.setattr(xs, "HybridMesh", lambda **kw: calls.update(kw) or "mesh")
    monkeypatch.setattr(xr, "global_runtime_device_attributes",
                        lambda: [{"slice_index": i // 4} for i in range(8)])
    dims = _dims([P + "data_parallel_replicate_degree", "2", P + "num_slices", "2"], 8)
    assert dims.build_mesh("TPU") == "mesh"
    assert calls == dict(ici_mesh_shape=(1, 1, 4, 1, 1, 1), dcn_mesh_shape=(1, 2, 1, 1, 1, 1),
                         axis_names=("pp", "dp_replicate", "fsdp", "ep", "cp", "tp"))
    with pytest.raises(ConfigError, match=r"num_slices is 1, but the TPU runtime sees 2 slice"):
        _dims([], 8).build_mesh("TPU")


def test_native_tpu_mesh_is_torch_tpus_topology_aware_layout(monkeypatch):
    """On TorchTPU the mesh's rank layout is torch.tpu.distributed.topology_aware_mesh's (here a
    stand-in with torch-tpu 0.2.0's signature: no TPU): several slices (libtpu's
    MEGASCALE_NUM_SLICES) split dp_replicate over the data-centre network, as HybridMesh does on
    XLA; a mesh the slice cannot hold is one line naming [parallelism]."""
    import math
    import sys
    import types

    from torchtitan_xla.runtime.native import device, sharding

    calls = []

    def topology_aware_mesh(mesh_shape, *, dcn_mesh_shape=None, allow_split_physical_axes=False,
                            contiguous_submeshes=False):
        calls.append((mesh_shape, dcn_mesh_shape))
        if math.prod(mesh_shape) != 8:
            raise ValueError(f"mesh_shape {mesh_shape} has {math.prod(mesh_shape)} devices, the world 8\ndetails")
        return torch.arange(8).reshape(mesh_shape)

    tpu, tpu_distributed = types.ModuleType("torch.tpu"), types.ModuleType("torch.tpu.distributed")
    tpu_distributed.topology_aware_mesh, tpu.distributed = topology_aware_mesh, tpu_distributed
    monkeypatch.setitem(sys.modules, "torch.tpu", tpu)
    monkeypatch.setitem(sys.modules, "torch.tpu.distributed", tpu_distributed)
    monkeypatch.setattr("torch.distributed.device_mesh.DeviceMesh",
                        lambda kind, ranks, mesh_dim_names: (kind, ranks.tolist(), mesh_dim_names))
    monkeypatch.setattr(device, "_kind", "tpu")
    monkeypatch.setenv("MEGASCALE_NUM_SLICES", "2")
    assert device.slice_count() == 2
    axes = ("dp_replicate", "fsdp", "ep", "tp")
    kind, ranks, names = sharding.build_mesh((2, 4, 1, 1), axes, device_type="TPU", num_slices=2)
    # torch-tpu lays out every axis; the DeviceMesh keeps those longer than one device
    assert (kind, names, calls) == ("tpu", axes[:2], [((2, 4, 1, 1), (2, 1, 1, 1))])
    assert ranks == torch.arange(8).reshape(2, 4).tolist()
    sharding.build_mesh((1, 8, 1, 1), axes, device_type="TPU")
    assert calls[-1] == ((1, 8, 1, 1), None)  # one slice: torch-tpu infers the layout
    with pytest.raises(ConfigError) as e:
        sharding.build_mesh((1, 3, 1, 2), axes, device_type="TPU")
    assert str(e.value) == ("[parallelism] the mesh (dp_replicate 1, fsdp 3, ep 1, tp 2) does not fit this TPU "
                            "slice (1 slice(s)): torch-tpu says: mesh_shape (1, 3, 1, 2) has 6 devices, the world 8")
    with pytest.raises(ConfigError, match=r"num_slices = 2: several slices are TPU slices; this run's devices are CPU"):
        sharding.build_mesh((2, 4, 1, 1), axes, device_type="CPU", num_slices=2)


def test_pallas_attention_swaps_modules_only_on_tpu(caplog):
    from helpers import capture_logs

    from torchtitan_xla.models.llama import ModelArgs, Transformer
    from torchtitan_xla.models.llama.attention_kernels import KernelAttention, apply_attention_kernel

    with torch.device("meta"):
        model = Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=64, multiple_of=32))
    with capture_logs() as log:
        apply_attention_kernel(model, "splash", mesh=None, device_type="CPU")
    assert [r.getMessage() for r in log.records] == [
        "[model] attention = 'splash': torch_xla's Pallas kernels run only on TPU; this CPU run uses sdpa"]
    assert not any(isinstance(m, KernelAttention) for m in model.modules())
    with caplog.at_level("INFO", logger="torchtitan_xla"), capture_logs() as log:
        apply_attention_kernel(model, "flash", mesh="mesh", device_type="TPU")
    assert [r.getMessage() for r in log.records] == [
        "Attention: torch_xla's Pallas flash attention kernel (not verified on TPU by this project)"]
    kernels = [b.attention.sdpa for b in model.layers.values()]
    assert all(isinstance(k, KernelAttention) and k.kind == "flash" for k in kernels)
    assert kernels[0].spec == (("dp_replicate", "fsdp", "ep"), "tp", None, None)


def test_scan_refuses_torchax_files_overwritten_by_torch_xla(monkeypatch):
    """torch_xla's wheel bundles an old torchax into the same directory; with it scan_layers dies
    with SIGSEGV. The check turns that into one line with the fix (and passes on this install)."""
    import importlib.metadata
    import types

    from torchtitan_xla.runtime.xla.kernels import check_torchax

    installed = importlib.metadata.version("torchax")
    check_torchax()  # the environment the suite runs in has the right files
    monkeypatch.setitem(sys.modules, "torchax", types.SimpleNamespace(__version__="0.0.6"))
    with pytest.raises(ConfigError, match=rf"found: 0\.0\.6\); restore them with: pip install "
                                          rf"--force-reinstall --no-deps torchax=={installed}"):
        check_torchax()
