"""gpt-oss as options and flavors of the one model: its logits against transformers'
GptOssForCausalLM in float64 (attention sinks, q/k/v/o biases, local and global blocks, biased experts
with the clamped SwiGLU, top-4 routing, untruncated YaRN; sequences shorter and longer than the
window, a packed batch), the HF names round trip, a saved folder imports, the published MXFP4 expert
weights dequantize as transformers does, every flavor's parameter count against transformers' own
model of its config and the model card's, and what the model cannot take is one line."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers import (
    assert_packed_row_is_each_documents_own,
    decode_through_cache,
    rmsnorm_in_input_dtype,
    tiny_args,
    train_many,
)

from torchtitan_xla.models import get_model_args
from torchtitan_xla.models.llama import Transformer
from torchtitan_xla.models.llama.hf_config_json import hf_config
from torchtitan_xla.models.llama.state_dict_adapter import dequantize_mxfp4, from_hf, to_hf

transformers = pytest.importorskip("transformers")
OSS = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")

SEQ = 64


def _config(args):
    cfg = {k: v for k, v in hf_config(args).items() if k not in ("architectures", "model_type", "torch_dtype")}
    return transformers.GptOssConfig(**cfg)


@pytest.fixture
def float64_gpt_oss(monkeypatch):
    """transformers' GptOssRMSNorm without its float32 cast (a float64 model would be float32 there)."""
    monkeypatch.setattr(OSS.GptOssRMSNorm, "forward", rmsnorm_in_input_dtype)


def _models(seed: int = 0):
    """The debug flavor (4 blocks, the even ones local with an 8-token window; 8 experts of 192, top-4; YaRN
    factor 4 untruncated) in float64 with every bias, sink and norm random, and transformers' model of
    its exported config and weights (eager attention and experts: float64 throughout). The RoPE
    tables: ours equal transformers' to float32 rounding (which computes them in float32), then
    shared."""
    args = get_model_args("gpt_oss", "debugmodel", vocab_size=128, max_seq_len=SEQ)
    torch.manual_seed(seed)
    model = Transformer(args).double()
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.1)
            if "bias" in name or "sinks" in name or name.endswith(("b1", "b2", "b3")):
                p.normal_(0, 0.5 if "sinks" in name else 0.1)
            if name.endswith(("w1", "w3")):  # some gates and ups past the clamp at 7
                p.mul_(40)
    hf = OSS.GptOssForCausalLM._from_config(_config(args), attn_implementation="eager",
                                         experts_implementation="eager").double().eval()
    result = hf.load_state_dict(to_hf(model.state_dict(), args), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    rotary = hf.model.rotary_emb
    angles = torch.arange(SEQ, dtype=torch.float32)[:, None] * rotary.inv_freq.float()
    cos, sin = angles.cos() * rotary.attention_scaling, angles.sin() * rotary.attention_scaling
    assert rotary.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1, rel=1e-12)
    torch.testing.assert_close(model.rope_cos, cos.double(), rtol=0, atol=2e-6)
    torch.testing.assert_close(model.rope_sin, sin.double(), rtol=0, atol=2e-6)
    with torch.no_grad():
        model.rope_cos.copy_(cos.double())
        model.rope_sin.copy_(sin.double())
    return args, model, hf


@pytest.mark.parametrize("seq", [6, 29], ids=["shorter-than-window", "longer"])
def test_logits_match_transformers_float64(float64_gpt_oss, seq):
    args, model, hf = _models()
    assert [args.window(i) for i in range(4)] == [8, 0, 8, 0]
    tokens = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(1))
    inputs = []
    model.layers["0"].feed_forward.register_forward_hook(lambda m, args, out: inputs.append(args[0]))
    torch.testing.assert_close(model(tokens), hf(tokens).logits, rtol=0, atol=1e-12)
    # The clamps are in play: gates and ups past 7 (on both sides for up).
    experts = model.layers["0"].feed_forward
    up = torch.einsum("bsd,ehd->bseh", inputs[0], experts.w3)
    assert torch.einsum("bsd,ehd->bseh", inputs[0], experts.w1).max() > 7 and up.max() > 7 and up.min() < -7


