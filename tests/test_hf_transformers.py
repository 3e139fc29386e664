"""HuggingFace folders written by the installed transformers itself (issue 53): tiny random models
of every supported architecture made with `AutoModelForCausalLM.from_config` and saved with
`save_pretrained` (float32), read by `python -m torchtitan_xla.eval` and by train.py starting from
them with `[model] flavor = "hf"`: the log-likelihoods equal transformers' own on the same token
ids. Their config.json (as transformers 5 writes it, and with the older names hub files carry)
reads as what transformers builds from it; FFN sizes below Llama's 8/3 rule are representable."""

import dataclasses
import json
import math
import re
import subprocess
import sys

import pytest
import torch
from data_helpers import train_qwen_style_tokenizer
from helpers import REPO, _env, run_train

transformers = pytest.importorskip("transformers")

SEQ_LEN = 32
LL_TOLERANCE = 1e-4  # relative: float32 on XLA against float32 in torch
# Documents of several lengths (the third is scored in two windows of SEQ_LEN): with batches of 4
# the second batch is padded.
DOCUMENTS = [
    "The interpreter reads the source file and compiles it to bytecode",
    "A list comprehension builds a new list",
    "Exceptions propagate up the call stack until a handler catches them. " * 3,
    "x",
    "The garbage collector frees objects that are no longer referenced",
]
# [model] name, then the config's values (2 blocks and a 512-token vocabulary added below). The
# FFN sizes are below Llama's 8/3 rule (128 -> 341; 96 -> 256; 64 -> 170) and none a multiple of
# another; one Llama has its own head size, tied embeddings and Llama 3.1's RoPE scaling, the
# Qwen3-MoE a dense block before its MoE block, DeepSeek-V3 YaRN.
ARCHITECTURES = {
    "llama": ("llama3", dict(model_type="llama", hidden_size=128, intermediate_size=256, num_attention_heads=4)),
    "llama_gqa": ("llama3", dict(model_type="llama", hidden_size=96, intermediate_size=200, num_attention_heads=6,
                                 num_key_value_heads=2, head_dim=24, tie_word_embeddings=True,
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                                  "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 16})),
    "qwen3": ("qwen3", dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3", dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=2)),
    "mixtral": ("mixtral", dict(model_type="mixtral", hidden_size=64, intermediate_size=80, num_attention_heads=4,
                                num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)),
    "deepseek_v3": ("deepseek_v3", dict(
        model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8,
        qk_rope_head_dim=8, v_head_dim=8,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0, "mscale_all_dim": 1.0})),
    "deepseek_v2": ("deepseek_v2", dict(
        model_type="deepseek_v2", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=8,
        v_head_dim=8)),
}


def _config(arch: str):
    values = dict(ARCHITECTURES[arch][1])
    # Larger than transformers' 0.02: token distributions far from uniform, routers decisive.
    return transformers.AutoConfig.for_model(values.pop("model_type"), num_hidden_layers=2, vocab_size=512,
                                             initializer_range=0.08, **values)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """{arch: folder} of transformers' save_pretrained, the tokenizer folder and the task file."""
    root = tmp_path_factory.mktemp("hf_transformers")
    folders = {}
    for seed, arch in enumerate(ARCHITECTURES):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(_config(arch), dtype=torch.float32)
        model.save_pretrained(root / arch)
        folders[arch] = root / arch
    tokenizer = train_qwen_style_tokenizer(root / "tokenizer", vocab_size=400)
    docs = root / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCUMENTS))
    return folders, tokenizer, docs


@pytest.fixture(scope="module")
def expected(made):
    """{arch: [log-likelihood of each document]} by transformers' own model from the folder, on the
    token ids and windows our evaluation scores (the project's tokenizer and rolling windows)."""
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.eval.scorer import rolling_windows

    folders, tokenizer_dir, _ = made
    tokenizer = build_tokenizer(str(tokenizer_dir))
    out = {}
    for arch, folder in folders.items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        lls = []
        for text in DOCUMENTS:
            total = 0.0
            ids = tokenizer.encode(text, bos=False, eos=False)
            for sequence, n in rolling_windows(ids, tokenizer.prefix_id, SEQ_LEN):
                with torch.no_grad():
                    logits = model(torch.tensor([sequence[:-1]])).logits[0]
                logp = torch.log_softmax(logits.double(), -1)[torch.arange(len(sequence) - 1), sequence[1:]]
                total += logp[-n:].sum().item()
            lls.append(total)
        out[arch] = lls
    return out


