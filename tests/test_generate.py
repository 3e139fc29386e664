"""Generation with a KV cache (torchtitan_xla/generate): greedy completions equal transformers'
`generate(do_sample=False)` token for token on tiny random models of every supported architecture
made by transformers itself, on a batch of prompts of different lengths (left-padded) with EOS
inside the batch, in plain PyTorch on the CPU (the native runtime's eager path) and on XLA, where
the decode step compiles once; seeded sampling repeats; `python -m torchtitan_xla.generate` on a
HuggingFace folder, on one device and on an fsdp x tp mesh, and its error lines."""

import copy
import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch
from data_helpers import train_qwen_style_tokenizer
from helpers import REPO, _env
from test_hf_transformers import ARCHITECTURES, _config

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 17, 33, 2, 9, 100], [7, 8], list(range(300, 318)) + [3], [42]]
NEW_TOKENS = 12
CACHE = 64


@pytest.fixture(scope="module")
def hf_models():
    """{arch: (transformers' model, our model with its weights, (the EOS id, the row it stops))}.
    EOS is a token the model's greedy completion of one prompt reaches after a token or more, so
    that row stops early while others go on."""
    from torchtitan_xla.models.llama.hf_args import model_args_from_hf_config
    from torchtitan_xla.models.llama.model import Transformer
    from torchtitan_xla.models.llama.state_dict_adapter import from_hf

    out = {}
    for seed, arch in enumerate(ARCHITECTURES):
        torch.manual_seed(seed)
        config = _config(arch)
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        args = dataclasses.replace(model_args_from_hf_config(config.to_dict()), max_seq_len=CACHE)
        ours = Transformer(args)
        ours.init_weights()  # the RoPE tables; every parameter is then the folder's
        ours.load_state_dict(from_hf(hf.state_dict(), args), strict=False)
        free = _hf_generate(hf, PROMPTS, eos=-1)
        row, at = next((r, i) for r in (1, 0, 2, 3) for i in range(1, NEW_TOKENS) if free[r][i] not in free[r][:i])
        out[arch] = (hf, ours.eval(), (free[row][at], row))
    return out


def _hf_generate(hf, prompts, eos: int, new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """transformers' greedy completions of left-padded `prompts`, cut before EOS."""
    width = max(map(len, prompts))
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        attention[row, width - len(prompt):] = 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=attention, max_new_tokens=new_tokens, do_sample=False,
                          eos_token_id=[eos] if eos >= 0 else None, pad_token_id=0)
    rows = [row[width:].tolist() for row in out]
    return [row[:row.index(eos)] if eos in row else row for row in rows]


@pytest.fixture
def native():
    """The native runtime's answers (eager PyTorch) for this test, the XLA runtime's after it."""
    from torchtitan_xla import runtime

    runtime.use("native")
    yield
    runtime.use("xla")


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_greedy_equals_transformers_in_plain_pytorch(arch, hf_models, native):
    from torchtitan_xla.generate import Generator

    hf, ours, (eos, row) = hf_models[arch]
    expected = _hf_generate(hf, PROMPTS, eos)
    generator = Generator(ours, cache_size=CACHE, batch_size=4, device="cpu", eos_ids=[eos], pad_id=0,
                          check_every=4)
    completions = generator(PROMPTS, NEW_TOKENS)
    assert [c.tokens for c in completions] == expected
    assert completions[row].finish == "eos" and completions[row].tokens
    assert "length" in [c.finish for c in completions]  # and EOS did not stop the others


@pytest.mark.parametrize("arch", ["llama_gqa", "deepseek_v3"])
def test_greedy_on_xla_equals_transformers_and_decode_compiles_once(arch, hf_models, xla_device):
    """Two graphs on the first batch (the prefill at its prompts' bucket of 16 tokens, the decode
    step), then only the prefill of the next bucket (32) for longer prompts generating 30 tokens:
    the decode step is one graph for every position and bucket of a cache size."""
    from torchtitan_xla import runtime
    from torchtitan_xla.generate import Generator

    hf, ours, (eos, _) = hf_models[arch]
    model = copy.deepcopy(ours).to(xla_device)  # the CPU model stays for the other tests
    generator = Generator(model, cache_size=CACHE, batch_size=2, device=xla_device, eos_ids=[eos], pad_id=0,
                          check_every=4)
    runtime.materialise()  # whatever moving the weights left pending: not generation's
    before = runtime.compile_stats()[0]
    first = generator(PROMPTS[:2], NEW_TOKENS)
    assert runtime.compile_stats()[0] - before == 2
    assert [c.tokens for c in first] == _hf_generate(hf, PROMPTS[:2], eos)
    longer = generator(PROMPTS[2:], 30)  # the second bucket (19 tokens -> 32): its own prefill
    assert runtime.compile_stats()[0] - before == 3
    assert [c.tokens for c in longer] == _hf_generate(hf, PROMPTS[2:], eos, new_tokens=30)


