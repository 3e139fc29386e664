"""Preference objectives (dpo, ipo, simpo, orpo): the losses and gradients against TRL's formulas on
transformers' log-probabilities in float64, the LoRA reference, the pairs' rows, and DPO training
from the shared run's HF export: the preference learnt, every mesh the same, resume bit-exact, and
bad input stopped in one line before anything runs."""

import json
import math
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from checkpoint_helpers import TWO_BLOCKS, from_hf
from helpers import REPO, _env, hf_rope, rmsnorm_in_input_dtype, run_train, tiny_args, train_many, train_run

from torchtitan_xla.batch import Batch
from torchtitan_xla.losses import IGNORE_INDEX

BETA, SMOOTHING, GAMMA = 0.3, 0.1, 0.4

# Pairs of different prompt and completion lengths; plain text, a system prompt, and a
# conversational prompt whose earlier answer is context, not completion.
PAIRS = [
    {"prompt": "What is a list?", "chosen": "A mutable sequence.", "rejected": "A kind of fish that swims."},
    {"prompt": "Name a loop.", "system": "Be brief.", "chosen": "for", "rejected": "while True: pass"},
    {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! Ask away."},
                {"role": "user", "content": "What does len do?"}],
     "chosen": [{"role": "assistant", "content": "It returns the number of items of a container."}],
     "rejected": [{"role": "assistant", "content": "Nothing."}]},
]


def _dataset(tokenizer, records, seq_len=96, **options):
    from torchtitan_xla.datasets.preference import PreferenceDataset, encode_pairs, parse_pair
    from torchtitan_xla.datasets.sources import _from_generator

    stream = _from_generator(encode_pairs, column="pair", pairs=[parse_pair(r) for r in records])
    return PreferenceDataset(stream, tokenizer, seq_len, infinite=False, name="test", **options)


def _rows(tokenizer, records, seq_len=96, packing=False):
    """The pairs' training rows through the dataset class the loader uses, [rows, seq_len] x 4:
    unpacked, 2 x pairs rows."""
    rows = list(_dataset(tokenizer, records, seq_len, packing=packing))
    return tuple(torch.stack(column) for column in zip(*rows))


def test_stored_reference_rows_carry_their_log_probability_and_resume_between_a_pairs_rows(tokenizer):
    """With `reference`, each row gets a fifth column, [its stored log-probability] in float32;
    a state taken between a pair's rows gives the rejected row, its number included; resuming it
    with the other setting, or a pair without the numbers, is one line."""
    from torchtitan_xla.errors import ConfigError

    records = [{**r, "ref_chosen_logps": -10.25 - k, "ref_rejected_logps": -3.5 - k} for k, r in enumerate(PAIRS)]

    def dataset(records, reference=True):
        return _dataset(tokenizer, records, reference=reference)

    rows = list(dataset(records))
    assert [row[4].tolist() for row in rows] == [[-10.25], [-3.5], [-11.25], [-4.5], [-12.25], [-5.5]]
    assert all(row[4].dtype == torch.float32 and len(row) == 5 for row in rows)
    plain = list(dataset(records, reference=False))
    assert all(len(p) == 4 and all(torch.equal(a, b) for a, b in zip(p, row)) for p, row in zip(plain, rows))
    first = dataset(records)
    it = iter(first)
    next(it)
    state = first.state_dict()  # between the first pair's rows
    resumed = dataset(records)
    resumed.load_state_dict(state)
    assert [row[4].item() for row in resumed] == [-3.5, -11.25, -4.5, -12.25, -5.5]
    with pytest.raises(ConfigError, match="holds pairs read with .* precomputed_reference = true"):
        dataset(records, reference=False).load_state_dict(state)
    with pytest.raises(ConfigError, match="no 'ref_chosen_logps' or 'ref_rejected_logps'"):
        list(dataset(PAIRS))


@pytest.fixture(scope="module")
def tokenizer():
    from torchtitan_xla.datasets import build_tokenizer

    return build_tokenizer("", "llama3")


@pytest.mark.parametrize("record, message", [
    ({"prompt": "p", "chosen": "c"}, "no 'rejected'"),
    ({"prompt": [], "chosen": "c", "rejected": "r"}, "no messages"),
    ({"prompt": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
      "chosen": "c", "rejected": "r"}, "a prompt ends with the user's turn"),
    ({"prompt": "p", "chosen": [{"role": "user", "content": "c"}], "rejected": "r"},
     "'chosen': expected a string or a list of one assistant message"),
    ({**PAIRS[0], "ref_chosen_logps": -3.5}, "'ref_chosen_logps' without 'ref_rejected_logps'"),
    ({**PAIRS[0], "ref_chosen_logps": "-3.5", "ref_rejected_logps": -2.0},
     "'ref_chosen_logps': expected a finite number"),
    ({**PAIRS[0], "ref_chosen_logps": -3.5, "ref_rejected_logps": float("nan")},
     "'ref_rejected_logps': expected a finite number"),
])
def test_malformed_pairs_are_one_line(record, message):
    from torchtitan_xla.datasets.preference import parse_pair
    from torchtitan_xla.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_pair(record)


