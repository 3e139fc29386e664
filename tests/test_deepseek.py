"""DeepSeek-V3 (models/llama/mla.py, the sigmoid router of moe.py) on the CPU: logits in float64
against transformers' DeepseekV3ForCausalLM built from our export, the router's choices against
DeepseekV3TopkRouter, the bias update, YaRN's tables, the published configs, sizes and bad input."""

import json

import pytest
import torch
import torch.nn.functional as F

from torchtitan_xla.models import get_model_args
from torchtitan_xla.models.llama.model import Transformer
from torchtitan_xla.models.llama.moe import MoE, update_expert_bias

transformers = pytest.importorskip("transformers")


def _deepseek(seed: int = 0, family: str = "deepseek_v3", **overrides) -> Transformer:
    """The debug model of `family` in float64, norms, router and expert bias (V3) made to matter;
    the router's weights and the bias float32 numbers (transformers keeps both in float32)."""
    args = get_model_args(family, "debugmodel", **{"vocab_size": 300, "max_seq_len": 32, **overrides})
    torch.manual_seed(seed)
    model = Transformer(args).double()
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("router.weight"):
                p.copy_((torch.randn_like(p) * 0.3).float())
        for m in model.modules():
            if isinstance(m, MoE) and m.expert_bias is not None:
                m.expert_bias.copy_((torch.randn(m.num_experts) * 0.05).float())
    return model


def _rmsnorm_in_input_dtype(self, hidden_states):
    """transformers' DeepseekV3RMSNorm without its cast to float32."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _router_in_input_dtype(self, hidden_states):
    """transformers' DeepseekV3TopkRouter.forward with the logits in the input's dtype (it casts
    them to float32); otherwise its code."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
                    .topk(2, dim=-1)[0].sum(dim=-1))
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                  .reshape(-1, self.num_experts))
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


def _hf_rope(model, hf) -> None:
    """transformers' RoPE tables (angles in float32, times its attention factor) into our model."""
    rotary = hf.model.rotary_emb
    angles = torch.arange(model.args.max_seq_len, dtype=torch.float32)[:, None] * rotary.inv_freq.float()[None, :]
    model.rope_cos.copy_((angles.cos() * rotary.attention_scaling).double())
    model.rope_sin.copy_((angles.sin() * rotary.attention_scaling).double())


# (overrides, sequence length): the debug flavor (query latent, YaRN, 4 groups, top-2 groups), and
# queries straight from the input, plain RoPE, no groups, two shared experts, as Moonlight's.
CASES = [({}, 32), ({"q_lora_rank": 0, "yarn": None, "expert_groups": 1, "topk_groups": 1,
                     "shared_experts": 2, "dense_layers": 2}, 17)]


