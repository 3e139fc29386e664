"""The Llama definition against an independent reference: HuggingFace transformers' LlamaForCausalLM
with the same weights (converted by the state-dict adapter), in float64 on the CPU."""

import dataclasses
import os
import re
import subprocess
import sys

import pytest
import torch
from helpers import REPO

from torchtitan_xla.models import get_model_args
from torchtitan_xla.models.llama import ModelArgs, RopeScaling, Transformer
from torchtitan_xla.models.llama.blockwise_attention import BlockwiseCausalAttention
from torchtitan_xla.models.llama.hf_config_json import hf_config
from torchtitan_xla.models.llama.state_dict_adapter import from_hf, to_hf

transformers = pytest.importorskip("transformers")

# Llama 2 style (multi-head, plain RoPE) and Llama 3.1 style (grouped-query, scaled RoPE; the
# scaling's original context is short so every branch of the frequency blend is exercised).
CASES = {
    "llama2": ModelArgs(dim=64, n_layers=2, n_heads=4, vocab_size=97, multiple_of=32, max_seq_len=48),
    "llama3.1": ModelArgs(dim=64, n_layers=2, n_heads=8, n_kv_heads=2, vocab_size=97, multiple_of=32,
                          ffn_dim_multiplier=1.3, rope_theta=500000, max_seq_len=48,
                          rope_scaling=RopeScaling(factor=8, low_freq_factor=1, high_freq_factor=4,
                                                   original_max_position_embeddings=16)),
}


def _ours(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args).double()
    model.init_weights()
    with torch.no_grad():  # init leaves norms at 1: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    return model


def _hf(args: ModelArgs, ours: Transformer):
    config = transformers.LlamaConfig(**hf_config(args))
    hf = transformers.LlamaForCausalLM(config).double()
    hf.load_state_dict(to_hf(ours.state_dict(), args), strict=True)
    return hf.eval()


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_float64(case):
    args = CASES[case]
    ours = _ours(args)
    hf = _hf(args, ours)
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        expected = hf(tokens).logits
        got = ours(tokens)
    # Both run in float64, except that transformers computes the RoPE angles in float32 whatever
    # the model dtype (we compute them in float64): angle errors of ~1e-7 rad give logit
    # differences of a few 1e-7 here (measured 4.9e-7). A wrong layout or formula gives O(1).
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)


def test_rope_permutation_is_what_makes_them_agree():
    """Guard against a vacuous pass: without the wq/wk permutation the outputs differ."""
    args = CASES["llama3.1"]
    ours = _ours(args)
    hf = _hf(args, ours)
    sd = to_hf(ours.state_dict(), args)
    sd_unpermuted = {k: v for k, v in sd.items()}
    for i in range(args.n_layers):
        sd_unpermuted[f"model.layers.{i}.self_attn.q_proj.weight"] = ours.layers[str(i)].attention.wq.weight
    hf.load_state_dict(sd_unpermuted)
    tokens = torch.randint(0, args.vocab_size, (1, 32))
    with torch.no_grad():
        assert (hf(tokens).logits - ours(tokens)).abs().max() > 1e-3


def test_hf_round_trip_is_exact():
    args = CASES["llama3.1"]
    sd = _ours(args).state_dict()
    back = from_hf(to_hf(sd, args), args)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k


@pytest.mark.parametrize("attention", ["sdpa", "blockwise"])
def test_xla_float32_matches_float64_reference(xla_device, attention):
    """The same model run by XLA (float32, CPU backend) against the float64 eager reference."""
    args = CASES["llama3.1"]
    ref = _ours(args)
    tokens = torch.randint(0, args.vocab_size, (2, args.max_seq_len))
    with torch.no_grad():
        expected = ref(tokens)
        model = Transformer(args)
        if attention == "blockwise":
            for block in model.layers.values():
                block.attention.sdpa = BlockwiseCausalAttention()
        model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
        model.to(xla_device)
        got = model(tokens.to(xla_device)).cpu().double()
    # float32 through 2 layers with |logits| ~ 1: errors of a few 1e-6 expected.
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-5)


