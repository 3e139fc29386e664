"""HuggingFace interop: the folder exported after training loads whole in `transformers`
(tokenizer and model), converts back bit-exactly, and the conversion script writes the same
files. All from the checkpoint tests' shared run (conftest.py's `straight`)."""

import json
import subprocess
import sys

import pytest
import torch
from checkpoint_helpers import run
from helpers import REPO

from torchtitan_xla.checkpoint import read_model_state


def test_export_loads_in_transformers_with_equal_logits(straight):
    """The folder written after the last step is usable without this project: AutoTokenizer and
    AutoModelForCausalLM load it, the tokenizer gives the training tokenizer's ids, the model our
    logits."""
    transformers = pytest.importorskip("transformers")
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.models.llama import Transformer

    folder, _, _ = straight
    hf_dir = folder / "checkpoint" / "step-6-hf"
    assert {p.name for p in hf_dir.iterdir()} == {"model.safetensors", "config.json", "tokenizer.json",
                                                   "tokenizer_config.json", "chat_template.jinja"}
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(hf_dir), local_files_only=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    sentence = "The quick brown fox jumps over the lazy dog; déjà vu, 12345 times."
    ids = hf_tokenizer(sentence, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == build_tokenizer("").encode(sentence, bos=True, eos=False)
    assert hf_tokenizer.decode(ids[0], skip_special_tokens=True) == sentence
    state, model_args = read_model_state(folder / "checkpoint" / "step-6")
    ours = Transformer(model_args)  # on the CPU: RoPE tables are computed by the constructor
    ours.load_state_dict(state)
    tokens = torch.cat([ids[:, :16].expand(2, 16), torch.randint(0, model_args.vocab_size, (2, 48))], 1)
    with torch.no_grad():
        expected, got = hf(tokens).logits, ours(tokens)
    # float32 on both sides; they differ in summation order and in RoPE's angle precision.
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-4)
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["vocab_size"] == 2256 and config["num_hidden_layers"] == 2
    assert (config["bos_token_id"], config["eos_token_id"]) == (2000, 2001)


def test_import_round_trip(straight, tmp_path):
    folder, _, _ = straight
    hf_dir = folder / "checkpoint" / "step-6-hf"
    out = tmp_path / "imported" / "step-0"
    p = subprocess.run([sys.executable, str(REPO / "scripts/convert_from_hf.py"), str(hf_dir), str(out)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    imported, _ = read_model_state(out)
    original, _ = read_model_state(folder / "checkpoint" / "step-6")
    assert imported.keys() == original.keys()
    for k in original:
        assert torch.equal(imported[k], original[k]), k  # exact: names and RoPE permutation invert
    # (A run starting from the HF folder and one from the checkpoint see the same weights:
    # test_torchtitan_import.py.)


def test_convert_to_hf_script_matches_the_in_training_export(straight, tmp_path):
    folder, _, _ = straight
    out = tmp_path / "hf"
    p = subprocess.run([sys.executable, str(REPO / "scripts/convert_to_hf.py"),
                        str(folder / "checkpoint" / "step-6"), str(out), "--tokenizer", ""],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    from safetensors.torch import load_file

    exported = folder / "checkpoint" / "step-6-hf"
    a = load_file(str(out / "model.safetensors"))
    b = load_file(str(exported / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in exported.iterdir())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (out / name).read_bytes() == (exported / name).read_bytes(), name


def test_exported_config_gives_the_flavors_context_not_the_training_seq_len(straight):
    """The run trained the llama3 debug model at seq_len 64, which sizes only its RoPE tables:
    config.json's max_position_embeddings is the flavor's max_seq_len, its RoPE the flavor's, and
    reading it back (convert_from_hf, initial_load_in_hf) gives that context length again."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.models import get_model_args

    folder, _, _ = straight
    config = json.loads((folder / "checkpoint" / "step-6-hf" / "config.json").read_text())
    flavor = get_model_args("llama3", "debugmodel")
    _, trained = read_model_state(folder / "checkpoint" / "step-6")
    assert trained.max_seq_len == 64  # the training seq_len (tiny_args)
    assert config["max_position_embeddings"] == flavor.max_seq_len == 2048
    assert config["rope_theta"] == flavor.rope_theta and "rope_scaling" not in config
    assert "router_aux_loss_coef" not in config and "output_router_logits" not in config  # dense
    back = model_args_from_hf_config(config)
    assert (back.max_seq_len, back.context_len, trained.context_len) == (2048, 2048, 2048)


def test_flavor_exports_carry_the_published_context_and_rope():
    """Llama 3.1 8B trained at seq_len 8192 exports Llama-3.1-8B's config.json values (131072
    positions, the llama3 RoPE scaling, which depends on original_max_position_embeddings and not
    on max_position_embeddings); a model trained past its flavor's context says what it saw."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama.hf_config_json import hf_config

    config = hf_config(get_model_args("llama3", "8B", vocab_size=128256, max_seq_len=8192))
    assert (config["max_position_embeddings"], config["rope_theta"], config["intermediate_size"]) == (
        131072, 500000, 14336)
    assert config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert model_args_from_hf_config(config).context_len == 131072
    assert hf_config(get_model_args("llama2", "7B", vocab_size=32000, max_seq_len=1024))[
        "max_position_embeddings"] == 4096
    long = hf_config(get_model_args("llama3", "debugmodel", vocab_size=300, max_seq_len=4096))
    assert long["max_position_embeddings"] == 4096  # trained on positions past the flavor's 2048


def test_a_qwen3_export_is_a_tied_qwen3_with_our_logits(tmp_path):
    """Qwen3's debug model (query/key norms, tied embeddings) trained 3 steps and exported after the
    last: AutoModelForCausalLM loads a Qwen3ForCausalLM whose lm_head is its embedding, with the
    checkpoint's logits."""
    transformers = pytest.importorskip("transformers")
    from torchtitan_xla.models.llama import Transformer

    run(tmp_path / "q", "--model.name", "qwen3", "--training.steps", "3", "--checkpoint.last_save_in_hf")
    hf_dir = tmp_path / "q" / "checkpoint" / "step-3-hf"
    config = json.loads((hf_dir / "config.json").read_text())
    assert (config["architectures"], config["tie_word_embeddings"], config["head_dim"]) == (
        ["Qwen3ForCausalLM"], True, 32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), local_files_only=True).eval()
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    state, model_args = read_model_state(tmp_path / "q" / "checkpoint" / "step-3")
    assert model_args.tie_embeddings and "output.weight" not in state
    ours = Transformer(model_args)
    ours.load_state_dict(state)
    tokens = torch.randint(0, model_args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-4)  # float32, as above
