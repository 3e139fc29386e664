"""HuggingFace `tokenizer.json` tokenizers (Qwen3's, Llama 3.2's): against transformers'
AutoTokenizer on the embedded corpus and chat set, the chat formats they select, their masks, and
their errors. Every tokenizer file is trained or written by the test, offline."""

from __future__ import annotations

import json

import pytest
from data_helpers import HARMONY, train_gemma_style_tokenizer, train_qwen_style_tokenizer

from torchtitan_xla.config import ConfigError
from torchtitan_xla.datasets import python_docs
from torchtitan_xla.datasets.chat import render
from torchtitan_xla.datasets.tokenizer import build_tokenizer
from torchtitan_xla.datasets.tokenizer.hf import HFTokenizer

SAMPLE = "The \"assert\" statement — déjà vu 🙂 in 世界\n\n\tindented   text <|im_end|> 12345"


def conversations() -> list[list[dict]]:
    from torchtitan_xla.datasets.sources import load_documents

    return [json.loads(r["messages"]) for r in load_documents("python_docs_chat", "", "train")]


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory):
    """Qwen's kind of tokenizer.json, trained here on the embedded corpus (data_helpers)."""
    return train_qwen_style_tokenizer(tmp_path_factory.mktemp("qwen_style"))


def test_a_tokenizer_json_is_read_with_its_chatml_tokens_and_no_bos(qwen_style):
    tok = build_tokenizer(str(qwen_style))  # a model folder: its tokenizer.json
    assert isinstance(tok, HFTokenizer) and tok.chat_format == "chatml"
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (-1, 0, 0)  # <|endoftext|> ends and pads
    assert tok.n_words == 800 and tok.prefix_id == tok.eos_id
    ids = tok.encode(SAMPLE, bos=True, eos=True)
    assert ids[-1] == tok.eos_id and tok.decode(ids[:-1]) == SAMPLE
    # Special-token text inside a document stays text.
    assert not set(ids[:-1]) & set(tok.special_tokens.values())


def test_the_model_folders_tokenizer_config_names_the_eos(qwen_style, tmp_path):
    """Qwen3's instruct folders end turns and documents with <|im_end|>: tokenizer_config.json
    beside the file decides."""
    (tmp_path / "tokenizer.json").write_bytes((qwen_style / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": None, "eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}}))
    tok = build_tokenizer(str(tmp_path / "tokenizer.json"))
    assert (tok.bos_id, tok.eos_id, tok.pad_id) == (-1, 2, 0)


def test_ids_equal_autotokenizers_on_the_whole_corpus(qwen_style, tmp_path):
    """The exported tokenizer (what an HF export carries) loaded by AutoTokenizer encodes every
    embedded document as the project does."""
    import transformers

    tok = build_tokenizer(str(qwen_style))
    tok.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    documents = python_docs.documents()
    assert len(documents) > 50
    for text in [*documents, SAMPLE.replace("<|im_end|>", "")]:
        assert hf(text)["input_ids"] == tok.encode(text, bos=True, eos=False)
    assert hf.eos_token == "<|endoftext|>" and hf.bos_token is None


def test_chatml_rendering_equals_apply_chat_template_and_trains_only_the_answers(qwen_style, tmp_path):
    """Every embedded conversation: the ids training renders are apply_chat_template's on the
    exported tokenizer; the trained ids are each assistant answer and its <|im_end|>."""
    import transformers

    tok = build_tokenizer(str(qwen_style))
    tok.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    chats = conversations()
    assert len(chats) > 300
    end = tok.special_tokens["<|im_end|>"]
    for messages in chats:
        ids, trained = render(messages, tok)
        assert hf.apply_chat_template(messages, tokenize=True)["input_ids"] == ids
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        picked = [i for i, t in zip(ids, trained) if t]
        assert tok.decode(picked) == "<|im_end|>".join(answers) + "<|im_end|>"
        assert picked.count(end) == len(answers)
    prompt = hf.apply_chat_template(chats[0][:-1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_gemma_rendering_equals_apply_chat_template_and_trains_only_the_answers(tmp_path):
    """A Gemma-style tokenizer.json (no pre-tokenizer: pieces may span a turn's role, newline and
    content): <bos>, <eos>, <pad> and the Gemma chat format found by their names. Every embedded
    conversation, and one with a system message: the ids training renders are apply_chat_template's
    on the exported tokenizer (Gemma 3's format: the system text opening the first user turn); the
    trained ids are each answer and its <end_of_turn>."""
    import transformers

    from torchtitan_xla.datasets.chat import generation_prompt

    tok = build_tokenizer(str(train_gemma_style_tokenizer(tmp_path / "gemma")))
    assert (tok.chat_format, tok.bos_id, tok.eos_id, tok.pad_id) == ("gemma", 2, 1, 0)
    tok.save_pretrained(tmp_path / "out")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello \n"},
              {"role": "assistant", "content": "Hi."}]
    assert hf.apply_chat_template(system, tokenize=False) == (
        "<bos><start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n<start_of_turn>model\nHi.<end_of_turn>\n")
    end = tok.special_tokens["<end_of_turn>"]
    for messages in [system, *conversations()]:
        ids, trained = render(messages, tok)
        assert hf.apply_chat_template(messages, tokenize=True)["input_ids"] == ids
        answers = [m["content"].strip() for m in messages if m["role"] == "assistant"]
        picked = [i for i, t in zip(ids, trained) if t]
        assert tok.decode(picked) == "<end_of_turn>".join(answers) + "<end_of_turn>"
        assert picked.count(end) == len(answers)
        prompt = hf.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)["input_ids"]
        assert generation_prompt(messages[:-1], tok) == prompt
    assert hf.decode(prompt).endswith("<end_of_turn>\n<start_of_turn>model\n")