@pytest.mark.parametrize("seqlen", [1, 3, 48, 50])
def test_blockwise_attention_equals_sdpa_float64(seqlen):
    """Blockwise causal attention (query blocks against only their visible keys) is the same
    function as causal SDPA, values and gradients, including lengths the blocks do not divide."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, seqlen, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    got = BlockwiseCausalAttention()(q, k, v)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    grad_out = torch.randn_like(expected)
    for g, e in zip(torch.autograd.grad(got, (q, k, v), grad_out),
                    torch.autograd.grad(expected, (q, k, v), grad_out)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-12)


def _window_reference(q, k, v, window: int, documents=None):
    """torch's SDPA with the sliding-window mask written out: key j seen by query i iff
    0 <= i - j < window (and in its document)."""
    i = torch.arange(q.shape[-2])[:, None]
    mask = ((i - torch.arange(k.shape[-2])[None, :]) >= 0) & ((i - torch.arange(k.shape[-2])[None, :]) < window)
    if documents is not None:
        mask = (documents[:, :, None] == documents[:, None, :]) & mask
        mask = mask[:, None]
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("seqlen, window", [(5, 8), (48, 8), (50, 7), (64, 16)])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_sliding_window_attention_equals_the_masked_reference_in_every_kernel_float64(seqlen, window, packed):
    """A sliding window (sequences shorter and longer than it, windows the blocks do not divide,
    with and without packed documents): the model's einsum sdpa, the blockwise kernel and the
    native runtime's fused kernel give torch's SDPA under the window's mask written out, values
    and gradients; the blockwise kernel multiplies only the keys from each query block's first
    window on."""
    from torchtitan_xla.models.llama import blockwise_attention
    from torchtitan_xla.models.llama.layers import ScaledDotProductAttention
    from torchtitan_xla.runtime.native.kernels import flash_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, seqlen, 16, dtype=torch.float64, requires_grad=True) for _ in range(3))
    documents = positions = None
    if packed:  # two documents a row, split at different places
        documents = torch.stack([(torch.arange(seqlen) >= seqlen // 3).long() + 1,
                                 (torch.arange(seqlen) >= seqlen // 2).long() + 1])
        positions = torch.arange(seqlen).expand(2, seqlen)
    expected = _window_reference(q, k, v, window, documents)
    products = []
    apply = blockwise_attention._QueriesTimesKeys.apply

    def counted(a, b):
        products.append(a.shape[-2] * b.shape[-2])
        return apply(a, b)

    blockwise_attention._QueriesTimesKeys.apply = counted
    try:
        got = {"sdpa": ScaledDotProductAttention(window)(q, k, v, *(() if documents is None else (documents, positions))),
               "blockwise": BlockwiseCausalAttention(window=window)(q, k, v, documents),
               "native flash": flash_attention(q, k, v, segment_ids=documents, window=window)}
    finally:
        blockwise_attention._QueriesTimesKeys.apply = apply
    grad_out = torch.randn_like(expected)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad_out)
    for name, out in got.items():
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12, msg=name)
        for g, e in zip(torch.autograd.grad(out, (q, k, v), grad_out), expected_grads):
            torch.testing.assert_close(g, e, rtol=0, atol=1e-12, msg=name)
    # Query blocks of at most half a window (at least 4), each against its keys from the window
    # of its first query on.
    n = min(max(4, -(-2 * seqlen // window)), seqlen)
    bounds = [seqlen * i // n for i in range(n + 1)]
    assert products == [(e - s) * (e - max(s - window + 1, 0)) for s, e in zip(bounds, bounds[1:])]


def test_blockwise_sliding_window_multiplies_a_fraction_of_the_causal_scores():
    """At a sequence 4 windows long (256, window 64): the blockwise kernel multiplies 0.33 of the
    [seq, seq] scores, 0.58 of what causal blocks of the same size do (the window's band is 0.22 of
    the scores and the causal triangle 0.5)."""
    from torchtitan_xla.models.llama import blockwise_attention

    products = []
    apply = blockwise_attention._QueriesTimesKeys.apply
    blockwise_attention._QueriesTimesKeys.apply = lambda a, b: products.append(a.shape[-2] * b.shape[-2]) or apply(a, b)
    try:
        q = torch.randn(1, 1, 256, 8)
        BlockwiseCausalAttention(window=64)(q, q, q)
        windowed = sum(products)
        products.clear()
        BlockwiseCausalAttention(blocks=8)(q, q, q)  # the same 8 blocks, causal only
        causal = sum(products)
    finally:
        blockwise_attention._QueriesTimesKeys.apply = apply
    assert windowed / 256**2 == pytest.approx(0.33, abs=0.005)
    assert windowed / causal == pytest.approx(0.58, abs=0.005)


def test_a_models_local_layers_are_its_windowed_ones_and_the_kv_cache_keeps_to_them():
    """`sliding_window_pattern` p: every p-th block global, the rest local (Gemma 3: 6, gpt-oss: 2).
    Greedy decoding through the KV cache gives the logits of the whole sequence at once, with the
    window's mask on the local layers (a prompt longer than the window)."""
    from helpers import decode_through_cache

    from torchtitan_xla.models.llama import ModelArgs, Transformer

    args = ModelArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=50, multiple_of=16, max_seq_len=24,
                     sliding_window=5, sliding_window_pattern=2)
    assert [args.window(i) for i in range(4)] == [5, 0, 5, 0]
    torch.manual_seed(0)
    model = Transformer(args).double()
    model.init_weights()
    assert [b.attention.sdpa.window for b in model.layers.values()] == [5, 0, 5, 0]
    tokens = torch.randint(1, 50, (2, 20))
    whole = model(tokens)
    plain = Transformer(dataclasses.replace(args, sliding_window=0)).double()
    plain.load_state_dict(model.state_dict())
    assert not torch.allclose(plain(tokens), whole)  # the window changes the logits beyond 5 tokens
    torch.testing.assert_close(decode_through_cache(model, tokens, 12), whole, rtol=0, atol=1e-12)


