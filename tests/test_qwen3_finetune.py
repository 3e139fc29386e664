"""Fine-tuning Qwen3 as a user does: a Qwen-style tokenizer.json with ChatML's tokens (trained here
from the embedded corpus), a short pre-training of Qwen3's debug model exported to HuggingFace, then
full SFT and LoRA on the embedded chat set rendered as ChatML, from that export: the held-out masked
loss falls, and the PEFT export loads in peft and computes the merged export's logits."""

import json

import pytest
import torch
from checkpoint_helpers import TWO_BLOCKS
from data_helpers import train_qwen_style_tokenizer
from helpers import chat_finetune_jobs, tiny_args, train_many

QWEN3 = ["--model.name", "qwen3", "--model.flavor", "debugmodel"]


@pytest.fixture(scope="module")
def qwen3_runs(tmp_path_factory):
    """In one process: 6 steps of pre-training exported to HF, then 30 steps of SFT and of LoRA
    (rank 8) from that export with validation on the held-out topics every 10."""
    out = tmp_path_factory.mktemp("qwen3")
    tokenizer = train_qwen_style_tokenizer(out / "tokenizer")
    return out, train_many(chat_finetune_jobs(out, QWEN3, tokenizer, "1e-3", "2e-2"), devices=1,
                           model_overrides=TWO_BLOCKS)


@pytest.mark.parametrize("kind", ["sft", "lora"])
def test_qwen3_fine_tuning_lowers_the_held_out_masked_loss(kind, qwen3_runs):
    """ChatML-rendered conversations, only the assistant's tokens counted: the training loss falls
    and the loss on the held-out topics falls at every validation."""
    out, runs = qwen3_runs
    losses, validation = runs[kind]["losses"], runs[kind]["validation"]
    assert sorted(validation) == [10, 20, 30]
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(26, 31)) / 5
    assert last < 0.9 * first, (kind, first, last)
    assert validation[30] < validation[20] < validation[10], (kind, validation)
    if kind == "lora":  # only the adapters have optimizer state
        assert all(("exp_avg" in p) == (".lora_" in n) for n, p in runs[kind]["params"].items())


def test_qwen3_peft_export_loads_in_peft_and_equals_the_merged_export(qwen3_runs):
    """The LoRA run's PEFT folder names Qwen3's HF modules, loads with its base through peft's
    AutoPeftModelForCausalLM (a Qwen3ForCausalLM underneath), and gives the merged export's logits;
    the exports carry the ChatML tokenizer with its chat template."""
    import peft
    import transformers

    out, _ = qwen3_runs
    step = out / "lora" / "checkpoint"
    config = json.loads((step / "step-30-peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                               "up_proj", "down_proj"])
    assert json.loads((step / "step-30-hf" / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(step / "step-30-peft")).eval()
    assert type(adapted.get_base_model()).__name__ == "Qwen3ForCausalLM"
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(step / "step-30-hf")).eval()
    tokens = torch.randint(0, 800, (2, 64), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        theirs, ours = adapted(tokens).logits, merged(tokens).logits
    # float32: W x + (alpha/r) B A x against (W + (alpha/r) B A, folded in float64) x.
    torch.testing.assert_close(theirs, ours, rtol=0, atol=1e-5)
    with adapted.disable_adapter(), torch.no_grad():  # the adapters act
        assert (theirs - adapted(tokens).logits).abs().max() > 1e-3
    chat = transformers.AutoTokenizer.from_pretrained(str(step / "step-30-hf"), local_files_only=True)
    text = chat.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text.startswith("<|im_start|>user\nhi<|im_end|>")


def test_a_qwen3_export_as_a_llama_runs_start_is_one_line(qwen3_runs, tmp_path):
    """HF weights of another architecture stop the run before any model is built, exit 2, naming
    the first difference."""
    from helpers import run_train

    out, _ = qwen3_runs
    base = out / "pretrain" / "checkpoint" / "step-6-hf"
    r = run_train(tiny_args(tmp_path, "--model.tokenizer_path", str(out / "tokenizer"),
                            "--checkpoint.initial_load_path", str(base), "--checkpoint.initial_load_in_hf"))
    assert r.returncode == 2 and r.losses == {}
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: command line: --checkpoint.initial_load_path: {base / 'config.json'} is not the run's model "
        f"llama3 debugmodel: num_hidden_layers 2 there, 8 here; no flavor of ours has its architecture: "
        f"set [model] flavor = \"hf\" to take it (with [model] name = qwen3)")


@pytest.mark.parametrize("family,flavor,run", [("qwen3", "0.6B", ("llama3", "1B")),
                                               ("qwen3", "30B-A3B", ("qwen3", "8B")),
                                               ("llama3", "1B", ("qwen3", "1.7B"))])
def test_the_mismatch_names_the_flavor_the_folder_holds(family, flavor, run, tmp_path):
    """A published model's config.json given to a run of another flavor: the line says which flavor
    it is; given to its own flavor, the run takes its (padded) vocabulary."""
    from torchtitan_xla.checkpoint.hf import match_initial_hf_weights
    from torchtitan_xla.config import ConfigError, parse_args
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama.hf_config_json import hf_config

    held = get_model_args(family, flavor, vocab_size=151936)
    (tmp_path / "config.json").write_text(json.dumps(hf_config(held)))
    cfg = parse_args(["--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_in_hf"])
    with pytest.raises(ConfigError, match=rf"is not the run's model {' '.join(run)}: .* there, .* here; "
                                          rf"it holds {family} {flavor}: set \[model\] name and flavor to it$"):
        match_initial_hf_weights(cfg.checkpoint, get_model_args(*run, vocab_size=151669), " ".join(run))
    args = match_initial_hf_weights(cfg.checkpoint, get_model_args(family, flavor, vocab_size=151669), "")
    assert args.vocab_size == 151936


@pytest.mark.parametrize("config, message", [
    ({"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
      "intermediate_size": 128, "rms_norm_eps": 1e-5, "vocab_size": 300, "sliding_window": 4096},
     "sliding-window attention (sliding_window) is not supported"),
    ({"model_type": "bert", "num_attention_heads": 4},
     "model_type 'bert' is not supported: not a Llama, Mixtral, Qwen3, DeepSeek, Gemma 3 or gpt-oss config"),
    ("{not json", "not JSON ("),
])
def test_an_unusable_config_json_is_one_line_naming_the_file(config, message, tmp_path):
    from torchtitan_xla.checkpoint.hf import match_initial_hf_weights
    from torchtitan_xla.config import ConfigError, parse_args
    from torchtitan_xla.models import get_model_args

    (tmp_path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    cfg = parse_args(["--checkpoint.initial_load_path", str(tmp_path), "--checkpoint.initial_load_in_hf"])
    with pytest.raises(ConfigError) as e:
        match_initial_hf_weights(cfg.checkpoint, get_model_args("llama3", "debugmodel", vocab_size=300), "")
    assert str(e.value).startswith(f"[checkpoint] initial_load_path: {tmp_path / 'config.json'}: {message}")
    assert "\n" not in str(e.value)
