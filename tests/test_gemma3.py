"""Gemma 3 (text) as options and flavors of the one model: its logits against transformers'
Gemma3ForCausalLM in float64 (local and global blocks, sequences shorter and longer than the window,
a packed batch), the HF names round trip, every flavor's parameter count against transformers' own
model of the same config (its training on a mesh: tests/test_gpt_oss.py, with gpt-oss's)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers import assert_packed_row_is_each_documents_own

from torchtitan_xla.models import get_model_args
from torchtitan_xla.models.llama import Transformer
from torchtitan_xla.models.llama.hf_config_json import hf_config
from torchtitan_xla.models.llama.state_dict_adapter import from_hf, to_hf

transformers = pytest.importorskip("transformers")
G = pytest.importorskip("transformers.models.gemma3.modeling_gemma3")


def _gemma3_config(args):
    cfg = {k: v for k, v in hf_config(args).items() if k not in ("architectures", "model_type", "torch_dtype")}
    return transformers.Gemma3TextConfig(**cfg)


@pytest.fixture
def float64_gemma(monkeypatch):
    """transformers' Gemma3RMSNorm without its float32 cast (which would make a float64 model float32
    in every norm)."""
    def norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)

    monkeypatch.setattr(G.Gemma3RMSNorm, "forward", norm)


def _models(seed: int = 0):
    """The debug flavor (6 blocks, one global; a 16-token window; a linearly scaled global RoPE; a
    query scale of its own) in float64 with random norm weights, and transformers' model of its
    exported config and weights, sharing its RoPE tables (transformers computes their angles in
    float32) and its exact embedding scale."""
    args = get_model_args("gemma3", "debugmodel", vocab_size=128, max_seq_len=64)
    torch.manual_seed(seed)
    model = Transformer(args).double()
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.1)
    config = _gemma3_config(args)
    config._attn_implementation = "sdpa"  # its eager attention softmaxes in float32
    hf = G.Gemma3ForCausalLM(config).double().eval()
    result = hf.load_state_dict(to_hf(model.state_dict(), args), strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied
    hf.model.embed_tokens.embed_scale.fill_(args.dim ** 0.5)
    rotary = hf.model.rotary_emb
    tables = []
    for kind in ("full_attention", "sliding_attention"):
        assert getattr(rotary, f"{kind}_attention_scaling") == 1.0
        angles = torch.arange(64, dtype=torch.float32)[:, None] * getattr(rotary, f"{kind}_inv_freq").float()
        tables.append((angles.cos().double(), angles.sin().double()))
    with torch.no_grad():
        model.rope_cos.copy_(torch.cat([tables[0][0], tables[1][0]], -1))
        model.rope_sin.copy_(torch.cat([tables[0][1], tables[1][1]], -1))
    return args, model, hf


@pytest.mark.parametrize("seq", [12, 40], ids=["shorter-than-window", "longer"])
def test_logits_match_transformers_float64(float64_gemma, seq):
    args, model, hf = _models()
    assert [args.window(i) for i in range(6)] == [16] * 5 + [0]
    tokens = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=0, atol=1e-12)


def test_a_packed_batch_gives_each_documents_own_logits(float64_gemma):
    """A row of two documents (22 and 30 tokens: both longer than the window), positions restarting
    at the second: each document's logits are transformers' on that document alone."""
    _, model, hf = _models()
    assert_packed_row_is_each_documents_own(model, hf, [22, 30], 128, atol=1e-12)


def test_a_transformers_folder_imports_with_its_architecture_and_logits(float64_gemma, tmp_path):
    """transformers' Gemma3ForCausalLM saved by save_pretrained: its config.json (per-type RoPE
    parameters and layer types, as transformers 5 writes them) reads as the debug flavor's
    architecture, alone and as a multimodal config's text_config; its weights give its logits, also
    under a multimodal folder's names (`language_model.model.*`) beside vision weights."""
    from safetensors.torch import load_file

    from torchtitan_xla.models.llama.hf_args import model_args_from_hf_config
    from torchtitan_xla.models.llama.hf_folder import architecture_difference

    args, model, hf = _models()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gemma3_text" and "rope_parameters" in config
    for cfg in (config, {"model_type": "gemma3", "text_config": config}):
        assert architecture_difference(model_args_from_hf_config(cfg), args) is None
    weights = load_file(tmp_path / "model.safetensors")
    multimodal = {"language_model." + k: v for k, v in weights.items()} | {
        "vision_tower.vision_model.embeddings.patch_embedding.weight": torch.zeros(2),
        "multi_modal_projector.mm_input_projection_weight": torch.zeros(2)}
    tokens = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(3))
    expected = hf(tokens).logits
    for state in (weights, multimodal):
        imported = Transformer(args).double()
        imported.load_state_dict(from_hf(state, args))
        imported.rope_cos.copy_(model.rope_cos)
        imported.rope_sin.copy_(model.rope_sin)
        torch.testing.assert_close(imported(tokens), expected, rtol=0, atol=1e-12)