_BLOCKWISE_PROBE = """
import torch, torch_xla, torch_xla.runtime as xr
xr.use_spmd()
from torchtitan_xla.models.llama.blockwise_attention import BlockwiseCausalAttention
dev = torch_xla.device()
q, k, v = (torch.randn(2, 4, 32, 8).to(dev).requires_grad_() for _ in range(3))
out = BlockwiseCausalAttention(blocks=2)(q, k, v)
grads = torch.autograd.grad(out, (q, k, v), torch.randn(out.shape).to(dev))
torch_xla.sync()
"""


def test_blockwise_attention_compiles_to_fast_dot_orientations(tmp_path):
    """Every batched product of blockwise attention, forward and backward, as XLA CPU compiles it
    (the optimized HLO it dumps): both operands row-major, contracting over the left one's last and
    the right one's middle dimension, and no [keys, head_dim] output. Eigen runs the other
    orientations of these shapes 1.5-3x slower (docs/performance.md). Head dim 8 and query blocks
    of 16 keep the shapes distinct: [queries, keys], [queries, head_dim], [head_dim, keys]."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
           "XLA_FLAGS": f"--xla_dump_to={tmp_path} --xla_dump_hlo_as_text"}
    subprocess.run([sys.executable, "-c", _BLOCKWISE_PROBE], env=env, cwd=REPO, check=True,
                   capture_output=True, timeout=300)
    (hlo,) = [p.read_text() for p in tmp_path.glob("*SyncTensorsGraph*cpu_after_optimizations.txt")]
    dots = re.findall(r"= f32\[\d+,(\d+),(\d+)\]\S* dot\(.*lhs_contracting_dims=\{(\d)\}.*"
                      r"rhs_contracting_dims=\{(\d)\}", hlo)
    assert len(dots) == 12  # 2 blocks x (2 forward + 4 gradient products)
    assert {(lhs, rhs) for *_, lhs, rhs in dots} == {("2", "1")}
    assert {(int(m), int(n)) for m, n, *_ in dots} == {(16, 16), (16, 32), (16, 8), (8, 16), (8, 32)}


def test_flavors_have_published_sizes():
    """Parameter counts of the flavors (vocab from the real tokenizers) equal the published ones."""
    expected = {("llama2", "7B", 32000): 6_738_415_616, ("llama2", "13B", 32000): 13_015_864_320,
                ("llama2", "70B", 32000): 68_976_648_192, ("llama3", "8B", 128256): 8_030_261_248,
                ("llama3", "70B", 128256): 70_553_706_496, ("llama3", "405B", 128256): 405_853_388_800}
    for (name, flavor, vocab), n in expected.items():
        args = get_model_args(name, flavor, vocab_size=vocab)
        with torch.device("meta"):
            assert Transformer(args).num_params() == n, (name, flavor)
    debug = get_model_args("llama3", "debugmodel", vocab_size=2256)
    assert (debug.dim, debug.n_layers, debug.n_heads, debug.ffn_hidden_dim) == (256, 8, 16, 768)


def test_meta_init_allocates_nothing():
    args = get_model_args("llama3", "405B", vocab_size=128256)
    with torch.device("meta"):
        model = Transformer(args)
    assert all(p.is_meta for p in model.parameters())


def test_registry_is_not_mutated():
    a = get_model_args("llama3", "debugmodel", vocab_size=10)
    b = get_model_args("llama3", "debugmodel")
    assert a.vocab_size == 10 and b.vocab_size == -1
    assert dataclasses.replace(b) == b


# Qwen3: per-head query/key norms before RoPE, heads wider than dim / n_heads, grouped-query.
QWEN3 = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim_override=24, qk_norm=True,
                  vocab_size=97, multiple_of=192, rope_theta=1e6, norm_eps=1e-6, max_seq_len=48)


@pytest.mark.parametrize("seq", [48, 17])
def test_qwen3_logits_match_transformers_float64(seq):
    """transformers' Qwen3ForCausalLM with the exported config and weights (the norms' entries
    permuted with the heads' RoPE layout), at two lengths: the same logits (RoPE angles in float32
    there, as for Llama above: 4.2e-7 measured); and without the norms' permutation, not."""
    ours = _ours(QWEN3)
    config = transformers.Qwen3Config(**hf_config(QWEN3))
    hf = transformers.Qwen3ForCausalLM(config).double().eval()
    state = to_hf(ours.state_dict(), QWEN3)
    hf.load_state_dict(state, strict=True)
    tokens = torch.randint(0, QWEN3.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seq))
    with torch.no_grad():
        got, expected = ours(tokens), hf(tokens).logits
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-6)
        for i in range(QWEN3.n_layers):
            state[f"model.layers.{i}.self_attn.q_norm.weight"] = ours.layers[str(i)].attention.q_norm.weight
        hf.load_state_dict(state, strict=True)
        assert (hf(tokens).logits - got).abs().max() > 1e-4