def test_a_saved_hf_dataset_gives_the_pairs_of_its_json_lines(tmp_path):
    """TRL's columns as `datasets` saves them (save_to_disk: a train and a validation split, each
    row given every column, None where it had none) give the pairs the same records give as JSON
    lines; a bad row names the folder, the split and the row."""
    import datasets

    from torchtitan_xla.datasets.sources import load_documents
    from torchtitan_xla.errors import ConfigError

    # Plain text, the first row with a system prompt (from_list takes its columns from it), and chat.
    splits = {"train": [PAIRS[1], PAIRS[0]], "validation": PAIRS[2:]}
    saved = tmp_path / "saved"
    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(str(saved))
    for split, records in splits.items():
        lines = tmp_path / f"{split}.jsonl"
        lines.write_text("".join(json.dumps(r) + "\n" for r in records))
        want = [r["pair"] for r in load_documents("preference", str(lines), "train")]
        assert [r["pair"] for r in load_documents("preference", str(saved), split)] == want
    datasets.Dataset.from_list([PAIRS[0], {**PAIRS[0], "rejected": None}]).save_to_disk(str(tmp_path / "bad"))
    with pytest.raises(ConfigError, match=f"^{tmp_path / 'bad'} \\(train split\\), row 1: not a preference "
                                          f"pair: no 'rejected'"):
        load_documents("preference", str(tmp_path / "bad"), "train")


def test_rows_hold_the_final_answer_only_and_come_in_pairs(tokenizer):
    """Each pair is two rows sharing the prompt's ids; only the final answer (and its end-of-turn
    token) is labelled, in the chosen row then the rejected row."""
    from torchtitan_xla.datasets import chat

    inputs, labels, positions, documents = _rows(tokenizer, PAIRS)
    assert inputs.shape[0] == 2 * len(PAIRS)
    eot = tokenizer.special_tokens["<|eot_id|>"]
    for i, record in enumerate(PAIRS):
        for side, key in enumerate(("chosen", "rejected")):
            row = 2 * i + side
            answer = record[key] if isinstance(record[key], str) else record[key][0]["content"]
            trained = [t for t in labels[row].tolist() if t != IGNORE_INDEX]
            assert trained == tokenizer.encode(answer, bos=False, eos=False) + [eot], (i, key)
            # The labelled tokens are the row's last real ones: the prompt comes first, whole.
            real = int((documents[row] == 1).sum())
            first = next(k for k, t in enumerate(labels[row].tolist()) if t != IGNORE_INDEX)
            assert first + len(trained) == real and positions[row, real - 1] == real - 1
        prompt_len = next(k for k, t in enumerate(labels[2 * i].tolist()) if t != IGNORE_INDEX)
        assert torch.equal(inputs[2 * i, :prompt_len + 1], inputs[2 * i + 1, :prompt_len + 1])
    # The conversational prompt's earlier answer is rendered but not labelled.
    messages = chat.parse_conversation({"messages": PAIRS[2]["prompt"]}, final="user")
    prompt = chat.generation_prompt(messages, tokenizer)
    assert inputs[4, :len(prompt)].tolist() == prompt and (labels[4, :len(prompt) - 1] == IGNORE_INDEX).all()


