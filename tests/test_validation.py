"""[validation]: the held-out loss during training is the model's plain cross-entropy on the
validation batches (checked by hand, in float64, through the exported HF weights), the same on
fsdp=4 x tp=2, and never changes training or its resume."""

import pytest
import torch
from checkpoint_helpers import TWO_BLOCKS
from helpers import tiny_args, train_many

from torchtitan_xla.config import parse_args
from torchtitan_xla.errors import ConfigError

VALIDATION = ["--validation.enable", "--validation.freq", "3", "--validation.steps", "2"]
SINKS = ["--metrics.enable_tensorboard", "--metrics.enable_wandb", "--metrics.wandb_mode", "offline",
         "--metrics.wandb_run_name", "validated"]


def _args(folder, *extra):
    return tiny_args(folder, "--training.steps", "6", "--training.local_batch_size", "4", *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folders = {name: tmp_path_factory.mktemp(name) for name in ("plain", "validated", "mesh")}
    ckpt = ["--checkpoint.enable", "--checkpoint.interval", "3"]
    one = train_many({
        "plain": _args(folders["plain"]),
        "validated": _args(folders["validated"], *VALIDATION, *ckpt, *SINKS, "--checkpoint.last_save_in_hf"),
        # Resumed at step 3 from the validated run's checkpoint (its step-6-hf stays the first's).
        "resumed": _args(folders["validated"], *VALIDATION, *ckpt, "--checkpoint.load_step", "3"),
    }, devices=1, model_overrides=TWO_BLOCKS)
    mesh = train_many({"mesh": _args(folders["mesh"], *VALIDATION, "--training.local_batch_size", "1",
                                     "--parallelism.tensor_parallel_degree", "2")},
                      devices=8, model_overrides=TWO_BLOCKS)
    return {**one, **mesh}, folders


def test_validation_never_changes_training_and_resumes_exactly(runs):
    results, _ = runs
    plain, validated, resumed = (results[k] for k in ("plain", "validated", "resumed"))
    assert plain["losses"] == validated["losses"]  # bit for bit
    assert sorted(validated["validation"]) == [3, 6] and plain["validation"] == {}
    assert resumed["losses"] == {s: validated["losses"][s] for s in (4, 5, 6)}
    assert resumed["validation"] == {6: validated["validation"][6]}
    # The eval graph compiled once (its second trace found it cached), and training's two
    # compiles are unchanged; train.py's guard would have failed a later compile.
    assert validated["compiles"] - plain["compiles"] <= 2 + 1, (validated["compiles"], plain["compiles"])


def test_validation_loss_is_the_plain_cross_entropy_of_the_validation_batches(runs):
    """By hand: the HF export of step 6 in transformers, float64, on the same batches."""
    transformers = pytest.importorskip("transformers")
    from torchtitan_xla.datasets import build_data_loader, build_tokenizer
    from torchtitan_xla.validate import validation_config

    results, folders = runs
    cfg = parse_args(_args(folders["validated"], *VALIDATION))
    loader = build_data_loader(validation_config(cfg), build_tokenizer(""), batch_size=4,
                               infinite=False, drop_last=True)
    batches = [b for _, b in zip(range(2), loader)]
    loader.close()
    assert len(batches) == 2
    hf_dir = folders["validated"] / "checkpoint" / "step-6-hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True)
    hf = hf.double().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for inputs, labels in batches:
            logits = hf(inputs).logits
            losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
            total, count = total + losses.sum().item(), count + labels.numel()
    # float32 on XLA against float64 here.
    assert results["validated"]["validation"][6] == pytest.approx(total / count, rel=2e-6)
    # The training data's batches are not the validation batches.
    train_loader = build_data_loader(cfg, build_tokenizer(""), batch_size=4)
    first_train = next(iter(train_loader))[0]
    train_loader.close()
    assert not torch.equal(first_train, batches[0][0])


def test_validation_on_fsdp4_tp2_equals_one_device(runs):
    results, _ = runs
    one, mesh = results["validated"], results["mesh"]
    assert mesh["validation"].keys() == one["validation"].keys() == {3, 6}
    for step in (3, 6):  # only the order of sums differs
        assert mesh["validation"][step] == pytest.approx(one["validation"][step], rel=1e-5)


def _wandb_history(run_file) -> dict[int, dict[str, float]]:
    """The scalars of an offline W&B run, read from its run-*.wandb file. wandb (0.19+) ships no
    Python reader: the file is a LevelDB-style log (32 KiB blocks of records with a 7-byte header:
    crc, length, kind) of `Record` protobufs, which wandb does ship."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks, history = 7, 32768, [], {}
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero padding
            pos += left
            continue
        chunks.append(data[pos + 7:pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            if record.WhichOneof("record_type") == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item}
                history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
    return history


def test_wandb_and_tensorboard_hold_the_same_scalars_with_validation(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    results, folders = runs
    dump = folders["validated"]
    (run_file,) = (dump / "wandb").glob("offline-run-*/run-*.wandb")
    wandb = _wandb_history(run_file)
    (tb_dir,) = (dump / "tb").iterdir()
    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tb = {}
    for tag in acc.Tags()["scalars"]:
        for event in acc.Scalars(tag):
            tb.setdefault(event.step, {})[tag] = event.value
    assert sorted(wandb) == sorted(tb) == [1, 2, 3, 4, 5, 6]
    for step in tb:
        assert wandb[step].keys() == tb[step].keys(), step
        for tag, value in tb[step].items():  # TensorBoard stores float32
            assert value == pytest.approx(wandb[step][tag], rel=1e-6, abs=1e-6), (step, tag)
    validated = results["validated"]
    for step in (3, 6):
        assert wandb[step]["loss_metrics/validation_loss"] == validated["validation"][step]
        assert wandb[step]["loss_metrics/global_avg_loss"] == validated["losses"][step]
    assert "loss_metrics/validation_loss" not in wandb[4]


@pytest.mark.parametrize("argv,message", [
    (["--validation.enable", "--validation.steps", "0"],
     r"command line: --validation.steps = 0: must be -1 \(the whole split\) or a number of batches > 0"),
    (["--validation.steps", "-2"], r"--validation.steps = -2: must be >= -1"),
    (["--validation.dataset", "wiki"], r"--validation.dataset: expected one of"),
])
def test_bad_validation_config_is_one_line(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(argv)