def test_the_hf_names_round_trip_bit_exactly():
    args = get_model_args("gemma3", "debugmodel", vocab_size=128)
    model = Transformer(args)
    model.init_weights()
    ours = model.state_dict()
    hf = to_hf(ours, args)
    assert {"model.layers.0.pre_feedforward_layernorm.weight", "model.layers.0.post_attention_layernorm.weight",
            "model.layers.0.post_feedforward_layernorm.weight", "model.layers.0.self_attn.q_norm.weight"} <= set(hf)
    back = from_hf(hf, args)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], v) for k, v in ours.items())
    # Gemma's norms start at 0 and scale by 1 + weight, as transformers' do.
    assert torch.count_nonzero(ours["layers.0.post_ffn_norm.weight"]) == 0


@pytest.mark.parametrize("flavor, vocab, non_embedding", [("1B", 262144, 697_896_064), ("4B", 262208, 3_209_010_688),
                                                          ("12B", 262208, 10_759_155_456),
                                                          ("27B", 262208, 25_599_716_096)])
def test_flavors_have_transformers_parameter_counts(flavor, vocab, non_embedding):
    """On the meta device: the flavor's parameters and those of transformers' Gemma3ForCausalLM of the
    config it exports are the same number; without the embedding table (tied), 698M, 3.21B, 10.76B
    and 25.6B."""
    args = get_model_args("gemma3", flavor, vocab_size=vocab)
    with torch.device("meta"):
        ours = Transformer(dataclasses.replace(args, max_seq_len=16))
        theirs = G.Gemma3ForCausalLM(_gemma3_config(args))
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters())
    assert ours.num_params() - vocab * args.dim == non_embedding


@pytest.mark.parametrize("key, value", [("final_logit_softcapping", 30.0), ("hidden_activation", "gelu"),
                                        ("layer_types", ["full_attention", "sliding_attention"])])
def test_a_config_with_what_the_model_does_not_compute_is_one_line(key, value):
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.models.llama.hf_args import model_args_from_hf_config

    with pytest.raises(ConfigError) as e:
        model_args_from_hf_config({"model_type": "gemma3_text", "num_hidden_layers": 2, key: value})
    assert str(e.value) == f"config.json: Gemma 3 with this {key} ({value!r}) is not supported"


@pytest.mark.parametrize("flags, message", [
    (["--model.attention", "flash"], "command line: --model.attention = 'flash': torch_xla's Pallas flash kernel "
     "has no sliding window, and gemma3 debugmodel attends within 16 tokens; use splash, sdpa or blockwise"),
    (["--compile.scan_layers", "--activation_checkpoint.mode", "none"], "command line: --compile.scan_layers = True runs every block as one, and gemma3 "
     "debugmodel has sliding-window blocks (16 tokens): not supported yet"),
    (["--parallelism.pipeline_parallel_degree", "2"], "command line: --parallelism.pipeline_parallel_degree = 2 "
     "runs every block as one, and gemma3 debugmodel has sliding-window blocks (16 tokens): not supported yet"),
], ids=["xla-flash", "scan", "pipeline"])
def test_what_cannot_take_the_window_is_one_line(flags, message):
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_args(["--model.name", "gemma3", *flags])
    assert str(e.value) == message