def test_packed_rows_hold_whole_pairs_as_documents_and_resume_inside_a_row(tokenizer):
    """Packed, pairs fill rows in order as documents 1, 2 (a pair's chosen and rejected), 3, 4, ...,
    each document the unpacked row's tokens, labels and positions; a pair never spans rows. A pair
    longer than the row has its answers cut to fit (the longer first, neither below half the row);
    a prompt longer than its half is one line. The stored reference numbers sit in their
    documents' slots; a state taken inside a row resumes to the same rows, and with the other
    setting is one line."""
    from torchtitan_xla.datasets.preference import document_slots
    from torchtitan_xla.errors import ConfigError

    # The three pairs are 59, 66 and 112 tokens (chosen + rejected).
    unpacked, packed = _rows(tokenizer, PAIRS, 128), _rows(tokenizer, PAIRS, 128, packing=True)
    assert packed[3].amax(-1).tolist() == [4, 2] and packed[0].shape == (2, 128)
    for k, (row, document) in enumerate([(0, 1), (0, 2), (0, 3), (0, 4), (1, 1), (1, 2)]):
        n = int((unpacked[3][k] == 1).sum())
        assert [packed[c][row][packed[3][row] == document].tolist() for c in range(3)] == \
            [unpacked[c][k][:n].tolist() for c in range(3)], k
    # At 100 tokens the first two pairs need a row each; the third is cut to 50 + 50 tokens
    # (chosen 59 -> 50, rejected 53 -> 50), each the start of its whole sequence.
    cut = _rows(tokenizer, PAIRS, 100, packing=True)
    assert [[int((cut[3][r] == d).sum()) for d in (1, 2)] for r in range(3)] == [[24, 35], [31, 35], [50, 50]]
    for d, k in ((1, 4), (2, 5)):
        assert cut[0][2][cut[3][2] == d].tolist() == unpacked[0][k][:50].tolist()
        assert cut[1][2][cut[3][2] == d].tolist() == unpacked[1][k][:50].tolist()
    with pytest.raises(ConfigError, match="a prompt of 49 tokens leaves no room for its answer in the 48 tokens "
                                          "its pair leaves it in a packed row of .training. seq_len 96"):
        _rows(tokenizer, PAIRS, 96, packing=True)

    records = [{**r, "ref_chosen_logps": -10.25 - k, "ref_rejected_logps": -3.5 - k} for k, r in enumerate(PAIRS)]
    first = _dataset(tokenizer, records, 100, packing=True, reference=True)
    rows = list(first)
    slots = document_slots(100, True)
    assert [row[4].tolist() for row in rows] == [[-10.25, -3.5] + [0.0] * (slots - 2), [-11.25, -4.5] + [0.0] * (slots - 2),
                                                 [-12.25, -5.5] + [0.0] * (slots - 2)]
    first = _dataset(tokenizer, records, 100, packing=True, reference=True)
    it = iter(first)
    next(it)
    state = first.state_dict()  # the second pair read, its row not yet out
    resumed = _dataset(tokenizer, records, 100, packing=True, reference=True)
    resumed.load_state_dict(state)
    again = list(resumed)
    assert len(again) == 2 and all(all(torch.equal(a, b) for a, b in zip(x, y)) for x, y in zip(again, rows[1:]))
    with pytest.raises(ConfigError, match="holds pairs read with .training. packing = true; resume with the same"):
        _dataset(tokenizer, records, 100, reference=True).load_state_dict(state)


def _trl_losses(kind, pc, pr, rc, rr, nc, nr, nll_chosen):
    """TRL's formulas as its trainers write them (DPO's sigmoid with the conservative smoothing,
    IPO on length-normalised log-ratios, CPO's simpo, ORPO), on summed log-probs."""
    if kind == "dpo":
        logits = (pc - pr) - (rc - rr)
        losses = -F.logsigmoid(BETA * logits) * (1 - SMOOTHING) - F.logsigmoid(-BETA * logits) * SMOOTHING
        return losses.mean(), BETA * (pc - rc), BETA * (pr - rr)
    if kind == "ipo":
        pc, pr, rc, rr = pc / nc, pr / nr, rc / nc, rr / nr
        logits = (pc - pr) - (rc - rr)
        return ((logits - 1 / (2 * BETA)) ** 2).mean(), BETA * (pc - rc), BETA * (pr - rr)
    pc, pr = pc / nc, pr / nr
    if kind == "simpo":
        logits = (pc - pr) - GAMMA / BETA
        losses = -F.logsigmoid(BETA * logits) * (1 - SMOOTHING) - F.logsigmoid(-BETA * logits) * SMOOTHING
        return losses.mean(), BETA * pc, BETA * pr
    log_odds = (pc - pr) - (torch.log1p(-torch.exp(pc)) - torch.log1p(-torch.exp(pr)))
    return nll_chosen - (BETA * F.logsigmoid(log_odds)).mean(), BETA * pc, BETA * pr


