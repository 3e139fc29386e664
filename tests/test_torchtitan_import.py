"""A step folder torchtitan wrote for its Llama 3 loads as initial weights (checkpoint/torchtitan.py):
the folders here are written with plain torch.distributed.checkpoint in torchtitan's layouts, from
the weights of the checkpoint tests' shared run (conftest.py's `straight`), and each first step's
loss is that of the run started from the same weights' HuggingFace export.

torchtitan's layouts (pytorch/torchtitan, torchtitan/components/checkpoint.py): no commit record,
only DCP's `.metadata`; model keys at the top level (model-only saves always; full checkpoints since
July 2025) or under `model.` (full checkpoints before); `optimizer`, `lr_scheduler`, `dataloader`
and `train_state` entries beside them in a full checkpoint; `freqs_cis` saved until June 2025;
`attention.qkv_linear.wq` and `lm_head` since April 2026.
"""

import dataclasses
import pickle
import re
import shutil

import pytest
import torch
from checkpoint_helpers import TWO_BLOCKS, args
from helpers import run_train, tiny_args, train_many

from torchtitan_xla.checkpoint import COMMIT_FILE, read_model_state
from torchtitan_xla.config import ConfigError


def _save(state: dict, folder) -> str:
    import torch.distributed.checkpoint as dcp

    from torchtitan_xla.checkpoint.commit import quiet_dcp, writer

    quiet_dcp()  # DCP's warning that there is no process group
    # The project's writer: DCP's own overlapping loader breaks once torchax (scan) has registered
    # its device module in this process, as another test does.
    dcp.save(state, storage_writer=writer(str(folder)), no_dist=True)
    return str(folder)


def _freqs_cis(args) -> torch.Tensor:
    """torchtitan's RoPE table (complex64, [positions, head_dim / 2]), a persistent buffer until 2025."""
    d = args.head_dim
    freqs = 1.0 / (args.rope_theta ** (torch.arange(0, d, 2).float() / d))
    return torch.polar(torch.ones(args.max_seq_len, d // 2), torch.outer(torch.arange(args.max_seq_len).float(), freqs))


def _renamed_2026(name: str) -> str:
    """torchtitan's Llama 3 names since April 2026."""
    name = re.sub(r"^(layers\.\d+\.attention\.)(w[qkv]\.)", r"\1qkv_linear.\2", name)
    return re.sub(r"^output\.", "lm_head.", name)


def _training_entries(keys: list[str], state: dict, step: int = 6) -> dict:
    """What a torchtitan full checkpoint holds beside the model: AdamW's state flattened by
    parameter name (flatten_optimizer_state_dict), the LR schedule, each data-parallel rank's
    pickled loader state, and the trainer's step and token count."""
    group = {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "amsgrad": False,
             "maximize": False, "foreach": None, "capturable": False, "differentiable": False, "fused": None}
    optimizer = {"state": {k: {"step": torch.tensor(float(step)), "exp_avg": torch.full_like(v, 0.5),
                               "exp_avg_sq": torch.full_like(v, 0.25)} for k, v in zip(keys, state.values())},
                 "param_groups": {k: dict(group) for k in keys}}
    schedule = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]),
                                                 lambda s: 1.0)
    return {"optimizer": optimizer, "lr_scheduler": schedule.state_dict(),
            "dataloader": {"dp_rank_0": pickle.dumps({"sample_idx": 48}), "world_size": 1},
            "train_state": {"step": step, "ntokens_seen": step * 8 * 64}}


@pytest.fixture(scope="module")
def weights(straight):
    """The run's step-6 weights on the host (its HuggingFace export holds the same, bit for bit:
    test_hf_export.py) and their ModelArgs."""
    return read_model_state(straight[0] / "checkpoint" / "step-6")


@pytest.fixture(scope="module")
def titan(weights, tmp_path_factory):
    """torchtitan step folders of those weights: `model_only` (a model-only save with the RoPE
    table, as torchtitan's convert_llama_to_dcp.py wrote Meta's weights until June 2025), `full`
    (a full training checkpoint of today's torchtitan: model keys at the top level, its 2026
    names), `full_2025` (a full checkpoint before July 2025: model keys under `model.`, with
    `model.freqs_cis`)."""
    state, args = weights
    root = tmp_path_factory.mktemp("torchtitan")
    renamed = {_renamed_2026(k): v for k, v in state.items()}
    return {
        "model_only": _save({**state, "freqs_cis": _freqs_cis(args)}, root / "model_only" / "step-0"),
        "full": _save({**renamed, **_training_entries(list(renamed), state)}, root / "full" / "step-6"),
        "full_2025": _save({"model": {**state, "freqs_cis": _freqs_cis(args)},
                            **_training_entries(list(state), state)}, root / "full_2025" / "step-6"),
    }


