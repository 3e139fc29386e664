"""Chat data for instruction tuning: records and their errors (also through train.py), the Llama 3
and Llama 2 chat formats with their label masks, packing and padding, truncation, exact resume,
and the embedded python_docs_chat set."""

import json
import logging
import time

import pytest
import torch
from data_helpers import CharTokenizer
from helpers import capture_logs

from torchtitan_xla.config import ConfigError, parse_args
from torchtitan_xla.datasets import build_data_loader, build_tokenizer, python_docs
from torchtitan_xla.datasets.chat import parse_conversation, render
from torchtitan_xla.datasets.packing import ChatDataset
from torchtitan_xla.datasets.sources import load_documents

IGNORE = -100

DIALOG = [
    {"role": "system", "content": "  Answer briefly.\n"},
    {"role": "user", "content": "What is a list?"},
    {"role": "assistant", "content": " A mutable sequence. "},
    {"role": "user", "content": "And a tuple? Not <|eot_id|> a trick."},
    {"role": "assistant", "content": "An immutable one, written <|eot_id|> here as text."},
]


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer("")  # the project's Llama-3-format debug tokenizer (2256 ids)


@pytest.fixture(scope="module")
def sp_tok(tmp_path_factory):
    """A small Llama-2-style sentencepiece tokenizer (as in test_tokenizer.py)."""
    import sentencepiece as spm

    prefix = tmp_path_factory.mktemp("sp") / "sp"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(python_docs.documents()[:30]), model_prefix=str(prefix),
        vocab_size=400, model_type="bpe", byte_fallback=True, character_coverage=1.0,
        num_threads=1, minloglevel=2, normalization_rule_name="identity",
        remove_extra_whitespaces=False)
    return build_tokenizer(str(prefix) + ".model")


def conversations(n):
    """`n` distinct conversations of varied length, one with a system message in three."""
    out = []
    for i in range(n):
        messages = [{"role": "system", "content": "Be kind."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"Question {i}?"},
                     {"role": "assistant", "content": f"Answer {i}:" + " yes" * (i % 5)}]
        out.append(messages)
    return out


def write_chat(path, lines):
    """JSON lines: dicts are dumped, strings written as they are."""
    path.write_text("".join((ln if isinstance(ln, str) else json.dumps(ln)) + "\n" for ln in lines))
    return path


def chat_stream(tokenizer, seq_len, path, **kw):
    return ChatDataset(load_documents("chat", str(path)), tokenizer, seq_len, infinite=False,
                       name="chat", **kw)


def example(messages, tokenizer):
    """A conversation's (inputs, labels) computed here from render's ids and mask."""
    ids, trained = render(messages, tokenizer)
    return ids[:-1], [t if keep else IGNORE for t, keep in zip(ids[1:], trained[1:])]


def segments(rows):
    """Every conversation of the rows as (inputs, labels, positions), by document id."""
    out = []
    for inputs, labels, positions, docs in rows:
        for d in range(1, int(docs.max()) + 1):
            at = docs == d
            out.append((inputs[at].tolist(), labels[at].tolist(), positions[at].tolist()))
    return out


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


def test_both_record_forms_become_messages():
    assert parse_conversation({"prompt": "p", "completion": "c", "id": 7}) == [
        {"role": "user", "content": "p"}, {"role": "assistant", "content": "c"}]
    assert parse_conversation({"system": "s", "prompt": "p", "completion": "c"})[0] == {
        "role": "system", "content": "s"}
    messages = [{"role": "user", "content": "u", "name": "x"}, {"role": "assistant", "content": "a"}]
    assert parse_conversation({"messages": messages}) == [
        {"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]


BAD_RECORDS = [
    ('{"messages": [', "not a JSON object (Expecting value)"),
    ({"text": "hello"}, "not a conversation: expected a 'messages' list, or 'prompt' and "
                        "'completion' strings (found: text)"),
    ({"prompt": "p"}, "not a conversation: expected a 'messages' list, or 'prompt' and "
                      "'completion' strings (found: prompt)"),
    ({"messages": "hi"}, "'messages' is a str, expected a list"),
    ({"messages": [{"role": "user", "content": 3}]},
     "message 1: expected an object with 'role' and 'content' strings"),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "bot", "content": "a"}]},
     "message 2: unknown role 'bot' (expected system, user, assistant)"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]},
     "no assistant turn: nothing to train on"),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "user", "content": "u"},
                   {"role": "assistant", "content": "a"}]},
     "message 2: role 'user' where 'assistant' was expected (a conversation is an optional "
     "system message, then user and assistant turns alternating, ending with the assistant's)"),
    ({"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "u"}]},
     "the last message is the user's (a conversation is an optional system message, then user "
     "and assistant turns alternating, ending with the assistant's)"),
]