def test_qwen3_config_round_trips_and_the_weights_bit_exactly():
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config

    back = model_args_from_hf_config(hf_config(QWEN3))
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "head_dim", "qk_norm", "ffn_hidden_dim",
                  "norm_eps", "rope_theta", "vocab_size"):
        assert getattr(back, field) == getattr(QWEN3, field), field
    sd = _ours(QWEN3).state_dict()
    again = from_hf(to_hf(sd, QWEN3), QWEN3)
    assert again.keys() == sd.keys() and all(torch.equal(again[k], sd[k]) for k in sd)


# (family, flavor, vocabulary, total and non-embedding parameters in billions as the model cards
# round them, FFN size of the checkpoints' config.json)
PUBLISHED = [("qwen3", "0.6B", 151936, 0.6, 0.44, 3072), ("qwen3", "1.7B", 151936, 1.7, 1.4, 6144),
             ("qwen3", "4B", 151936, 4.0, 3.6, 9728), ("qwen3", "8B", 151936, 8.2, 6.95, 12288),
             ("qwen3", "14B", 151936, 14.8, 13.2, 17408), ("qwen3", "32B", 151936, 32.8, 31.2, 25600),
             ("qwen3", "30B-A3B", 151936, 30.5, 29.9, 6144), ("qwen3", "235B-A22B", 151936, 235, 234, 12288),
             ("llama3", "1B", 128256, 1.24, None, 8192), ("llama3", "3B", 128256, 3.21, None, 8192)]
# The MoE flavors' activated parameters (a token runs through top_k of the experts), as published.
ACTIVE = {"30B-A3B": 3.3, "235B-A22B": 22}