@pytest.fixture(scope="module")
def loaded(straight, titan, tmp_path_factory):
    """One step from each folder of the same weights (in one process): the run's HF export, its own
    step-6 checkpoint and each torchtitan layout."""
    folder = straight[0] / "checkpoint"
    root = tmp_path_factory.mktemp("loaded")
    sources = {"hf": [str(folder / "step-6-hf"), "--checkpoint.initial_load_in_hf"],
               "ours": [str(folder / "step-6")]} | {name: [path] for name, path in titan.items()}
    return train_many({name: args(root / name, "--training.steps", "1", "--checkpoint.initial_load_path", *flags)
                       for name, flags in sources.items()}, devices=1, model_overrides=TWO_BLOCKS)


def test_every_folder_starts_with_the_loss_of_the_same_weights_from_hf(straight, titan, loaded):
    """Bit-equal first-step losses (the same weights, graph and data: no tolerance), from this
    project's checkpoint and from each torchtitan layout as from the HF export (whose import
    round trip: test_hf_export.py)."""
    from_hf = loaded["hf"]["losses"]
    assert from_hf[1] < straight[1][1]  # trained weights, not the initialisation
    assert any("Initial weights loaded from" in line and "(HuggingFace)" in line for line in loaded["hf"]["log"])
    assert loaded["ours"]["losses"] == from_hf
    for name in titan:
        log = loaded[name]["log"]
        assert any(f"Initial weights loaded from {titan[name]} (torchtitan)" in line for line in log), (name, log)
        assert loaded[name]["losses"] == from_hf, name
        assert not [line for line in log if "torch/distributed/checkpoint/" in line], name  # no DCP warning


def test_the_model_keys_of_each_layout(weights, titan, straight, tmp_path):
    """Only the model's tensors are read, under the name each layout gives them; a step folder of
    this project is told apart by its commit record, even one killed before it (refused)."""
    from torchtitan_xla.checkpoint.torchtitan import model_keys

    state, _ = weights
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    assert model_keys(titan["model_only"], shapes) == {k: k for k in state}
    assert model_keys(titan["full"], shapes) == {k: _renamed_2026(k) for k in state}
    assert model_keys(titan["full"], shapes)["layers.1.attention.wk.weight"] == "layers.1.attention.qkv_linear.wk.weight"
    assert model_keys(titan["full_2025"], shapes) == {k: f"model.{k}" for k in state}
    # torchtitan's fused QKV as it saved it between April and June 2026: not read, one line.
    fused = {k: v for k, v in state.items() if ".attention.w" not in k or ".attention.wo." in k}
    fused |= {f"layers.{i}.attention.qkv_linear.wqkv.weight": torch.zeros(1) for i in range(2)}
    with pytest.raises(ConfigError, match=r": a torchtitan checkpoint without layers\.0\.attention\.wq\.weight "
                                          r"\(6 of this model's 21 tensors are not in it"):
        model_keys(_save(fused, tmp_path / "fused" / "step-1"), shapes)
    ours = straight[0] / "checkpoint" / "step-6"
    assert model_keys(str(ours), shapes) is None  # this project's: its COMMITTED record decides
    # Killed before its record: its keys are `model.` ones, with no torchtitan loader state.
    killed = shutil.copytree(ours, tmp_path / "killed" / "step-6")
    (killed / COMMIT_FILE).unlink()
    with pytest.raises(ConfigError, match=r"no COMMITTED record .* and no \.metadata with torchtitan's"):
        model_keys(str(killed), shapes)


def _error_line(folder, tmp_path) -> str:
    r = run_train(tiny_args(tmp_path, "--checkpoint.initial_load_path", str(folder)))
    assert r.returncode == 2 and r.losses == {}, r.stderr[-2000:]
    return r.stderr.strip().splitlines()[-1]


def test_a_folder_of_neither_layout_is_one_line(tmp_path):
    folder = tmp_path / "not_a_checkpoint"
    _save({"weights": {"w": torch.zeros(2)}}, folder)  # DCP, but none of a Llama's keys
    assert _error_line(folder, tmp_path / "run") == (
        f"error: command line: --checkpoint.initial_load_path: {folder} is not a usable checkpoint: "
        f"no COMMITTED record (this project's checkpoints) and no .metadata with torchtitan's model "
        f"keys (a torchtitan step folder)")


def test_a_torchtitan_checkpoint_of_another_size_is_one_line_naming_the_key(weights, tmp_path):
    from torchtitan_xla.models.llama import Transformer

    _, args = weights
    other = Transformer(dataclasses.replace(args, dim=128, n_heads=8)).state_dict()
    folder = _save(other, tmp_path / "small" / "step-0")
    assert _error_line(folder, tmp_path / "run") == (
        f"error: command line: --checkpoint.initial_load_path: {folder}: a torchtitan checkpoint of "
        f"another model: tok_embeddings.weight is [2256, 128], this model's tok_embeddings.weight is "
        f"[2256, 256] (check [model] flavor and the tokenizer's vocabulary)")
