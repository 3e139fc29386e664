"""Pipeline parallelism: the debug model (8 blocks narrowed to dim 128, sdpa, float32) on pp=2 x fsdp=4,
pp=4 x fsdp=2 and pp=2 x fsdp=2 x tp=2, GPipe and circular, M = S and 2S microbatches, gives one device's losses; the
compiled step moves activations between stages by collective permutes (as many as the schedule's
iterations say) and gathers no stage weight across pp; checkpoints resume bit-exact and move
between pipelined and plain meshes under the per-layer names; bad settings are one line, exit 2."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from helpers import run_train, tiny_args, train_many

from torchtitan_xla.checkpoint import committed_steps
from torchtitan_xla.config import ConfigError, parse_args
from torchtitan_xla.parallelisms import MESH_AXES, ParallelDims
from torchtitan_xla.parallelisms.pipeline_parallel import Schedule

P = "--parallelism."
SEQ, DIM, GLOBAL = 64, 128, 16
# The debug model's 8 blocks (4 stages x 2 rounds need them) at half its width: a quarter of the
# matmul work, and the layouts, permutes and schedules are the same.
NARROW = {"dim": DIM, "n_heads": 8}
# Sixteen sequences per step on every mesh; no decay, so runs of different lengths share their lrs.
COMMON = ["--model.attention", "sdpa", "--training.global_batch_size", str(GLOBAL),
          "--lr_scheduler.decay_ratio", "0"]
CIRCULAR = [P + "pipeline_schedule", "circular"]
CHAT = ["--training.dataset", "python_docs_chat"]
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]
BLOCKWISE = ["--model.attention", "blockwise"]  # (the one-device references run sdpa)


def mesh(pp: int, tp: int = 1, micro: int | None = None, *extra: str) -> list[str]:
    """pp x fsdp x tp on 8 devices, the local batch making the global one, M microbatches."""
    dp = 8 // pp // tp
    return [P + "pipeline_parallel_degree", str(pp), P + "tensor_parallel_degree", str(tp),
            P + "pipeline_microbatches", str(micro or pp), "--training.local_batch_size", str(GLOBAL // dp),
            *extra]


# name: (args, mesh shape in MESH_AXES order, stages, microbatches, repeats). Each mesh (pp=2, pp=4,
# pp=2 x tp=2) runs each schedule (GPipe, circular) and M = S and M = 2S, in pairs, not in every triple.
MESHES = {
    "pp2_fsdp4": (mesh(2), (2, 1, 4, 1, 1, 1), 2, 2, 1),
    "pp2_fsdp4_circular_m4": (mesh(2, 1, 4, *CIRCULAR), (2, 1, 4, 1, 1, 1), 2, 4, 2),
    "pp4_fsdp2_m8": (mesh(4, 1, 8), (4, 1, 2, 1, 1, 1), 4, 8, 1),
    # (on packed conversations, whose positions and document ids travel with the activations, round
    # the circular schedule's wrap; with full activation checkpointing; blockwise attention, vmapped)
    "pp4_fsdp2_circular_chat_full_ac_blockwise": (
        mesh(4, 1, 4, *CIRCULAR, *CHAT, "--activation_checkpoint.mode", "full", *BLOCKWISE), (4, 1, 2, 1, 1, 1), 4, 4, 2),
    "pp2_fsdp2_tp2_m4_blockwise": (mesh(2, 2, 4, *BLOCKWISE), (2, 1, 2, 1, 1, 2), 2, 4, 1),
    # (with gradient accumulation: 2 steps of 8 sequences)
    "pp2_fsdp2_tp2_circular_accumulated": ([*mesh(2, 2, 2, *CIRCULAR), "--training.local_batch_size", "4"],
                                           (2, 1, 2, 1, 1, 2), 2, 2, 2),
}
# Only the order of floating-point sums differs between meshes (float32).
MESH_RTOL = 2e-6


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """One device: 6 steps saved at 3 and 6 and exported to HF; 5 steps of chat data."""
    out = tmp_path_factory.mktemp("pp1")
    runs = {"one": [*CKPT, "--training.steps", "6", "--checkpoint.last_save_in_hf"], "chat": CHAT}
    return out, train_many({k: tiny_args(out / k, *COMMON, "--training.local_batch_size", str(GLOBAL), *v)
                            for k, v in runs.items()}, devices=1, model_overrides=NARROW)


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    """Every mesh on 8 devices (each compiled step dumped); pp=2 x fsdp=4 saving at 3 and 6 and
    exporting to HF after its 6 steps, fsdp=8 saving at 3."""
    out = tmp_path_factory.mktemp("pp8")
    runs = {k: tiny_args(out / k, *COMMON, *v[0]) for k, v in MESHES.items()}
    runs["pp_saved"] = tiny_args(out / "pp_saved", *COMMON, *mesh(2), *CKPT, "--training.steps", "6",
                                 "--checkpoint.last_save_in_hf")
    runs["fsdp8_saved"] = tiny_args(out / "fsdp8_saved", *COMMON, "--training.local_batch_size", "2", *CKPT,
                                    "--training.steps", "3")
    return out, train_many(runs, devices=8, xla_dump=out / "xla", model_overrides=NARROW)


def _keep_only(folder: Path, source: Path, step: int) -> Path:
    shutil.copytree(source, folder)
    for s in committed_steps(folder / "checkpoint"):
        if s != step:
            shutil.rmtree(folder / "checkpoint" / f"step-{s}")
    return folder


@pytest.fixture(scope="module")
def resumed(eight_devices):
    """pp=2 x fsdp=4 resumed from its own step 3 (to 6), and on fsdp=8 (to 6); pp=2 x fsdp=4
    resumed from fsdp=8's step 3 (to 5)."""
    out, _ = eight_devices
    runs = {
        "pp_resumed": tiny_args(_keep_only(out / "r1", out / "pp_saved", 3), *COMMON, *mesh(2), *CKPT,
                                "--training.steps", "6"),
        "fsdp8_from_pp": tiny_args(_keep_only(out / "r2", out / "pp_saved", 3), *COMMON, *CKPT,
                                   "--training.local_batch_size", "2", "--training.steps", "6"),
        "pp_from_fsdp8": tiny_args(_keep_only(out / "r3", out / "fsdp8_saved", 3), *COMMON, *mesh(2), *CKPT),
    }
    return train_many(runs, devices=8, model_overrides=NARROW)