def test_harmony_rendering_equals_apply_chat_template_and_trains_the_final_channel(tmp_path):
    """gpt-oss's chat format on a byte-level tokenizer.json with its special tokens (found by
    <|channel|>): the published format for a conversation with a system message (written out
    here: the default system message with today's date, the system text as the developer's
    instructions, content unstripped, the last answer closed by <|return|>); every embedded
    conversation's ids = apply_chat_template's on the export, the trained ids each answer's
    "<|channel|>final<|message|>", text and closing token, and the generation prompts equal."""
    import time

    import transformers

    from torchtitan_xla.datasets.chat import end_of_turn_ids, generation_prompt

    tok = build_tokenizer(str(train_qwen_style_tokenizer(tmp_path / "gpt_oss", special=HARMONY)))
    assert (tok.chat_format, tok.bos_id, tok.eos_id) == ("harmony", -1, HARMONY.index("<|endoftext|>"))
    assert end_of_turn_ids(tok) == [HARMONY.index("<|return|>")]
    tok.save_pretrained(tmp_path / "out")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "out"), local_files_only=True)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hello \n"},
              {"role": "assistant", "content": "Hi."}]
    today = time.strftime("%Y-%m-%d")
    assert hf.apply_chat_template(system, tokenize=False) == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge "
        f"cutoff: 2024-06\nCurrent date: {today}\n\nReasoning: medium\n\n# Valid channels: analysis, "
        "commentary, final. Channel must be included for every message.<|end|><|start|>developer<|message|>"
        "# Instructions\n\nBe brief.\n\n<|end|><|start|>user<|message|> Hello \n<|end|><|start|>assistant"
        "<|channel|>final<|message|>Hi.<|return|>")
    multi_turn = 0
    for messages in [system, *conversations()]:
        ids, trained = render(messages, tok)
        assert hf.apply_chat_template(messages, tokenize=True)["input_ids"] == ids
        answers = [m["content"] for m in messages if m["role"] == "assistant"]
        ends = ["<|end|>"] * (len(answers) - 1) + ["<|return|>"]
        picked = tok.decode([i for i, t in zip(ids, trained) if t])
        assert picked == "".join(f"<|channel|>final<|message|>{a}{e}" for a, e in zip(answers, ends))
        prompt = hf.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True)["input_ids"]
        assert generation_prompt(messages[:-1], tok) == prompt
        multi_turn += len(answers) > 1
    assert multi_turn and hf.decode(prompt).endswith("<|end|><|start|>assistant")


def test_a_llama3_tokenizer_json_keeps_llama3s_ids_bos_and_chat_format(tmp_path):
    """Llama 3.2 ships its tokenizer as tokenizer.json: the debug tiktoken tokenizer exported to
    one (BOS added, Llama 3's special tokens) reads back with the same ids on the whole corpus and
    the same chat rendering."""
    tiktok = build_tokenizer("")
    tiktok.save_pretrained(tmp_path)
    tok = build_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and tok.chat_format == "llama3"
    assert (tok.n_words, tok.bos_id, tok.eos_id, tok.pad_id) == (
        tiktok.n_words, tiktok.bos_id, tiktok.eos_id, tiktok.pad_id)
    for text in [*python_docs.documents(), SAMPLE]:
        assert tok.encode(text, bos=True, eos=True) == tiktok.encode(text, bos=True, eos=True)
    for messages in conversations()[:50]:
        assert render(messages, tok) == render(messages, tiktok)


def test_bad_tokenizer_json_files_are_one_line(qwen_style, tmp_path):
    not_a_tokenizer = tmp_path / "tokenizer.json"
    not_a_tokenizer.write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ConfigError, match=r"^\[model\] tokenizer_path: .*tokenizer.json is not a "
                                          r"HuggingFace tokenizer.json \(.+\)$"):
        build_tokenizer(str(not_a_tokenizer))
    # A vocabulary with neither an end-of-text token nor a config naming one.
    spec = json.loads((qwen_style / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|endoftext|>"]
    del spec["model"]["vocab"]["<|endoftext|>"]
    not_a_tokenizer.write_text(json.dumps(spec))
    with pytest.raises(ConfigError, match=r"has no end-of-text token .* put the model's tokenizer_config.json"):
        build_tokenizer(str(not_a_tokenizer))