def _hf_logps(hf, inputs, labels):
    """Per-row summed completion log-probs and the chosen rows' token-mean NLL from transformers'
    logits, TRL's way: the full sequence in, logits[:, :-1] scored against ids[1:] under the
    completion mask (our rows hold exactly that shift)."""
    logp = torch.log_softmax(hf(inputs).logits, -1)
    mask = labels != IGNORE_INDEX
    per_token = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1) * mask
    chosen = per_token[0::2].sum() / mask[0::2].sum()
    return per_token.sum(-1), mask.sum(-1), -chosen


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo", "orpo"])
def test_losses_and_gradients_equal_trls_formulas_on_transformers(kind, tokenizer, tmp_path, monkeypatch):
    """Our model and objective in float64 against TRL's formulas on LlamaForCausalLM's log-probs of
    the exported weights (and of an exported reference), the pairs unpacked (a row each) and packed
    (two rows of 128 tokens: four documents and two, the rest of each row's slots empty): the loss,
    the rewards and every weight's gradient agree to float64 precision."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    from torchtitan_xla.checkpoint.hf import export_hf
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.datasets.preference import document_slots
    from torchtitan_xla.losses import token_losses
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer
    from torchtitan_xla.models.llama.state_dict_adapter import to_hf
    from torchtitan_xla.objectives import Preference, document_logps

    inputs, labels, positions, documents = _rows(tokenizer, PAIRS)
    args = get_model_args("llama3", "debugmodel", vocab_size=tokenizer.n_words, max_seq_len=128, n_layers=2)
    models, hfs = [], []
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)
    for seed, name in ((0, "policy"), (1, "reference")):
        torch.manual_seed(seed)
        model = Transformer(args).double()
        model.init_weights()
        export_hf(model.state_dict(), args, tmp_path / name, dtype=torch.float64)
        hf = LlamaForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float64,
                                              attn_implementation="sdpa")
        hf_rope(model, hf)
        models.append(model)
        hfs.append(hf)
    policy, reference = models

    hf_policy, hf_reference = hfs
    # TRL's batch: each row's real tokens only (no padding), as its collator pads them.
    theirs_logps, counts = [], []
    for row in range(inputs.shape[0]):
        n = int((documents[row] == 1).sum())
        ids, row_labels = inputs[row:row + 1, :n], labels[row:row + 1, :n]
        theirs_logps.append([_hf_logps(m, ids, row_labels)[0] for m in (hf_policy, hf_reference)])
        counts.append(int((row_labels != IGNORE_INDEX).sum()))
    (pc, rc), (pr, rr) = (list(zip(*theirs_logps[side::2])) for side in (0, 1))
    pc, rc, pr, rr = (torch.cat(t) for t in (pc, rc, pr, rr))
    rc, rr = rc.detach(), rr.detach()
    nc, nr = (torch.tensor(counts[side::2], dtype=torch.float64) for side in (0, 1))
    chosen_tokens = -(pc.sum()) / nc.sum()  # the chosen rows' mean NLL over their tokens
    expected, chosen_rewards, rejected_rewards = _trl_losses(kind, pc, pr, rc, rr, nc, nr, chosen_tokens)
    expected.backward()
    theirs_grads = dict(hf_policy.named_parameters())

    job_config = parse_args(["--preference.beta", str(BETA), "--preference.label_smoothing", str(SMOOTHING),
                             "--preference.simpo_gamma", str(GAMMA)])
    for packing, seq_len in ((False, 96), (True, 128)):
        batch = Batch(*_rows(tokenizer, PAIRS, seq_len, packing))
        slots = document_slots(seq_len, packing)
        objective = Preference(kind, job_config, slots)
        if objective.needs_reference:
            with torch.no_grad():
                ref_losses = token_losses(reference(batch.inputs, *batch.packing), batch.labels)
            batch = batch.replace(reference_logps=document_logps(ref_losses, batch, slots)[0])
        policy.zero_grad()
        loss, metrics = objective(token_losses(policy(batch.inputs, *batch.packing), batch.labels), batch,
                                  objective.totals(batch))
        loss.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12, msg=f"packing {packing}")
        torch.testing.assert_close(metrics, torch.stack([
            chosen_rewards.mean(), rejected_rewards.mean(), (chosen_rewards - rejected_rewards).mean(),
            (chosen_rewards > rejected_rewards).double().mean()]).detach(), rtol=1e-9, atol=1e-12)
        ours_grads = to_hf({n: p.grad for n, p in policy.named_parameters()}, args)
        assert ours_grads.keys() == theirs_grads.keys()
        for name, grad in ours_grads.items():
            torch.testing.assert_close(grad, theirs_grads[name].grad, rtol=1e-8, atol=1e-12,
                                       msg=f"{name}, packing {packing}")
        assert all(g.abs().sum() > 0 for g in ours_grads.values())


def test_the_lora_reference_is_the_base_model_exactly():
    """With the adapters switched off (the reference of a LoRA run) the model computes the base
    model's logits bit for bit, although its adapters are non-zero."""
    from torchtitan_xla.config.job_config import LoRA
    from torchtitan_xla.lora import adapters_disabled, apply_lora, init_adapters
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer

    args = get_model_args("llama3", "debugmodel", vocab_size=300, max_seq_len=32, n_layers=2)
    torch.manual_seed(0)
    base = Transformer(args)
    base.init_weights()
    adapted = Transformer(args)
    adapted.load_state_dict(base.state_dict())
    apply_lora(adapted, LoRA(rank=4, alpha=8.0))
    init_adapters(adapted)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if name.endswith("lora_B.weight"):
                p.normal_(std=0.05)
    tokens = torch.randint(0, 300, (2, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = base(tokens)
        assert not torch.equal(adapted(tokens), expected)
        with adapters_disabled(adapted):
            assert torch.equal(adapted(tokens), expected)
        assert not torch.equal(adapted(tokens), expected)  # switched back on


# ---- training ------------------------------------------------------------------------------------

MESH_RTOL = 2e-6  # only the order of reductions differs between meshes (tests/test_parallelisms.py)
# Context parallelism sums each row's log-probabilities in two halves, one per device: a pair's
# logit (beta x four sums of up to 190 log-probabilities, each a few float32 ulps of ~150 apart)
# moves the loss by a few 1e-6. Measured at step 2: 1.1e-6 (AVX-512), 2.2e-6 (AVX2 pins).
CP_RTOL = 5e-6
# Pipeline stages: the reference's scoring graph and the policy's training graph, each a loop over
# the stages, sum a row's log-probabilities in orders of their own, so the first step is not log 2
# to the last bit as elsewhere. Measured (AVX-512): 1.3e-6 at step 1, 1.8e-6 at most (step 2).
PP_RTOL = 5e-6
DPO = ["--training.dataset", "python_docs_preference", "--training.objective", "dpo",
       "--training.seq_len", "192", "--training.steps", "6", "--optimizer.lr", "3e-4",
       "--preference.beta", "0.1", "--checkpoint.enable", "--checkpoint.interval", "3",
       "--model.attention", "sdpa",  # the attention context parallelism takes
       "--training.no-packing"]  # a pair's answers in rows 2i and 2i + 1, as TRL pads them
# Packed pairs: 384-token rows hold about two each (the embedded pairs are 64-350 tokens).
PACKED = ["--training.packing", "true", "--training.seq_len", "384"]


# Validation after steps 3 and 6 on the first 28 held-out pairs: 14 batches of one device's 4 rows,
# 7 of fsdp=4 x tp=2's 8.
HELD_OUT = ["--validation.enable", "--validation.freq", "3"]


def _with_reference_logps(straight, tokenizer, path):
    """The embedded training pairs as JSON lines, each with TRL's ref_chosen_logps and
    ref_rejected_logps: the shared run's export's summed log-probabilities, from transformers."""
    from transformers import AutoModelForCausalLM

    from torchtitan_xla.datasets.sources import load_documents

    pairs = [json.loads(r["pair"]) for r in load_documents("python_docs_preference", "", "train")]
    records = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r, _ in pairs]
    inputs, labels, _, _ = _rows(tokenizer, records, seq_len=192)
    hf = AutoModelForCausalLM.from_pretrained(str(straight[0] / "checkpoint" / "step-6-hf"),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        logps = torch.cat([_hf_logps(hf, inputs[i:i + 64], labels[i:i + 64])[0]
                           for i in range(0, len(inputs), 64)]).tolist()
    path.write_text("".join(json.dumps({**r, "ref_chosen_logps": c, "ref_rejected_logps": j}) + "\n"
                            for r, c, j in zip(records, logps[0::2], logps[1::2])))
    return path


@pytest.fixture(scope="module")
def dpo_runs(straight, tokenizer, tmp_path_factory):
    """6 DPO steps on the embedded preference pairs from the shared run's HF export (the reference),
    the same global batch of 8 rows (4 pairs) on one device in 2 microbatches and on the meshes;
    on one device, the same pairs as a file carrying the reference's log-probabilities, and LoRA:
    {run: (folder, train_many's result)}."""
    stored = _with_reference_logps(straight, tokenizer, tmp_path_factory.mktemp("pairs") / "pairs.jsonl")
    one_device = ["--training.local_batch_size", "4", "--training.global_batch_size", "8"]
    runs = {}
    for devices, jobs in (
            (1, {"1 device": [*one_device, "--checkpoint.last_save_in_hf", *HELD_OUT, "--validation.steps", "14"],
                 "stored reference": [*one_device, "--training.dataset", "preference", "--training.dataset_path",
                                      str(stored), "--preference.precomputed_reference"],
                 # LoRA: the reference is the policy with its adapters switched off.
                 "lora": ["--training.local_batch_size", "8", "--lora.rank", "4", "--lora.alpha", "8",
                          "--optimizer.lr", "3e-3", "--checkpoint.last_save_in_hf"],
                 "packed": [*PACKED, "--training.local_batch_size", "2", "--training.global_batch_size", "4",
                            *HELD_OUT, "--validation.steps", "4"]}),
            (8, {"fsdp4 x tp2": ["--training.local_batch_size", "2", "--parallelism.tensor_parallel_degree", "2",
                                 *HELD_OUT, "--validation.steps", "7"],
                 # Each row's 192 tokens over 2 devices, load-balanced: a pair's sums cross them.
                 "cp2 x fsdp4": ["--training.local_batch_size", "2",
                                 "--parallelism.context_parallel_degree", "2"],
                 # Pipeline stages, the reference model's copy pipelined as the policy is; a pair's
                 # two rows in different pipeline microbatches.
                 "pp2 x fsdp4": ["--training.local_batch_size", "2",
                                 "--parallelism.pipeline_parallel_degree", "2"],
                 "packed cp2 x fsdp2 x tp2": [*PACKED, "--training.local_batch_size", "2",
                                              "--parallelism.context_parallel_degree", "2",
                                              "--parallelism.tensor_parallel_degree", "2",
                                              *HELD_OUT, "--validation.steps", "2"]})):
        folders = {name: tmp_path_factory.mktemp(name.replace(" ", "")) for name in jobs}
        results = train_many({name: tiny_args(folders[name], *DPO, *from_hf(straight), *flags)
                              for name, flags in jobs.items()}, devices=devices, model_overrides=TWO_BLOCKS)
        runs |= {name: (folders[name], results[name]) for name in jobs}
    return runs


def test_the_reference_command_writes_transformers_log_probabilities(straight, tokenizer, tmp_path):
    """`python -m torchtitan_xla.reference` on pairs of each form (plain, with a system prompt,
    conversational: 3 pairs), packed (a batch of 4 rows: two pairs in the first, one in the second,
    two empty rows): each line is the record, its prompt as chat messages, with the reference's
    summed log-probabilities of both answers, those transformers gives the export (float32 sums in
    another order: within 2e-5). With no output file named: one line, exit 2."""
    from transformers import AutoModelForCausalLM

    from torchtitan_xla.datasets.preference import parse_pair

    pairs, out = tmp_path / "pairs.jsonl", tmp_path / "out" / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in PAIRS))
    command = [sys.executable, "-m", "torchtitan_xla.reference", *tiny_args(tmp_path / "dump"), *DPO,
               *from_hf(straight), "--training.dataset", "preference", "--training.dataset_path", str(pairs),
               "--training.local_batch_size", "4", "--training.packing", "true"]
    for flags, code in ((["--preference.reference_output", str(out)], 0), ([], 2)):
        p = subprocess.run([*command, *flags], capture_output=True, text=True, cwd=REPO, env=_env(1, None),
                           timeout=600)
        assert p.returncode == code, p.stderr[-3000:]
    assert p.stderr.strip() == ("error: [preference] reference_output: empty; give the JSON lines file "
                                "to write"), p.stderr
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [parse_pair(w)[:3] for w in written] == [parse_pair(r)[:3] for r in PAIRS]
    inputs, labels, _, _ = _rows(tokenizer, PAIRS, seq_len=192)
    hf = AutoModelForCausalLM.from_pretrained(str(straight[0] / "checkpoint" / "step-6-hf"),
                                              dtype=torch.float32).eval()
    with torch.no_grad():
        expected = _hf_logps(hf, inputs, labels)[0].tolist()
    got = [w[k] for w in written for k in ("ref_chosen_logps", "ref_rejected_logps")]
    assert got == pytest.approx(expected, abs=2e-5)