@pytest.mark.parametrize("name", MESHES)
def test_every_mesh_and_schedule_gives_one_devices_losses(name, one_device, eight_devices):
    """Each mesh, GPipe and circular (2 rounds), M = S and 2S, with full activation checkpointing,
    gradient accumulation and packed conversations, sdpa and blockwise attention: one device's
    (sdpa) losses on the same 16 sequences, step by step, and no compile after the first step."""
    reference = one_device[1]["chat" if "chat" in name else "one"]["losses"]
    run = eight_devices[1][name]
    assert set(run["losses"]) == {1, 2, 3, 4, 5}
    for step, loss in run["losses"].items():
        assert loss == pytest.approx(reference[step], rel=MESH_RTOL), (name, step)
    assert run["compiles"] <= 2  # init and the step: nothing recompiles


def test_resume_is_bit_exact_and_checkpoints_move_between_pp_and_fsdp(one_device, eight_devices, resumed):
    """A pipelined run resumed from its step 3 repeats its own losses exactly; the same checkpoint
    resumes on fsdp=8, and fsdp=8's step 3 on pp=2 x fsdp=4, each with one device's losses."""
    saved, reference = eight_devices[1]["pp_saved"]["losses"], one_device[1]["one"]["losses"]
    assert resumed["pp_resumed"]["losses"] == {s: saved[s] for s in range(4, 7)}
    for run, steps in (("fsdp8_from_pp", {4, 5, 6}), ("pp_from_fsdp8", {4, 5})):
        assert set(resumed[run]["losses"]) == steps
        for step, loss in resumed[run]["losses"].items():
            assert loss == pytest.approx(reference[step], rel=MESH_RTOL), (run, step)


