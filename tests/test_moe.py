"""Mixture of experts (models/llama/moe.py) on the CPU in float64: the Mixtral debug model against
transformers' MixtralForCausalLM built from our export, the router losses against transformers'
load_balancing_loss_func and their path into the gradient, GShard's capacity and its priority,
and where the experts go with moe_every."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from torchtitan_xla.models import get_model_args
from torchtitan_xla.models.llama.model import FeedForward, Transformer
from torchtitan_xla.models.llama.moe import (
    MoE,
    dispatch_and_combine,
    grouped_mm_reference,
    set_router_loss_weights,
    sorted_experts,
)

transformers = pytest.importorskip("transformers")


def _mixtral(seed: int = 0, **overrides) -> Transformer:
    """The Mixtral debug model, 2 blocks, float64, norms and router made to matter."""
    args = get_model_args("mixtral", "debugmodel", **{"vocab_size": 300, "max_seq_len": 32, "n_layers": 2,
                                                      **overrides})
    return _random_moe(args, seed)


def _random_moe(args, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args).double()
    model.init_weights()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # init leaves norms at 1
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("router.weight"):  # init's router is nearly uniform
                p.normal_(std=0.3)
    return model


def _rmsnorm_in_input_dtype(self, hidden_states):
    """transformers' MixtralRMSNorm without its cast to float32 (which would make a float64 model
    float32 in every norm)."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _router_in_input_dtype(self, hidden_states):
    """transformers' MixtralTopKRouter without its cast of the logits to float32 before the softmax
    (our router computes in float32 or wider: float64 here)."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)
    top_value, top_index = torch.topk(router_logits.softmax(-1), self.top_k, dim=-1)
    return router_logits, top_value / top_value.sum(-1, keepdim=True), top_index


def _hf_rope(model, hf) -> None:
    """Our model gets transformers' RoPE tables (angles computed in float32, as tests/test_lora.py)."""
    inv_freq = hf.model.rotary_emb.inv_freq.float()
    angles = torch.arange(model.args.max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    model.rope_cos.copy_(angles.cos().double())
    model.rope_sin.copy_(angles.sin().double())


def _router_logits(model) -> tuple[list[torch.Tensor], list]:
    """Hooks collecting each MoE block's router logits [b, s, E] in forward order (and the handles)."""
    logits, handles = [], []
    for layer in model.layers.values():
        if isinstance(layer.feed_forward, MoE):
            handles.append(layer.feed_forward.router.register_forward_hook(lambda m, i, o: logits.append(o)))
    return logits, handles


def _aux_and_z(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The Switch / Mixtral load-balancing loss and the ST-MoE z-loss of one layer's router logits
    [..., E], written out independently of moe.py."""
    n = logits.shape[-1]
    flat = logits.reshape(-1, n)
    probs = flat.softmax(-1)
    chosen = F.one_hot(probs.topk(top_k, dim=-1).indices, n).sum(1).to(flat.dtype)  # [tokens, E]
    aux = n * (chosen.mean(0) * probs.mean(0)).sum()
    z = (flat.exp().sum(-1).log() ** 2).mean()
    return aux, z


def _loop(moe: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """The mixture computed token by token over its top-k experts (only the `keep` [b, s, k] ones)."""
    out = torch.zeros_like(x)
    probs = moe.router(x).softmax(-1)
    top_p, top_e = probs.topk(moe.top_k, dim=-1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    for b in range(x.shape[0]):
        for s in range(x.shape[1]):
            for j in range(moe.top_k):
                if keep is not None and not keep[b, s, j]:
                    continue
                e, t = top_e[b, s, j], x[b, s]
                out[b, s] += top_p[b, s, j] * (moe.w2[e] @ (F.silu(moe.w1[e] @ t) * (moe.w3[e] @ t)))
    return out


# ---- against transformers -----------------------------------------------------------------------


def test_logits_match_transformers_mixtral_float64(tmp_path, monkeypatch):
    """Exported with export_hf, the folder holds what MixtralForCausalLM.save_pretrained writes, and
    loaded with from_pretrained it computes our logits (dropless, top-2, float64); from_hf gives back
    our weights from the folder and from transformers' own (fused) state dict."""
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM
    from transformers.models.mixtral import modeling_mixtral

    from torchtitan_xla.checkpoint.hf import export_hf, model_args_from_hf_config, read_hf_state_dict
    from torchtitan_xla.models.llama.state_dict_adapter import from_hf

    model = _mixtral()
    args = model.args
    ours = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_hf(ours, args, tmp_path / "ours", dtype=torch.float64)

    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["MixtralForCausalLM"], "mixtral")
    assert (config["num_local_experts"], config["num_experts_per_tok"], config["intermediate_size"]) == (8, 2, 384)
    assert config["sliding_window"] is None and config["rope_theta"] == 1e6
    back = model_args_from_hf_config(config)
    assert (back.num_experts, back.top_k, back.expert_hidden_dim, back.moe_every, back.capacity_factor,
            back.n_kv_heads, back.rope_theta) == (8, 2, 384, 1, 0.0, 8, 1e6)
    assert back.ffn_hidden_dim == 384  # what scripts/convert_from_hf.py checks against intermediate_size

    monkeypatch.setattr(modeling_mixtral.MixtralRMSNorm, "forward", _rmsnorm_in_input_dtype)
    monkeypatch.setattr(modeling_mixtral.MixtralTopKRouter, "forward", _router_in_input_dtype)
    # "eager": transformers' reference loop over the experts.
    hf = MixtralForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float64, attn_implementation="sdpa",
                                            experts_implementation="eager").eval()
    assert hf.config.rope_parameters["rope_theta"] == 1e6
    _hf_rope(model, hf)

    # The layout on disk is transformers' own: save_pretrained of the loaded model writes the same
    # names and shapes, and model_args_from_hf_config reads its config.json (rope_parameters) alike.
    hf.save_pretrained(str(tmp_path / "theirs"))
    exported, saved = load_file(str(tmp_path / "ours" / "model.safetensors")), read_hf_state_dict(tmp_path / "theirs")
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in saved.items()}
    assert "model.layers.1.block_sparse_moe.experts.7.w2.weight" in exported
    assert model_args_from_hf_config(json.loads((tmp_path / "theirs" / "config.json").read_text())) == back
    for name, t in from_hf(read_hf_state_dict(tmp_path / "ours"), args).items():
        assert torch.equal(t, ours[name]), name
    assert from_hf(read_hf_state_dict(tmp_path / "ours"), args).keys() == ours.keys()
    in_memory = from_hf(hf.state_dict(), args)  # mlp.gate, mlp.experts.gate_up_proj / down_proj
    assert in_memory.keys() == ours.keys() and all(torch.equal(in_memory[k], ours[k]) for k in ours)
    incomplete = {k: v for k, v in exported.items() if k != "model.layers.0.block_sparse_moe.experts.3.w3.weight"}
    with pytest.raises(KeyError, match=r"layers\.0\.block_sparse_moe\.experts\.E\.w3\.weight is missing"):
        from_hf(incomplete, args)

    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    logits, handles = _router_logits(model)
    with torch.no_grad():
        got, out = model(tokens), hf(tokens, output_router_logits=True)
    for h in handles:
        h.remove()
    torch.testing.assert_close(got, out.logits, rtol=0, atol=1e-12)
    # Not a vacuous match: the experts chosen vary, and more than one expert serves each block.
    assert all((layer.feed_forward.expert_load[0] > 0).sum() > 2 for layer in model.layers.values())

    # Load balancing, against transformers' load_balancing_loss_func (which accumulates in float32).
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    stats = [layer.feed_forward.router_stats for layer in model.layers.values()]
    for i, (theirs_logits, ours_logits) in enumerate(zip(out.router_logits, logits)):
        torch.testing.assert_close(ours_logits.reshape(-1, 8), theirs_logits, rtol=0, atol=1e-12)
        one_layer = load_balancing_loss_func((theirs_logits,), 8, 2)
        torch.testing.assert_close(stats[i][0], one_layer.float(), rtol=2e-6, atol=0)
        aux, z = _aux_and_z(ours_logits, 2)
        torch.testing.assert_close(stats[i][:2], torch.stack([aux, z]).float(), rtol=2e-7, atol=0)
    # Over layers transformers does not average the layers' losses: it averages the fractions and
    # the probabilities over the layers first, E * sum_e mean_l(f_le) * mean_l(P_le), which the
    # layers' expert_load [fractions, mean probabilities] give.
    load = torch.stack([layer.feed_forward.expert_load for layer in model.layers.values()]).mean(0)
    torch.testing.assert_close(8 * (load[0] * load[1]).sum(), out.aux_loss.float(), rtol=2e-6, atol=0)
    assert not math.isclose(out.aux_loss.item(), torch.stack(stats)[:, 0].mean().item(), rel_tol=1e-4)