def test_a_packed_batch_gives_each_documents_own_logits(float64_gpt_oss):
    """A row of two documents (13 and 17 tokens, both longer than the window), positions restarting
    at the second: each document's logits are transformers' on that document alone."""
    _, model, hf = _models()
    assert_packed_row_is_each_documents_own(model, hf, [13, 17], 128, atol=1e-12)


@pytest.mark.parametrize("packed", [False, True], ids=["one-document", "packed"])
def test_blockwise_attention_with_sinks_equals_the_einsum_kernel(packed):
    """The blockwise kernel (query blocks of at most half a window on the local blocks) with the
    sinks: the einsum kernel's logits and gradients in float64, 29 tokens (window 8), one document
    or two packed."""
    from torchtitan_xla.models.llama.blockwise_attention import BlockwiseCausalAttention

    _, model, _ = _models()
    tokens = torch.randint(0, 128, (2, 29), generator=torch.Generator().manual_seed(5))
    mask = (torch.tensor([[1] * 13 + [2] * 16] * 2), torch.cat([torch.arange(13), torch.arange(16)])[None]
            .expand(2, -1)) if packed else ()
    runs = []
    for blockwise in (False, True):
        if blockwise:
            for block in model.layers.values():
                block.attention.sdpa = BlockwiseCausalAttention(window=block.attention.sdpa.window)
        model.zero_grad()
        logits = model(tokens, *reversed(mask))
        logits.square().mean().backward()
        runs.append((logits, [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=1e-12)
    for blockwise_grad, einsum_grad in zip(runs[1][1], runs[0][1]):
        torch.testing.assert_close(blockwise_grad, einsum_grad, rtol=0, atol=1e-11)


def test_decoding_through_the_kv_cache_equals_the_whole_sequence(float64_gpt_oss):
    """The sinks and the window in the KV cache's attention: a 12-token prompt (longer than the
    window) then 8 tokens one at a time give the whole sequence's logits."""
    _, model, _ = _models()
    tokens = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(decode_through_cache(model, tokens, 12), model(tokens), rtol=0, atol=1e-12)


def test_a_transformers_folder_imports_with_its_architecture_and_logits(float64_gpt_oss, tmp_path):
    """transformers' GptOssForCausalLM saved by save_pretrained (unquantized): its config.json reads as
    the debug flavor's architecture, and its weights give its logits."""
    from safetensors.torch import load_file

    from torchtitan_xla.models.llama.hf_args import model_args_from_hf_config
    from torchtitan_xla.models.llama.hf_folder import architecture_difference

    args, model, hf = _models()
    hf.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "gpt_oss" and config["rope_parameters"]["truncate"] is False
    theirs = model_args_from_hf_config(config)
    assert architecture_difference(theirs, args) is None and theirs.yarn == args.yarn
    imported = Transformer(args).double()
    imported.load_state_dict(from_hf(load_file(tmp_path / "model.safetensors"), args))
    imported.rope_cos.copy_(model.rope_cos)
    imported.rope_sin.copy_(model.rope_sin)
    tokens = torch.randint(0, 128, (2, 20), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(imported(tokens), hf(tokens).logits, rtol=0, atol=1e-12)


def test_the_hf_names_round_trip_bit_exactly():
    args = get_model_args("gpt_oss", "debugmodel", vocab_size=128)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    ours = model.state_dict()
    hf = to_hf(ours, args)
    layer = "model.layers.0."
    assert {layer + n for n in ("self_attn.sinks", "self_attn.q_proj.bias", "mlp.router.bias",
                                "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
                                "mlp.experts.down_proj", "mlp.experts.down_proj_bias")} <= set(hf)
    # transformers' layout: [E, dim, 2 x hidden], gate and up interleaved along the last dimension.
    gate_up = hf[layer + "mlp.experts.gate_up_proj"]
    assert gate_up.shape == (8, 256, 2 * 192)
    assert torch.equal(gate_up[..., 1::2], ours["layers.0.feed_forward.w3"].transpose(1, 2))
    back = from_hf(hf, args)
    assert back.keys() == ours.keys() and all(torch.equal(back[k], v) for k, v in ours.items())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp4_experts_dequantize_as_transformers_does(dtype):
    """Every byte value and every exponent near 1 (and the extremes bfloat16 still holds): our
    dequantization of the published format equals transformers' convert_moe_packed_tensors bit for
    bit, and a folder's MXFP4 experts read as the weights they encode."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (2, 6, 3, 16), dtype=torch.uint8, generator=g)
    blocks[0, 0, 0] = torch.arange(16, dtype=torch.uint8) * 17  # every nibble
    scales = torch.randint(120, 134, (2, 6, 3), dtype=torch.uint8, generator=g)
    scales[1, 0] = torch.tensor([1, 127, 254], dtype=torch.uint8)
    ours = dequantize_mxfp4(blocks, scales, dtype)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
    assert ours.shape == (2, 6, 96) and torch.equal(ours, theirs.transpose(1, 2))

    args = get_model_args("gpt_oss", "debugmodel", vocab_size=128)
    model = Transformer(args)
    model.init_weights()
    hf = to_hf(model.state_dict(), args)
    layer = "model.layers.1.mlp.experts."
    e, f, d = args.num_experts, args.expert_hidden_dim, args.dim
    packed = {"gate_up_proj": ((e, 2 * f, d // 32, 16), (e, 2 * f, d // 32)),
              "down_proj": ((e, d, f // 32, 16), (e, d, f // 32))}
    for kind, (block_shape, scale_shape) in packed.items():
        del hf[layer + kind]
        hf[layer + kind + "_blocks"] = torch.randint(0, 256, block_shape, dtype=torch.uint8, generator=g)
        hf[layer + kind + "_scales"] = torch.randint(118, 128, scale_shape, dtype=torch.uint8, generator=g)
    read = from_hf(hf, args)
    gate_up = convert_moe_packed_tensors(hf[layer + "gate_up_proj_blocks"], hf[layer + "gate_up_proj_scales"])
    assert torch.equal(read["layers.1.feed_forward.w1"], gate_up[..., 0::2].transpose(1, 2))
    assert torch.equal(read["layers.1.feed_forward.w3"], gate_up[..., 1::2].transpose(1, 2))
    down = convert_moe_packed_tensors(hf[layer + "down_proj_blocks"], hf[layer + "down_proj_scales"])
    assert torch.equal(read["layers.1.feed_forward.w2"], down.transpose(1, 2))


@pytest.mark.parametrize("flavor, total, active", [("20B", 20_914_757_184, 3_608_307_264),
                                                   ("120B", 116_829_156_672, 5_132_849_472)])
def test_flavors_have_transformers_and_the_model_cards_parameter_counts(flavor, total, active):
    """On the meta device: the flavor's parameters and those of transformers' GptOssForCausalLM of the
    config it exports are the same number, the model card's 20.91B / 116.83B; active per token (4
    experts, the embedding table left out) 3.61B / 5.13B."""
    from torchtitan_xla.models.llama.moe import inactive_expert_params

    args = get_model_args("gpt_oss", flavor, vocab_size=201088)
    with torch.device("meta"):
        ours = Transformer(dataclasses.replace(args, max_seq_len=16))
        theirs = OSS.GptOssForCausalLM(_config(args))
    assert ours.num_params() == sum(p.numel() for p in theirs.parameters()) == total
    assert ours.num_params() - inactive_expert_params(ours) - 201088 * args.dim == active


@pytest.mark.parametrize("key, value, expected", [
    ("swiglu_limit", 10.0, "only 7.0"),
    ("layer_types", ["full_attention", "sliding_attention"], "only every p-th block full_attention, the others "
     "sliding_attention"),
    ("quantization_config", {"quant_method": "fp8"}, "only unquantized or mxfp4"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 32.0, "mscale": 0.7}, "only YaRN without mscale, "
     "mscale_all_dim or attention_factor")])
def test_a_config_with_what_the_model_does_not_compute_is_one_line(key, value, expected):
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.models.llama.hf_args import model_args_from_hf_config

    with pytest.raises(ConfigError) as e:
        model_args_from_hf_config({"model_type": "gpt_oss", "num_hidden_layers": 2, key: value})
    assert str(e.value) == f"config.json: gpt-oss with this {key} ({value!r}) is not supported ({expected})"


def test_the_published_config_reads_as_the_20b_flavor():
    """openai/gpt-oss-20b's config.json (its keys as published): the 20B flavor."""
    from torchtitan_xla.models.llama.hf_args import model_args_from_hf_config

    published = {
        "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
        "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu",
        "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
        "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
        "max_position_embeddings": 131072, "model_type": "gpt_oss", "num_attention_heads": 64,
        "num_experts_per_tok": 4, "num_hidden_layers": 24, "num_key_value_heads": 8, "num_local_experts": 32,
        "output_router_logits": False, "pad_token_id": 199999,
        "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                           "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"},
        "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                                "truncate": False},
        "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088}
    assert model_args_from_hf_config(published) == get_model_args("gpt_oss", "20B", vocab_size=201088)


def test_the_debug_models_train_on_meshes_as_on_one_device(tmp_path):
    """XLA runtime, blockwise attention, 10 steps of synthetic data, one process per device count for
    both families: Gemma 3 on fsdp=4 x tp=2 (the heads, the GeGLU and the sandwich norms' inputs split or gathered) and
    gpt-oss on ep=2 x fsdp=2 x tp=2 (the experts and their biases split over ep, the sinks and the
    biases over tp) give one device's losses."""
    def job(name, model, *flags):  # (the debug recipe's blockwise attention: the windows, the sinks)
        return tiny_args(tmp_path / name, "--model.name", model, "--training.dataset", "synthetic",
                         "--training.steps", "10", "--training.global_batch_size", "8", "--optimizer.lr", "3e-3",
                         *flags)

    one = train_many({m: job(f"{m}-one", m, "--training.local_batch_size", "8") for m in ("gemma3", "gpt_oss")},
                     devices=1)
    tp = ("--parallelism.tensor_parallel_degree", "2")
    mesh = train_many({"gemma3": job("gemma3-mesh", "gemma3", "--training.local_batch_size", "2", *tp),
                       "gpt_oss": job("gpt_oss-mesh", "gpt_oss", "--training.local_batch_size", "2", *tp,
                                      "--parallelism.expert_parallel_degree", "2")}, devices=8)
    params = mesh["gpt_oss"]["params"]
    assert {name.removeprefix("layers.0."): params[name]["partition_spec"] for name in params if any(
        name.endswith(k) for k in ("sinks", ".bias", ".b1", ".b2", ".b3"))and name.startswith("layers.0.")} == {
        "attention.sinks": ["tp"], "attention.wq.bias": ["tp"], "attention.wk.bias": ["tp"],
        "attention.wv.bias": ["tp"], "attention.wo.bias": [["fsdp", "ep"]], "feed_forward.b1": ["ep", "tp"],
        "feed_forward.b3": ["ep", "tp"], "feed_forward.b2": ["ep", "fsdp"],
        "feed_forward.router.bias": [["fsdp", "ep"]]}
    assert all(p["actual"] == p["expected"] for p in params.values())
    for model in ("gemma3", "gpt_oss"):
        losses, on_mesh = one[model]["losses"], mesh[model]["losses"]
        assert len(losses) == 10 and losses.keys() == on_mesh.keys()
        for step, loss in losses.items():
            assert on_mesh[step] == pytest.approx(loss, rel=1e-6), (model, step)


@pytest.mark.parametrize("flags, message", [
    (["--model.attention", "flash"], "command line: --model.attention = 'flash': the kernel has no attention "
     "sinks, and gpt_oss debugmodel adds one logit per head to each softmax; use sdpa or blockwise"),
    (["--moe.grouped_mm"], "command line: --moe.grouped_mm = true: the sorted experts compute SwiGLU without "
     "biases, and gpt_oss debugmodel's experts have biases and the swiglu_clamp gate; leave it off"),
], ids=["flash", "grouped_mm"])
def test_what_cannot_take_gpt_oss_is_one_line(flags, message):
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        parse_args(["--model.name", "gpt_oss", *flags])
    assert str(e.value) == message