@pytest.mark.parametrize("family,flavor,vocab,total,non_embedding,ffn", PUBLISHED, ids=[p[1] for p in PUBLISHED])
def test_new_flavors_have_the_published_sizes(family, flavor, vocab, total, non_embedding, ffn):
    """Qwen3's and Llama 3.2's parameter counts as their model cards publish them, from the flavor
    table's numbers; a tied flavor counts its one embedding matrix once; an MoE flavor's activated
    parameters too."""
    from torchtitan_xla.models import get_model_class
    from torchtitan_xla.models.llama.moe import inactive_expert_params

    with torch.device("meta"):
        model = get_model_class(family)(get_model_args(family, flavor, vocab_size=vocab, max_seq_len=128))
    n = model.num_params()
    tied = model.args.tie_embeddings
    assert tied == (flavor in ("0.6B", "1.7B", "4B", "1B", "3B"))
    embeddings = (1 if tied else 2) * vocab * model.args.dim

    def billions(x, like):
        return round(x / 1e9, len(str(like).partition(".")[2]))

    assert billions(n, total) == total
    if non_embedding is not None:
        assert billions(n - embeddings, non_embedding) == non_embedding
    assert hf_config(model.args)["intermediate_size"] == ffn
    if flavor in ACTIVE:
        # The cards truncate here: 3.35B activated is "3.3B", 22.19B "22B".
        digits = len(str(ACTIVE[flavor]).partition(".")[2])
        active = (n - inactive_expert_params(model)) / 1e9
        assert int(active * 10**digits) / 10**digits == ACTIVE[flavor]
        assert (model.args.num_experts, model.args.top_k) == (128, 8)


# Tied embeddings (Llama 3.2 and Qwen3's small flavors): Llama 3.2's scaled RoPE, and Qwen3.
TIED = {"llama3.2": dataclasses.replace(CASES["llama3.1"], tie_embeddings=True),
        "qwen3": dataclasses.replace(QWEN3, tie_embeddings=True)}


@pytest.mark.parametrize("case", TIED)
def test_tied_embeddings_are_one_parameter_and_match_transformers_float64(case):
    """One Parameter for the embedding and the output projection, still one after `to_empty` (how
    train.py materialises the model); transformers' model with tie_word_embeddings and the export
    (no lm_head) gives the same logits; import and export round-trip bit-exactly."""
    args = TIED[case]
    with torch.device("meta"):
        meta = Transformer(args)
    meta.to_empty(device="cpu")
    assert meta.output.weight is meta.tok_embeddings.weight
    ours = _ours(args)
    names = [n for n, _ in ours.named_parameters()]
    assert "output.weight" not in names and "output.weight" not in ours.state_dict()
    state = to_hf(ours.state_dict(), args)
    assert "lm_head.weight" not in state and hf_config(args)["tie_word_embeddings"] is True
    config_class, model_class = ((transformers.Qwen3Config, transformers.Qwen3ForCausalLM) if case == "qwen3"
                                 else (transformers.LlamaConfig, transformers.LlamaForCausalLM))
    hf = model_class(config_class(**hf_config(args))).double().eval()
    hf.load_state_dict(state, strict=False)  # lm_head is the embedding's
    assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, args.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=2e-6)
    back = from_hf({**state, "lm_head.weight": state["model.embed_tokens.weight"]}, args)
    assert back.keys() == ours.state_dict().keys()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())


# The published config.json values (where they are not the config class's defaults) of a dense
# model of each new family; vocab_size from the checkpoints.
PUBLISHED_CONFIGS = {
    ("qwen3", "0.6B"): ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                            num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                            head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                            tie_word_embeddings=True)),
    ("qwen3", "8B"): ("Qwen3Config", dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                                          num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                                          head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
                                          rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                                          tie_word_embeddings=False)),
    ("llama3", "1B"): ("LlamaConfig", dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                           num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                           head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
                                           rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                            "factor": 32.0, "low_freq_factor": 1.0,
                                                            "high_freq_factor": 4.0,
                                                            "original_max_position_embeddings": 8192},
                                           tie_word_embeddings=True)),
}


