"""Training the Mixtral debug model (2 MoE blocks): every mesh gives one device's losses
(dropless), the experts carry the sharding asked for, resume is bit-exact, capacity mode drops
tokens and still learns, and bad MoE settings are one line before anything is built."""

import re
from pathlib import Path

import pytest
from helpers import tiny_args, train_many, train_run

from torchtitan_xla.config import ConfigError, parse_args

TWO_BLOCKS = {"n_layers": 2}
MIXTRAL = ["--model.name", "mixtral"]
# Only the order of floating-point reductions differs between meshes (tests/test_parallelisms.py).
# Measured on a Xeon (AVX-512), natively and with XLA, ATen, MKL and oneDNN pinned to AVX2: every
# float32 mesh within 2.4e-7 of one device; the 1-device runs themselves move by at most 3e-7
# under other legitimate float32 orders (one XLA thread instead of two, no FMA in XLA's kernels,
# the batch in two accumulated halves) or 1-2 ulp changes of the initial router or embedding.
MESH_RTOL = 2e-6
# bfloat16 autocast: a float32 sum in another order flips some of the bf16 roundings after it, and
# those move the losses by up to bf16's own effect on them. Measured (Xeon, AVX2 pins): autocast
# moves the 1-device losses 1.4e-5 to 2.9e-5 from the float32 run's (steps 1-5); the same 1-device
# run with one XLA thread instead of two moves by up to 1.6e-5 (step 4); fsdp=8 was 6.6e-6 from one
# device (9.5e-6 on an AVX2-only EPYC). The first step's gradient norm (same weights, same batch)
# stays within MESH_RTOL (measured 1.1e-7).
BF16_RTOL = 5e-5
BF16 = ["--training.mixed_precision_param", "bfloat16"]
# Packed conversations (padding at row ends, routed to no expert) with a capacity that drops.
CHAT = ["--training.dataset", "python_docs_chat", "--moe.capacity_factor", "1.25"]
# Qwen3's MoE debug model: 8 experts, top-4, query/key norms, heads wider than dim / n_heads.
QWEN3_MOE = ["--model.name", "qwen3", "--model.flavor", "debugmodel_moe"]
# DeepSeek-V3's debug model cut to 2 blocks: one dense, one with 16 experts in 4 groups (top-4 within
# 2 groups), a shared expert, the sigmoid router and its bias; latent attention.
DEEPSEEK = ["--model.name", "deepseek_v3"]


# 6 steps saved at 3 and 6.
SAVED = ["--training.steps", "6", "--checkpoint.enable", "--checkpoint.interval", "3"]


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe1")
    runs = {"dropless": [], "grouped_mm_bf16": ["--moe.grouped_mm", *BF16], "chat": CHAT}
    runs = {k: [*MIXTRAL, *v] for k, v in runs.items()} | {"qwen3": QWEN3_MOE, "deepseek": DEEPSEEK}
    runs = {k: tiny_args(out, "--training.local_batch_size", "8", *v) for k, v in runs.items()}
    runs["saved"] = saved_args(out / "saved")  # (the dropless run's compiled step)
    runs["capacity"] = tiny_args(out / "capacity", *MIXTRAL, "--moe.capacity_factor", "0.5",
                                 "--training.steps", "60", "--metrics.log_freq", "6",
                                 "--lr_scheduler.warmup_steps", "6")
    results = train_many(runs, devices=1, model_overrides=TWO_BLOCKS)
    results["saved"]["folder"] = out / "saved"
    return results


def saved_args(folder: Path) -> list[str]:
    """Mixtral on one device, 6 steps saved at 3 and 6."""
    return tiny_args(folder, "--training.local_batch_size", "8", *MIXTRAL, *SAVED)