def test_stored_reference_logps_give_the_reference_models_losses(dpo_runs):
    """TRL's ref_chosen_logps / ref_rejected_logps in the pairs (transformers' log-probabilities of
    the reference export, float32) instead of the reference model: the same losses, within float32
    sums of ~100 log-probabilities in another order (measured: 1.1e-6 at most over the 6 steps)."""
    stored, run = dpo_runs["stored reference"][1]["losses"], dpo_runs["1 device"][1]["losses"]
    assert stored.keys() == run.keys() == set(range(1, 7))
    for step, loss in run.items():
        assert stored[step] == pytest.approx(loss, rel=1e-5), step


def test_dpo_learns_the_pairs_and_every_mesh_agrees(dpo_runs, straight, tokenizer):
    """The first step's loss is log 2 (policy = reference); fsdp x tp, cp x fsdp and pp x fsdp give
    one device's losses; the exported policy prefers the chosen answers of the 24 pairs it trained on
    more than the reference does (TRL's rewards/accuracies, scored by transformers: 0.92 measured,
    ties at the start).
    Validation on 28 held-out pairs gives the loss and the rewards transformers gives the exports,
    on one device and on the mesh (whose validation batches are twice as large), and a clear rise
    in their accuracy (debug_dpo.toml's figures: docs/posttrain.md)."""
    from transformers import AutoModelForCausalLM

    from torchtitan_xla.datasets.preference import parse_pair
    from torchtitan_xla.datasets.sources import load_documents

    (folder, one), (_, eight) = dpo_runs["1 device"][:2], dpo_runs["fsdp4 x tp2"][:2]
    assert one["losses"][1] == pytest.approx(0.6931472, abs=1e-6)  # -log sigmoid(0)
    for step, loss in one["losses"].items():
        assert eight["losses"][step] == pytest.approx(loss, rel=MESH_RTOL), step
        assert dpo_runs["cp2 x fsdp4"][1]["losses"][step] == pytest.approx(loss, rel=CP_RTOL), step
        assert dpo_runs["pp2 x fsdp4"][1]["losses"][step] == pytest.approx(loss, rel=PP_RTOL), step

    trained = [json.loads(r["pair"]) for r in load_documents("python_docs_preference", "", "train")][:24]
    records = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r, _ in trained]
    assert all(parse_pair(r)[1:3] == (r["chosen"], r["rejected"]) for r in records)
    inputs, labels, _, _ = _rows(tokenizer, records, seq_len=192)
    margins = []
    for path in (folder / "checkpoint" / "step-6-hf", straight[0] / "checkpoint" / "step-6-hf"):
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            logps = _hf_logps(hf, inputs, labels)[0]
        margins.append(logps[0::2] - logps[1::2])
    rewards = 0.1 * (margins[0] - margins[1])  # beta x (policy margin - reference margin)
    accuracy = (rewards > 0).float().mean().item()
    assert accuracy >= 0.7 and rewards.mean() > 0, (accuracy, rewards.mean())

    held_out = [dict(zip(("prompt", "chosen", "rejected"), json.loads(r["pair"])))
                for r in load_documents("python_docs_preference", "", "validation")][:28]
    assert set(one["validation_metrics"]) == set(eight["validation_metrics"]) == {3, 6}
    # The rejected answers are unfinished (datasets/preference.py), which the held-out topics share:
    # from all ties (policy = reference), their accuracy rises well past one half and their margin
    # and loss move the right way (measured: 0.86 and 0.93 after steps 3 and 6, 24 and 26 of 28).
    held_out_metrics, held_out_loss = one["validation_metrics"], one["validation"]
    assert held_out_metrics[6]["rewards/accuracies"] >= 0.75, held_out_metrics
    assert held_out_metrics[6]["rewards/margins"] > held_out_metrics[3]["rewards/margins"] > 0
    assert held_out_loss[6] < held_out_loss[3] < math.log(2)
    for step, metrics in one["validation_metrics"].items():
        assert eight["validation"][step] == pytest.approx(one["validation"][step], rel=MESH_RTOL)
        # The rewards move with the loss: MESH_RTOL of the loss (about log 2) is 1.4e-6, and the
        # loss moves by half the margin's change, so 3e-6 on each reward (measured: 1.6e-7 after
        # step 3, 1.1e-6 after step 6, the weights by then a few float32 steps apart).
        for name, value in metrics.items():
            assert eight["validation_metrics"][step][name] == pytest.approx(value, abs=3e-6), (step, name)
    inputs, labels, _, _ = _rows(tokenizer, held_out, seq_len=192)
    logps = []
    for path in (folder / "checkpoint" / "step-6-hf", straight[0] / "checkpoint" / "step-6-hf"):
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            logps.append(_hf_logps(hf, inputs, labels)[0].double())
    chosen, rejected = (0.1 * (logps[0][k::2] - logps[1][k::2]) for k in (0, 1))
    got = one["validation_metrics"][6]
    # float32 sums of up to 190 log-probabilities in another order, times beta.
    assert got["rewards/chosen"] == pytest.approx(chosen.mean().item(), abs=2e-5)
    assert got["rewards/rejected"] == pytest.approx(rejected.mean().item(), abs=2e-5)
    assert got["rewards/margins"] == pytest.approx((chosen - rejected).mean().item(), abs=2e-5)
    assert one["validation"][6] == pytest.approx(-F.logsigmoid(chosen - rejected).mean().item(), abs=2e-5)
    ties = ((chosen - rejected).abs() < 1e-5).sum().item()  # a pair that rounding could flip
    assert abs(got["rewards/accuracies"] - (chosen > rejected).double().mean().item()) <= ties / 28