@pytest.mark.parametrize("line,problem", BAD_RECORDS, ids=[
    "not_json", "neither_form", "prompt_only", "messages_not_a_list", "message_not_an_object",
    "unknown_role", "no_assistant", "not_alternating", "ends_with_user"])
def test_a_bad_record_stops_the_build_with_file_and_line(tmp_path, line, problem):
    """Local files are checked whole when the dataset is built: a bad last line is found before
    any batch is read."""
    good = {"prompt": "p", "completion": "c"}
    path = write_chat(tmp_path / "chat.jsonl", [good, "", good, line])
    with pytest.raises(ConfigError) as e:
        load_documents("chat", str(path))
    assert str(e.value) == f"{path}:4: {problem}"


# --------------------------------------------------------------------------------------------
# Chat formats and label masks
# --------------------------------------------------------------------------------------------


def test_llama3_format_and_exactly_the_assistant_tokens_are_trained(tok, tmp_path):
    sp = tok.special_tokens
    bos, start, end, eot = (sp[t] for t in ("<|begin_of_text|>", "<|start_header_id|>",
                                            "<|end_header_id|>", "<|eot_id|>"))
    ids, _ = render(DIALOG, tok)
    # Meta's reference ChatFormat (encode_dialog_prompt without the open assistant header).
    reference = [bos]
    for m in DIALOG:
        reference += [start, *tok.encode(m["role"], bos=False, eos=False), end,
                      *tok.encode("\n\n", bos=False, eos=False),
                      *tok.encode(m["content"].strip(), bos=False, eos=False), eot]
    assert ids == reference
    assert ids.count(eot) == 5  # the "<|eot_id|>" inside contents is plain text

    # Where each message's content lies, found from the layout: after its header, up to its eot.
    trained_at, rest = [], 1
    for m in DIALOG:
        assert ids[rest] == start
        body = ids.index(end, rest) + 1 + len(tok.encode("\n\n", bos=False, eos=False))
        close = ids.index(eot, body)
        if m["role"] == "assistant":
            trained_at += range(body, close + 1)  # the content and its eot
        rest = close + 1
    assert rest == len(ids)

    inputs, labels, positions, docs = next(iter(chat_stream(
        tok, 128, write_chat(tmp_path / "one.jsonl", [{"messages": DIALOG}]), packing=False)))
    n = len(ids) - 1
    assert inputs[:n].tolist() == ids[:-1]
    counted = [i for i, y in enumerate(labels.tolist()) if y != IGNORE]
    assert counted == [p - 1 for p in trained_at]  # label i is token i + 1
    assert [labels[i].item() for i in counted] == [ids[p] for p in trained_at]
    assert tok.decode([labels[i].item() for i in counted]) == (
        "A mutable sequence.<|eot_id|>An immutable one, written <|eot_id|> here as "
        "text.<|eot_id|>")
    assert positions[:n].tolist() == list(range(n)) and docs[:n].tolist() == [1] * n
    assert (labels[n:] == IGNORE).all() and (inputs[n:] == tok.pad_id).all()
    assert (docs[n:] == 0).all() and (positions[n:] == 0).all()


def test_llama2_format_and_exactly_the_answers_are_trained(sp_tok, tmp_path):
    ids, trained = render(DIALOG, sp_tok)
    # Meta's Llama 2 reference chat_completion: the system message folded into the first user turn.
    system, user1, answer1, user2, answer2 = (m["content"] for m in DIALOG)
    user1 = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user1}"
    reference = []
    for user, answer in ((user1, answer1), (user2, answer2)):
        reference += sp_tok.encode(f"[INST] {user.strip()} [/INST] {answer.strip()} ", bos=True,
                                   eos=True)
    assert ids == reference
    # Each pair: untrained BOS + question, then the trained answer and EOS.
    pairs, start = [], 0
    for _ in range(2):
        stop = ids.index(sp_tok.eos_id, start) + 1
        pairs.append((ids[start:stop], trained[start:stop]))
        start = stop
    for (pair, mask), (user, answer) in zip(pairs, ((user1, answer1), (user2, answer2))):
        k = mask.index(True)
        assert not any(mask[:k]) and all(mask[k:]) and pair[-1] == sp_tok.eos_id
        assert sp_tok.decode(pair[:k]) == f"[INST] {user.strip()} [/INST]"
        assert sp_tok.decode(pair[k:-1]).strip() == answer.strip()
    assert sp_tok.pad_id == -1  # no pad piece: padding holds EOS
    row = next(iter(chat_stream(sp_tok, 200, write_chat(
        tmp_path / "one.jsonl", [{"messages": DIALOG}]), packing=False)))
    assert row[0][len(ids) - 1:].eq(sp_tok.eos_id).all()


