"""Tokenizers: Llama 3 (tiktoken format) and Llama 2 (sentencepiece) conventions, the project's own
deterministic debug tokenizer, and their errors. Every tokenizer file here is built by the test."""

import base64
from pathlib import Path

import pytest

from torchtitan_xla.config import ConfigError
from torchtitan_xla.datasets import python_docs
from torchtitan_xla.datasets.tokenizer import build_tokenizer
from torchtitan_xla.datasets.tokenizer.tiktoken import TikTokenizer, llama3_special_tokens
from torchtitan_xla.datasets.tokenizer.train_bpe import (
    default_tokenizer_path,
    train_bpe,
    write_ranks,
)

SAMPLE = "The \"assert\" statement — déjà vu 🙂 in 世界\n\n\tindented   text <|end_of_text|> 12345"


@pytest.fixture(scope="module")
def tiktok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "small.tiktoken"
    write_ranks(train_bpe(python_docs.documents()[:20], 600), path)
    return build_tokenizer(str(path))


def test_llama3_special_token_layout():
    specials = llama3_special_tokens()
    assert len(specials) == 256 and len(set(specials)) == 256
    assert specials[:2] == ["<|begin_of_text|>", "<|end_of_text|>"]
    assert specials[4:12] == ["<|finetune_right_pad_id|>", "<|step_id|>", "<|start_header_id|>",
                              "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                              "<|image|>"]
    assert specials[12] == "<|reserved_special_token_2|>"
    assert specials[-1] == "<|reserved_special_token_245|>"


def test_tiktoken_bos_eos_and_round_trip(tiktok):
    assert isinstance(tiktok, TikTokenizer)
    assert (tiktok.n_words, tiktok.bos_id, tiktok.eos_id) == (856, 600, 601)
    ids = tiktok.encode(SAMPLE, bos=True, eos=True)
    assert ids[0] == 600 and ids[-1] == 601
    assert tiktok.decode(ids[1:-1]) == SAMPLE
    plain = tiktok.encode(SAMPLE, bos=False, eos=False)
    assert plain == ids[1:-1]
    # Special-token text inside a document stays text.
    assert 601 not in plain and max(plain) < 600


def test_tiktoken_long_runs_are_split_without_changing_text(tiktok):
    text = "x" * 60_000 + " " * 30_000 + "end"
    ids = tiktok.encode(text, bos=False, eos=False)
    assert tiktok.decode(ids) == text


def test_tiktoken_matches_huggingface_tokenizers_on_the_corpus():
    """Our rank file read by tiktoken encodes exactly as the HF BPE it was trained as."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    from torchtitan_xla.datasets.tokenizer.tiktoken import LLAMA3_PATTERN

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    hf.train_from_iterator(list(python_docs.documents()), trainers.BpeTrainer(
        vocab_size=2000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    ours = build_tokenizer("")
    for doc in python_docs.documents()[::7] + (SAMPLE,):
        assert ours.encode(doc, bos=False, eos=False) == hf.encode(doc).ids


def test_default_tokenizer_is_deterministic_and_cached():
    path = default_tokenizer_path()
    first = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    assert default_tokenizer_path().stat().st_mtime_ns == mtime  # cached: not retrained
    path.unlink()
    assert default_tokenizer_path().read_bytes() == first  # retrained: identical bytes
    tok = build_tokenizer("")
    assert tok.n_words == 2256  # 2000 BPE tokens + Llama 3's 256 special tokens


def test_sentencepiece_llama2_conventions(tmp_path):
    import sentencepiece as spm

    prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(python_docs.documents()[:30]), model_prefix=str(prefix),
        vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        num_threads=1, minloglevel=2,
        # Llama 2's settings: no normalisation, whitespace kept as is.
        normalization_rule_name="identity", remove_extra_whitespaces=False)
    tok = build_tokenizer(str(prefix) + ".model")
    ref = spm.SentencePieceProcessor(model_file=str(prefix) + ".model")
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (400, 1, 2)
    ids = tok.encode(SAMPLE, bos=True, eos=True)
    assert ids == [1] + ref.encode(SAMPLE) + [2]
    assert tok.encode(SAMPLE, bos=False, eos=False) == ref.encode(SAMPLE)
    assert tok.decode(ids) == SAMPLE  # byte fallback: even emoji round-trip


def test_bad_tokenizer_files(tmp_path):
    with pytest.raises(ConfigError, match=r"\[model\] tokenizer_path: file not found: .*nope"):
        build_tokenizer(str(tmp_path / "nope"))
    junk = tmp_path / "junk.model"
    junk.write_bytes(b"\x00\x01 not a model")
    with pytest.raises(ConfigError, match="neither a tiktoken BPE file, a HuggingFace tokenizer.json nor a sentencepiece model"):
        build_tokenizer(str(junk))
    bad = tmp_path / "bad.tiktoken"
    bad.write_text(f"{base64.b64encode(b'a').decode()} 0\n!!notbase64 1\n")
    with pytest.raises(ConfigError, match="line 2 is not '<base64 token> <rank>'"):
        build_tokenizer(str(bad))
    gap = tmp_path / "gap.tiktoken"
    gap.write_text(f"{base64.b64encode(b'a').decode()} 0\n{base64.b64encode(b'b').decode()} 5\n")
    with pytest.raises(ConfigError, match="ranks must be 0..1 without gaps"):
        build_tokenizer(str(gap))


def _fake_llama_models(root, ranks):
    """A stand-in for the llama-models package: just its llama3/tokenizer.model."""
    pkg = root / "llama_models"
    (pkg / "llama3").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    write_ranks(ranks, pkg / "llama3" / "tokenizer.model")
    return root


def test_llama3_is_found_in_the_llama_models_package(tmp_path, monkeypatch):
    import sys

    monkeypatch.delitem(sys.modules, "llama_models", raising=False)
    ranks = train_bpe(python_docs.documents()[:5], 300)
    monkeypatch.syspath_prepend(str(_fake_llama_models(tmp_path, ranks)))
    tok = build_tokenizer("llama3")
    assert (tok.n_words, tok.bos_id, tok.eos_id) == (556, 300, 301)


def test_llama3_without_llama_models_is_one_line(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a, **k: None)
    with pytest.raises(ConfigError, match=r"^\[model\] tokenizer_path = 'llama3' means the Llama 3 "
                                          r"tokenizer.model shipped by the llama-models package, "
                                          r"which is not installed \(pip install --no-deps "
                                          r"llama-models\)"):
        build_tokenizer("llama3")


def test_tiktoken_matches_metas_reference_implementation(tmp_path):
    """Meta's own Llama 3 Tokenizer class (from llama-models, when installed) on the same file:
    identical ids for every BOS/EOS combination, special-token text, long runs; same specials."""
    from pathlib import Path

    reference = pytest.importorskip("llama_models.llama3.tokenizer", exc_type=ImportError)
    path = tmp_path / "small.tiktoken"
    write_ranks(train_bpe(python_docs.documents()[:20], 600), path)
    ref, ours = reference.Tokenizer(Path(path)), build_tokenizer(str(path))
    assert ours.special_tokens == ref.special_tokens
    assert (ours.n_words, ours.bos_id, ours.eos_id, ours.eot_id, ours.pad_id) == (
        ref.n_words, ref.bos_id, ref.eos_id, ref.eot_id, ref.pad_id)
    texts = [SAMPLE, "", "<|begin_of_text|><|eot_id|> text", "a" * 30_000 + " " * 26_000 + "b",
             *python_docs.documents()[20:23]]
    for text in texts:
        for bos in (False, True):
            for eos in (False, True):
                assert ours.encode(text, bos=bos, eos=eos) == ref.encode(text, bos=bos, eos=eos)
    ids = ref.encode(SAMPLE, bos=True, eos=True) + [ref.eot_id, ref.pad_id]
    assert ours.decode(ids) == ref.decode(ids)


def test_the_real_llama3_file_when_llama_models_is_installed():
    reference = pytest.importorskip("llama_models.llama3.tokenizer", exc_type=ImportError)
    ours, ref = build_tokenizer("llama3"), reference.Tokenizer.get_instance()
    assert ours.n_words == ref.n_words == 128_256 and ours.bos_id == 128_000
    assert ours.encode("Hello world!", bos=True, eos=False) == [128000, 9906, 1917, 0]
    for text in (SAMPLE, python_docs.documents()[3]):
        assert ours.encode(text, bos=True, eos=True) == ref.encode(text, bos=True, eos=True)


# ---- HuggingFace export: what `AutoTokenizer` loads from an exported folder ----------------------

# Special-token text inside a document is text for us but the control token for HF Llama 3
# tokenizers (Meta's included): the sample without it.
TEXTS = [SAMPLE.replace(" <|end_of_text|>", ""), "Hello world!", "", *python_docs.documents()[40:43]]


def _assert_hf_round_trip(ours, out_dir, texts=TEXTS):
    """transformers' AutoTokenizer on `out_dir` gives our ids (with BOS, as a HF Llama tokenizer
    adds it) and decodes them back to the text."""
    transformers = pytest.importorskip("transformers")

    ours.save_pretrained(out_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(out_dir), local_files_only=True)
    assert (hf.bos_token_id, hf.eos_token_id) == (ours.bos_id, ours.eos_id)
    for text in texts:
        ids = hf(text)["input_ids"]
        assert ids == ours.encode(text, bos=True, eos=False), text[:40]
        assert hf.decode(ids, skip_special_tokens=True) == text
    return hf


def test_tiktoken_export_loads_in_auto_tokenizer(tiktok, tmp_path):
    hf = _assert_hf_round_trip(tiktok, tmp_path / "hf")
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["chat_template.jinja", "tokenizer.json",
                                                                 "tokenizer_config.json"]
    assert len(hf) == tiktok.n_words
    assert hf.convert_tokens_to_ids(["<|eot_id|>", "<|finetune_right_pad_id|>"]) == [tiktok.eot_id, tiktok.pad_id]


def test_sentencepiece_export_loads_in_auto_tokenizer(tmp_path):
    import sentencepiece as spm

    prefix = tmp_path / "sp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(python_docs.documents()[:30]), model_prefix=str(prefix),
        vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        num_threads=1, minloglevel=2, normalization_rule_name="identity", remove_extra_whitespaces=False)
    ours = build_tokenizer(str(prefix) + ".model")
    # Llama 2 style text: sentencepiece's own leading-space convention is what HF's reproduces.
    hf = _assert_hf_round_trip(ours, tmp_path / "hf", ["Hello world!", *python_docs.documents()[40:43]])
    assert type(hf).__name__.startswith("LlamaTokenizer")  # LlamaTokenizerFast before transformers 5
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (prefix.with_suffix(".model")).read_bytes()


def test_the_real_llama3_file_exports_to_auto_tokenizer(tmp_path):
    pytest.importorskip("llama_models.llama3.tokenizer", exc_type=ImportError)
    _assert_hf_round_trip(build_tokenizer("llama3"), tmp_path / "hf")


# ---- where the recipes' tokenizers come from -------------------------------------------------


def test_a_missing_recipe_tokenizer_says_where_to_get_it():
    """The recipes' tokenizer files are not in the repository: the error names the HuggingFace
    repository, its file, the licence step and the download command, in one line."""
    from helpers import REPO

    from torchtitan_xla.config import parse_args
    from torchtitan_xla.datasets.tokenizer.hub import SOURCES

    recipes = sorted((REPO / "train_configs").glob("*.toml"))
    checked = 0
    for recipe in recipes:
        cfg = parse_args(["--job.config_file", str(recipe)])
        path = cfg.model.tokenizer_path
        if not path.startswith("./assets/"):
            continue  # the debug recipes' own tokenizer
        source = SOURCES[cfg.model.name]
        if path.startswith("./assets/tokenizer/"):  # pre-training recipes: the download's default
            assert path == source.default_path, recipe.name
        with pytest.raises(ConfigError) as e:
            build_tokenizer(f"/nonexistent{path[1:]}", cfg.model.name)
        message = str(e.value)
        assert "\n" not in message
        assert message.startswith(f"[model] tokenizer_path: file not found: /nonexistent{path[1:]}; ")
        out = f"/nonexistent{path[1:]}"
        if not Path(path).suffix:  # a model folder (the fine-tuning recipes'): its tokenizer file
            out += "/" + Path(source.filename).name
        for part in (source.repo, source.filename, f"python scripts/download_tokenizer.py {cfg.model.name} --out {out}`"):
            assert part in message, (recipe.name, part)
        assert (f"accept its licence at {source.url}" in message) == source.gated, recipe.name
        checked += 1
    assert checked >= 10  # llama2, llama3 (8B, 70B, 405B, SFT, LoRA, 3.2 1B), mixtral, qwen3 (SFT, LoRA, 30B-A3B)


def test_download_script_offline_is_one_line_and_writes_nothing(tmp_path):
    """Tested by its error paths only: nothing downloads in tests (HF_HUB_OFFLINE)."""
    import os
    import subprocess
    import sys

    from helpers import REPO

    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    out = tmp_path / "tok" / "tokenizer.model"
    script = str(REPO / "scripts" / "download_tokenizer.py")
    p = subprocess.run([sys.executable, script, "llama3", "--out", str(out)], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=120)
    assert (p.returncode, p.stdout) == (1, "")
    assert p.stderr == (f"error: cannot download original/tokenizer.model from meta-llama/Llama-3.1-8B: "
                        f"the HuggingFace Hub is not reachable (HF_HUB_OFFLINE is set); download it on "
                        f"a machine with network and copy it to {out}\n")
    assert not out.parent.exists()
    p = subprocess.run([sys.executable, script, "llama4"], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1  # argparse's wording varies by Python
    assert p.stderr.startswith("error: argument model: invalid choice: 'llama4' (choose from ")