def test_packed_pairs_give_one_devices_losses_on_a_mesh(dpo_runs, tokenizer):
    """Packed pairs (rows of 384 tokens, about two pairs each, a step's pair count varying): the
    first loss is log 2; cp2 x fsdp2 x tp2 gives one device's losses (measured: 2.2e-6 at step 2,
    1.0e-6 under the AVX2 pins), and its held-out loss and rewards (1.1e-6), each the mean over
    pairs of batches holding different numbers of them. Validation read the held-out pairs packed:
    the labels it counted are those of their first 8 packed rows."""
    from torchtitan_xla.datasets.sources import load_documents

    one, mesh = dpo_runs["packed"][1], dpo_runs["packed cp2 x fsdp2 x tp2"][1]
    assert one["losses"][1] == pytest.approx(0.6931472, abs=1e-6)
    assert one["losses"].keys() == mesh["losses"].keys() == set(range(1, 7))
    for step, loss in one["losses"].items():
        assert mesh["losses"][step] == pytest.approx(loss, rel=CP_RTOL), step
    assert one["validation_metrics"].keys() == mesh["validation_metrics"].keys() == {3, 6}
    for step, metrics in one["validation_metrics"].items():
        assert mesh["validation"][step] == pytest.approx(one["validation"][step], rel=CP_RTOL)
        for name, value in metrics.items():
            assert mesh["validation_metrics"][step][name] == pytest.approx(value, abs=1e-5), (step, name)
    held_out = [dict(zip(("prompt", "chosen", "rejected"), json.loads(r["pair"])))
                for r in load_documents("python_docs_preference", "", "validation")]
    labels = _rows(tokenizer, held_out, 384, packing=True)[1][:8]
    counted = f"4 batches, {int((labels != IGNORE_INDEX).sum()):,} tokens"
    assert sum(counted in line for line in one["log"]) == 2, [line for line in one["log"] if "validation" in line]