def test_a_tokenizer_without_a_chat_format_is_refused(tmp_path):
    path = write_chat(tmp_path / "c.jsonl", [{"prompt": "p", "completion": "c"}])
    with pytest.raises(ConfigError, match=r"has none of ChatML's <\|im_start\|>, Llama 3's"):
        chat_stream(CharTokenizer(), 16, path)


# --------------------------------------------------------------------------------------------
# Packing, padding, truncation
# --------------------------------------------------------------------------------------------


def test_packed_rows_hold_the_same_examples_as_unpacked_rows(tok, tmp_path):
    convs = conversations(12)
    path = write_chat(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
    expected = [example(m, tok) for m in convs]
    assert all(28 <= len(x) <= 48 for x, _ in expected)

    unpacked = list(chat_stream(tok, 96, path, packing=False))
    assert len(unpacked) == 12 and all(int(r[3].max()) == 1 for r in unpacked)
    packed = list(chat_stream(tok, 96, path))
    assert len(packed) <= 6  # two or three conversations per row
    for rows in (unpacked, packed):
        assert all(len(r) == 4 and all(t.shape == (96,) and t.dtype == torch.long for t in r)
                   for r in rows)
        assert [(x, y) for x, y, _ in segments(rows)] == expected
        for inputs, labels, positions, docs in rows:
            ids = docs.tolist()
            used = sum(d > 0 for d in ids)
            # Documents 1, 2, ... in order, then padding (document 0, position 0, label -100).
            assert ids[:used] == sorted(ids[:used]) and ids[0] == 1 and not any(ids[used:])
            assert (labels[used:] == IGNORE).all() and (inputs[used:] == tok.pad_id).all()
            assert (positions[used:] == 0).all()
        for x, y, pos in segments(rows):
            assert pos == list(range(len(x)))  # positions restart at each conversation
            # No label crosses into the next conversation: the last one is this one's eot.
            assert y[-1] == tok.special_tokens["<|eot_id|>"]
    # Greedy: a row is emitted only when the next conversation does not fit.
    lengths = [len(x) for x, _ in expected]
    k = 0
    for _, _, _, docs in packed[:-1]:
        n = int(docs.max())
        assert sum(lengths[k:k + n]) + lengths[k + n] > 96
        k += n


def test_a_long_conversation_is_truncated_with_one_warning(tok, tmp_path):
    convs = conversations(6)
    path = write_chat(tmp_path / "chat.jsonl", [{"messages": m} for m in convs])
    with capture_logs() as log:
        rows = list(chat_stream(tok, 16, path))
    warnings = [m for m in log.messages(logging.WARNING) if "longer than seq_len" in m]
    first = len(example(convs[0], tok)[0])
    assert warnings == [f"dataset chat (host 0 of 1): a conversation of {first} tokens is longer "
                        f"than seq_len 16; its last {first - 16} tokens are dropped (logged once: "
                        f"longer conversations are all truncated to seq_len)"]
    assert len(rows) == 6  # each fills a row on its own
    for (inputs, labels, _, docs), m in zip(rows, convs):
        x, y = example(m, tok)
        assert inputs.tolist() == x[:16] and labels.tolist() == y[:16] and (docs == 1).all()


# --------------------------------------------------------------------------------------------
# Exact resume through the loader
# --------------------------------------------------------------------------------------------


def take(it, n):
    return [next(it) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(
        len(x) == 4 and all(torch.equal(u, v) for u, v in zip(x, y, strict=True))
        for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("extra", [["--training.shuffle_buffer", "5"], ["--training.no-packing"],
                                   ["--training.shuffle_buffer", "3", "--training.num_workers", "1"]],
                         ids=["packing_shuffled", "unpacked", "worker"])
def test_resume_continues_exactly_across_an_epoch(tok, extra):
    """python_docs_chat has 33 packed rows (72 unpacked) per epoch: 45 batches of 2 cross one."""
    args_list = ["--training.dataset", "python_docs_chat", "--training.seq_len", "256", *extra]
    args = parse_args(args_list)

    def loader():
        return build_data_loader(args, tok, batch_size=2)

    full_loader = loader()
    full = take(iter(full_loader), 45)
    full_loader.close()
    assert all(len(b) == 4 and b[0].shape == (2, args.training.seq_len) for b in full)
    dl = loader()
    first = take(iter(dl), 17)
    time.sleep(0.3)  # the prefetch thread is now ahead of the batches taken
    state = dl.state_dict()
    dl.close()
    resumed = loader()
    resumed.load_state_dict(state)
    rest = take(iter(resumed), 28)
    resumed.close()
    assert same(first + rest, full)
    if extra[0] == "--training.shuffle_buffer" and len(extra) == 2:
        # The packed state holds the conversations of the row being filled: not a state to
        # continue one conversation per row from.
        unpacked = build_data_loader(parse_args([*args_list, "--training.no-packing"]), tok, batch_size=2)
        with pytest.raises(ConfigError, match=r"^dataset python_docs_chat: the checkpoint holds conversations "
                                              r"read with \[training\] packing = true; resume with the same setting$"):
            unpacked.load_state_dict(state)
            next(iter(unpacked))
        unpacked.close()


# --------------------------------------------------------------------------------------------
# The embedded python_docs_chat set
# --------------------------------------------------------------------------------------------


def test_python_docs_chat_splits_and_packs_several_per_row(tok):
    def rows(split):
        return [json.loads(r["messages"]) for r in load_documents("python_docs_chat", "", split)]

    train, val = rows("train"), rows("validation")
    topics = python_docs.conversations()
    assert len(topics) == len(python_docs.documents())
    # Held out by topic: every tenth topic's conversations, and no held-out answer is trained on.
    assert val == [c for i, t in enumerate(topics) if i % 10 == 9 for c in t] and len(val) >= 24
    assert len(train) + len(val) == sum(map(len, topics))
    assert not {m[-1]["content"] for m in val} & {m[-1]["content"] for m in train}
    assert rows("train") == train and rows("validation") == val  # deterministic
    dumped = {json.dumps(m) for m in train}
    assert not any(json.dumps(m) in dumped for m in val)
    everything = train + val
    for m in everything:
        assert parse_conversation({"messages": m}) == m  # a valid record: ends with the answer
    assert any(m[0]["role"] == "system" for m in everything)
    assert any(len(m) >= 4 and m[-2]["content"] == python_docs.FOLLOW_UP for m in everything)
    assert len({m[-1]["content"] for m in everything}) > 70  # real, mostly distinct answers
    with pytest.raises(ConfigError, match=r"^\[training\] dataset_split: python_docs_chat has "
                                          r"splits train and validation, not 'test'$"):
        load_documents("python_docs_chat", "", "test")

    ds = ChatDataset(load_documents("python_docs_chat"), tok, 256, infinite=False)
    packed = list(ds)
    per_row = sum(int(r[3].max()) for r in packed) / len(packed)
    assert per_row >= 2, f"{per_row:.2f} conversations per 256-token row"


# --------------------------------------------------------------------------------------------
# Through train.py: a bad file stops the run before anything is trained or written
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("line,problem", [
    ({"messages": [{"role": "user", "content": "u"}]}, "no assistant turn: nothing to train on"),
    ({"messages": [{"role": "human", "content": "u"}, {"role": "assistant", "content": "a"}]},
     "message 1: unknown role 'human' (expected system, user, assistant)"),
    ("prompt: hi", "not a JSON object (Expecting value)"),
], ids=["no_assistant", "unknown_role", "not_json"])
def test_a_bad_chat_file_stops_train_py_with_one_line(tmp_path, line, problem):
    from helpers import run_train, tiny_args

    path = write_chat(tmp_path / "chat.jsonl", [{"prompt": "p", "completion": "c"}] * 2 + [line])
    out = tmp_path / "out"
    run = run_train(tiny_args(out, "--training.dataset", "chat", "--training.dataset_path",
                              str(path)))
    assert run.returncode == 2, run.stderr[-3000:]
    # The file and line, after the flag that named the file.
    assert run.stderr.strip().splitlines()[-1] == (
        f"error: command line: --training.dataset_path: {path}:3: {problem}")
    assert "Traceback" not in run.stderr and not run.losses and not out.exists()