def test_the_training_export_has_the_runs_aux_weight_and_the_flavors_context(tmp_path):
    """A Mixtral run with [moe] aux_loss_weight 0.03 at seq_len 64, exported after its last step:
    config.json's router_aux_loss_coef is 0.03 with output_router_logits on (transformers adds
    the balancing loss only then), max_position_embeddings the flavor's context, and the folder
    gives the checkpoint's logits in transformers."""
    from helpers import tiny_args, train_run
    from transformers import MixtralForCausalLM

    from torchtitan_xla.checkpoint import read_model_state

    train_run(tiny_args(tmp_path, "--model.name", "mixtral", "--training.steps", "1", "--moe.aux_loss_weight",
                        "0.03", "--checkpoint.enable", "--checkpoint.last_save_in_hf"),
              model_overrides={"n_layers": 2})
    hf_dir = tmp_path / "checkpoint" / "step-1-hf"
    config = json.loads((hf_dir / "config.json").read_text())
    assert (config["router_aux_loss_coef"], config["output_router_logits"]) == (0.03, True)
    assert config["max_position_embeddings"] == get_model_args("mixtral", "debugmodel").max_seq_len == 2048
    assert (config["rope_theta"], config["num_hidden_layers"], config["router_jitter_noise"]) == (1e6, 2, 0.0)
    state, args = read_model_state(tmp_path / "checkpoint" / "step-1")
    assert (args.max_seq_len, args.aux_loss_weight) == (64, 0.03)
    ours = Transformer(args)
    ours.load_state_dict(state)
    hf = MixtralForCausalLM.from_pretrained(str(hf_dir), attn_implementation="sdpa").eval()
    tokens = torch.randint(0, args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = hf(tokens)
        # float32 on both sides: summation order and RoPE angle precision (measured 1.2e-6).
        torch.testing.assert_close(ours(tokens), out.logits, rtol=0, atol=1e-5)
    assert out.aux_loss is not None  # the config's output_router_logits: transformers computes it


QWEN3_MOE_CASES = [(1, 32), (2, 17)]  # (moe_every, sequence length)


@pytest.mark.parametrize("moe_every,seq", QWEN3_MOE_CASES, ids=["every_block_32", "every_other_17"])
def test_qwen3_moe_matches_transformers_float64(moe_every, seq, tmp_path, monkeypatch):
    """Qwen3's MoE debug model (8 experts, top-4, query/key norms), exported with export_hf: the
    folder is what Qwen3MoeForCausalLM.save_pretrained writes (per-expert gate/up/down_proj under
    mlp.experts), from_pretrained computes our logits (dropless, renormalised top-k, float64), with
    experts in every block and, as decoder_sparse_step, in every other; import is bit-exact."""
    from safetensors.torch import load_file
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    from torchtitan_xla.checkpoint.hf import export_hf, model_args_from_hf_config, read_hf_state_dict
    from torchtitan_xla.models.llama.state_dict_adapter import from_hf

    args = get_model_args("qwen3", "debugmodel_moe", vocab_size=300, max_seq_len=32, n_layers=2,
                          moe_every=moe_every)
    model = _random_moe(args)
    ours = {k: v.detach().clone() for k, v in model.state_dict().items()}
    export_hf(ours, args, tmp_path / "ours", dtype=torch.float64)
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Qwen3MoeForCausalLM"], "qwen3_moe")
    assert (config["num_experts"], config["num_experts_per_tok"], config["moe_intermediate_size"],
            config["intermediate_size"], config["decoder_sparse_step"], config["norm_topk_prob"]) == (
        8, 4, 192, 768, moe_every, True)
    assert model_args_from_hf_config(config) == get_model_args("qwen3", "debugmodel_moe", vocab_size=300,
                                                               n_layers=2, moe_every=moe_every)

    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeRMSNorm, "forward", _rmsnorm_in_input_dtype)
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _router_in_input_dtype)
    hf = Qwen3MoeForCausalLM.from_pretrained(str(tmp_path / "ours"), dtype=torch.float64, attn_implementation="sdpa",
                                             experts_implementation="eager").eval()
    _hf_rope(model, hf)
    hf.save_pretrained(str(tmp_path / "theirs"))
    exported, saved = load_file(str(tmp_path / "ours" / "model.safetensors")), read_hf_state_dict(tmp_path / "theirs")
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in saved.items()}
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in exported
    for state in (read_hf_state_dict(tmp_path / "ours"), hf.state_dict()):  # on disk; fused in memory
        back = from_hf(state, args)
        assert back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)

    tokens = torch.randint(0, args.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        got, expected = model(tokens), hf(tokens).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    moe_blocks = [layer.feed_forward for layer in model.layers.values() if isinstance(layer.feed_forward, MoE)]
    assert len(moe_blocks) == 2 // moe_every and all((m.expert_load[0] > 0).sum() > 4 for m in moe_blocks)


# ---- router losses --------------------------------------------------------------------------------


def test_router_losses_reach_the_gradient_without_changing_the_output():
    """With aux_loss_weight and z_loss_weight set, backward of logits.sum() gives the gradient of
    logits.sum() + sum over blocks of (w_aux * aux + w_z * z), those computed independently from the
    router logits; the logits themselves are the same with the weights as without."""
    model = _mixtral()
    tokens = torch.randint(0, model.args.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2))
    w_aux, w_z = 0.3, 0.05

    logits, handles = _router_logits(model)
    plain = model(tokens)
    explicit = plain.sum() + sum(w_aux * a + w_z * z for a, z in (_aux_and_z(lg, 2) for lg in logits))
    explicit.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    for h in handles:
        h.remove()
    model.zero_grad()

    # Shared over the 2 blocks and 3 microbatches: each block gets w / 6 (set back to w here).
    blocks = set_router_loss_weights(model, 6 * w_aux, 6 * w_z, microbatches=3)
    assert blocks == [layer.feed_forward for layer in model.layers.values()]
    assert [(b.aux_loss_weight, b.z_loss_weight) for b in blocks] == [pytest.approx((w_aux, w_z))] * 2
    weighted = model(tokens)
    assert torch.equal(weighted, plain)
    weighted.sum().backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-12, atol=1e-14, msg=name)
    # The losses moved the routers: their gradients differ from the language-model-only ones.
    model.zero_grad()
    for layer in model.layers.values():
        layer.feed_forward.aux_loss_weight = layer.feed_forward.z_loss_weight = 0.0
    model(tokens).sum().backward()
    router = "layers.0.feed_forward.router.weight"
    assert (dict(model.named_parameters())[router].grad - expected[router]).abs().max() > 1e-3