# Each mesh on 8 devices with the global batch of 8 sequences: local batch x data-parallel ranks
# (dp_replicate x fsdp x ep).
MESHES = {
    "fsdp4_tp2": ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"],
    "ep4_fsdp2": ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "4"],
    "ep2_fsdp2_tp2": ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree", "2",
                      "--parallelism.tensor_parallel_degree", "2"],
    "ep8": ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "8"],
    "hsdp2_fsdp2_ep2": ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "2",
                        "--parallelism.data_parallel_replicate_degree", "2"],
    # Sorted experts and grouped matmuls, each device on its own sequences (runtime.per_shard).
    "fsdp8_grouped_mm": ["--training.local_batch_size", "1", "--moe.grouped_mm"],
    "fsdp8_grouped_mm_bf16": ["--training.local_batch_size", "1", "--moe.grouped_mm", *BF16],
    "ep4_fsdp2_chat": ["--training.local_batch_size", "1", "--parallelism.expert_parallel_degree", "4", *CHAT],
}


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe8")
    runs = {k: [*MIXTRAL, *v] for k, v in MESHES.items()} | {
        f"{name}_{k}": [*model, *MESHES[k]] for name, model in (("qwen3", QWEN3_MOE), ("deepseek", DEEPSEEK))
        for k in ("fsdp4_tp2", "ep4_fsdp2")}
    runs = {k: tiny_args(out, *v) for k, v in runs.items()}
    # Saved on ep=4 x fsdp=2, then resumed from its step 3 on ep=2 x fsdp=2 x tp=2 (each reuses
    # the compiled step of its mesh above).
    runs["ep4_fsdp2_saved"] = tiny_args(out / "reshard", *MIXTRAL, *SAVED, *MESHES["ep4_fsdp2"])
    runs["ep2_fsdp2_tp2_resumed"] = tiny_args(out / "reshard", *MIXTRAL, *SAVED, "--checkpoint.load_step", "3",
                                              *MESHES["ep2_fsdp2_tp2"])
    return train_many(runs, devices=8, model_overrides=TWO_BLOCKS, xla_dump=out / "xla")


def test_grouped_mm_region_recomputes_under_autocast(one_device, eight_devices):
    """bfloat16: on a mesh each device's sorted experts run in a region whose backward recomputes
    them; under the step's autocast that gives one device's training: the first step's gradient
    norm within float32's bound, the losses within bfloat16's (BF16_RTOL). Losses cannot tell
    the recomputation's dtype (recomputed in float32 they were 4e-6 to 1.1e-5 off, inside bf16's
    own noise): the region's gradients test that (next test). A region whose expert-weight
    gradients were averaged over the devices instead of summed: the first step's gradient norm
    1.8e-3 off (losses only 7e-6 to 1.1e-5: Adam normalises the scale away)."""
    reference, run = one_device["grouped_mm_bf16"], eight_devices["fsdp8_grouped_mm_bf16"]
    assert run["grad_norms"]["1"] == pytest.approx(reference["grad_norms"]["1"], rel=MESH_RTOL)
    for step, loss in reference["losses"].items():
        assert run["losses"][step] == pytest.approx(loss, rel=BF16_RTOL), step


_REGION_DRIVER = """
import functools, json, sys
sys.path.insert(0, {repo!r})
import torch, torch_xla
import torch_xla.runtime as xr
xr.use_spmd()
from torchtitan_xla import runtime
from torchtitan_xla.models.llama.moe import grouped_mm_reference, sorted_experts
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES, MESH_AXES

dev, n = torch_xla.device(), xr.global_runtime_device_count()
mesh = runtime.build_mesh((1, 1, n, 1, 1, 1), MESH_AXES, device_type="CPU", num_slices=1, slice_axis=1)
g = torch.Generator().manual_seed(0)
b, s, d, h, e, k = 8, 32, 64, 96, 8, 2
x, probe = torch.randn(b, s, d, generator=g), torch.randn(b, s, d, generator=g)
top, experts = torch.randn(b, s, e, generator=g).softmax(-1).topk(k, dim=-1)
weights = top / top.sum(-1, keepdim=True)
w1, w3 = (torch.randn(e, h, d, generator=g) * d ** -0.5 for _ in range(2))
w2 = torch.randn(e, d, h, generator=g) * h ** -0.5
experts_fn = functools.partial(sorted_experts, grouped_mm=grouped_mm_reference)
tokens, whole = (BATCH_AXES, None, None), (None, None, None)
region = runtime.per_shard(experts_fn, mesh, [tokens] * 3 + [whole] * 3, tokens, BATCH_AXES)

def grads(fn):
    leaves = [t.to(dev).requires_grad_() for t in (x, weights, w1, w2, w3)]
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = fn(leaves[0], experts.to(dev), *leaves[1:])
    gs = torch.autograd.grad((out.float() * probe.to(dev)).sum(), leaves)
    torch_xla.sync()
    return [t.cpu().double() for t in (out.float(), *gs)]

names = ["out", "x", "weights", "w1", "w2", "w3"]
off = {{m: ((a - r).norm() / r.norm()).item() for m, a, r in zip(names, grads(region), grads(experts_fn))}}
print("OFF " + json.dumps(off))
"""


