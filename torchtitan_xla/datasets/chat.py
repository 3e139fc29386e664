"""Conversations for instruction tuning (SFT): the record format and the chat formats.

Records (`[training] dataset = "chat"`: JSON lines at dataset_path, a file, folder or glob, local
or a URL; `"python_docs_chat"`: embedded, offline). One JSON object per line, either

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}            (optionally with "system": "...")

The second form is one user turn answered by one assistant turn. A conversation is an optional
system message, then user and assistant turns alternating, ending with the assistant's (the shape
both chat formats below can render); other fields of a record are ignored. Local files are
checked whole when the dataset is built, so a bad line stops the run before training starts,
with `file:line` and the problem; files behind a URL are checked as they are read.

Rendering (`render`) follows the reference code of the tokenizer's model family:
- Llama 3 (tiktoken): <|begin_of_text|>, then per message <|start_header_id|> role
  <|end_header_id|> "\\n\\n" content.strip() <|eot_id|>. Special tokens are ids, never parsed from
  text: message text that looks like a special token stays plain text.
- ChatML (a tokenizer.json with <|im_start|>, Qwen's): per message <|im_start|> role "\\n"
  content.strip() <|im_end|> "\\n"; no BOS.
- Gemma (a tokenizer.json with <start_of_turn>): <bos>, then per message <start_of_turn> role
  ("model" for the assistant) "\\n" content.strip() <end_of_turn> "\\n", a system message's
  content and "\\n\\n" before the first user turn's content; each turn's text encoded whole, as
  the chat template's string is.
- Harmony (gpt-oss; a tokenizer.json with <|channel|>), as gpt-oss's chat template renders text
  turns: a system message <|start|>system<|message|>{HARMONY_SYSTEM}<|end|> (today's date in it,
  as the template's strftime_now), the record's system message as the developer's
  "# Instructions\n\n{system}\n\n", then <|start|>user<|message|>{content}<|end|> and
  <|start|>assistant<|channel|>final<|message|>{content}<|end|>, the last assistant turn closed by
  <|return|> instead (the token that ends generation); content as given, not stripped.
- Llama 2 (sentencepiece): a system message is folded into the first user turn as
  "<<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user}"; each (user, assistant) pair is
  BOS + "[INST] {user} [/INST] {assistant} " + EOS.
Only the assistant's tokens are trained: its content, and its closing <|eot_id|> (Llama 3),
<|im_end|> (ChatML), <end_of_turn> (Gemma), <|end|> / <|return|> (Harmony, with the
"<|channel|>final<|message|>" the model writes after the prompt's "<|start|>assistant") or EOS
(Llama 2), so the model learns to stop. Headers, BOS, system and user turns are context only.

Training rows (packing.ChatDataset): a conversation of n tokens gives n - 1 (input, label) pairs,
label i = ids[i + 1], or -100 (ignored by the loss) where ids[i + 1] is not trained. Each row is
four int64 tensors of seq_len: inputs, labels, positions (0 at each conversation's first token)
and document ids (1, 2, ... for the conversations of the row, 0 for padding). With packing,
conversations fill a row greedily in stream order; without, each has its own row. Padding has
input = the tokenizer's pad id (EOS where it has none), label -100, position 0, document id 0.
A conversation longer than seq_len is truncated to seq_len (a warning, logged once).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from torchtitan_xla.datasets.tokenizer.hf import HARMONY_SYSTEM
from torchtitan_xla.errors import ConfigError

if TYPE_CHECKING:
    from torchtitan_xla.datasets.tokenizer import Tokenizer

ROLES = ("system", "user", "assistant")
SHAPE = ("a conversation is an optional system message, then user and assistant turns "
         "alternating, ending with the assistant's")

Message = dict[str, str]


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


def parse_conversation(record: object, final: str = "assistant") -> list[Message]:
    """A JSON record (already decoded) -> its messages as [{"role", "content"}, ...], the last
    one `final`'s (a prompt to generate from ends with the user's). Raises a ConfigError saying
    what is wrong (the reader adds the file and line)."""
    if isinstance(record, dict) and "messages" in record:
        raw = record["messages"]
        if not isinstance(raw, list):
            raise ConfigError(f"'messages' is a {type(raw).__name__}, expected a list")
        messages = []
        for k, m in enumerate(raw, 1):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                    and isinstance(m.get("content"), str)):
                raise ConfigError(f"message {k}: expected an object with 'role' and 'content' strings")
            messages.append({"role": m["role"], "content": m["content"]})
    elif isinstance(record, dict) and isinstance(record.get("prompt"), str) \
            and isinstance(record.get("completion"), str):
        system = record.get("system")
        if system is not None and not isinstance(system, str):
            raise ConfigError(f"'system' is a {type(system).__name__}, expected a string")
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages += [{"role": "user", "content": record["prompt"]},
                     {"role": "assistant", "content": record["completion"]}]
    else:
        found = ", ".join(record) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"not a conversation: expected a 'messages' list, or 'prompt' and "
                          f"'completion' strings (found: {found or 'an empty object'})")
    _check_turns(messages, final)
    return messages


def _check_turns(messages: list[Message], final: str) -> None:
    if not messages:
        raise ConfigError(f"no messages ({SHAPE})")
    roles = [m["role"] for m in messages]
    for k, role in enumerate(roles, 1):
        if role not in ROLES:
            raise ConfigError(f"message {k}: unknown role {role!r} (expected {', '.join(ROLES)})")
    if final == "assistant" and "assistant" not in roles:
        raise ConfigError("no assistant turn: nothing to train on")
    first = 1 if roles[0] == "system" else 0
    for k, role in enumerate(roles[first:], first):
        expected = "user" if (k - first) % 2 == 0 else "assistant"
        if role != expected:
            raise ConfigError(f"message {k + 1}: role {role!r} where {expected!r} was expected "
                              f"({SHAPE})")
    if roles[-1] != final:
        raise ConfigError(f"the last message is the user's ({SHAPE})" if final == "assistant" else
                          f"the last message is the {roles[-1]}'s: a prompt ends with the user's turn")


# --------------------------------------------------------------------------------------------
# Rendering: messages -> token ids and which of them are trained
# --------------------------------------------------------------------------------------------


def chat_format(tokenizer: Tokenizer) -> str:
    """"llama3", "llama2", "chatml", "gemma" or "harmony": the chat format of the tokenizer's model
    family (never guessed: a tokenizer.json without one of their special tokens has none)."""
    if tokenizer.chat_format is None:
        raise ConfigError(f"[model] tokenizer_path: {getattr(tokenizer, 'path', '')} has none of ChatML's "
                          f"<|im_start|>, Llama 3's <|start_header_id|>, Gemma's <start_of_turn> and "
                          f"gpt-oss's <|channel|> special tokens: chat data needs one of the chat formats "
                          f"(datasets/chat.py)")
    return tokenizer.chat_format


def pad_id(tokenizer: Tokenizer) -> int:
    """The id padding positions hold (their labels are ignored, so any valid id would do)."""
    pad = getattr(tokenizer, "pad_id", -1)
    return pad if pad >= 0 else tokenizer.eos_id


def render(messages: list[Message], tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """The conversation's token ids in the tokenizer's chat format, and for each id whether it is
    trained (the assistant's content and end-of-turn token)."""
    return {"llama3": _render_llama3, "chatml": _render_chatml, "gemma": _render_gemma,
            "harmony": _render_harmony, "llama2": _render_llama2}[chat_format(tokenizer)](messages, tokenizer)


def _after_common_prefix(head: list[int], whole: list[int]) -> int:
    """Where `whole` (the encoding of a header's text and what follows it) parts from `head` (the
    header's alone): the first token that is not the header's. A token spanning the boundary
    holds text after it, so it counts as what follows."""
    return next((i for i, (a, b) in enumerate(zip(head, whole)) if a != b), min(len(head), len(whole)))


def _render_gemma(messages: list[Message], tokenizer) -> tuple[list[int], list[bool]]:
    special = tokenizer.special_tokens
    start, end = special["<start_of_turn>"], special["<end_of_turn>"]
    newline = tokenizer.encode("\n", bos=False, eos=False)
    prefix = ""
    if messages[0]["role"] == "system":
        prefix, messages = messages[0]["content"] + "\n\n", messages[1:]
    ids, trained = [tokenizer.bos_id], [False]
    for k, m in enumerate(messages):
        head = ("model" if m["role"] == "assistant" else m["role"]) + "\n" + (prefix if k == 0 else "")
        turn = tokenizer.encode(head + m["content"].strip(), bos=False, eos=False)
        common = _after_common_prefix(tokenizer.encode(head, bos=False, eos=False), turn)
        answer = m["role"] == "assistant"
        ids += [start, *turn, end, *newline]
        trained += [False] * (1 + common) + [answer] * (len(turn) - common + 1) + [False] * len(newline)
    return ids, trained


def _render_harmony(messages: list[Message], tokenizer) -> tuple[list[int], list[bool]]:
    special = tokenizer.special_tokens

    def text(t: str) -> list[int]:
        return tokenizer.encode(t, bos=False, eos=False)

    def message(role: str, content: str, end: str = "<|end|>") -> list[int]:
        return [special["<|start|>"], *text(role), special["<|message|>"], *text(content), special[end]]

    ids = message("system", HARMONY_SYSTEM.format(date=time.strftime("%Y-%m-%d")))
    if messages[0]["role"] == "system":
        ids += message("developer", f"# Instructions\n\n{messages[0]['content']}\n\n")
        messages = messages[1:]
    trained = [False] * len(ids)
    last = len(messages) - 1  # closed by <|return|> when the assistant's (training, not a prompt)
    for k, m in enumerate(messages):
        if m["role"] == "user":
            turn = message("user", m["content"])
            ids, trained = ids + turn, trained + [False] * len(turn)
            continue
        head = [special["<|start|>"], *text("assistant")]
        body = [special["<|channel|>"], *text("final"), special["<|message|>"], *text(m["content"]),
                special["<|return|>" if k == last else "<|end|>"]]
        ids, trained = ids + head + body, trained + [False] * len(head) + [True] * len(body)
    return ids, trained


def _render_llama3(messages: list[Message], tokenizer) -> tuple[list[int], list[bool]]:
    special = tokenizer.special_tokens
    ids, trained = [special["<|begin_of_text|>"]], [False]
    for m in messages:
        header = [special["<|start_header_id|>"], *tokenizer.encode(m["role"], bos=False, eos=False),
                  special["<|end_header_id|>"], *tokenizer.encode("\n\n", bos=False, eos=False)]
        body = [*tokenizer.encode(m["content"].strip(), bos=False, eos=False), special["<|eot_id|>"]]
        ids += header + body
        trained += [False] * len(header) + [m["role"] == "assistant"] * len(body)
    return ids, trained


def _render_chatml(messages: list[Message], tokenizer) -> tuple[list[int], list[bool]]:
    special = tokenizer.special_tokens
    newline = tokenizer.encode("\n", bos=False, eos=False)
    ids: list[int] = []
    trained: list[bool] = []
    for m in messages:
        header = [special["<|im_start|>"], *tokenizer.encode(m["role"], bos=False, eos=False), *newline]
        body = [*tokenizer.encode(m["content"].strip(), bos=False, eos=False), special["<|im_end|>"]]
        ids += header + body + newline
        trained += [False] * len(header) + [m["role"] == "assistant"] * len(body) + [False] * len(newline)
    return ids, trained


B_INST, E_INST = "[INST]", "[/INST]"
B_SYS, E_SYS = "<<SYS>>\n", "\n<</SYS>>\n\n"


def _render_llama2(messages: list[Message], tokenizer) -> tuple[list[int], list[bool]]:
    if messages[0]["role"] == "system":
        messages = [{"role": "user", "content": B_SYS + messages[0]["content"] + E_SYS
                     + messages[1]["content"]}, *messages[2:]]
    ids: list[int] = []
    trained: list[bool] = []
    for prompt, answer in zip(messages[::2], messages[1::2], strict=True):
        question = f"{B_INST} {prompt['content'].strip()} {E_INST}"
        pair = tokenizer.encode(f"{question} {answer['content'].strip()} ", bos=True, eos=True)
        # The ids are those of the whole string, as Meta's reference encodes it. The answer's
        # tokens are what follows the longest common prefix with the question's own encoding:
        # pieces start at whitespace, so that prefix is the whole question, and a piece that
        # spanned the boundary would count as the answer's (it holds answer text).
        common = _after_common_prefix(tokenizer.encode(question, bos=True, eos=False), pair)
        ids += pair
        trained += [False] * common + [True] * (len(pair) - common)
    return ids, trained


def generation_prompt(messages: list[Message], tokenizer: Tokenizer) -> list[int]:
    """The ids of a conversation that ends with the user's turn, then the assistant's header: what
    the model continues (transformers' `add_generation_prompt=True`)."""
    fmt = chat_format(tokenizer)
    if fmt == "llama2":
        if messages[0]["role"] == "system":
            messages = [{"role": "user", "content": B_SYS + messages[0]["content"] + E_SYS
                         + messages[1]["content"]}, *messages[2:]]
        before = render(messages[:-1], tokenizer)[0] if len(messages) > 1 else []
        question = f"{B_INST} {messages[-1]['content'].strip()} {E_INST}"
        return before + tokenizer.encode(question, bos=True, eos=False)
    special, role = tokenizer.special_tokens, tokenizer.encode("assistant", bos=False, eos=False)
    if fmt == "harmony":
        header = [special["<|start|>"], *role]
    elif fmt == "gemma":
        header = [special["<start_of_turn>"], *tokenizer.encode("model\n", bos=False, eos=False)]
    elif fmt == "llama3":
        header = [special["<|start_header_id|>"], *role, special["<|end_header_id|>"],
                  *tokenizer.encode("\n\n", bos=False, eos=False)]
    else:
        header = [special["<|im_start|>"], *role, *tokenizer.encode("\n", bos=False, eos=False)]
    return render(messages, tokenizer)[0] + header


def end_of_turn_ids(tokenizer: Tokenizer) -> list[int]:
    """The ids that end an assistant's turn in the tokenizer's chat format, besides EOS."""
    special = getattr(tokenizer, "special_tokens", None) or {}
    return [special[t] for t in ("<|eot_id|>", "<|im_end|>", "<end_of_turn>", "<|return|>") if t in special]