def test_lora_dpo_uses_the_base_model_as_its_reference(dpo_runs):
    """A LoRA run keeps no copy of the weights: its reference is the policy with the adapters off.
    Its first loss is log 2 (B starts at zero); after that the policy moves away from the base, so
    the loss leaves log 2. A reference that kept its adapters would be the policy itself, and every
    loss would stay log 2. The adapters export as a PEFT folder, as for SFT."""
    folder, lora = dpo_runs["lora"][:2]
    assert lora["losses"][1] == pytest.approx(0.6931472, abs=1e-6)
    assert max(abs(lora["losses"][s] - 0.6931472) for s in (2, 3, 4, 5, 6)) > 1e-3, lora["losses"]
    assert (folder / "checkpoint" / "step-6-peft" / "adapter_config.json").is_file()
    assert (folder / "checkpoint" / "step-6-hf" / "config.json").is_file()


def test_dpo_resumes_bit_exactly(dpo_runs, straight):
    """The data position between a pair's rows, the optimizer and the reference come back: resuming
    at step 3 gives the uninterrupted run's losses exactly, and the log line shows TRL's metrics."""
    folder, one = dpo_runs["1 device"][:2]
    shutil.rmtree(folder / "checkpoint" / "step-6")
    shutil.rmtree(folder / "checkpoint" / "step-6-hf")
    resumed, log = train_run(tiny_args(folder, *DPO, *from_hf(straight), "--training.local_batch_size", "4",
                                       "--training.global_batch_size", "8"), model_overrides=TWO_BLOCKS)
    assert "Resumed from" in log and sorted(resumed) == [4, 5, 6]
    assert resumed == {s: one["losses"][s] for s in (4, 5, 6)}
    assert "accuracy: " in log and "margin: " in log