@pytest.mark.parametrize("family,flavor", PUBLISHED_CONFIGS, ids=[f for _, f in PUBLISHED_CONFIGS])
def test_published_config_jsons_read_as_the_flavors(family, flavor):
    """Qwen3-0.6B's, Qwen3-8B's and Llama-3.2-1B's config.json (as transformers 5 writes them)
    give our flavors exactly, so their HF folders start a run of that flavor."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config

    config_class, values = PUBLISHED_CONFIGS[family, flavor]
    cfg = getattr(transformers, config_class)(**values).to_dict()
    got, expected = model_args_from_hf_config(cfg), get_model_args(family, flavor, vocab_size=values["vocab_size"])
    for field in ("dim", "n_layers", "n_heads", "kv_heads", "head_dim", "ffn_hidden_dim", "qk_norm",
                  "tie_embeddings", "norm_eps", "rope_theta", "rope_scaling", "max_seq_len", "vocab_size"):
        assert getattr(got, field) == getattr(expected, field), field


def test_embedding_reads_its_table_in_the_compute_dtype_and_sums_gradients_in_float32():
    """Under autocast the table is read in bfloat16 (FSDP then gathers bf16: test_plan.py) and the
    rows enter the residual stream in float32; the gradient is summed in float32 (a bf16
    scatter-add would round a frequent token's sum); without autocast it is nn.Embedding, bit for
    bit. Tokens repeat (one 300 times) so that the sum's precision shows."""
    from torchtitan_xla.models.llama.layers import Embedding

    torch.manual_seed(0)
    table = torch.randn(50, 16)
    tokens = torch.cat([torch.randint(0, 50, (2, 40)), torch.full((2, 150), 7)], 1)
    grad = torch.randn(2, 190, 16)
    ours, plain = Embedding(50, 16), torch.nn.Embedding(50, 16)
    with torch.no_grad():
        ours.weight.copy_(table)
        plain.weight.copy_(table)

    out = ours(tokens)
    out.backward(grad)
    expected = plain(tokens)
    expected.backward(grad)
    assert torch.equal(out, expected) and torch.equal(ours.weight.grad, plain.weight.grad)

    ours.weight.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ours(tokens)
    out.backward(grad)
    assert out.dtype == torch.float32
    assert torch.equal(out, table.bfloat16().float()[tokens])
    f32_sum = torch.zeros(50, 16).index_add_(0, tokens.flatten(), grad.flatten(0, 1))
    torch.testing.assert_close(ours.weight.grad, f32_sum, rtol=1e-6, atol=1e-6)
    bf16_sum = torch.zeros(50, 16, dtype=torch.bfloat16).index_add_(
        0, tokens.flatten(), grad.flatten(0, 1).bfloat16())
    assert (bf16_sum.float() - f32_sum).abs().max() > 100 * (ours.weight.grad - f32_sum).abs().max()


@pytest.mark.parametrize("device", ["cpu", "xla"])
@pytest.mark.parametrize("tokens", [(4, 32), (96,)], ids=["batch-seq", "flat"])
def test_a_float32_reduce_makes_linear_weight_gradients_float32_results(device, tokens):
    """[training] mixed_precision_reduce = "float32" (parallelisms/compute_dtype.py): under bf16
    autocast a linear layer's output and input gradient are autocast's, bit for bit; its weight
    gradient is the float32 sum of the same bf16 products (the dot whose output XLA's partitioner
    reduces across devices), equal to their float64 sum within float32 rounding, where autocast's
    is rounded to bf16. Plain PyTorch and the XLA runtime's dot alike."""
    from torchtitan_xla import runtime
    from torchtitan_xla.parallelisms.compute_dtype import apply_reduce_dtype

    dev = torch.device("cpu") if device == "cpu" else runtime.current_device()
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(*tokens, 64, generator=g), torch.randn(96, 64, generator=g) / 8
    dy = torch.randn(*tokens, 96, generator=g).bfloat16()

    def run(reduce: torch.dtype):
        layer = torch.nn.Linear(64, 96, bias=False)
        apply_reduce_dtype(layer, reduce)
        layer.weight = torch.nn.Parameter(w.to(dev))
        xx = x.to(dev).requires_grad_()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            y = layer(xx)
        y.backward(dy.to(dev))
        return y.cpu(), xx.grad.cpu(), layer.weight.grad.cpu()

    (y32, gx32, gw32), (y16, gx16, gw16) = run(torch.float32), run(torch.bfloat16)
    assert y32.dtype == torch.bfloat16 and torch.equal(y32, y16) and torch.equal(gx32, gx16)
    exact = torch.einsum("...o,...i->oi", dy.double(), x.bfloat16().double())
    assert gw32.dtype == gw16.dtype == torch.float32
    assert (gw32.double() - exact).abs().max() <= 1e-6 * exact.abs().max()
    assert (gw16.double() - exact).abs().max() >= 1e-3 * exact.abs().max()