@pytest.mark.parametrize("overrides,seq", CASES, ids=["debugmodel_32", "no_q_latent_17"])
def test_logits_match_transformers_deepseek_v3_float64(overrides, seq, tmp_path, monkeypatch):
    """Exported with export_hf, the folder is what DeepseekV3ForCausalLM.save_pretrained writes,
    from_pretrained computes our logits (float64, 1e-12) with the expert bias steering the
    choices, and import gives our weights and bias back bit-exactly."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3

    from torchtitan_xla.checkpoint.hf import export_hf, model_args_from_hf_config, read_hf_state_dict
    from torchtitan_xla.models.llama.state_dict_adapter import from_hf

    model = _deepseek(**overrides)
    args = model.args
    ours = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_hf(ours, args, tmp_path / "ours", dtype=torch.float64)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (config["architectures"], config["num_nextn_predict_layers"], config["rope_interleave"]) == (
        ["DeepseekV3ForCausalLM"], 0, True)
    assert model_args_from_hf_config(config) == get_model_args("deepseek_v3", "debugmodel", vocab_size=300,
                                                               **overrides)

    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3RMSNorm, "forward", _rmsnorm_in_input_dtype)
    monkeypatch.setattr(modeling_deepseek_v3.DeepseekV3TopkRouter, "forward", _router_in_input_dtype)
    hf = DeepseekV3ForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float64,
                                               attn_implementation="sdpa", experts_implementation="eager").eval()
    # Our YaRN frequencies are transformers' (theirs computed in float32).
    from torchtitan_xla.models.llama.layers import rope_tables

    cos, _ = rope_tables(args)
    angles = torch.arange(args.max_seq_len, dtype=torch.float64)[:, None] * hf.model.rotary_emb.inv_freq.double()
    torch.testing.assert_close(cos, angles.cos() * hf.model.rotary_emb.attention_scaling, rtol=0, atol=2e-6)
    _hf_rope(model, hf)

    hf.save_pretrained(str(tmp_path / "theirs"))
    exported, saved = load_file(str(tmp_path / "ours" / "model.safetensors")), read_hf_state_dict(tmp_path / "theirs")
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in saved.items()}
    assert "model.layers.3.mlp.experts.15.down_proj.weight" in exported
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in exported
    for state in (read_hf_state_dict(tmp_path / "ours"), hf.state_dict()):  # on disk; fused in memory
        back = from_hf(state, args)
        assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k].to(back[k].dtype)) for k in ours)
    # DeepSeek-V3's own checkpoints carry a multi-token-prediction layer past the last: left out.
    extra = {**exported, f"model.layers.{args.n_layers}.eh_proj.weight": torch.zeros(2, 2)}
    assert from_hf(extra, args).keys() == ours.keys()

    tokens = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        got, expected = model(tokens), hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    moe = [layer.feed_forward for layer in model.layers.values() if isinstance(layer.feed_forward, MoE)]
    assert len(moe) == args.n_layers - args.dense_layers and all((m.expert_load[0] > 0).sum() > 4 for m in moe)
    # The bias mattered: without it other experts are chosen, and the logits differ.
    with torch.no_grad():
        for m in moe:
            m.expert_bias.zero_()
        assert (model(tokens) - got).abs().max() > 1e-6


def _same_choices(ours: MoE, theirs, x: torch.Tensor, top_k: int) -> bool:
    """Assert our router chooses `theirs`'s experts for every token of x, with its weights (1e-6);
    whether the plain top-k of the scores would have chosen them too."""
    with torch.no_grad():
        _, their_weights, their_experts = theirs(x)
        scores, our_experts, our_weights = ours.route(ours.router(x))
    order_ours, order_theirs = our_experts.view(-1, top_k).sort(-1), their_experts.sort(-1)
    assert torch.equal(order_ours.values, order_theirs.values)
    torch.testing.assert_close(our_weights.view(-1, top_k).gather(-1, order_ours.indices),
                               their_weights.gather(-1, order_theirs.indices), rtol=1e-6, atol=0)
    return torch.equal(scores.topk(top_k).indices.view(-1, top_k).sort(-1).values, order_ours.values)


@pytest.mark.parametrize("groups,topk_groups,top_k", [(4, 2, 4), (1, 1, 6), (8, 3, 5)])
def test_router_picks_transformers_experts(groups, topk_groups, top_k):
    """On the same hidden states, router weights and bias (float32, transformers' own router
    unpatched), our sigmoid router chooses the same experts with the same weights, including where
    the bias overturns the scores' order and the groups exclude a better expert."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    experts, dim = 16, 32
    config = DeepseekV3Config(hidden_size=dim, n_routed_experts=experts, num_experts_per_tok=top_k,
                              n_group=groups, topk_group=topk_groups, routed_scaling_factor=2.5,
                              norm_topk_prob=True)
    theirs = DeepseekV3TopkRouter(config)
    ours = MoE(dim, 8, experts, top_k, router="sigmoid", groups=groups, topk_groups=topk_groups,
               routed_scaling=2.5)
    g = torch.Generator().manual_seed(groups)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(experts, dim, generator=g) * 0.2)
        ours.router.weight.copy_(theirs.weight)
        bias = torch.randn(experts, generator=g) * 0.2
        theirs.e_score_correction_bias.copy_(bias)
        ours.expert_bias.copy_(bias)
    x = torch.randn(3, 40, dim, generator=g)
    # The bias and the groups change the choice: the top-k of the plain scores is not it.
    assert not _same_choices(ours, theirs, x, top_k)