def test_seeded_sampling_repeats_on_xla(hf_models, xla_device):
    from torchtitan_xla.generate import Generator, Sampling

    _, ours, _ = hf_models["qwen3"]
    generator = Generator(copy.deepcopy(ours).to(xla_device), cache_size=CACHE, batch_size=4,
                          device=xla_device, eos_ids=[], pad_id=0)
    sample = Sampling(temperature=1.0, top_k=3, top_p=0.9, seed=7)
    first = [c.tokens for c in generator(PROMPTS, NEW_TOKENS, sample)]
    assert [c.tokens for c in generator(PROMPTS, NEW_TOKENS, sample)] == first
    other = [c.tokens for c in generator(PROMPTS, NEW_TOKENS, dataclasses.replace(sample, seed=8))]
    assert other != first


@pytest.mark.parametrize("ac", [["full"], ["full", "--activation_checkpoint.offload", "decoder_layer_input,qkv_proj"],
                                ["selective"], ["selective", "--activation_checkpoint.selective_ac_option", "op"]],
                         ids=["full", "full_offload", "every_2", "op"])
def test_a_checkpointed_model_generates_through_its_kv_cache(ac, native, monkeypatch):
    """GRPO's rollouts run the training model, its blocks checkpointed (the Qwen3 8B and Llama 3.2
    1B GRPO recipes: mode full): the cache (passed by keyword) reaches the blocks and the logits are
    the plain model's; without gradients nothing is recomputed or offloaded."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.generate.cache import KVCache
    from torchtitan_xla.models.llama import ModelArgs, Transformer
    from torchtitan_xla.parallelisms.activation_checkpoint import apply_ac
    from torchtitan_xla.runtime.native import kernels

    offloaded = []
    monkeypatch.setattr(kernels, "offload", lambda t: offloaded.append(t) or t)
    args = ModelArgs(dim=32, n_layers=2, n_heads=4, vocab_size=50, multiple_of=16, max_seq_len=16)
    logits = []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = Transformer(args)
        model.init_weights()
        if checkpointed:
            apply_ac(model, parse_args(["--activation_checkpoint.mode", *ac]).activation_checkpoint)
        cache = KVCache(2, 2, 16, "cpu")
        tokens, positions = torch.randint(0, 50, (2, 6)), torch.arange(6).expand(2, 6)
        documents = torch.ones(2, 6, dtype=torch.long)
        cache.write(torch.arange(6), positions, documents)
        with torch.no_grad():
            logits.append(model(tokens, positions, documents, cache))
    assert torch.equal(*logits) and offloaded == []


def test_a_finished_cache_is_freed_without_the_cyclic_collector():
    """Training loops run with Python's collector off (train.py): a KV cache whose layers' views
    referred back to it would hold a batch's keys and values (device memory) until the next
    collection, one more cache at every rollout. Dropping the cache frees its buffers at once."""
    import gc
    import weakref

    from torchtitan_xla.generate import KVCache

    cache = KVCache(2, batch=1, size=4, device="cpu")
    cache.write(torch.arange(2), torch.arange(2)[None], torch.ones(1, 2, dtype=torch.long))
    keys, values = cache[1].update(torch.ones(1, 2, 3), torch.ones(1, 2, 3))
    assert keys.shape == (1, 4, 3) and keys[0, :2].eq(1).all() and keys[0, 2:].eq(0).all()
    alive = weakref.ref(keys)
    gc.disable()
    try:
        del cache, keys, values
        assert alive() is None
    finally:
        gc.enable()


def test_sampling_noise_is_the_same_on_every_device_and_uniform(xla_device):
    """The Gumbel noise is hashed from (key, token index, row, column), not drawn from a device's
    generator: bit for bit the same on XLA as on the CPU (torch_xla's `>>` and floor division on
    int32 differ from torch's; the hash avoids both), new at each index and key, and uniform
    (a chi-square of 32 bins within its 99.9% bound, 31 degrees of freedom; neighbours
    uncorrelated)."""
    from torchtitan_xla.generate.sampling import uniform_noise

    key, index = torch.tensor([123456789], dtype=torch.int32), torch.tensor([7])
    here = uniform_noise(key, index, (64, 2256))
    assert torch.equal(uniform_noise(key.to(xla_device), index.to(xla_device), (64, 2256)).cpu(), here)
    assert not (uniform_noise(key, index + 1, (64, 2256)) == here).any()
    assert not (uniform_noise(key + 1, index, (64, 2256)) == here).all()
    noise = uniform_noise(key, index, (256, 4096))
    assert 0 < noise.min() and noise.max() < 1
    bins = torch.histc(noise, 32, 0, 1)
    assert ((bins - noise.numel() / 32) ** 2 / (noise.numel() / 32)).sum() < 61.1
    assert abs(torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1]) < 0.005


def test_sampling_keeps_the_top_p_nucleus_and_the_top_k():
    """Over many draws only the tokens of the nucleus appear, in proportion to their renormalised
    probabilities (0.5 and 0.3 of 0.8: 0.625 and 0.375, within 0.03 over 4000 draws)."""
    from torchtitan_xla.generate import Sampling, next_tokens

    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(4000, 4)
    key, index = torch.tensor([11], dtype=torch.int32), torch.tensor([0])
    drawn = next_tokens(logits, Sampling(temperature=1.0, top_p=0.75), key, index)
    counts = torch.bincount(drawn, minlength=4).double() / len(drawn)
    assert counts[2] == counts[3] == 0
    assert counts[0].item() == pytest.approx(0.625, abs=0.03)
    # top_k = 1 is greedy whatever the temperature
    noisy = torch.randn(64, 100)
    assert torch.equal(next_tokens(noisy, Sampling(temperature=5.0, top_k=1), key, index), noisy.argmax(-1))
    for bad, message in ((dict(top_p=1.5), "top_p = 1.5: expected a value in (0, 1]"),
                         (dict(temperature=-0.5), "temperature = -0.5: expected 0 (greedy) or more"),
                         (dict(top_k=-1), "top_k = -1: expected 0 (every token) or more")):
        with pytest.raises(ValueError, match=re.escape(f"[generate] {message}")):
            Sampling(**bad).check()


# ---- the command ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cli_setup(tmp_path_factory):
    """A Qwen3 (tied) folder saved by transformers, a ChatML tokenizer and a prompts file with a
    plain prompt and a conversation."""
    root = tmp_path_factory.mktemp("generate")
    torch.manual_seed(3)
    hf = transformers.AutoModelForCausalLM.from_config(_config("qwen3"), dtype=torch.float32)
    hf.save_pretrained(root / "qwen3")
    tokenizer = train_qwen_style_tokenizer(root / "tokenizer", vocab_size=400)
    prompts = root / "prompts.jsonl"
    records = [{"prompt": "def main():"},
               {"messages": [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "What is a list?"}]},
               {"prompt": "The interpreter reads the source file and compiles it to bytecode. It"}]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    return root, tokenizer, prompts, records


def _generate(cli_setup, dump, *extra, devices=1, processes=1):
    root, tokenizer, prompts, _ = cli_setup
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(processes)]
    cmd = [sys.executable, *(torchrun if processes > 1 else []), "-m", "torchtitan_xla.generate", "--job.config_file",
           str(REPO / "train_configs" / "debug_model.toml"), "--job.dump_folder", str(dump),
           "--job.no-print_config", "--training.seq_len", "64", "--model.tokenizer_path", str(tokenizer),
           "--generate.checkpoint", str(root / "qwen3"), "--generate.prompts", str(prompts),
           "--generate.max_new_tokens", "16", "--generate.batch_size", "4", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(devices, None), cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def cli_runs(cli_setup, tmp_path_factory):
    """The command's output lines and log on one device, on fsdp=4 x tp=2, and on the native
    runtime (one process, and two on tp=2, eager); and 100 new tokens on the native runtime,
    compiled."""
    out = {}
    native = ["--runtime.backend", "native", "--runtime.device", "cpu"]
    long = ["--training.seq_len", "160", "--generate.max_new_tokens", "100"]
    tp2 = ["--parallelism.tensor_parallel_degree", "2"]
    for name, devices, processes, extra in (
            ("one", 1, 1, []), ("fsdp4_tp2", 8, 1, tp2),
            ("native", 1, 1, [*native, "--compile.step", "eager"]),
            ("native_tp2", 1, 2, [*native, *tp2, "--compile.step", "eager"]),
            ("native compiled, 100", 1, 1, [*native, *long, "--compile.step", "compile"])):
        dump = tmp_path_factory.mktemp(re.sub(r"\W+", "_", name))
        p = _generate(cli_setup, dump, *extra, devices=devices, processes=processes)
        assert p.returncode == 0, p.stderr[-3000:]
        out[name] = ([json.loads(line) for line in (dump / "generations.jsonl").read_text().splitlines()],
                     p.stderr)
    return out


def test_the_command_equals_transformers_with_the_chat_template(cli_setup, cli_runs):
    """Each output line is its input with the completion transformers' greedy generation gives for
    the same ids; the conversation's ids are those of the exported tokenizer's chat template with
    the generation prompt."""
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.generate.__main__ import encode

    root, tokenizer_dir, _, records = cli_setup
    lines, log = cli_runs["one"]
    tokenizer = build_tokenizer(str(tokenizer_dir))
    ids = encode(records, tokenizer)
    export = root / "exported_tokenizer"
    tokenizer.save_pretrained(export)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    templated = hf_tokenizer.apply_chat_template(records[1]["messages"], add_generation_prompt=True,
                                                 tokenize=True, return_dict=False)
    assert ids[1] == list(templated)
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "qwen3", dtype=torch.float32).eval()
    eos = tokenizer.special_tokens["<|im_end|>"]
    expected = _hf_generate(hf, ids, eos, new_tokens=16)
    assert [{k: v for k, v in line.items() if k not in ("completion", "finish")} for line in lines] == records
    assert [line["completion"] for line in lines] == [tokenizer.decode(e) for e in expected]
    # The weights' graph, the prefill (one bucket: 39 tokens -> 48) and the decode step.
    assert "tokens/s" in log and "3 compiles in total" in log


@pytest.mark.parametrize("run", ["fsdp4_tp2", "native", "native_tp2"])
def test_the_command_on_a_mesh_and_on_the_native_runtime_gives_one_devices_completions(cli_runs, run):
    """On native tp=2 the cache's buffers are split over the heads as the keys and values are."""
    assert cli_runs[run][0] == cli_runs["one"][0]


def test_the_native_runtimes_decode_step_compiles_once_over_100_tokens(cli_setup, cli_runs):
    """`--compile.step compile` on the native runtime: the prefill and the decode step are one
    torch.compile'd graph each (2 in total), the decode's reused at each of the 99 later positions
    of every row; the completions are transformers' greedy ones over the same 100 tokens."""
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.generate.__main__ import encode

    root, tokenizer_dir, _, records = cli_setup
    compiled, log = cli_runs["native compiled, 100"]
    assert [line["finish"] for line in compiled] == ["length"] * 3  # no row stopped early
    tokenizer = build_tokenizer(str(tokenizer_dir))
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "qwen3", dtype=torch.float32).eval()
    expected = _hf_generate(hf, encode(records, tokenizer), tokenizer.special_tokens["<|im_end|>"], new_tokens=100)
    assert [line["completion"] for line in compiled] == [tokenizer.decode(e) for e in expected]
    assert "decode 297 tokens" in log and "(2 compiles in total)" in log, log[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--generate.max_new_tokens", "30"], "--generate.max_new_tokens = 30: with the longest prompt, 39 tokens "
                                          "(padded to 48), it needs 78 KV cache slots; the cache has "
                                          "[training] seq_len = 64"),
    (["--generate.top_p", "1.5"], "generate.top_p"),
    (["--generate.temperature", "-1"], "generate.temperature"),
    (["--generate.prompts", "", "--generate.prompt", ""], "--generate.prompts / prompt: give one of them"),
], ids=["longer-than-cache", "top_p", "temperature", "no-prompts"])
def test_bad_generation_settings_are_one_line_exit_2(cli_setup, tmp_path, flags, message):
    p = _generate(cli_setup, tmp_path, *flags)
    assert p.returncode == 2, p.stderr[-2000:]
    assert message in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert not (tmp_path / "generations.jsonl").exists()


@pytest.mark.parametrize("line, message", [
    ('{"question": "where is the prompt?"}', 'expected an object with "prompt" (a string) or "messages" (a list)'),
    ('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}',
     "the last message is the assistant's: a prompt ends with the user's turn"),
], ids=["no-prompt", "answered"])
def test_a_bad_prompt_line_is_named(cli_setup, tmp_path, line, message):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n' + line + "\n")
    p = _generate(cli_setup, tmp_path, "--generate.prompts", str(bad))
    assert p.returncode == 2
    assert p.stderr.strip() == f"error: command line: --generate.prompts: {bad}:2: {message}", p.stderr
