"""LoRA: the adapted model against peft's LoRA on transformers' Llama (float64), the exports (a PEFT
folder peft loads, the merged HF model), and training that touches only the adapters, on one
device and on fsdp x tp, from an exported HF checkpoint."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import TWO_BLOCKS
from helpers import REPO, hf_rope, rmsnorm_in_input_dtype, tiny_args, train_many

from torchtitan_xla.checkpoint import read_model_state
from torchtitan_xla.config.job_config import LoRA
from torchtitan_xla.lora import apply_lora, init_adapters, is_adapter

ALPHA, RANK = 12.0, 4


def test_adapted_model_equals_peft_and_the_exports_load(tmp_path, monkeypatch):
    """A fixed, non-zero adapter: our logits equal peft's LoRA on LlamaForCausalLM built from the
    exported base and the exported PEFT folder, in float64; the merged export is base + (alpha/r) B A
    and computes the same logits as a plain LlamaForCausalLM."""
    import peft
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    from torchtitan_xla.checkpoint.hf import export_hf, export_peft
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer

    args = get_model_args("llama3", "debugmodel", vocab_size=300, max_seq_len=32, n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args).double()
    model.init_weights()
    cfg = LoRA(rank=RANK, alpha=ALPHA, target_modules=["wq", "wk", "wv", "wo", "w1", "w2", "w3"])
    apply_lora(model, cfg)
    model.double()
    init_adapters(model)
    with torch.no_grad():  # B starts at zero: give it values, so the adapters change the output
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(std=0.05)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    base = {k: v for k, v in state.items() if not is_adapter(k)}
    lora = {"rank": RANK, "alpha": ALPHA, "dropout": 0.0}
    export_hf(base, args, tmp_path / "base", dtype=torch.float64)
    export_peft(state, args, lora, tmp_path / "adapter", dtype=torch.float64)
    export_hf(state, args, tmp_path / "merged", dtype=torch.float64, lora=lora)

    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                               "up_proj", "down_proj"])
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (RANK, ALPHA, "LORA")

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "base"), dtype=torch.float64, attn_implementation="sdpa").eval()
    hf_rope(model, hf)
    adapted = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    assert sum(n.endswith("lora_A.default.weight") for n, _ in adapted.named_parameters()) == 2 * 7
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, theirs = model(tokens), adapted(tokens).logits
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)
    assert (ours - model.output(model.hidden_states(tokens))).abs().max() == 0

    # Merged = base + (alpha / r) B A, in HF's names and layout, from the two exported folders.
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    base_hf = load_file(str(tmp_path / "base" / "model.safetensors"))
    adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert merged.keys() == base_hf.keys()
    folded = 0
    for name, w in base_hf.items():
        a = adapter.get(f"base_model.model.{name.removesuffix('.weight')}.lora_A.weight")
        if a is None:
            assert torch.equal(merged[name], w), name
            continue
        b = adapter[f"base_model.model.{name.removesuffix('.weight')}.lora_B.weight"]
        torch.testing.assert_close(merged[name], w + ALPHA / RANK * (b @ a), rtol=0, atol=1e-15)
        folded += 1
    assert folded == 2 * 7
    plain = LlamaForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float64, attn_implementation="sdpa").eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(tokens).logits, theirs, rtol=0, atol=1e-12)


# ---- training ------------------------------------------------------------------------------------

# Only the order of floating-point reductions differs between meshes (as tests/test_parallelisms.py).
MESH_RTOL = 2e-6
# On packed chat data (positions and document ids sharded with the batch).
LORA_ARGS = ["--training.dataset", "python_docs_chat", "--training.seq_len", "256",
             "--lora.rank", "4", "--lora.alpha", "8", "--optimizer.lr", "3e-3",
             "--checkpoint.enable", "--checkpoint.interval", "5", "--checkpoint.last_save_in_hf"]


def _from_hf(straight) -> list[str]:
    """The shared run's HF export, relative to the working directory (which the training process
    inherits), as a user types it: the PEFT export must still name it absolutely."""
    folder, _, _ = straight
    return ["--checkpoint.initial_load_path", os.path.relpath(folder / "checkpoint" / "step-6-hf"),
            "--checkpoint.initial_load_in_hf"]


@pytest.fixture(scope="module")
def lora_runs(straight, tmp_path_factory):
    """5 LoRA steps on the embedded chat set from the shared run's HF export, on one device and on
    fsdp=4 x tp=2:
    {mesh: (folder, train_many's result)}."""
    runs = {}
    # The same global batch of 8 sequences: 2 microbatches of 4 on one device, 4 ranks x 2.
    for mesh, devices, extra in (
            # With full activation checkpointing (torch_xla's reentrant checkpoint) on one device.
            ("1 device", 1, ["--training.local_batch_size", "4", "--training.global_batch_size", "8",
                             "--activation_checkpoint.mode", "full"]),
            ("fsdp4 x tp2", 8, ["--training.local_batch_size", "2",
                                "--parallelism.tensor_parallel_degree", "2"])):
        folder = tmp_path_factory.mktemp(mesh.replace(" ", ""))
        result = train_many({mesh: tiny_args(folder, *LORA_ARGS, *_from_hf(straight), *extra)},
                            devices=devices, model_overrides=TWO_BLOCKS)
        runs[mesh] = folder, result[mesh]
    return runs


def test_lora_trains_only_the_adapters_with_the_same_losses_on_every_mesh(lora_runs, straight):
    from torchtitan_xla.checkpoint.hf import read_hf_state_dict
    from torchtitan_xla.models.llama.state_dict_adapter import from_hf

    (_, one), (folder8, eight) = lora_runs["1 device"], lora_runs["fsdp4 x tp2"]
    assert one["losses"].keys() == {1, 2, 3, 4, 5}
    for step, loss in one["losses"].items():
        assert eight["losses"][step] == pytest.approx(loss, rel=MESH_RTOL), step
    assert one["losses"][5] != one["losses"][1]  # it trained
    # (No recompile after warm-up: the runs' CompileGuard stops a run at one, [debug] on_recompile.)
    for r in (one, eight):
        for name, p in r["params"].items():
            # Optimizer state exists for the adapters only.
            assert (("exp_avg" in p) == is_adapter(name)), name
    # The adapters' sharding on fsdp x tp: B [out, 4] split over tp like the layer's output, A
    # [4, in] like its input; FSDP takes the largest dimension left that 4 divides.
    params = eight["params"]
    assert params["layers.0.attention.wq.lora_B.weight"]["partition_spec"] == ["tp", "fsdp"]
    assert params["layers.0.attention.wq.lora_A.weight"]["partition_spec"] == [None, "fsdp"]
    assert params["layers.0.attention.wo.lora_A.weight"]["partition_spec"] == ["fsdp", "tp"]
    assert params["layers.0.feed_forward.w2.lora_B.weight"]["partition_spec"] == ["fsdp", None]
    for name, p in params.items():
        assert p["actual"] == p["expected"], name
    # The base weights leave training bit-identical to the HF weights they started from.
    _, model_args = read_model_state(folder8 / "checkpoint" / "step-5")
    base = from_hf(read_hf_state_dict(straight[0] / "checkpoint" / "step-6-hf"), model_args)
    state, _ = read_model_state(folder8 / "checkpoint" / "step-5")
    assert sorted(k for k in state if not is_adapter(k)) == sorted(base)
    for name, w in base.items():
        assert torch.equal(state[name], w), name
    assert any(not torch.equal(state[k], torch.zeros_like(state[k])) for k in state
               if k.endswith("lora_B.weight"))


def test_lora_exports_a_peft_folder_and_merged_weights_after_training(lora_runs):
    """The exports written after the last step agree with the checkpoint of that step."""
    from safetensors.torch import load_file

    from torchtitan_xla.lora import merge
    from torchtitan_xla.models.llama.state_dict_adapter import to_hf

    folder, _ = lora_runs["1 device"]
    state, model_args = read_model_state(folder / "checkpoint" / "step-5")
    assert json.loads((folder / "checkpoint" / "step-5" / "lora.json").read_text())["alpha"] == 8.0
    adapter = load_file(str(folder / "checkpoint" / "step-5-peft" / "adapter_model.safetensors"))
    expected = to_hf({k: v for k, v in state.items() if is_adapter(k)}, model_args)
    assert adapter.keys() == {f"base_model.model.{k}" for k in expected}
    assert all(torch.equal(adapter[f"base_model.model.{k}"], v) for k, v in expected.items())
    merged = load_file(str(folder / "checkpoint" / "step-5-hf" / "model.safetensors"))
    assert merged.keys() == to_hf(merge(state, 8.0), model_args).keys()
    for k, v in to_hf(merge(state, 8.0), model_args).items():
        assert torch.equal(merged[k], v), k


def test_the_peft_export_loads_with_its_base_from_any_working_directory(lora_runs, straight, tmp_path,
                                                                       monkeypatch):
    """adapter_config.json names the HF folder the run started from (given relative) by its
    absolute path: AutoPeftModelForCausalLM loads the adapter folder alone from another working
    directory, and computes the merged export's logits."""
    import peft
    from transformers import AutoModelForCausalLM

    folder, _ = lora_runs["1 device"]
    adapter_dir = folder / "checkpoint" / "step-5-peft"
    monkeypatch.chdir(tmp_path)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    base = config["base_model_name_or_path"]
    assert Path(base).is_absolute() and Path(base).is_dir(), base
    assert Path(base).samefile(straight[0] / "checkpoint" / "step-6-hf")
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8.0, 0.0)  # LORA_ARGS
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter_dir)).eval()
    merged = AutoModelForCausalLM.from_pretrained(str(folder / "checkpoint" / "step-5-hf")).eval()
    tokens = torch.randint(0, 2256, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        # float32: W x + (alpha/r) B A x against (W + (alpha/r) B A, folded in float64) x (measured 1.2e-6).
        torch.testing.assert_close(adapted(tokens).logits, merged(tokens).logits, rtol=0, atol=1e-5)


def test_convert_to_hf_writes_the_training_exports_peft_config(lora_runs, straight, tmp_path):
    """scripts/convert_to_hf.py --peft with --base-model (relative to its working directory)
    writes the adapter_config.json the run wrote, the base's absolute path included."""
    folder, _ = lora_runs["1 device"]
    base = os.path.relpath(straight[0] / "checkpoint" / "step-6-hf", tmp_path)
    p = subprocess.run([sys.executable, str(REPO / "scripts/convert_to_hf.py"),
                        str(folder / "checkpoint" / "step-5"), "hf", "--tokenizer", "", "--peft", "peft",
                        "--base-model", base],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    written = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert written == json.loads((folder / "checkpoint" / "step-5-peft" / "adapter_config.json").read_text())
    assert (tmp_path / "hf" / "config.json").read_bytes() == (folder / "checkpoint" / "step-5-hf" /
                                                               "config.json").read_bytes()


@pytest.mark.parametrize("flags, message", [
    (["--lora.target_modules", "wq,q_proj"],
     "command line: --lora.target_modules: expected one of wq, wk, wv, wo, w1, w2, w3, got 'q_proj'"),
    (["--float8.enable_float8_linear"],
     "command line: --lora.rank = 4: LoRA cannot be combined with [float8] enable_float8_linear = true"),
    (["--lora.dropout", "0.1"],
     "command line: --lora.dropout = 0.1 needs [compile] step = \"lazy\""),
])
def test_bad_lora_settings_are_one_line_before_anything_runs(flags, message, tmp_path):
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_args(tiny_args(tmp_path, "--lora.rank", "4", *flags))
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_lora_checkpoint_as_initial_weights_is_one_line(lora_runs, tmp_path):
    """Its adapters would be dropped silently: the run stops before training, exit 2."""
    from helpers import run_train

    folder, _ = lora_runs["1 device"]
    r = run_train(tiny_args(tmp_path, "--checkpoint.initial_load_path", str(folder / "checkpoint" / "step-5"),
                            "--lora.rank", "4"), env=None)
    assert r.returncode == 2 and r.losses == {}
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: command line: --checkpoint.initial_load_path: {folder / 'checkpoint' / 'step-5'} holds "
        f"LoRA adapters; "
        f"start from its merged weights instead (scripts/convert_to_hf.py, then initial_load_in_hf = true), "
        f"or resume it as a checkpoint")


def test_the_plan_counts_gradients_and_optimizer_state_for_the_adapters_only():
    """`--plan` for the 8B LoRA recipe: gradients and Adam's two moments of the adapters alone,
    sharded over the 8 chips; the frozen base weights cost their float32 shard only."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.parallelisms import ParallelDims
    from torchtitan_xla.plan import memory

    cfg = parse_args(["--job.config_file", "train_configs/llama3_8b_lora.toml"])
    dims = ParallelDims.from_config(cfg.parallelism, 8)
    mem = memory.estimate(cfg, dims)
    r, dim, kv, ffn, layers = 16, 4096, 1024, 14336, 32
    per_layer = r * ((dim + dim) * 2 + (dim + kv) * 2 + (dim + ffn) * 3)  # wq wo, wk wv, w1 w2 w3
    adapters = layers * per_layer
    assert mem.gradients == adapters * 4 // 8
    assert mem.optimizer == 2 * mem.gradients
    full = memory.estimate(parse_args(["--job.config_file", "train_configs/llama3_8b_lora.toml",
                                       "--lora.rank", "0"]), dims)
    assert mem.parameters == full.parameters + adapters * 4 // 8
    assert full.gradients == full.parameters


def test_flops_per_token_count_no_weight_gradient_for_frozen_weights():
    """MFU's model FLOPs under LoRA: 4 per frozen non-embedding weight (forward, input gradient),
    6 per adapter weight, plus attention's."""
    from torchtitan_xla.lora import frozen_matmul_params
    from torchtitan_xla.metrics import num_flops_per_token
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer

    args = get_model_args("llama3", "debugmodel", vocab_size=2256, max_seq_len=256)
    with torch.device("meta"):
        model = Transformer(args)
    base = model.num_params(exclude_embedding=True)
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 256
    assert num_flops_per_token(args, base, 256, frozen=frozen_matmul_params(model)) == 6 * base + attention
    apply_lora(model, LoRA(rank=RANK, target_modules=["wq", "wo"]))
    adapters = args.n_layers * RANK * 4 * args.dim  # wq and wo: dim -> dim, A and B each r x dim
    assert frozen_matmul_params(model) == base
    flops = num_flops_per_token(args, model.num_params(exclude_embedding=True), 256,
                                frozen=frozen_matmul_params(model))
    assert flops == 4 * base + 6 * adapters + attention


def test_evaluating_a_lora_checkpoint_equals_evaluating_its_merged_export(lora_runs, tmp_path):
    """`python -m torchtitan_xla.eval` on the LoRA run's checkpoint (adapters merged on load, from
    lora.json) scores as on the merged HF export."""
    import subprocess
    import sys

    from helpers import REPO, _env

    folder, _ = lora_runs["1 device"]
    task = tmp_path / "ppl.jsonl"
    task.write_text("".join(json.dumps({"text": t}) + "\n" for t in (
        "What does the Python reference say about the assert statement?",
        "Assert statements are a convenient way to insert debugging assertions into a program.")))
    scores = []
    for name, weights in (("checkpoint", "step-5"), ("merged", "step-5-hf")):
        out = tmp_path / name
        p = subprocess.run([sys.executable, "-m", "torchtitan_xla.eval",
                            *tiny_args(out, "--training.seq_len", "256"),
                            "--eval.checkpoint", str(folder / "checkpoint" / weights),
                            "--eval.tasks", f"perplexity:{task}", "--eval.batch_size", "2"],
                           capture_output=True, text=True, env=_env(1, None), cwd=REPO, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        scores.append(json.loads((out / "eval_results.json").read_text())["samples"])
    (task_name, checkpoint), = scores[0].items()
    for (ll, _), (ll_merged, _) in zip(checkpoint, scores[1][task_name], strict=True):
        assert ll == pytest.approx(ll_merged, rel=1e-6, abs=1e-6)