def test_the_bias_moves_by_the_sign_of_each_experts_load():
    """update_expert_bias: b += rate * sign(mean(load) - load), per block, from the step's counts
    (summed over microbatches here), on a router skewed towards expert 0; the bias is a buffer, so
    the gradient never reaches it, and the load it records has no gradient either."""
    torch.manual_seed(0)
    moe = MoE(16, 8, 8, 2, router="sigmoid")
    moe.init_weights(0.02)
    with torch.no_grad():
        moe.router.weight.normal_(std=0.5)
        moe.router.weight[0] = 2.0  # with positive inputs: every token's first choice
    assert "expert_bias" not in dict(moe.named_parameters()) and "expert_bias" in moe.state_dict()
    counts = []
    for x in (torch.ones(2, 8, 16), torch.rand(2, 8, 16)):  # two microbatches
        moe(x).sum().backward()
        counts.append(moe.expert_counts)
    assert moe.expert_bias.grad is None and not moe.expert_bias.requires_grad
    load = counts[0] + counts[1]
    assert load.sum() == 2 * 2 * 8 * 2 and load[0] == 32  # every token chose expert 0
    update_expert_bias([moe], [load], rate=0.25)
    expected = torch.where(load > load.mean(), -0.25, torch.where(load < load.mean(), 0.25, 0.0))
    assert torch.equal(moe.expert_bias, expected)
    update_expert_bias([moe], [load], rate=0.25)
    assert torch.equal(moe.expert_bias, 2 * expected)
    assert moe.expert_bias[0] == -0.5


def test_sequence_balance_loss_is_one_when_balanced_and_counts_each_sequence():
    """DeepSeek-V3's sequence-wise balance loss, against its formula written out: 1 for a
    perfectly balanced sequence, larger for a skewed one, the mean over sequences (not the loss of
    the pooled batch), padding in neither count."""
    from torchtitan_xla.models.llama.moe import sequence_balance_loss

    experts, k = 4, 2
    balanced_choice = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 1]] * 2, dtype=torch.float64)  # 4 tokens
    uniform = torch.full((4, experts), 0.5, dtype=torch.float64)
    skewed_choice = torch.tensor([[1, 1, 0, 0]] * 4, dtype=torch.float64)
    skewed_scores = torch.tensor([[0.9, 0.8, 0.1, 0.1]] * 4, dtype=torch.float64)
    real = torch.ones(2, 4, dtype=torch.float64)
    loss = sequence_balance_loss(torch.stack([uniform, skewed_scores]),
                                 torch.stack([balanced_choice, skewed_choice]), real, k)
    f = experts / k * skewed_choice.mean(0)
    p = (skewed_scores / skewed_scores.sum(-1, keepdim=True)).mean(0)
    torch.testing.assert_close(loss, (1.0 + (f * p).sum()) / 2, rtol=1e-15, atol=0)
    # Padding: a sequence's last two tokens are not counted.
    padded = sequence_balance_loss(skewed_scores[None], skewed_choice[None],
                                   torch.tensor([[1.0, 1.0, 0.0, 0.0]], dtype=torch.float64), k)
    torch.testing.assert_close(padded, (f * p).sum(), rtol=1e-15, atol=0)


def test_published_configs_give_the_flavors_and_sizes():
    """DeepSeek-V3's and Moonlight-16B-A3B's config.json (their published values) read as our 671B
    and 16B flavors; parameters as published: 671B total / 37B activated (without V3's
    multi-token-prediction module), Moonlight 16B / 3B."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.models.llama.moe import inactive_expert_params

    v3 = transformers.DeepseekV3Config(
        vocab_size=129280, max_position_embeddings=163840, rope_scaling={
            "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 4096, "type": "yarn"}, aux_loss_alpha=0.001).to_dict()
    moonlight = {  # moonshotai/Moonlight-16B-A3B's config.json
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "aux_loss_alpha": 0.001,
        "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "intermediate_size": 11264,
        "kv_lora_rank": 512, "max_position_embeddings": 8192, "moe_intermediate_size": 1408,
        "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
        "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
        "num_key_value_heads": 16, "num_nextn_predict_layers": 0, "q_lora_rank": None, "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 50000.0, "routed_scaling_factor": 2.446,
        "scoring_func": "sigmoid", "seq_aux": True, "tie_word_embeddings": False, "topk_group": 1,
        "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 163840}
    for cfg, flavor, total, active in ((v3, "671B", 671.0e9, 37.6e9), (moonlight, "16B", 15.96e9, 2.91e9)):
        args = model_args_from_hf_config(cfg)
        assert args == get_model_args("deepseek_v3", flavor, vocab_size=cfg["vocab_size"]), flavor
        with torch.device("meta"):
            model = Transformer(args)
        n = model.num_params()
        assert abs(n - total) / total < 0.001 and abs(n - inactive_expert_params(model) - active) / active < 0.005
    assert get_model_args("deepseek_v3", "671B").ffn_hidden_dim == 18432  # below Llama's 8/3 dim


def test_unsupported_deepseek_configs_are_one_line():
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.errors import ConfigError

    cfg = transformers.DeepseekV3Config(vocab_size=300).to_dict()
    for key, value in (("scoring_func", "softmax"), ("topk_method", "greedy"), ("norm_topk_prob", False)):
        with pytest.raises(ConfigError, match=f"^config.json: DeepSeek-V3 with this {key} "):
            model_args_from_hf_config({**cfg, key: value})


def test_blockwise_attention_takes_values_narrower_than_queries():
    """`[model] attention = "blockwise"` on latent attention (queries and keys 48 wide, values 32):
    sdpa's logits, float64, with and without documents packed in the rows."""
    from torchtitan_xla.models.llama.blockwise_attention import BlockwiseCausalAttention

    model = _deepseek(max_seq_len=64)
    tokens = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(2))
    documents = torch.cat([torch.ones(2, 40, dtype=torch.long), torch.full((2, 24), 2)], 1)
    positions = torch.cat([torch.arange(40), torch.arange(24)]).expand(2, -1)
    with torch.no_grad():
        expected = [model(tokens), model(tokens, positions, documents)]
        for block in model.layers.values():
            block.attention.sdpa = BlockwiseCausalAttention()
        got = [model(tokens), model(tokens, positions, documents)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)
    assert (expected[0] - expected[1]).abs().max() > 1e-3  # the documents mattered