def _common(made, dump) -> list[str]:
    _, tokenizer, docs = made
    return ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(dump),
            "--job.no-print_config", "--training.seq_len", str(SEQ_LEN), "--model.tokenizer_path", str(tokenizer),
            "--eval.tasks", f"perplexity:{docs}", "--eval.batch_size", "4"]


def _assert_lls_equal(results: dict, expected_lls: list[float]):
    got = [ll for ll, _ in results["samples"][next(iter(results["samples"]))]]
    assert len(got) == len(expected_lls)
    for ours, theirs in zip(got, expected_lls):
        assert math.isclose(ours, theirs, rel_tol=LL_TOLERANCE), (got, expected_lls)


# ---- config.json as transformers writes and reads it ------------------------------------------------


def _shapes_of_our_model(args) -> dict[str, tuple]:
    """HF names and shapes of the model `args` build (on the meta device, through to_hf)."""
    from torchtitan_xla.models.llama.model import Transformer
    from torchtitan_xla.models.llama.state_dict_adapter import to_hf

    with torch.device("meta"):
        model = Transformer(args)
    return {k: tuple(v.shape) for k, v in to_hf(model.state_dict(), args).items()}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_config_json_gives_the_model_transformers_saved(arch, made):
    """model_args_from_hf_config on the config.json transformers 5 wrote builds a model with exactly
    the folder's tensors (names and shapes): the experts' count under num_local_experts, any FFN
    size, its head size; its RoPE as transformers has it."""
    from safetensors import safe_open

    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config

    folders, _, _ = made
    cfg = json.loads((folders[arch] / "config.json").read_text())
    args = model_args_from_hf_config(cfg)
    with safe_open(str(folders[arch] / "model.safetensors"), "pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert _shapes_of_our_model(args) == saved
    hf = _config(arch)
    assert args.ffn_hidden_dim == hf.intermediate_size
    assert args.rope_theta == hf.rope_parameters["rope_theta"]
    assert args.max_seq_len == hf.max_position_embeddings


def _older_names(cfg: dict) -> dict:
    """The same config as hub files written before transformers 5 spell it: rope_theta at the top,
    the scaling as rope_scaling with "type", Qwen3-MoE's experts as num_experts."""
    old = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "dtype")}
    rope = dict(cfg["rope_parameters"])
    old["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    if kind != "default":
        old["rope_scaling"] = {"type": kind, **rope}
    if "num_local_experts" in old and cfg["model_type"] == "qwen3_moe":
        old["num_experts"] = old.pop("num_local_experts")
    old["torch_dtype"] = cfg["dtype"]
    return old


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_older_hub_names_read_the_same(arch, made):
    """The older spellings give the same ModelArgs, as transformers reads them to the same config."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config

    folders, _, _ = made
    cfg = json.loads((folders[arch] / "config.json").read_text())
    old = _older_names(cfg)
    assert model_args_from_hf_config(old) == model_args_from_hf_config(cfg)
    values = {k: v for k, v in old.items() if k not in ("model_type", "architectures", "transformers_version")}
    again = transformers.AutoConfig.for_model(cfg["model_type"], **values).to_dict()
    assert model_args_from_hf_config(again) == model_args_from_hf_config(cfg)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_key_left_out_takes_transformers_default(arch, made):
    """Each optional key of the written config.json left out: the same ModelArgs as transformers'
    config built without it (its class default), or the same refusal."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.errors import ConfigError

    folders, _, _ = made
    cfg = json.loads((folders[arch] / "config.json").read_text())
    core = {"model_type", "architectures", "transformers_version", "hidden_size", "num_hidden_layers",
            "num_attention_heads", "vocab_size", "dtype"}
    checked = 0
    for key in sorted(set(cfg) - core):
        rest = {k: v for k, v in cfg.items() if k != key}
        try:
            theirs = transformers.AutoConfig.for_model(cfg["model_type"], **{
                k: v for k, v in rest.items() if k not in ("model_type", "architectures")}).to_dict()
        except Exception:  # transformers refuses the config without it (its validation)
            continue
        try:
            ours = model_args_from_hf_config(rest)
        except ConfigError as e:
            with pytest.raises(ConfigError, match=f"^{str(e)[:40]}"):
                model_args_from_hf_config(theirs)
            continue
        assert ours == model_args_from_hf_config(theirs), key
        checked += 1
    assert checked >= 8


def test_published_and_legacy_rope_and_expert_keys():
    """The keys' older names on hand-written configs: Qwen3-MoE's num_experts, a top-level
    rope_theta beside rope_parameters (transformers 5 takes the one inside), rope_scaling's "type",
    a Llama 3.1 scaling without original_max_position_embeddings (transformers: the context),
    head_dim null (derived) and left out (Qwen3: 128)."""
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config
    from torchtitan_xla.errors import ConfigError

    base = dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=300, norm_topk_prob=True, moe_intermediate_size=32)
    assert model_args_from_hf_config({**base, "num_experts": 8}).num_experts == 8
    assert model_args_from_hf_config({**base, "num_local_experts": 8}).num_experts == 8
    assert model_args_from_hf_config(base).num_experts == 128  # Qwen3MoeConfig's default
    both = {**base, "rope_theta": 5.0, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}
    assert model_args_from_hf_config(both).rope_theta == 7.0
    assert model_args_from_hf_config({**base, "rope_theta": 5.0}).rope_theta == 5.0
    llama = dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=300, max_position_embeddings=4096,
                 rope_scaling={"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0})
    scaling = model_args_from_hf_config(llama).rope_scaling
    assert (scaling.factor, scaling.original_max_position_embeddings) == (8.0, 4096)
    assert transformers.LlamaConfig(**{k: v for k, v in llama.items() if k != "model_type"}).rope_parameters[
        "original_max_position_embeddings"] == 4096
    assert model_args_from_hf_config({**llama, "head_dim": None, "rope_scaling": None}).head_dim == 16
    qwen3 = dict(base, model_type="qwen3")
    assert model_args_from_hf_config(qwen3).head_dim == transformers.Qwen3Config().head_dim == 128
    assert model_args_from_hf_config(qwen3).kv_heads == transformers.Qwen3Config().num_key_value_heads == 32
    for bad, message in (({**llama, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "llama with RoPE 'linear'"),
                         ({**qwen3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "qwen3 with RoPE 'yarn'"),
                         ({**llama, "attention_bias": True}, "llama with attention_bias"),
                         ({**llama, "hidden_act": "gelu"}, "hidden_act 'gelu'"),
                         ({**llama, "model_type": "bert"}, "model_type 'bert' is not supported")):
        with pytest.raises(ConfigError, match=f"^config.json: {message}"):
            model_args_from_hf_config(bad)


# ---- FFN sizes and the saved ModelArgs ------------------------------------------------------------

# Every flavor's FFN sizes before ffn_dim existed (multiple_of and ffn_dim_multiplier encoded them).
FFN_SIZES = {
    ("llama2", "debugmodel"): 768, ("llama2", "7B"): 11008, ("llama2", "13B"): 13824, ("llama2", "70B"): 28672,
    ("llama3", "debugmodel"): 768, ("llama3", "8B"): 14336, ("llama3", "70B"): 28672, ("llama3", "405B"): 53248,
    ("llama3", "1B"): 8192, ("llama3", "3B"): 8192, ("mixtral", "debugmodel"): 768, ("mixtral", "8x7B"): 14336,
    ("mixtral", "8x22B"): 16384, ("qwen3", "debugmodel"): 768, ("qwen3", "debugmodel_moe"): 768,
    ("qwen3", "0.6B"): 3072, ("qwen3", "1.7B"): 6144, ("qwen3", "4B"): 9728, ("qwen3", "8B"): 12288,
    ("qwen3", "14B"): 17408, ("qwen3", "32B"): 25600, ("qwen3", "30B-A3B"): 6144, ("qwen3", "235B-A22B"): 12288,
    ("deepseek_v2", "debugmodel"): 768, ("deepseek_v2", "16B"): 10944, ("deepseek_v2", "236B"): 12288,
    ("deepseek_v3", "debugmodel"): 768, ("deepseek_v3", "16B"): 11264, ("deepseek_v3", "671B"): 18432,
    ("gemma3", "debugmodel"): 768, ("gemma3", "1B"): 6912, ("gemma3", "4B"): 10240, ("gemma3", "12B"): 15360,
    ("gemma3", "27B"): 21504, ("gpt_oss", "debugmodel"): 192, ("gpt_oss", "20B"): 2880, ("gpt_oss", "120B"): 2880,
}


def test_every_flavor_keeps_its_ffn_size():
    from torchtitan_xla.models import models_config

    assert {(n, f): a.ffn_hidden_dim for n, fl in models_config.items() for f, a in fl.items()} == FFN_SIZES


def test_ffn_dim_gives_any_size_and_the_saved_model_args_read_back():
    """ffn_dim is the FFN size itself, where Llama's rule cannot go (256 for dim 128); model_args.json
    written now reads back equal, and one written before ffn_dim existed still loads."""
    from torchtitan_xla.checkpoint.hf import model_args_from_json, model_args_to_json
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama.args import ModelArgs

    small = ModelArgs(dim=128, n_layers=2, n_heads=4, vocab_size=512, ffn_dim=256)
    assert small.ffn_hidden_dim == 256 and dataclasses.replace(small, ffn_dim=None).ffn_hidden_dim == 512
    for args in (small, get_model_args("deepseek_v3", "debugmodel", vocab_size=300),
                 get_model_args("llama3", "8B", vocab_size=300)):
        assert model_args_from_json(model_args_to_json(args)) == args
    old = json.loads(model_args_to_json(get_model_args("llama3", "debugmodel", vocab_size=300)))
    del old["ffn_dim"]
    assert model_args_from_json(json.dumps(old)) == get_model_args("llama3", "debugmodel", vocab_size=300)
    with pytest.raises(ValueError, match="ffn_dim must be >= 1"):
        ModelArgs(ffn_dim=0)


# ---- flavor "hf" and its errors -------------------------------------------------------------------


def test_a_flavor_mismatch_suggests_flavor_hf(made):
    from torchtitan_xla.checkpoint.hf import match_initial_hf_weights
    from torchtitan_xla.config import ConfigError, parse_args
    from torchtitan_xla.models import get_model_args

    folders, _, _ = made
    for arch, run, hint in (("llama", ("llama3", "debugmodel"), 'to take it$'),
                            ("qwen3", ("llama3", "debugmodel"), r'to take it \(with \[model\] name = qwen3\)$')):
        cfg = parse_args(["--checkpoint.initial_load_path", str(folders[arch]), "--checkpoint.initial_load_in_hf"])
        with pytest.raises(ConfigError, match=r'no flavor of ours has its architecture: set \[model\] flavor = "hf" '
                                              + hint):
            match_initial_hf_weights(cfg.checkpoint, get_model_args(*run, vocab_size=400), " ".join(run))


def test_flavor_hf_takes_the_folders_architecture_with_the_runs_overrides(made):
    """get_model_args gives a stand-in for "hf"; match_initial_hf_weights the folder's args, with
    the run's seq_len and [moe] settings that are not architecture."""
    from torchtitan_xla.checkpoint.hf import match_initial_hf_weights, model_args_from_hf_config
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.models import get_model_args, moe_overrides

    folders, _, _ = made
    cfg = parse_args(["--model.name", "qwen3", "--model.flavor", "hf", "--checkpoint.initial_load_path",
                      str(folders["qwen3_moe"]), "--checkpoint.initial_load_in_hf", "--moe.capacity_factor", "1.5",
                      "--moe.top_k", "2"])
    args = get_model_args("qwen3", "hf", vocab_size=400, max_seq_len=SEQ_LEN, **moe_overrides(cfg.moe))
    got = match_initial_hf_weights(cfg.checkpoint, args, "qwen3 hf")
    folder = model_args_from_hf_config(json.loads((folders["qwen3_moe"] / "config.json").read_text()))
    assert got == dataclasses.replace(folder, max_seq_len=SEQ_LEN, capacity_factor=1.5, aux_loss_weight=0.01)
    assert (got.vocab_size, got.context_len, got.moe_every) == (512, 32768, 2)


def test_the_plan_of_a_run_with_flavor_hf_counts_the_folders_parameters(made):
    """`run_train.sh --plan` reads the folder's architecture as train.py does: its parameters are
    transformers' model's (the vocabulary the folder's, the embedding not tied)."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.parallelisms import ParallelDims
    from torchtitan_xla.plan import memory

    folders, _, _ = made
    cfg = parse_args(["--model.flavor", "hf", "--checkpoint.initial_load_path", str(folders["llama"]),
                      "--checkpoint.initial_load_in_hf", "--training.seq_len", "64"])
    mem = memory.estimate(cfg, ParallelDims.from_config(cfg.parallelism, 1))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(folders["llama"]))
    assert mem.parameters == 4 * sum(p.numel() for p in theirs.parameters())


@pytest.mark.parametrize("flags, message", [
    (["--model.flavor", "hf"], r'^command line: --model.flavor = "hf" takes the architecture of the HuggingFace '
                               r"folder the run starts from: it needs \[checkpoint\] initial_load_path \(that folder\) "
                               r"and initial_load_in_hf = true \(initial_load_path is not set\)$"),
    (["--model.flavor", "hf", "--checkpoint.initial_load_path", "{qwen3}"],
     r"\(initial_load_in_hf is not set\)$"),
    (["--model.flavor", "hf", "--checkpoint.initial_load_path", "{qwen3}", "--checkpoint.initial_load_in_hf"],
     r"^command line: --checkpoint.initial_load_path: .*config.json holds a qwen3 model, and the run's \[model\] "
     r"name is llama3: set \[model\] name = qwen3 \(flavor hf takes the folder's architecture"),
    (["--model.name", "qwen3", "--model.flavor", "hf", "--checkpoint.initial_load_path", "{qwen3_moe}",
      "--checkpoint.initial_load_in_hf", "--moe.num_experts", "16"],
     r"^command line: --moe.num_experts = 16: the HuggingFace folder's model has num_experts 8, and \[model\] "
     r'flavor = "hf" takes its architecture$'),
    (["--model.flavor", "hf", "--checkpoint.initial_load_path", "{missing}", "--checkpoint.initial_load_in_hf"],
     r"^command line: --checkpoint.initial_load_path: no such file .*missing/config.json \(\[model\] flavor"),
    (["--model.flavor", "9B"], r"unknown flavor for llama3; expected one of debugmodel, 8B, 70B, 405B, 1B, 3B, "
                               r'or "hf" \(the architecture of the HuggingFace folder the run starts from\)$'),
])
def test_bad_flavor_hf_settings_are_one_line(flags, message, made, tmp_path):
    from torchtitan_xla.config import ConfigError, parse_args

    folders, _, _ = made
    flags = [f.format(missing=tmp_path / "missing", **folders) for f in flags]
    with pytest.raises(ConfigError) as e:
        parse_args(flags)
    assert "\n" not in str(e.value)
    assert re.search(message, str(e.value)), str(e.value)


def test_train_py_refuses_flavor_hf_without_initial_load_in_hf_exit_2(made, tmp_path):
    r = run_train([*_common(made, tmp_path), "--model.flavor", "hf", "--training.steps", "1"])
    assert r.returncode == 2 and r.losses == {}
    assert r.stderr.strip().splitlines()[-1].startswith('error: command line: --model.flavor = "hf" takes the ')


def test_a_config_json_that_does_not_describe_its_weights_is_blamed(made, tmp_path):
    """A folder whose config.json says another FFN size than its weights have: the line blames that
    file, not the flavor or the tokenizer."""
    folders, _, _ = made
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").symlink_to(folders["llama"] / "model.safetensors")
    cfg = json.loads((folders["llama"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 320}))
    p = subprocess.run([sys.executable, "-m", "torchtitan_xla.eval", *_common(made, tmp_path / "out"),
                        "--eval.checkpoint", str(bad)], capture_output=True, text=True, env=_env(1, None),
                       cwd=REPO, timeout=600)
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == (
        f"error: command line: --eval.checkpoint: {bad}: layers.0.feed_forward.w1.weight has shape [256, 128], "
        f"the model expects [320, 128] (its config.json does not describe these weights)")


# ---- the numbers: evaluation and a run from the folder, against transformers ---------------------

_DRIVER = """
import json, sys, traceback
sys.path.insert(0, {repo!r})
import train
from torchtitan_xla.config import parse_args
from torchtitan_xla.eval.__main__ import main as evaluate
failed = {{}}
for name, (kind, argv) in json.loads(sys.argv[1]).items():
    try:
        (evaluate if kind == "eval" else train.main)(parse_args(argv))
    except BaseException:  # one job's failure is its test's; the others still run
        failed[name] = traceback.format_exc()[-3000:]
print("FAILED " + json.dumps(failed), flush=True)
"""


@pytest.fixture(scope="module")
def jobs(made, tmp_path_factory):
    """In one process (start-up and the scoring graph's compilation shared), for each architecture:
    the evaluation main of `python -m torchtitan_xla.eval` on its folder (llama's is the real
    command line, in its test), then train.main from the folder with flavor "hf": one step at lr
    1e-30 (no weight moves in float32; DeepSeek's expert bias frozen), evaluated at the end,
    exported to HF; the llama run also checkpointed at step 1, then resumed for a second step.
    (dump folders, {job: its traceback} for the jobs that failed, the process's stderr)"""
    folders, _, _ = made
    root = tmp_path_factory.mktemp("jobs")
    todo = {}
    for arch, (name, _) in ARCHITECTURES.items():
        if arch != "llama":
            todo[f"eval-{arch}"] = ("eval", [*_common(made, root / "eval" / arch), "--eval.checkpoint",
                                             str(folders[arch])])
        start = [*_common(made, root / "train" / arch), "--model.name", name, "--model.flavor", "hf",
                 "--checkpoint.initial_load_path", str(folders[arch]), "--checkpoint.initial_load_in_hf",
                 "--training.local_batch_size", "2", "--metrics.log_freq", "1"]
        todo[f"train-{arch}"] = ("train", [*start, "--training.steps", "1", "--optimizer.lr", "1e-30",
                                           "--lr_scheduler.warmup_steps", "0", "--moe.bias_update_rate", "0",
                                           "--eval.at_end", "--checkpoint.last_save_in_hf",
                                           *(["--checkpoint.enable"] if arch == "llama" else [])])
        if arch == "llama":
            todo["resume-llama"] = ("train", [*start, "--training.steps", "2", "--checkpoint.enable"])
    p = subprocess.run([sys.executable, "-c", _DRIVER.format(repo=str(REPO)), json.dumps(todo)],
                       capture_output=True, text=True, env=_env(1, None), timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("FAILED "))
    return root, json.loads(line[len("FAILED "):]), p.stderr


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_eval_of_the_folder_gives_transformers_log_likelihoods(arch, made, expected, jobs, tmp_path):
    """`python -m torchtitan_xla.eval --eval.checkpoint FOLDER`: every document's log-likelihood
    (scored in windows of SEQ_LEN, in padded batches of 4) equals transformers'."""
    folders, _, _ = made
    if arch == "llama":  # the command line itself
        p = subprocess.run([sys.executable, "-m", "torchtitan_xla.eval", *_common(made, tmp_path),
                            "--eval.checkpoint", str(folders[arch])], capture_output=True, text=True,
                           env=_env(1, None), cwd=REPO, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
        results = tmp_path / "eval_results.json"
    else:
        root, failed, _ = jobs
        assert f"eval-{arch}" not in failed, failed[f"eval-{arch}"]
        results = root / "eval" / arch / "eval_results.json"
    _assert_lls_equal(json.loads(results.read_text()), expected[arch])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_run_from_the_folder_with_flavor_hf_gives_transformers_log_likelihoods(arch, made, expected, jobs):
    """train.py with --model.flavor hf --checkpoint.initial_load_in_hf: the weights it loaded give
    transformers' log-likelihoods (eval at the end of a step that moves no weight: its HF export
    is the folder's tensors, bit for bit, and transformers loads that export)."""
    from safetensors.torch import load_file

    folders, _, _ = made
    root, failed, _ = jobs
    assert f"train-{arch}" not in failed, failed[f"train-{arch}"]
    _assert_lls_equal(json.loads((root / "train" / arch / "eval_results.json").read_text()), expected[arch])
    export = root / "train" / arch / "checkpoint" / "step-1-hf"
    theirs, ours = load_file(str(folders[arch] / "model.safetensors")), load_file(str(export / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    model = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    reference = transformers.AutoModelForCausalLM.from_pretrained(folders[arch], dtype=torch.float32).eval()
    tokens = torch.randint(0, 400, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens).logits, reference(tokens).logits, rtol=0, atol=1e-5)


def test_a_run_with_flavor_hf_resumes_from_its_checkpoint(made, jobs):
    """The llama run's step-1 checkpoint holds the folder's args (its ffn_dim, seq_len as
    max_seq_len); the same command with 2 steps resumes from it and trains step 2."""
    from torchtitan_xla.checkpoint.commit import read_model_state
    from torchtitan_xla.checkpoint.hf import model_args_from_hf_config

    folders, _, _ = made
    root, failed, log = jobs
    assert "resume-llama" not in failed, failed["resume-llama"]
    _, saved = read_model_state(root / "train" / "llama" / "checkpoint" / "step-1")
    folder = model_args_from_hf_config(json.loads((folders["llama"] / "config.json").read_text()))
    assert saved == dataclasses.replace(folder, max_seq_len=SEQ_LEN) and saved.ffn_dim == 256
    assert f"Resumed from {root / 'train' / 'llama' / 'checkpoint' / 'step-1'} (step 1)" in log
    assert re.search(r"step:\s+2\s+loss:", log)