def test_checkpoints_and_the_hf_export_use_the_per_layer_names(one_device, eight_devices):
    """The pipelined run's checkpoint holds `layers.N....` (and the optimizer state numbered as
    without pipelining), no stacked tensor; its HF export after 6 steps has the one-device export's
    tensors: the same names and shapes, equal values within float32 rounding. Saving and exporting
    compile one graph each for the per-layer views (the run's step is pp2_fsdp4's, compiled before
    it); fetched one tensor at a time, the export compiled 106 programs."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader

    out = eight_devices[0]
    assert eight_devices[1]["pp_saved"]["compiles"] <= 2
    names = set(FileSystemReader(str(out / "pp_saved" / "checkpoint" / "step-6")).read_metadata().state_dict_metadata)
    assert "model.layers.7.attention.wq.weight" in names and not [n for n in names if "stages" in n]
    # 1 embedding + 8 blocks x 9 tensors + norm + output, numbered in that order.
    assert {"optimizer.state.1.exp_avg", "optimizer.state.74.exp_avg_sq"} <= names
    assert "optimizer.state.75.exp_avg" not in names

    def export(folder: Path) -> dict:
        files = sorted((folder / "checkpoint" / "step-6-hf").glob("*.safetensors"))
        return {k: v for f in files for k, v in load_file(f).items()}

    pp, one = export(out / "pp_saved"), export(one_device[0] / "one")
    assert {k: v.shape for k, v in pp.items()} == {k: v.shape for k, v in one.items()}
    assert len([k for k in pp if ".layers." in k]) == 8 * 9
    for k, v in one.items():
        torch.testing.assert_close(pp[k], v, rtol=1e-5, atol=1e-5, msg=k)


def _step_ops(run: dict, shape: tuple[int, ...]):
    from torchtitan_xla.runtime.xla.compiled import collective_ops, collective_ops_on_mesh

    step = max(run["hlo"], key=lambda f: len(collective_ops(Path(f).read_text())))
    return collective_ops_on_mesh(Path(step).read_text(), shape, MESH_AXES)


def _dims(shape: str) -> list[int]:
    return [int(d) for d in re.findall(r"\[([0-9,]*)\]", shape)[0].split(",") if d]


@pytest.mark.parametrize("name", ["pp2_fsdp4", "pp2_fsdp4_circular_m4", "pp4_fsdp2_m8",
                                  "pp2_fsdp2_tp2_m4_blockwise"])
def test_the_step_permutes_activations_over_pp_and_gathers_no_stage_weight(name, eight_devices):
    """The compiled step's optimized HLO, per device: the activations move one stage on at every
    iteration but the first, forward and back (2 (M R + S - 1 - 1) collective permutes over the pp
    groups only, each one microbatch's [rows, seq / tp, dim] float32); the last stage's output is
    all-reduced over pp once per microbatch, and its gradient at the first stage once; nothing
    else crossing pp carries a block's weights: only the embedding's output entering the pipeline,
    the gradients of the weights outside it, activations XLA re-lays between the stages' devices,
    and scalars."""
    args, shape, stages, micro, repeats = MESHES[name]
    tp = shape[-1]
    dp = 8 // stages // tp
    rows = GLOBAL // dp // micro
    activation = [1, rows, SEQ // tp, DIM]
    iterations = micro * repeats + stages - 1
    crossing = [(kind, _dims(s), size, axes) for kind, size, s, axes in _step_ops(eight_devices[1][name], shape)
                if "pp" in axes]
    permutes = [c for c in crossing if c[0] == "collective-permute" and c[3] == {"pp"}]
    assert [c[1] for c in permutes] == [activation] * (2 * (iterations - 1)), permutes
    assert sum(c[2] for c in permutes) == 2 * (iterations - 1) * rows * SEQ // tp * DIM * 4
    outputs = [c for c in crossing if c[0] == "all-reduce" and c[1][-2:] == activation[-2:]]
    assert len(outputs) == 2 * micro, crossing
    rest = [c for c in crossing if c not in permutes and c not in outputs]
    vocab, outside = 2256, GLOBAL // dp // stages * SEQ  # tokens per device outside the pipeline
    for kind, dims, size, _ in rest:
        if size <= 2048:  # scalars, token ids, the final norm's weight
            continue
        if kind == "all-gather":  # only the embedding's output, entering the pipeline
            assert dims[-2:] == [SEQ // tp, DIM], (kind, dims, size)
        elif kind == "all-reduce":  # the gradients of the embedding and output weights (vocabulary rows)
            assert any(vocab % d == 0 and d > DIM for d in dims), (kind, dims, size)
        else:  # activations re-laid between devices of the stages by XLA: [.., rows, seq, dim] (/ tp)
            assert kind in ("collective-permute", "all-to-all"), (kind, dims, size)
            assert (dims == [outside, DIM // tp] or (len(dims) >= 3 and dims[-2] in (SEQ, SEQ // tp)
                                                      and dims[-1] in (1, DIM, DIM // tp))), (kind, dims, size)


def test_the_schedule_runs_every_microbatch_round_once_per_stage_in_order():
    """Stage s runs work item w at iteration w + s; round r > 0 of a microbatch enters stage 0 just
    as the last stage finishes round r - 1; the idle iterations are (S-1) / (M R + S - 1)."""
    for stages, micro, repeats in ((2, 2, 1), (2, 3, 1), (4, 8, 1), (2, 4, 2), (4, 8, 3)):
        sched = Schedule(stages, micro, repeats)
        assert sched.iterations == micro * repeats + stages - 1
        for s in range(stages):
            done = [sched.work(t, s) for t in range(sched.iterations)]
            items = [w for w in done if w is not None]
            assert sorted(items) == sorted((m, r) for m in range(micro) for r in range(repeats))
            assert done.count(None) == stages - 1
            for t, w in enumerate(done):
                if w is not None and s > 0:
                    assert sched.work(t - 1, s - 1) == w  # from the previous stage, one iteration on
                elif w is not None and w[1] > 0:
                    assert sched.work(t - 1, stages - 1) == (w[0], w[1] - 1)
        assert sched.bubble == pytest.approx((stages - 1) / (micro * repeats + stages - 1))
    assert Schedule(4, 8, 1).bubble == pytest.approx(3 / 11) and Schedule(4, 8, 2).bubble == pytest.approx(3 / 19)


DEBUG = ["--job.config_file", "train_configs/debug_model.toml"]
SDPA = [*DEBUG, "--model.attention", "sdpa"]


def _dims_of(*args: str, devices: int = 8) -> ParallelDims:
    return ParallelDims.from_config(parse_args([*SDPA, *args]).parallelism, devices)


def test_pp_is_the_slice_axis_with_pipeline_stages(monkeypatch):
    """With pipeline parallelism the slices are the outer part of `pp` (only activations cross the
    data-centre network); pp must then be a multiple of the slices."""
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    calls = {}
    monkeypatch.setattr(xs, "HybridMesh", lambda **kw: calls.update(kw) or "mesh")
    monkeypatch.setattr(xr, "global_runtime_device_attributes",
                        lambda: [{"slice_index": i // 4} for i in range(8)])
    dims = _dims_of(P + "pipeline_parallel_degree", "2", P + "num_slices", "2")
    assert dims.build_mesh("TPU") == "mesh"
    assert calls == dict(ici_mesh_shape=(1, 1, 4, 1, 1, 1), dcn_mesh_shape=(2, 1, 1, 1, 1, 1), axis_names=MESH_AXES)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_degree \(2\) must be a multiple of num_slices \(4\)"):
        _dims_of(P + "pipeline_parallel_degree", "2", P + "num_slices", "4")


@pytest.mark.parametrize("args, message", [
    ([*SDPA, P + "pipeline_parallel_degree", "2", P + "pipeline_schedule", "circular",
      P + "pipeline_microbatches", "3"],
     "command line: --parallelism.pipeline_microbatches = 3 must be a multiple of pipeline_parallel_degree (2) "
     "in the circular schedule: microbatches go round the stages in groups of 2"),
    ([*DEBUG, P + "pipeline_parallel_degree", "2", "--model.attention", "flash"],
     "command line: --model.attention = 'flash' cannot run with pipeline parallelism "
     "(command line: --parallelism.pipeline_parallel_degree = 2): use sdpa or blockwise"),
    ([*SDPA, P + "pipeline_parallel_degree", "2", "--optimizer.name", "Muon"],
     "command line: --optimizer.name = 'Muon' cannot run with pipeline parallelism (command line: "
     "--parallelism.pipeline_parallel_degree = 2): its update reads each weight matrix whole, and a stage's "
     "are stacked; use AdamW, Adam or Lion"),
])
def test_bad_pipeline_settings_are_one_line_at_parse_time(args, message):
    """Each names where the keys were set (the config file or the command line)."""
    with pytest.raises(ConfigError) as e:
        parse_args(args)
    assert str(e.value) == message


def test_batch_and_depth_that_do_not_fit_the_schedule_are_one_line():
    dims = _dims_of(P + "pipeline_parallel_degree", "4", P + "pipeline_schedule", "circular",
                    P + "pipeline_microbatches", "8", "--model.attention", "sdpa")
    with pytest.raises(ConfigError) as e:
        dims.check_model(16, 16, 256, 768, n_layers=12)
    assert str(e.value) == ("[parallelism] pipeline_parallel_degree (4) x pipeline_repeats (2) must divide the "
                            "model's n_layers (12): every stage holds as many layers")
    with pytest.raises(ConfigError) as e:
        dims.check_batch(16, 4, 64, 1)
    assert str(e.value) == ("[parallelism] pipeline_microbatches (8) must divide [training] local_batch_size (4): "
                            "each microbatch takes the same share of every data-parallel rank's sequences")


def test_a_depth_the_stages_cannot_share_fails_through_train_py_with_exit_2(tmp_path):
    """n_layers 8 over 4 stages x 3 rounds: one line naming the keys, exit 2, before any compile."""
    run = run_train(tiny_args(tmp_path, "--model.attention", "sdpa", "--training.local_batch_size", "4",
                              P + "pipeline_parallel_degree", "4", P + "pipeline_schedule", "circular",
                              P + "pipeline_repeats", "3"), devices=8)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1] == (
        "error: command line: --parallelism.pipeline_parallel_degree (4) x pipeline_repeats (3) must divide "
        "the model's n_layers (8): every stage holds as many layers (pipeline_repeats from the command line)")