# ---- DeepSeek-V2: the softmax router without renormalisation, groups by their best expert ---------


def _v2_rope_in_input_dtype(xq, xk, freqs_cis):
    """transformers' DeepSeek-V2 apply_rotary_emb in the input's precision (it rotates in float32)."""
    def rotate(x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis.unsqueeze(1).to(pairs.dtype)).flatten(3)

    return rotate(xq), rotate(xk)


def _v2_router_in_input_dtype(self, hidden_states):
    """transformers' DeepseekV2TopkRouter.forward with the logits and softmax in the input's dtype;
    otherwise its code."""
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight.to(hidden_states.dtype))
    scores = router_logits.softmax(dim=-1)
    if self.topk_method == "greedy":
        topk_weights, topk_indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
    else:
        group_scores = scores.view(-1, self.num_group, self.num_experts // self.num_group).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores)
        group_mask.scatter_(1, group_idx, 1)
        score_mask = (group_mask.unsqueeze(-1).expand(-1, self.num_group, self.num_experts // self.num_group)
                      .reshape(-1, self.num_experts))
        scores = scores.masked_fill(~score_mask.bool(), 0.0)
        topk_weights, topk_indices = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
    return router_logits, topk_weights * self.routed_scaling_factor, topk_indices


@pytest.mark.parametrize("overrides", [{}, {"expert_groups": 1, "topk_groups": 1, "q_lora_rank": 0}],
                         ids=["debugmodel", "greedy_no_q_latent"])
def test_logits_match_transformers_deepseek_v2_float64(overrides, tmp_path, monkeypatch):
    """DeepSeek-V2's routing on the same model (softmax, top-k not renormalised, times 2, groups
    ranked by their best expert; YaRN with mscale 0.707): the export is DeepseekV2ForCausalLM's,
    which computes our logits in float64 (1e-12); import is bit-exact."""
    from transformers import DeepseekV2ForCausalLM
    from transformers.models.deepseek_v2 import modeling_deepseek_v2

    from torchtitan_xla.checkpoint.hf import export_hf, model_args_from_hf_config, read_hf_state_dict
    from torchtitan_xla.models.llama.state_dict_adapter import from_hf

    model = _deepseek(1, "deepseek_v2", **overrides)
    args = model.args
    assert not dict(model.named_buffers()).keys() & {"layers.1.feed_forward.expert_bias"}  # V2: no bias
    ours = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_hf(ours, args, tmp_path / "ours", dtype=torch.float64)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (config["architectures"], config["scoring_func"], config["norm_topk_prob"], config["topk_method"]) == (
        ["DeepseekV2ForCausalLM"], "softmax", False, "group_limited_greedy" if not overrides else "greedy")
    assert model_args_from_hf_config(config) == get_model_args("deepseek_v2", "debugmodel", vocab_size=300,
                                                               **overrides)

    monkeypatch.setattr(modeling_deepseek_v2.DeepseekV2RMSNorm, "forward", _rmsnorm_in_input_dtype)
    monkeypatch.setattr(modeling_deepseek_v2.DeepseekV2TopkRouter, "forward", _v2_router_in_input_dtype)
    monkeypatch.setattr(modeling_deepseek_v2, "apply_rotary_emb", _v2_rope_in_input_dtype)
    hf = DeepseekV2ForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float64,
                                               attn_implementation="sdpa", experts_implementation="eager").eval()
    positions = torch.arange(args.max_seq_len)[None]
    freqs_cis = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float64), positions)[0]
    from torchtitan_xla.models.llama.layers import rope_tables

    torch.testing.assert_close(rope_tables(args)[0], freqs_cis.real.double(), rtol=0, atol=2e-6)
    model.rope_cos.copy_(freqs_cis.real.double())
    model.rope_sin.copy_(freqs_cis.imag.double())
    for state in (read_hf_state_dict(tmp_path / "ours"), hf.state_dict()):
        back = from_hf(state, args)
        assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k].to(back[k].dtype)) for k in ours)

    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got, expected = model(tokens), hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert all((layer.feed_forward.expert_load[0] > 0).sum() > 4 for layer in list(model.layers.values())[1:])