# ---- dispatch and capacity ------------------------------------------------------------------------


def _moe(top_k: int = 2, capacity_factor: float = 0.0, num_experts: int = 4, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(16, 24, num_experts, top_k, capacity_factor).double()
    moe.init_weights(0.02)
    with torch.no_grad():
        moe.router.weight.normal_(std=1.0)
        for w in (moe.w1, moe.w2, moe.w3):
            w.normal_(std=0.3)
    return moe


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_dropless_equals_the_per_token_loop(top_k):
    moe = _moe(top_k)
    x = torch.randn(3, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        got = moe(x)
        torch.testing.assert_close(got, _loop(moe, x), rtol=0, atol=1e-13)
    assert moe.capacity(10) == 10 and moe.router_stats[2] == 0
    # A capacity of at least the sequence length never drops: the same result.
    big = _moe(top_k, capacity_factor=4 / top_k)
    with torch.no_grad():
        assert big.capacity(10) == 10 and torch.equal(big(x), got)


def test_grouped_mm_reference_is_megablox_gmm():
    """Rows in consecutive groups (an empty one included), each times its expert's matrix."""
    g = torch.Generator().manual_seed(0)
    lhs, rhs = torch.randn(9, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, 3, generator=g, dtype=torch.float64)
    sizes = torch.tensor([2, 0, 4, 3], dtype=torch.int32)
    expected = torch.cat([lhs[0:2] @ rhs[0], lhs[2:6] @ rhs[2], lhs[6:9] @ rhs[3]])
    torch.testing.assert_close(grouped_mm_reference(lhs, rhs, sizes), expected, rtol=0, atol=1e-14)


@pytest.mark.parametrize("top_k", [2, 3])
def test_sorted_experts_equal_dispatch_forward_and_backward(top_k):
    """[moe] grouped_mm's path (tokens sorted by expert, grouped matmuls) against GShard's dropless
    dispatch in float64: the output, and the gradients of the input, the router and every expert."""
    x = torch.randn(3, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    results = []
    for grouped in (False, True):
        moe = _moe(top_k)
        moe.routed_experts = sorted_experts if grouped else None
        xi = x.clone().requires_grad_()
        out = moe(xi)
        out.pow(2).sum().backward()
        results.append([out, xi.grad, moe.router.weight.grad, moe.w1.grad, moe.w2.grad, moe.w3.grad])
        assert moe.router_stats[2] == 0  # nothing dropped either way
    for dispatched, grouped in zip(*results):
        torch.testing.assert_close(grouped, dispatched, rtol=0, atol=1e-12)


def test_padding_takes_no_slot_and_no_share_of_the_router_losses():
    """A row of 6 tokens then 4 padding (`tokens` False): with a capacity that drops, the real
    tokens get the slots, outputs, router losses and load the 6 tokens alone get (the same C = 2
    slots per expert for 10 and 6 tokens), and padding's output is zero. Without the mask the
    padding's first choices take slots before the real tokens' second choices."""
    x = torch.randn(1, 10, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    tokens = torch.arange(10)[None] < 6
    moe = _moe(2, capacity_factor=0.4)
    assert moe.capacity(10) == moe.capacity(6) == 2
    with torch.no_grad():
        alone = moe(x[:, :6])
        alone_stats, alone_load = moe.router_stats, moe.expert_load
        masked = moe(x, tokens)
        torch.testing.assert_close(masked[:, :6], alone, rtol=0, atol=1e-13)
        assert torch.equal(masked[:, 6:], torch.zeros_like(masked[:, 6:]))
        torch.testing.assert_close(moe.router_stats, alone_stats, rtol=0, atol=1e-6)  # float32 stats
        torch.testing.assert_close(moe.expert_load, alone_load, rtol=0, atol=1e-6)
        assert not torch.allclose(moe(x)[:, :6], alone, atol=1e-6)  # unmasked, padding steals slots
        # Sorted experts (dropless) route padding nowhere as well.
        dropless = _moe(2)
        expected = dropless(x[:, :6])
        dropless.routed_experts = sorted_experts
        got = dropless(x, tokens)
        torch.testing.assert_close(got[:, :6], expected, rtol=0, atol=1e-13)
        assert torch.equal(got[:, 6:], torch.zeros_like(got[:, 6:]))


def test_packed_padding_leaves_every_blocks_router_losses_as_without_it():
    """Through the model: a packed row whose last 8 positions are padding (document 0) gives the
    real tokens' logits and every MoE block's router statistics of the row without the padding."""
    model = _mixtral()
    tokens = torch.randint(0, 300, (1, 24), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[1] * 10 + [2] * 6 + [0] * 8])
    positions = torch.cat([torch.arange(10), torch.arange(6), torch.zeros(8, dtype=torch.long)])[None]
    blocks = [m for m in model.modules() if isinstance(m, MoE)]
    with torch.no_grad():
        real = model(tokens[:, :16], positions[:, :16], documents[:, :16])
        stats = [m.router_stats for m in blocks]
        padded = model(tokens, positions, documents)
    torch.testing.assert_close(padded[:, :16], real, rtol=0, atol=1e-12)
    for m, expected in zip(blocks, stats):
        torch.testing.assert_close(m.router_stats, expected, rtol=0, atol=1e-6)


def _two_groups(b: int = 1) -> tuple[MoE, torch.Tensor]:
    """Tokens 0-2 choose expert 1 then 0, tokens 3-5 expert 0 then 1 (router on features 0 and 1);
    in a second sequence (b = 2) every token chooses expert 0 then 1."""
    moe = _moe(2, capacity_factor=0.6)  # C = ceil(0.6 * 2 * 6 / 4) = 2
    x = torch.randn(b, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    x[:, :, 0] = 1.0
    x[0, :3, 1], x[0, 3:, 1] = 1.0, -1.0
    if b == 2:
        x[1, :, 1] = -1.0
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, :2] = torch.tensor([10.0, -2.0], dtype=torch.float64)
        moe.router.weight[1, :2] = torch.tensor([10.0, 2.0], dtype=torch.float64)
    return moe, x


def test_capacity_drops_in_gshard_priority_order():
    """With 2 slots per expert, every first choice takes a slot before any second choice, in
    sequence order: expert 0 takes the first choices of tokens 3 and 4, expert 1 those of 0 and 1;
    token 2's and 5's first choices and every second choice are dropped; tokens 2 and 5 get
    nothing (output 0). Each sequence is its own group: the second, where every token chooses 0
    then 1, keeps both choices of tokens 0 and 1 only."""
    moe, x = _two_groups(b=2)
    assert moe.capacity(6) == 2
    with torch.no_grad():
        _, experts = moe.router(x).softmax(-1).topk(2, dim=-1)
    assert experts[0].tolist() == [[1, 0]] * 3 + [[0, 1]] * 3 and experts[1].tolist() == [[0, 1]] * 6

    dispatch, combine, kept = dispatch_and_combine(experts, torch.ones(2, 6, 2, dtype=torch.float64), 4, 2)
    slots = {(b, s, e, c) for b, s, e, c in dispatch.nonzero().tolist()}
    assert slots == {(0, 3, 0, 0), (0, 4, 0, 1), (0, 0, 1, 0), (0, 1, 1, 1),
                     (1, 0, 0, 0), (1, 1, 0, 1), (1, 0, 1, 0), (1, 1, 1, 1)}
    assert torch.equal(combine, dispatch)
    expected_kept = torch.zeros(2, 6, 2, dtype=torch.bool)
    expected_kept[0, [0, 1, 3, 4], 0] = True
    expected_kept[1, [0, 1]] = True
    assert torch.equal(kept, expected_kept)

    with torch.no_grad():
        out = moe(x)
        torch.testing.assert_close(out, _loop(moe, x, keep=expected_kept), rtol=0, atol=1e-13)
    assert out[0, 2].abs().max() == 0 and out[0, 5].abs().max() == 0 and out[1, 2:].abs().max() == 0
    assert out[0, [0, 1, 3, 4]].abs().amin(-1).min() > 0
    assert moe.router_stats[2].item() == pytest.approx(16 / 24)  # (8 + 8) of 24 choices
    # The fractions count choices before the drops: experts 0 and 1 are chosen by every token.
    assert moe.expert_load[0].tolist() == [1.0, 1.0, 0.0, 0.0]


def test_every_choice_to_one_expert_keeps_the_first_capacity_tokens():
    """Top-1, every token to expert 0, capacity factor 1: C = ceil(1 * 8 / 4) = 2 of 8 tokens."""
    moe = _moe(1, capacity_factor=1.0)
    x = torch.randn(1, 8, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    x[:, :, 0] = 1.0
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0, 0] = 5.0
        out = moe(x)
        torch.testing.assert_close(out[0, :2], _loop(moe, x)[0, :2], rtol=0, atol=1e-13)
    assert out[0, :2].abs().amin(-1).min() > 0 and out[0, 2:].abs().max() == 0
    assert moe.router_stats[2].item() == 0.75


def test_moe_traces_into_one_xla_graph(xla_device):
    """Forward and backward with the router losses on: one graph, no op falling back to the CPU and
    nothing read back to the host before the step ends (static shapes, no data-dependent ops)."""
    import torch_xla
    import torch_xla.debug.metrics as met

    moe = _moe(2, capacity_factor=1.0).float().to(xla_device)
    moe.aux_loss_weight, moe.z_loss_weight = 0.01, 0.001
    x = torch.randn(2, 16, 16, device=xla_device, requires_grad=True)
    met.clear_all()
    moe(x).sum().backward()
    assert "TransferFromDeviceTime" not in met.metric_names()
    torch_xla.sync(wait=True)  # executions are counted when they have run
    # One graph run (SPMD, as conftest's xla_device sets up), compiled here or by an earlier test.
    assert met.counter_value("ExecuteReplicated") == 1
    assert [c for c in met.counter_names() if c.startswith("aten::")] == []
    assert moe.w1.grad.cpu().abs().max() > 0 and moe.router_stats.cpu()[2] > 0


# ---- model arguments and structure ---------------------------------------------------------------


def test_mixtral_8x7b_config_json_gives_the_8x7b_flavor():
    """Mixtral-8x7B's config.json as transformers 5 writes it (MixtralConfig's defaults are 8x7B's:
    rope_parameters, head_dim null) reads as our 8x7B flavor; a sliding window is refused."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.errors import ConfigError

    # The published config.json's values where they are not MixtralConfig's defaults.
    cfg = transformers.MixtralConfig(max_position_embeddings=32768, router_aux_loss_coef=0.02).to_dict()
    assert cfg["head_dim"] is None and "rope_theta" not in cfg
    assert model_args_from_hf_config(cfg) == get_model_args("mixtral", "8x7B", vocab_size=32000, max_seq_len=32768)
    big = transformers.MixtralConfig(hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
                                     num_attention_heads=48, max_position_embeddings=65536,
                                     router_aux_loss_coef=0.001).to_dict()
    assert model_args_from_hf_config(big) == get_model_args("mixtral", "8x22B", vocab_size=32000, max_seq_len=65536)
    with pytest.raises(ConfigError, match="sliding_window"):
        model_args_from_hf_config({**cfg, "sliding_window": 4096})



def test_qwen3_moe_config_jsons_give_the_moe_flavors():
    """Qwen3-30B-A3B's and 235B-A22B's config.json (their published values, as transformers 5
    writes them) read as our flavors; a router without renormalised top-k is refused in one line."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.errors import ConfigError

    common = dict(vocab_size=151936, num_key_value_heads=4, head_dim=128, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}, max_position_embeddings=40960, rms_norm_eps=1e-6,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, router_aux_loss_coef=0.001)
    small = transformers.Qwen3MoeConfig(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, **common).to_dict()
    big = transformers.Qwen3MoeConfig(hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
                                      num_hidden_layers=94, num_attention_heads=64, **common).to_dict()
    for cfg, flavor in ((small, "30B-A3B"), (big, "235B-A22B")):
        assert model_args_from_hf_config(cfg) == get_model_args("qwen3", flavor, vocab_size=151936)
    with pytest.raises(ConfigError, match="^config.json: Qwen3-MoE without norm_topk_prob"):
        model_args_from_hf_config({**small, "norm_topk_prob": False})


def test_moe_every_two_puts_experts_in_every_other_block():
    args = get_model_args("mixtral", "debugmodel", vocab_size=300, max_seq_len=16, moe_every=2)
    assert [args.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    model = Transformer(args)
    assert [type(layer.feed_forward) for layer in model.layers.values()] == [FeedForward, MoE, FeedForward, MoE]
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters() if ".feed_forward." in n}
    assert {n: s for n, s in shapes.items() if n.startswith(("layers.0.", "layers.1."))} == {
        "layers.0.feed_forward.w1.weight": (768, 256), "layers.0.feed_forward.w2.weight": (256, 768),
        "layers.0.feed_forward.w3.weight": (768, 256),
        "layers.1.feed_forward.router.weight": (8, 256), "layers.1.feed_forward.w1": (8, 384, 256),
        "layers.1.feed_forward.w2": (8, 256, 384), "layers.1.feed_forward.w3": (8, 384, 256)}
    model.init_weights()
    tokens = torch.randint(0, 300, (2, 16))
    model(tokens).sum().backward()
    assert model.layers["3"].feed_forward.w2.grad.abs().max() > 0
    # No transformers architecture has this: export says so before writing anything.
    from torchtitan_xla.models.llama.hf_config_json import hf_config

    with pytest.raises(ValueError, match="moe_every=2"):
        hf_config(args)


def test_flavors_and_args():
    from torchtitan_xla.models import all_flavors, get_model_class

    assert all_flavors()["mixtral"] == ["debugmodel", "8x7B", "8x22B"]
    assert get_model_class("mixtral") is Transformer
    big = get_model_args("mixtral", "8x7B")
    assert (big.dim, big.n_layers, big.n_heads, big.kv_heads, big.num_experts, big.top_k, big.expert_hidden_dim,
            big.rope_theta) == (4096, 32, 32, 8, 8, 2, 14336, 1e6)
    assert all(big.is_moe_layer(i) for i in range(32))
    huge = get_model_args("mixtral", "8x22B")
    assert (huge.dim, huge.n_layers, huge.n_heads, huge.kv_heads, huge.expert_hidden_dim) == (6144, 56, 48, 8, 16384)
    assert (big.ffn_hidden_dim, huge.ffn_hidden_dim) == (14336, 16384)  # dense blocks, with moe_every > 1
    # Every dense flavor stays dense.
    for name in ("llama2", "llama3"):
        for flavor in all_flavors()[name]:
            args = get_model_args(name, flavor)
            assert args.num_experts == 0 and not any(args.is_moe_layer(i) for i in range(args.n_layers))
    from types import SimpleNamespace

    from torchtitan_xla.models import moe_overrides

    section = SimpleNamespace(num_experts=4, top_k=0, moe_every=2, capacity_factor=0.0, aux_loss_weight=0.0)
    # 0: the flavor's, except the aux loss's weight, for which 0 is a weight like any other.
    assert moe_overrides(section) == {"num_experts": 4, "moe_every": 2, "aux_loss_weight": 0.0}
    glam = get_model_args("llama3", "debugmodel", **moe_overrides(section))
    assert (glam.num_experts, glam.top_k, glam.moe_every, glam.expert_hidden_dim) == (4, 2, 2, 768)
    assert get_model_args("llama3", "debugmodel", aux_loss_weight=0.5).aux_loss_weight == 0.0  # no router
    with pytest.raises(ValueError, match="top_k"):
        get_model_args("mixtral", "debugmodel", top_k=9)
    with pytest.raises(ValueError, match="moe_every"):
        get_model_args("mixtral", "debugmodel", moe_every=0)
