"""Fine-tuning: packed conversations (document masking, restarting positions) have the losses they
have alone; the step's loss is the mean over every counted label of the global batch; SFT and LoRA
runs from an exported HF checkpoint lower the masked loss on the embedded chat set."""

import pytest
import torch
from checkpoint_helpers import from_hf

from torchtitan_xla.losses import IGNORE_INDEX

LENGTHS = (10, 7, 12)  # three conversations packed into one row of 32 (3 padding tokens)
SEQ = 32


def _conversations(vocab: int):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g) for n in LENGTHS]


def _packed(convs):
    """One row: the conversations back to back, positions restarting, document ids 1, 2, 3 and 0
    for the padding (what datasets/chat.py emits)."""
    tokens = torch.zeros(1, SEQ, dtype=torch.long)
    positions = torch.zeros(1, SEQ, dtype=torch.long)
    documents = torch.zeros(1, SEQ, dtype=torch.long)
    start = 0
    for i, c in enumerate(convs, 1):
        tokens[0, start:start + len(c)] = c
        positions[0, start:start + len(c)] = torch.arange(len(c))
        documents[0, start:start + len(c)] = i
        start += len(c)
    return tokens, positions, documents


def _per_conversation(logits, tokens, starts):
    """Each conversation's summed next-token loss within its own span."""
    losses = []
    for start, n in zip(starts, LENGTHS):
        lg, tg = logits[0, start:start + n - 1], tokens[0, start + 1:start + n]
        losses.append(torch.nn.functional.cross_entropy(lg, tg, reduction="sum"))
    return torch.stack(losses)


@pytest.mark.parametrize("attention", ["sdpa", "blockwise"])
def test_packed_conversations_have_the_losses_they_have_alone(attention):
    """float64 on the CPU: the packed row's per-conversation losses equal each conversation run
    alone from position 0, to rounding; without the document mask they would not."""
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer
    from torchtitan_xla.models.llama.blockwise_attention import BlockwiseCausalAttention

    args = get_model_args("llama3", "debugmodel", vocab_size=300, max_seq_len=SEQ, n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args).double()
    model.init_weights()
    if attention == "blockwise":
        for block in model.layers.values():
            block.attention.sdpa = BlockwiseCausalAttention()
    convs = _conversations(args.vocab_size)
    tokens, positions, documents = _packed(convs)
    starts = [0, LENGTHS[0], LENGTHS[0] + LENGTHS[1]]
    with torch.no_grad():
        packed = _per_conversation(model(tokens, positions, documents), tokens, starts)
        alone = torch.stack([torch.nn.functional.cross_entropy(model(c[None])[0, :-1], c[1:],
                                                               reduction="sum") for c in convs])
        unmasked = _per_conversation(model(tokens), tokens, starts)
    torch.testing.assert_close(packed, alone, rtol=0, atol=1e-10)
    assert (unmasked[1:] - alone[1:]).abs().min() > 1e-3  # the mask is what makes them equal