@pytest.mark.parametrize("flags, message", [
    (["--preference.beta", "0"], "--preference.beta = 0"),
    (["--training.objective", "dpo"], "dpo trains on preference pairs"),
    (["--training.dataset", "python_docs_preference"], "preference pairs need a preference objective"),
    (["--training.dataset", "python_docs_preference", "--training.objective", "orpo", "--training.no-packing",
      "--training.local_batch_size", "3"], "needs an even number of rows"),
    (["--validation.enable", "--validation.dataset", "python_docs_preference"],
     "held-out preference pairs are scored by the preference objective the run trains with"),
    (["--training.dataset", "python_docs_preference", "--training.objective", "simpo",
      "--preference.precomputed_reference"], "only dpo and ipo compare with a reference model"),
    (["--training.dataset", "python_docs_preference", "--training.objective", "dpo",
      "--preference.precomputed_reference", "--preference.reference", "ref"],
     "the pairs' stored log-probabilities replace the reference model; set one of them"),
])
def test_bad_settings_are_one_line(flags, message, tmp_path):
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_args(tiny_args(tmp_path, *flags))


def test_bad_pairs_and_references_are_one_line_before_anything_is_written(straight, tmp_path):
    """A pair without `rejected` (its file and line), a prompt longer than seq_len, a reference of
    another architecture, stored reference log-probabilities asked of pairs without them: one
    line, exit 2, nothing written."""
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "p", "chosen": "c"}) + "\n")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({**PAIRS[0], "prompt": "word " * 400}) + "\n")
    other = tmp_path / "other"
    from torchtitan_xla.checkpoint.hf import export_hf
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer

    vocab = json.loads((straight[0] / "checkpoint" / "step-6-hf" / "config.json").read_text())["vocab_size"]
    args = get_model_args("llama3", "debugmodel", vocab_size=vocab, n_layers=1)
    export_hf(Transformer(args).state_dict(), args, other)
    for flags, message in (
            (["--training.dataset", "preference", "--training.dataset_path", str(bad)],
             f"{bad}:2: not a preference pair: no 'rejected'"),
            (["--training.dataset", "preference", "--training.dataset_path", str(long)],
             "leaves no room for its answer in [training] seq_len 192"),
            (["--training.dataset", "python_docs_preference", "--preference.reference", str(other)],
             f"--preference.reference: {other} is not the policy's architecture: "
             f"layers.1.attention.wk.weight is missing there"),
            (["--training.dataset", "python_docs_preference", "--preference.precomputed_reference"],
             "no 'ref_chosen_logps' or 'ref_rejected_logps', which [preference] precomputed_reference "
             "= true reads in every pair")):
        dump = tmp_path / "dump"
        r = run_train(["--job.config_file", str(tiny_args(dump)[1]), "--job.dump_folder", str(dump),
                       *DPO, *from_hf(straight), *flags, "--model.flavor", "hf"])
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and message in lines[-1], r.stderr[-2000:]
        assert "Traceback" not in r.stderr and not (dump / "config.toml").exists()