@pytest.mark.parametrize("method,groups,topk_groups", [("group_limited_greedy", 4, 2), ("greedy", 1, 1)])
def test_v2_router_picks_transformers_experts(method, groups, topk_groups):
    """Our softmax router with V2's options chooses DeepseekV2TopkRouter's experts with its weights
    (float32, unpatched), where the groups exclude a better expert."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    experts, dim, top_k = 16, 32, 3
    config = DeepseekV2Config(hidden_size=dim, n_routed_experts=experts, num_experts_per_tok=top_k,
                              n_group=groups, topk_group=topk_groups, routed_scaling_factor=16.0,
                              topk_method=method)
    theirs = DeepseekV2TopkRouter(config)
    ours = MoE(dim, 8, experts, top_k, norm_topk=False, groups=groups, topk_groups=topk_groups,
               routed_scaling=16.0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(experts, dim, generator=g))
        ours.router.weight.copy_(theirs.weight)
    x = torch.randn(3, 40, dim, generator=g)
    assert _same_choices(ours, theirs, x, top_k) == (groups == 1)


def test_v2_published_configs_give_the_flavors_and_sizes():
    """DeepSeek-V2-Lite's and DeepSeek-V2's config.json read as our 16B and 236B deepseek_v2
    flavors: 15.7B / 2.66B active (2.4B without the embedding, as published) and 235.7B / 21.4B
    (21B)."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.models.llama.moe import inactive_expert_params

    yarn = {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
            "original_max_position_embeddings": 4096, "type": "yarn"}
    common = dict(model_type="deepseek_v2", vocab_size=102400, max_position_embeddings=163840, rms_norm_eps=1e-6,
                  rope_theta=10000, rope_scaling=yarn, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                  v_head_dim=128, n_shared_experts=2, num_experts_per_tok=6, first_k_dense_replace=1,
                  moe_layer_freq=1, norm_topk_prob=False, scoring_func="softmax", aux_loss_alpha=0.001,
                  tie_word_embeddings=False)
    lite = dict(common, hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, num_hidden_layers=27,
                num_attention_heads=16, num_key_value_heads=16, n_routed_experts=64, routed_scaling_factor=1.0,
                q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1)
    full = dict(common, hidden_size=5120, intermediate_size=12288, moe_intermediate_size=1536, num_hidden_layers=60,
                num_attention_heads=128, num_key_value_heads=128, n_routed_experts=160, routed_scaling_factor=16.0,
                q_lora_rank=1536, topk_method="group_limited_greedy", n_group=8, topk_group=3)
    for cfg, flavor, total, active in ((lite, "16B", 15.71e9, 2.661e9), (full, "236B", 235.74e9, 21.38e9)):
        args = model_args_from_hf_config(cfg)
        assert args == get_model_args("deepseek_v2", flavor, vocab_size=102400), flavor
        with torch.device("meta"):
            model = Transformer(args)
        n = model.num_params()
        assert abs(n - total) / total < 0.001 and abs(n - inactive_expert_params(model) - active) / active < 0.001
    from torchtitan_xla.errors import ConfigError

    with pytest.raises(ConfigError, match="^config.json: DeepSeek-V2 with this norm_topk_prob "):
        model_args_from_hf_config({**lite, "norm_topk_prob": True})