def test_grouped_mm_region_backward_recomputes_in_the_forwards_dtype():
    """The sorted experts under bfloat16 autocast on 8 devices, each on its own sequences in the
    region: output and gradients (tokens, router weights, expert weights) equal the whole batch's
    computation. Measured: output and token-side gradients equal to the bit, expert weights'
    within 9e-8 (their sums over the devices); with the backward's recomputation in float32
    instead every gradient was 4.2e-3 to 4.3e-3 off (bfloat16's rounding, 2^-9, of what the
    forward rounded and the recomputation did not)."""
    import json
    import subprocess
    import sys

    from helpers import REPO, _env

    env = _env(8, {"XLA_DISABLE_FUNCTIONALIZATION": "1"})
    p = subprocess.run([sys.executable, "-c", _REGION_DRIVER.format(repo=str(REPO))], capture_output=True,
                       text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    off = json.loads(next(ln for ln in p.stdout.splitlines() if ln.startswith("OFF "))[4:])
    for name, rel in off.items():
        assert rel < 1e-5, (name, off)


@pytest.mark.parametrize("mesh", [m for m in MESHES if "bf16" not in m])
def test_moe_mesh_losses_equal_one_device(mesh, one_device, eight_devices):
    """Every mesh, and sorted experts with grouped matmuls, give the 1-device dispatch's losses
    (packed chat rows with capacity 1.25: the 1-device run of that). (Sorted experts on one device
    equal the dispatch in float64: tests/test_moe.py; they run here in bfloat16.)"""
    reference = one_device["chat" if mesh.endswith("chat") else "dropless"]["losses"]
    run = eight_devices[mesh]
    assert reference.keys() == {1, 2, 3, 4, 5}
    for step, loss in reference.items():
        assert run["losses"][step] == pytest.approx(loss, rel=MESH_RTOL), (mesh, step)
    # The first step's gradient (the same weights and batch): its norm to the same bound.
    first = one_device["chat" if mesh.endswith("chat") else "dropless"]["grad_norms"]["1"]
    assert run["grad_norms"]["1"] == pytest.approx(first, rel=MESH_RTOL), mesh
    assert run["compiles"] <= 2  # init and one step: nothing recompiles


@pytest.mark.parametrize("mesh", ["fsdp4_tp2", "ep4_fsdp2"])
def test_qwen3_moe_on_a_mesh_equals_one_device_with_its_experts_split(mesh, one_device, eight_devices):
    """Qwen3's MoE debug model on fsdp=4 x tp=2 and ep=4 x fsdp=2 gives the 1-device losses; its
    experts are split as Mixtral's, its query/key norms stay whole over tp."""
    reference, run = one_device["qwen3"]["losses"], eight_devices[f"qwen3_{mesh}"]
    assert reference.keys() == {1, 2, 3, 4, 5}
    for step, loss in reference.items():
        assert run["losses"][step] == pytest.approx(loss, rel=MESH_RTOL), step
    assert run["grad_norms"]["1"] == pytest.approx(one_device["qwen3"]["grad_norms"]["1"], rel=MESH_RTOL)
    assert run["compiles"] <= 2
    params = run["params"]
    w1 = params["layers.1.feed_forward.w1"]  # [8, 192, 256]: FSDP takes the largest dimension left
    assert w1["partition_spec"] == ([None, "tp", "fsdp"] if "tp" in mesh else ["ep", None, "fsdp"])
    assert w1["actual"] == w1["expected"]
    assert "tp" not in params["layers.1.attention.q_norm.weight"]["partition_spec"]


@pytest.mark.parametrize("mesh", ["fsdp4_tp2", "ep4_fsdp2"])
def test_deepseek_on_a_mesh_equals_one_device(mesh, one_device, eight_devices):
    """DeepSeek-V3's debug model on fsdp=4 x tp=2 and ep=4 x fsdp=2 gives the 1-device losses and
    the same expert bias after 5 steps (its updates are signs of integer counts: exact); the latent
    attention's up-projections split by head over tp, its down-projections whole; experts split as
    Mixtral's. The bias moved as update_expert_bias says: multiples of the rate, at most 5 steps'."""
    reference, run = one_device["deepseek"], eight_devices[f"deepseek_{mesh}"]
    assert reference["losses"].keys() == {1, 2, 3, 4, 5}
    for step, loss in reference["losses"].items():
        assert run["losses"][step] == pytest.approx(loss, rel=MESH_RTOL), step
    assert run["compiles"] <= 2
    bias = reference["expert_bias"]["layers.1.feed_forward.expert_bias"]
    assert run["expert_bias"] == reference["expert_bias"]
    steps = [round(b / 1e-3, 3) for b in bias]  # [moe] bias_update_rate's default
    assert all(s == int(s) and abs(s) <= 5 for s in steps) and any(steps), steps
    params = run["params"]
    tp = "tp" in mesh
    for name in ("attention.wq_b.weight", "attention.wkv_b.weight", "feed_forward.shared_experts.w1.weight"):
        assert ("tp" in params[f"layers.1.{name}"]["partition_spec"]) == tp, name
    for name in ("attention.wq_a.weight", "attention.wkv_a.weight", "attention.kv_norm.weight"):
        assert "tp" not in params[f"layers.1.{name}"]["partition_spec"], name
    w1 = params["layers.1.feed_forward.w1"]  # [16, 96, 256]
    assert w1["partition_spec"] == ([None, "tp", "fsdp"] if tp else ["ep", None, "fsdp"])
    assert w1["actual"] == w1["expected"]


def test_deepseek_tokens_reach_their_experts_by_all_to_all(eight_devices):
    """ep=4 x fsdp=2: the one MoE block's expert-side tensor [1 sequence, 16 experts, 64 slots, 256]
    crosses the ep group by all-to-all, to the experts and back, forward and backward."""
    from torchtitan_xla.runtime.xla.compiled import collective_ops

    modules = [Path(f).read_text() for f in eight_devices["deepseek_ep4_fsdp2"]["hlo"]]
    ops = collective_ops(max(modules, key=len))
    moves = [group for kind, size, group, _ in ops if kind == "all-to-all" and size == 1 * 16 * 64 * 256 * 4]
    assert moves == [4] * 4, moves


FSDP_EP = ["fsdp", "ep"]  # dense weights are sharded over fsdp x ep


@pytest.mark.parametrize("mesh, expected", [
    # Stacked experts [E, hidden, dim] / [E, dim, hidden]: TP on the hidden dim as for the dense
    # SwiGLU, FSDP on the largest dimension left; the router [E, dim] whole over tp.
    ("fsdp4_tp2", {"w1": [None, "tp", "fsdp"], "w3": [None, "tp", "fsdp"], "w2": [None, "fsdp", "tp"],
                   "router.weight": [None, "fsdp"]}),
    # EP: the expert dim over ep; FSDP over fsdp alone for experts, over fsdp x ep for the rest.
    ("ep4_fsdp2", {"w1": ["ep", "fsdp", None], "w3": ["ep", "fsdp", None], "w2": ["ep", None, "fsdp"],
                   "router.weight": [None, FSDP_EP]}),
    ("ep2_fsdp2_tp2", {"w1": ["ep", "tp", "fsdp"], "w3": ["ep", "tp", "fsdp"],
                       "w2": ["ep", "fsdp", "tp"], "router.weight": [None, FSDP_EP]}),
    ("ep8", {"w1": ["ep", None, None], "w3": ["ep", None, None], "w2": ["ep", None, None],
             "router.weight": [None, FSDP_EP]}),
])
def test_experts_and_router_carry_the_requested_sharding(mesh, expected, eight_devices):
    """Each parameter's partition spec, and XLA's own sharding of it and of its Adam state equal to
    a fresh tensor's with that spec."""
    params = eight_devices[mesh]["params"]
    for block in (0, 1):
        for name, spec in expected.items():
            p = params[f"layers.{block}.feed_forward.{name}"]
            assert p["partition_spec"] == spec, (block, name)
            assert p["actual"] == p["expected"] == p["exp_avg"], (block, name, p)
    if "ep" in mesh:
        assert params["layers.0.attention.wq.weight"]["partition_spec"][-1 if "tp" in mesh else 0] == FSDP_EP


@pytest.mark.parametrize("mesh", ["ep4_fsdp2", "ep2_fsdp2_tp2", "ep8", "hsdp2_fsdp2_ep2"])
def test_tokens_reach_their_experts_by_all_to_all_and_experts_stay_split(mesh, eight_devices):
    """The compiled step (its optimized HLO): the expert-side tensors cross the ep group by
    all-to-all, bytes as the plan's theory says (4 per MoE block: to the experts and back, forward
    and backward), and no expert weight is ever gathered with more than this device's experts."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.parallelisms import ParallelDims
    from torchtitan_xla.plan import comms
    from torchtitan_xla.plan.memory import build_meta_model
    from torchtitan_xla.runtime.xla.compiled import collective_ops

    modules = [Path(f).read_text() for f in eight_devices[mesh]["hlo"]]
    ops = collective_ops(max(modules, key=len))  # the training step's module
    cfg = parse_args(tiny_args(Path("unused"), *MIXTRAL, *MESHES[mesh]))
    dims = ParallelDims.from_config(cfg.parallelism, 8)
    _, model = build_meta_model(cfg, **TWO_BLOCKS)
    t = cfg.training
    theory = comms.theory(model, dims, tokens=t.local_batch_size * t.seq_len, seq_len=t.seq_len,
                          microbatches=1, policy="none")
    # [local batch, experts, slots = seq (dropless), dim] float32 per device, to the experts and back.
    moved = t.local_batch_size * 8 * t.seq_len * 256 * 4
    moves = [group for kind, size, group, _ in ops if kind == "all-to-all" and size == moved]
    assert moves == [dims.ep] * 8, moves  # 2 MoE blocks x (there and back) x (forward, backward)
    # Every all-to-all of the step is in the theory (under TP also the embedding's), bytes exact.
    assert comms.measured(ops)["all-to-all"] == pytest.approx(theory["all-to-all"], rel=1e-9)

    def array_dims(shape):
        return [sorted(map(int, d.split(","))) for d in re.findall(r"\[([0-9,]+)\]", shape)]

    gathered = [d for kind, _, _, shape in ops if kind == "all-gather" for d in array_dims(shape)]
    hidden = 384 // dims.tp  # the debug MoE: 8 experts, hidden 384, dim 256
    assert sorted((8, hidden, 256)) not in gathered  # no expert weight whole on a device
    if dims.dp_shard > 1:  # FSDP gathers this device's experts' shards
        assert sorted((8 // dims.ep, hidden, 256)) in gathered


def test_moe_resumes_bit_exactly(one_device, tmp_path):
    """Model, optimizer and router state (the step's inputs all come back): resuming at step 3 in
    a new process gives the uninterrupted run's losses exactly. The resumed run traces steps 4 and
    5 where the uninterrupted one replays them; measured (Xeon, natively and with AVX2 pins): the
    same compiled step, and every one of its 116 inputs equal to the bit at steps 4-6. Where they
    differ, a second uninterrupted run tells a resume that is not exact from a run that does not
    repeat itself on this host (the message says which)."""
    import shutil

    straight = one_device["saved"]["losses"]
    folder = tmp_path / "resumed"
    shutil.copytree(one_device["saved"]["folder"], folder)
    shutil.rmtree(folder / "checkpoint" / "step-6")
    resumed, log = train_run(saved_args(folder), model_overrides=TWO_BLOCKS)
    assert "Resumed from" in log
    expected = {s: straight[s] for s in (4, 5, 6)}
    if resumed != expected:
        again, _ = train_run(tiny_args(tmp_path / "again", *MIXTRAL, "--training.steps", "6"),
                             model_overrides=TWO_BLOCKS)
        verdict = ("a second uninterrupted run repeats the first: the resume is not exact"
                   if again == straight else
                   f"a second uninterrupted run gives {again}: the run itself does not repeat on this host")
        raise AssertionError(f"resumed {resumed}, uninterrupted {expected}; {verdict}")


def test_capacity_mode_logs_its_drops_and_still_learns(one_device):
    """capacity_factor 0.5 keeps at most half of the top-2 choices: the log shows the drop rate
    (router `dropped: x%`), and the loss falls on the embedded corpus within 60 steps (measured
    8.197 to 6.166, 50-59% dropped)."""
    import re

    losses, log = one_device["capacity"]["losses"], "\n".join(one_device["capacity"]["log"])
    dropped = [float(x) for x in re.findall(r"dropped: ([0-9.]+)%", log)]
    assert len(dropped) == len(losses) and min(dropped) >= 40.0, dropped  # capacity: half the slots
    assert losses[60] < 0.8 * losses[1], losses


def test_moe_checkpoint_reshards_across_expert_parallel_meshes(eight_devices):
    """Saved on ep=4 x fsdp=2 at step 3, resumed on ep=2 x fsdp=2 x tp=2: steps 4-6 give the
    uninterrupted run's losses (DCP reshards the experts from 2 to 4 per device)."""
    straight, resumed = eight_devices["ep4_fsdp2_saved"], eight_devices["ep2_fsdp2_tp2_resumed"]
    assert resumed["losses"].keys() == {4, 5, 6}  # it resumed from step 3
    for step in (4, 5, 6):
        assert resumed["losses"][step] == pytest.approx(straight["losses"][step], rel=MESH_RTOL), step


@pytest.mark.parametrize("flags, message", [
    (["--moe.top_k", "2"], "command line: --moe.top_k = 2: the model llama3 debugmodel is dense (no "
                           "experts); set [moe] num_experts, or use an MoE flavor (mixtral, qwen3 "
                           "debugmodel_moe, 30B-A3B, 235B-A22B, deepseek_v2, deepseek_v3)"),
    ([*MIXTRAL, "--moe.top_k", "9"], "command line: --moe.top_k = 9: top_k (9) cannot exceed "
                                     "num_experts (8) of mixtral debugmodel"),
    ([*MIXTRAL, "--float8.enable_float8_linear"], "command line: --float8.enable_float8_linear = true: "
                                                  "float8 is not supported with mixture-of-experts"),
    ([*MIXTRAL, "--compile.scan_layers"], "command line: --compile.scan_layers = true: scan is not "
                                          "supported with mixture-of-experts"),
    ([*MIXTRAL, "--moe.top_k", "1"], "command line: --moe.top_k = 1: Mixtral's router renormalises"),
    ([*MIXTRAL, "--parallelism.expert_parallel_degree", "3"],
     "command line: --parallelism.expert_parallel_degree = 3 must divide num_experts (8) of mixtral debugmodel"),
    (["--parallelism.expert_parallel_degree", "2"], "command line: --parallelism.expert_parallel_degree = 2: "
                                                    "the model llama3 debugmodel is dense (no experts to split)"),
    ([*MIXTRAL, "--moe.grouped_mm", "--moe.capacity_factor", "1.25"],
     "command line: --moe.grouped_mm = true cannot be combined with [moe] capacity_factor = 1.25: "
     "sorted experts are dropless"),
    ([*MIXTRAL, "--moe.grouped_mm", "--parallelism.expert_parallel_degree", "2"],
     "command line: --moe.grouped_mm = true cannot be combined with [parallelism] expert_parallel_degree = 2"),
    ([*MIXTRAL, "--lora.rank", "8"], "command line: --lora.rank = 8: LoRA adapters for "
                                     "mixture-of-experts models (mixtral debugmodel) are not supported yet"),
    (["--moe.num_experts", "4", "--moe.moe_every", "2", "--checkpoint.last_save_in_hf"],
     "command line: --checkpoint.last_save_in_hf = true: a Llama model with MoE in one block of every 2"),
    ([*QWEN3_MOE, "--lora.rank", "8"], "command line: --lora.rank = 8: LoRA adapters for "
                                       "mixture-of-experts models (qwen3 debugmodel_moe) are not supported yet"),
    ([*DEEPSEEK, "--moe.expert_groups", "3"], "command line: --moe.expert_groups = 3: the 16 experts of "
                                              "deepseek_v3 debugmodel do not split into 3 groups of at least 2"),
    (["--model.name", "deepseek_v2", "--moe.expert_groups", "32"],
     "command line: --moe.expert_groups = 32: the 16 experts of deepseek_v2 debugmodel do not split into 32 "
     "groups of at least 1"),
    ([*DEEPSEEK, "--moe.topk_groups", "1", "--moe.top_k", "6"],
     "command line: --moe.top_k = 6: top_k (6) exceeds the 4 experts of the 1 group(s) a token may use"),
    ([*DEEPSEEK, "--moe.topk_groups", "5"], "command line: --moe.topk_groups = 5: topk_groups (5) must be in "
                                            "1..expert_groups (4)"),
    ([*DEEPSEEK, "--model.attention", "flash"], "command line: --model.attention = 'flash': the flash and splash "
                                                "kernels take values as wide as the queries and keys"),
    ([*MIXTRAL, "--moe.expert_groups", "2"], "command line: --moe.expert_groups = 2: group-limited routing is "
                                             "DeepSeek's (deepseek_v2, deepseek_v3); mixtral debugmodel routes over "
                                             "all its experts"),
    (["--model.flavor", "30B-A3B"], "command line: --model.flavor = '30B-A3B': unknown flavor for llama3; "
                                    "expected one of debugmodel, 8B, 70B, 405B, 1B, 3B (30B-A3B is a flavor of qwen3)"),
])
def test_bad_moe_settings_are_one_line_before_anything_is_built(flags, message, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_args(tiny_args(tmp_path, *flags))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)