@pytest.mark.parametrize("chunk_size", [0, 8])
def test_packed_losses_on_xla_through_the_training_loss(chunk_size, xla_device):
    """The same on the XLA device in float32, through the step's loss function (full logits or
    the chunked loss), with the labels datasets/chat.py writes: IGNORE_INDEX across a boundary and
    on padding."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.losses import build_loss_fn
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer

    args = get_model_args("llama3", "debugmodel", vocab_size=300, max_seq_len=SEQ, n_layers=2)
    torch.manual_seed(0)
    model = Transformer(args).double()
    model.init_weights()
    convs = _conversations(args.vocab_size)
    with torch.no_grad():
        alone = torch.stack([torch.nn.functional.cross_entropy(model(c[None])[0, :-1], c[1:],
                                                               reduction="sum") for c in convs])
    tokens, positions, documents = _packed(convs)
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[0, :-1] = tokens[0, 1:]
    labels[0, :-1][documents[0, 1:] != documents[0, :-1]] = IGNORE_INDEX  # no label across
    labels[documents == 0] = IGNORE_INDEX
    loss_fn = build_loss_fn(parse_args(["--loss.chunk_size", str(chunk_size)]), dp_degree=1,
                            autocast_dtype=None)
    model = model.float().to(xla_device)
    with torch.no_grad():
        token_losses = loss_fn(model, *(t.to(xla_device) for t in (tokens, labels, positions, documents)))
    token_losses = token_losses.cpu().double().reshape(-1)  # one rank, one row
    per_conversation = torch.stack([token_losses[documents[0] == i].sum() for i in (1, 2, 3)])
    torch.testing.assert_close(per_conversation, alone, rtol=1e-5, atol=0)
    assert token_losses[documents[0] == 0].abs().max() == 0


# ---- training on the embedded chat set, from an exported HF checkpoint ---------------------------

CHAT = ["--training.dataset", "python_docs_chat", "--training.seq_len", "256"]


@pytest.fixture(scope="module")
def chat_runs(straight, tmp_path_factory):
    """One process, one device, starting from the shared run's HF export: 30 steps of SFT and of
    LoRA with validation on the held-out topics every 10, and one step of 8 sequences in 4
    microbatches (the loss-averaging reference)."""
    from checkpoint_helpers import TWO_BLOCKS
    from helpers import tiny_args, train_many

    out = tmp_path_factory.mktemp("chat")
    learn = [*CHAT, *from_hf(straight), "--training.steps", "30", "--training.local_batch_size", "4",
             "--validation.enable", "--validation.freq", "10", "--validation.steps", "-1"]
    runs = {
        "sft": tiny_args(out / "sft", *learn, "--optimizer.lr", "1e-3"),
        # The chunked loss with the output layer frozen (no weight gradient is built).
        "lora": tiny_args(out / "lora", *learn, "--optimizer.lr", "1e-2", "--lora.rank", "8",
                          "--loss.chunk_size", "256"),
        "accumulate_4x2": tiny_args(out / "acc", *CHAT, *from_hf(straight), "--training.steps", "1",
                                    "--training.local_batch_size", "2", "--training.global_batch_size", "8"),
    }
    return train_many(runs, devices=1, model_overrides=TWO_BLOCKS)


@pytest.mark.parametrize("kind", ["sft", "lora"])
def test_fine_tuning_lowers_the_masked_loss_on_held_out_conversations(kind, chat_runs):
    r = chat_runs[kind]
    losses, validation = r["losses"], r["validation"]
    assert sorted(validation) == [10, 20, 30]
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(26, 31)) / 5
    assert last < 0.9 * first, (kind, first, last)
    # On the held-out topics (never trained on), the loss falls at every validation.
    assert validation[30] < validation[20] < validation[10], (kind, validation)


def test_the_loss_is_the_mean_over_every_counted_label_of_the_global_batch(straight, chat_runs):
    """Step 1's logged loss (8 sequences in 4 microbatches of 2) is the sum of the counted tokens'
    losses over the count, computed here on the CPU from the same weights and batch: not the mean
    of the microbatches' means, which differs on masked data. A 4-device run (4 ranks, 2
    microbatches of one sequence each) logs the same."""
    from checkpoint_helpers import TWO_BLOCKS
    from helpers import tiny_args, train_many

    from torchtitan_xla.checkpoint.hf import read_hf_state_dict
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.datasets import build_data_loader, build_tokenizer
    from torchtitan_xla.losses import token_losses
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer
    from torchtitan_xla.models.llama.state_dict_adapter import from_hf as hf_to_ours

    cfg = parse_args(tiny_args(straight[0] / "unused", *CHAT))
    tokenizer = build_tokenizer("")
    loader = build_data_loader(cfg, tokenizer, batch_size=8)
    inputs, labels, positions, documents = next(iter(loader))
    loader.close()
    args = get_model_args("llama3", "debugmodel", vocab_size=tokenizer.n_words, max_seq_len=256, **TWO_BLOCKS)
    model = Transformer(args)
    model.load_state_dict(hf_to_ours(read_hf_state_dict(straight[0] / "checkpoint" / "step-6-hf"), args),
                          strict=False)  # the RoPE tables are the constructor's
    with torch.no_grad():
        losses = token_losses(model(inputs, positions, documents).double(), labels)
    counted = labels != IGNORE_INDEX
    expected = (losses.sum() / counted.sum()).item()
    mean_of_means = sum((losses[i:i + 2].sum() / counted[i:i + 2].sum()).item() for i in (0, 2, 4, 6)) / 4
    assert abs(mean_of_means - expected) > 1e-3 * expected  # the batch tells the two apart
    logged = chat_runs["accumulate_4x2"]["losses"][1]
    assert logged == pytest.approx(expected, rel=2e-5)
    four = train_many({"dp4": tiny_args(straight[0] / "dp4", *CHAT, *from_hf(straight), "--training.steps", "1",
                                        "--training.local_batch_size", "1", "--training.global_batch_size", "8")},
                      devices=4, model_overrides=TWO_BLOCKS)
    assert four["dp4"]["losses"][1] == pytest.approx(logged, rel=2e-6)


def test_lora_on_chat_data_resumes_bit_exactly(straight, tmp_path):
    """Adapters, optimizer state and the chat loader's position (a packed row half filled, a
    shuffle buffer) come back from a checkpoint: resuming at step 3 gives the uninterrupted run's
    losses exactly."""
    import shutil

    from checkpoint_helpers import run

    flags = [*CHAT, *from_hf(straight), "--training.local_batch_size", "2", "--lora.rank", "4",
             "--training.shuffle_buffer", "16"]
    straight_losses, _ = run(tmp_path, *flags)
    shutil.rmtree(tmp_path / "checkpoint" / "step-6")
    resumed, log = run(tmp_path, *flags)
    assert "Resumed from" in log and sorted(resumed) == [4, 5, 6]
    assert resumed == {s: straight_losses[s] for s in (4, 5, 6)}


def test_the_exported_tokenizers_chat_template_renders_as_training_does(tmp_path):
    """transformers' apply_chat_template on the exported tokenizer gives the ids training rendered,
    for every conversation of the embedded set (chat served from an exported model sees the
    format it was fine-tuned on)."""
    import json

    import transformers

    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.datasets.chat import render
    from torchtitan_xla.datasets.sources import load_documents

    tokenizer = build_tokenizer("")
    tokenizer.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    conversations = [json.loads(r["messages"]) for r in load_documents("python_docs_chat", "", "train")]
    assert len(conversations) > 300
    for messages in conversations:
        assert hf.apply_chat_template(messages, tokenize=True)["input_ids"] == render(messages, tokenizer)[0]
    prompt = hf.apply_chat_template(conversations[0][:-1], add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
