"""Training the Mixtral debug model (2 MoE blocks): every mesh gives one device's losses
(dropless), the experts carry the sharding asked for, resume is bit-exact, capacity mode drops
tokens and still learns, and bad MoE settings are one line before anything is built."""

import pytest
from helpers import tiny_args, train_many, train_run

from torchtitan_xla.config import ConfigError, parse_args

TWO_BLOCKS = {"n_layers": 2}
MIXTRAL = ["--model.name", "mixtral"]
# Only the order of floating-point reductions differs between meshes (tests/test_parallelisms.py).
MESH_RTOL = 2e-6


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe1")
    return train_many({"dropless": tiny_args(out, *MIXTRAL, "--training.local_batch_size", "8")},
                      devices=1, model_overrides=TWO_BLOCKS)


@pytest.fixture(scope="module")
def eight_devices(tmp_path_factory):
    out = tmp_path_factory.mktemp("moe8")
    runs = {"fsdp8": ["--training.local_batch_size", "1"],
            "fsdp4_tp2": ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2"]}
    return train_many({k: tiny_args(out, *MIXTRAL, *v) for k, v in runs.items()}, devices=8,
                      model_overrides=TWO_BLOCKS)


@pytest.mark.parametrize("mesh", ["fsdp8", "fsdp4_tp2"])
def test_moe_mesh_losses_equal_one_device(mesh, one_device, eight_devices):
    reference = one_device["dropless"]["losses"]
    assert reference.keys() == {1, 2, 3, 4, 5}
    for step, loss in reference.items():
        assert eight_devices[mesh]["losses"][step] == pytest.approx(loss, rel=MESH_RTOL), (mesh, step)


def test_experts_and_router_carry_the_requested_sharding(eight_devices):
    """Stacked experts [E, hidden, dim] / [E, dim, hidden]: tensor parallelism on the hidden dim as
    for the dense SwiGLU, FSDP on the largest dimension left; the router [E, dim] whole over tp."""
    params = eight_devices["fsdp4_tp2"]["params"]
    expected = {"w1": [None, "tp", "fsdp"], "w3": [None, "tp", "fsdp"], "w2": [None, "fsdp", "tp"],
                "router.weight": [None, "fsdp"]}
    for block in (0, 1):
        for name, spec in expected.items():
            p = params[f"layers.{block}.feed_forward.{name}"]
            assert p["partition_spec"] == spec, (block, name)
            assert p["actual"] == p["expected"] == p["exp_avg"], (block, name, p)


def test_moe_resumes_bit_exactly(tmp_path):
    """Model, optimizer and router state (the step's inputs all come back): resuming at step 3
    gives the uninterrupted run's losses exactly."""
    import shutil

    args = tiny_args(tmp_path, *MIXTRAL, "--training.steps", "6", "--checkpoint.enable",
                     "--checkpoint.interval", "3")
    straight, _ = train_run(args, model_overrides=TWO_BLOCKS)
    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    resumed, log = train_run(args, model_overrides=TWO_BLOCKS)
    assert "Resumed from" in log
    assert resumed == {s: straight[s] for s in (4, 5, 6)}


def test_capacity_mode_logs_its_drops_and_still_learns(tmp_path):
    """capacity_factor 0.5 keeps at most half of the top-2 choices: the log shows the drop rate
    (router `dropped: x%`), and the loss falls on the embedded corpus within 200 steps."""
    import re

    losses, log = train_run(tiny_args(tmp_path, *MIXTRAL, "--moe.capacity_factor", "0.5",
                                      "--training.steps", "200", "--metrics.log_freq", "20",
                                      "--lr_scheduler.warmup_steps", "20"),
                            model_overrides=TWO_BLOCKS, timeout=900)
    dropped = [float(x) for x in re.findall(r"dropped: ([0-9.]+)%", log)]
    assert len(dropped) == len(losses) and min(dropped) >= 40.0, dropped  # capacity: half the slots
    assert losses[200] < 0.8 * losses[1], losses


@pytest.mark.parametrize("flags, message", [
    (["--moe.top_k", "2"], "command line: --moe.top_k = 2: the model llama3 debugmodel is dense (no "
                           "experts); set [moe] num_experts, or use a mixtral flavor"),
    ([*MIXTRAL, "--moe.top_k", "9"], "command line: --moe.top_k = 9: top_k (9) cannot exceed "
                                     "num_experts (8) of mixtral debugmodel"),
    ([*MIXTRAL, "--float8.enable_float8_linear"], "command line: --float8.enable_float8_linear = true: "
                                                  "float8 is not supported with mixture-of-experts"),
    ([*MIXTRAL, "--compile.scan_layers"], "command line: --compile.scan_layers = true: scan is not "
                                          "supported with mixture-of-experts"),
    ([*MIXTRAL, "--moe.top_k", "1"], "command line: --moe.top_k = 1: Mixtral's router renormalises"),
    ([*MIXTRAL, "--lora.rank", "8"], "command line: --lora.rank = 8: LoRA adapters for "
                                     "mixture-of-experts models (mixtral debugmodel) are not supported yet"),
    (["--moe.num_experts", "4", "--moe.moe_every", "2", "--checkpoint.last_save_in_hf"],
     "command line: --checkpoint.last_save_in_hf = true: a model with MoE in one block of every 2"),
])
def test_bad_moe_settings_are_one_line_before_anything_is_built(flags, message, tmp_path):
    with pytest.raises(ConfigError) as e:
        parse_args(tiny_args(tmp_path, *flags))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)

