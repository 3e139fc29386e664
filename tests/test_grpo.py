"""GRPO (online RL on the policy's own completions): the loss and gradients against TRL's formulas
on transformers' log-probabilities in float64, the advantages, the rewards and the completion
rows, and training from the shared run's HF export: the reward rises, fsdp x tp gives one
device's losses, resume is bit-exact, bad input is one line."""

import json
import re
import sys

import pytest
import torch
from checkpoint_helpers import TWO_BLOCKS, from_hf
from helpers import hf_rope, rmsnorm_in_input_dtype, run_train, tiny_args, train_many, train_run

from torchtitan_xla.batch import Batch

TEMPERATURE, MAX_COMPLETION = 0.7, 12


def _trl_advantages(rewards, g, scale):
    """TRL's GRPOTrainer: the group mean subtracted; divided by the group's (or the batch's)
    Bessel-corrected std + 1e-4 unless scale_rewards = "none"."""
    mean = rewards.view(-1, g).mean(1).repeat_interleave(g)
    std = rewards.view(-1, g).std(1).repeat_interleave(g) if scale == "group" else rewards.std().expand_as(rewards)
    adv = rewards - mean
    return adv if scale == "none" else adv / (std + 1e-4)


def _trl_microbatch_loss(logp, old, ref, adv, mask, *, loss_type, beta, eps_low, eps_high, accumulation,
                         global_tokens):
    """TRL's _compute_loss on one microbatch of completion tokens [rows, tokens], as the trainer
    backpropagates it (divided by the accumulation steps, except dapo's global normaliser)."""
    coef_1 = torch.exp(logp - old)
    coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
    per_token = -torch.min(coef_1 * adv.unsqueeze(1), coef_2 * adv.unsqueeze(1))
    if beta:
        per_token = per_token + beta * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean() / accumulation
    if loss_type == "bnpo":
        return (per_token * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
    if loss_type == "dr_grpo":
        return (per_token * mask).sum() / (per_token.size(0) * MAX_COMPLETION) / accumulation
    return (per_token * mask).sum() / global_tokens  # dapo


# Each loss type with each advantage scaling, with and without the KL term, one and two updates a
# rollout (two: the old policy's log-probabilities differ from the policy's, so ratios get clipped).
CASES = [(loss, scale, beta, iterations) for loss in ("grpo", "bnpo", "dapo", "dr_grpo")
         for scale, beta, iterations in (("group", 0.0, 1), ("batch", 0.04, 2), ("none", 0.04, 2))]


def test_loss_and_gradients_equal_trls_formulas_on_transformers(tmp_path, monkeypatch):
    """Our model and objective in float64 against TRL's GRPO formulas on LlamaForCausalLM's
    log-probabilities (at the sampling temperature) of the exported weights: 6 completions in 2
    groups of 3, of different prompt and completion lengths (one empty but for its EOS), in 2
    microbatches; every case of CASES: the loss within 1e-10 relative, every weight's gradient
    within 1e-8, the KL and clip metrics as TRL computes them."""
    from transformers import LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    from torchtitan_xla.checkpoint.hf import export_hf
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.grpo.objective import GRPO, advantages
    from torchtitan_xla.grpo.rollouts import completion_rows
    from torchtitan_xla.losses import token_losses
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer
    from torchtitan_xla.models.llama.state_dict_adapter import to_hf

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rmsnorm_in_input_dtype)
    args = get_model_args("llama3", "debugmodel", vocab_size=300, max_seq_len=32, n_layers=2)
    models, hfs = [], []
    for seed, name in ((0, "policy"), (1, "reference")):
        torch.manual_seed(seed)
        model = Transformer(args).double()
        model.init_weights()
        export_hf(model.state_dict(), args, tmp_path / name, dtype=torch.float64)
        hf = LlamaForCausalLM.from_pretrained(str(tmp_path / name), dtype=torch.float64, attn_implementation="sdpa")
        hf_rope(model, hf)
        models.append(model)
        hfs.append(hf)
    policy, reference = models
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 5, 5, 9, 9, 9)]
    completions = [torch.randint(3, 300, (n,), generator=g).tolist() for n in (4, 12, 1, 7, 12, 3)]
    inputs, labels = completion_rows(prompts, completions, 24, pad_id=0)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, 0.0, 2.0], dtype=torch.float64)

    def hf_logps(hf, row):
        """TRL's per-token log-probs of a completion: the logits of prompt + completion, divided by the
        temperature, scored against the completion's tokens."""
        ids = torch.tensor([prompts[row] + completions[row]])
        logits = hf(ids).logits[0, len(prompts[row]) - 1:-1] / TEMPERATURE
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completions[row])[:, None])[:, 0]

    def padded(values):  # [rows, MAX_COMPLETION], 0 past each completion
        return torch.stack([torch.nn.functional.pad(v, (0, MAX_COMPLETION - len(v))) for v in values])

    mask = padded([torch.ones(len(c), dtype=torch.float64) for c in completions])
    with torch.no_grad():
        ref_theirs = padded([hf_logps(hfs[1], r) for r in range(6)])
        ref_ours = -token_losses(reference(inputs) / TEMPERATURE, labels)
    # The old policy of a second update: the policy's log-probs moved by up to +-0.4 per token.
    shift = (torch.rand(6, MAX_COMPLETION, generator=g, dtype=torch.float64) - 0.5) * 0.8
    for loss_type, scale, beta, iterations in CASES:
        case = f"{loss_type}, scale {scale}, beta {beta}, {iterations} iterations"
        adv = _trl_advantages(rewards, 3, scale)
        torch.testing.assert_close(advantages(rewards, 3, scale), adv, rtol=1e-12, atol=1e-12, msg=case)
        hfs[0].zero_grad()
        expected = 0.0
        logps = padded([hf_logps(hfs[0], r) for r in range(6)])
        old = logps.detach() + shift if iterations > 1 else logps.detach()
        for rows in (slice(0, 3), slice(3, 6)):
            expected = expected + _trl_microbatch_loss(
                logps[rows], old[rows], ref_theirs[rows], adv[rows], mask[rows], loss_type=loss_type, beta=beta,
                eps_low=0.2, eps_high=0.28, accumulation=2, global_tokens=mask.sum())
        expected.backward()
        ratio = torch.exp(logps.detach() - old)
        a = adv[:, None]
        trl_clip = (((ratio < 0.8) & (a < 0)) | ((ratio > 1.28) & (a > 0))).double()
        trl_kl = torch.exp(ref_theirs - logps.detach()) - (ref_theirs - logps.detach()) - 1

        job_config = parse_args(["--training.objective", "grpo", "--training.dataset", "larger_numbers",
                                 "--grpo.loss_type", loss_type, "--grpo.beta", str(beta),
                                 "--grpo.epsilon_high", "0.28", "--grpo.max_completion_length", str(MAX_COMPLETION),
                                 "--training.seq_len", "32", "--grpo.max_prompt_length", "16"])
        objective = GRPO(job_config, accumulation_steps=2, dp_degree=1)
        # Our old log-probs: TRL's, at the tokens' places in the rows (label i is token i + 1).
        old_rows = torch.zeros(6, 24, dtype=torch.float64)
        for r in range(6):
            start = len(prompts[r]) - 1
            old_rows[r, start:start + len(completions[r])] = old[r, :len(completions[r])]
        batch = Batch(inputs, labels, advantages=adv, reference_logps=ref_ours if beta else None,
                      old_logps=old_rows if iterations > 1 else None)
        totals = objective.totals(batch)
        policy.zero_grad()
        loss, metrics = 0.0, 0.0
        for mb in batch.microbatches(1, 2):
            mb_loss, mb_metrics = objective(token_losses(policy(mb.inputs) / TEMPERATURE, mb.labels), mb, totals)
            mb_loss.backward()
            loss, metrics = loss + mb_loss.detach(), metrics + mb_metrics.detach()
        torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12, msg=case)
        kl_mean = (trl_kl * mask).sum() / mask.sum() if beta else torch.tensor(0.0, dtype=torch.float64)
        torch.testing.assert_close(metrics, torch.stack([kl_mean, (trl_clip * mask).sum() / mask.sum()]),
                                   rtol=1e-9, atol=1e-12, msg=case)
        if iterations > 1:
            assert 0 < (trl_clip * mask).sum() < mask.sum(), case  # the clip is exercised, not everywhere
        ours_grads = to_hf({n: p.grad for n, p in policy.named_parameters()}, args)
        theirs = dict(hfs[0].named_parameters())
        for name, grad in ours_grads.items():
            torch.testing.assert_close(grad, theirs[name].grad, rtol=1e-8, atol=1e-12, msg=f"{name}, {case}")
        assert sum(g.abs().sum() for g in ours_grads.values()) > 0, case


def test_completion_rows_label_the_completion_tokens_only():
    from torchtitan_xla.grpo.rollouts import completion_rows

    inputs, labels = completion_rows([[1, 2, 3], [4]], [[7, 8], [9, 10, 11]], 6, pad_id=0)
    assert inputs.tolist() == [[1, 2, 3, 7, 0, 0], [4, 9, 10, 0, 0, 0]]
    assert labels.tolist() == [[-100, -100, 7, 8, -100, -100], [9, 10, 11, -100, -100, -100]]


def test_a_completion_is_cut_at_its_earliest_stop_string_before_its_eos():
    """The reward sees the text before the earliest of the stop strings (whichever is listed first),
    and training the tokens that hold it, without the EOS a row that went on decoding met later."""
    from types import SimpleNamespace

    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.generate import Completion
    from torchtitan_xla.grpo.rollouts import Rollouts

    tokenizer = build_tokenizer("", "llama3")
    rollouts = Rollouts.__new__(Rollouts)
    rollouts.tokenizer, rollouts.cfg = tokenizer, SimpleNamespace(stop=["END", "STOP"])
    tokens = tokenizer.encode("six STOP then END and more", bos=False, eos=False)
    text, kept = rollouts._cut(Completion(tokens, "eos", tokenizer.eos_id))
    assert text == "six " and tokenizer.decode(kept).startswith("six STOP") and tokenizer.eos_id not in kept
    assert "STOP" not in tokenizer.decode(kept[:-1])
    rollouts.cfg = SimpleNamespace(stop=[])
    assert rollouts._cut(Completion(tokens, "eos", tokenizer.eos_id)) == (tokenizer.decode(tokens),
                                                                          tokens + [tokenizer.eos_id])


def test_built_in_rewards_score_as_documented():
    from torchtitan_xla.grpo.rewards import Rewards

    rewards = Rewards(["accuracy", "format", "length"], [1.0, 0.5, 0.1], answer_pattern=r"(-?[0-9][0-9,]*(?:\.[0-9]+)?)",
                      format_pattern=r"^\s*-?[0-9]+\s*$", max_completion_length=8)
    completions = ["7", "It is 1,234.", "3 then 12", "#### 72", "no number", " 7.0 "]
    answers = ["7", "1234", "3", "Natalia sold 48/2 = 24 clips.\n#### 72", "5", "7"]
    ids = [[1], [1, 2, 3, 4], [1, 2, 3], [1, 2], [1, 2], [1, 2, 3, 4, 5, 6, 7, 8]]
    per_function, totals = rewards(["q"] * 6, completions, ids, {"answer": answers})
    assert [r[0] for r in per_function] == [1.0, 1.0, 0.0, 1.0, 0.0, 1.0]  # the last number, as a number
    assert [r[1] for r in per_function] == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert [r[2] for r in per_function] == [-0.125, -0.5, -0.375, -0.25, -0.25, -1.0]
    assert totals == pytest.approx([1 + 0.5 - 0.0125, 1 - 0.05, -0.0375, 1 - 0.025, -0.025, 1 - 0.1])


def _write_module(tmp_path, body: str) -> str:
    (tmp_path / "user_rewards.py").write_text(body)
    return str(tmp_path)


@pytest.mark.parametrize("body, name, message", [
    ("def score(prompts, completions, **kw):\n    return [1.0] * len(completions)\n", "user_rewards:nothing",
     "[grpo] reward_functions: user_rewards:nothing: cannot be imported (AttributeError"),
    ("", "missing_module:score", "[grpo] reward_functions: missing_module:score: cannot be imported "
                                 "(ModuleNotFoundError: No module named 'missing_module')"),
    ("def score(completions, **kw):\n    raise KeyError('answer')\n", "user_rewards:score",
     "[grpo] reward_functions: user_rewards:score raised KeyError: 'answer'"),
    ("def score(completions, **kw):\n    return [1.0]\n", "user_rewards:score",
     "[grpo] reward_functions: user_rewards:score returned 1 values; expected a list of 2 numbers"),
])
def test_a_bad_reward_function_is_one_line(body, name, message, tmp_path, monkeypatch):
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.grpo.rewards import Rewards

    monkeypatch.syspath_prepend(_write_module(tmp_path, body))
    monkeypatch.delitem(sys.modules, "user_rewards", raising=False)  # another case's
    with pytest.raises(ConfigError) as e:
        Rewards([name], [], answer_pattern="(x)", format_pattern="x", max_completion_length=4)(
            ["p", "p"], ["a", "b"], [[1], [2]], {})
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_a_reward_function_may_return_numpy_values_and_none(tmp_path, monkeypatch):
    """As TRL accepts them: a numpy array, numpy scalars, None (not scored: 0 in the weighted sum,
    NaN in its own column)."""
    from torchtitan_xla.grpo.rewards import Rewards

    monkeypatch.syspath_prepend(_write_module(tmp_path, (
        "import numpy as np\n"
        "def array(completions, **kw):\n    return np.array([0.5, 2.0], dtype=np.float32)\n"
        "def scalars(completions, **kw):\n    return [np.float64(1.5), None]\n")))
    monkeypatch.delitem(sys.modules, "user_rewards", raising=False)
    rewards = Rewards(["user_rewards:array", "user_rewards:scalars"], [1.0, 2.0], answer_pattern="(x)",
                      format_pattern="x", max_completion_length=4)
    assert rewards.labels == ["array", "scalars"]
    per_function, totals = rewards(["p", "p"], ["a", "b"], [[1], [2]], {})
    assert per_function[0] == [0.5, 1.5] and per_function[1][0] == 2.0 and per_function[1][1] != per_function[1][1]
    assert totals == [3.5, 2.0]


# ---- training from the shared run's export -------------------------------------------------------

GRPO_FLAGS = ["--training.objective", "grpo", "--training.dataset", "larger_numbers", "--training.seq_len", "64",
              "--grpo.num_generations", "4", "--grpo.max_prompt_length", "48", "--grpo.max_completion_length", "16",
              "--grpo.reward_functions", "accuracy,tests.grpo_rewards:digit_share", "--lr_scheduler.warmup_steps", "1"]


def _logged(run: dict, name: str = "reward") -> dict[int, float]:
    """{step: the objective's figure `name` (reward, kl, ...)} of every logged step of a train_many run."""
    return {step: figures[name] for step, figures in run["objective"].items()}


def _held_out(run: dict) -> dict[int, float]:
    """{step: the mean reward on the held-out prompts} of every validation of a train_many run."""
    return {step: figures["reward"] for step, figures in run["validation_metrics"].items()}


def _log_rewards(log: str) -> dict[int, float]:
    """{step: the log line's `reward:`} (a run's own log, for a run train_many did not make)."""
    return {int(m[1]): float(m[2]) for m in re.finditer(r"step:\s+(\d+) .*? reward: ([-0-9.]+)", log)}


# 6 steps of 2 prompts x 4 completions, 2 updates a rollout (the old policy's log-probs recorded at
# the rollout), the KL to the export, each completion's token mean (loss_type grpo).
SMALL = ["--training.steps", "6", "--grpo.num_iterations", "2", "--grpo.beta", "0.04", "--grpo.loss_type", "grpo",
         "--training.global_batch_size", "8", "--optimizer.lr", "1e-3"]
# 40 steps of 2 prompts x 8 completions at a constant lr, the held-out reward after the last. The
# rewards: accuracy, and answering with a digit first (a user function; the 6-step export starts
# with one about 1 time in 20).
LEARN = ["--training.local_batch_size", "16", "--grpo.num_generations", "8", "--optimizer.lr", "2e-3",
         "--lr_scheduler.decay_ratio", "0.01", "--validation.enable", "--validation.freq", "40", "--training.steps", "40",
         "--grpo.reward_functions", "accuracy,tests.grpo_rewards:starts_with_a_digit"]


@pytest.fixture(scope="module")
def grpo_runs(straight, tmp_path_factory):
    """GRPO from the shared run's HF export: {run: (folder, train_many's result)}. One device:
    SMALL in 2 microbatches, saved at step 3 (inside a rollout's two updates); LEARN; the held-out
    reward of the export itself (an update at lr / 100001, then validation); SMALL with LoRA. Eight devices: SMALL
    on fsdp 4 x tp 2."""
    runs = {}
    for devices, jobs in (
            (1, {"1 device": [*SMALL, "--training.local_batch_size", "4", "--checkpoint.enable",
                              "--checkpoint.interval", "3"],
                 "learn": LEARN,
                 # LoRA: the reference is the policy with its adapters switched off.
                 "lora": [*SMALL, "--training.local_batch_size", "8", "--lora.rank", "4", "--lora.alpha", "8",
                          "--optimizer.lr", "3e-3"],
                 "start": [*LEARN, "--training.steps", "1", "--validation.freq", "1",
                           "--lr_scheduler.warmup_steps", "100000"]}),
            (8, {"fsdp4 x tp2": [*SMALL, "--training.local_batch_size", "2",
                                 "--parallelism.tensor_parallel_degree", "2"]})):
        folders = {name: tmp_path_factory.mktemp(name.replace(" ", "")) for name in jobs}
        results = train_many({name: tiny_args(folders[name], *GRPO_FLAGS, *from_hf(straight), *flags)
                              for name, flags in jobs.items()}, devices=devices, model_overrides=TWO_BLOCKS)
        runs |= {name: (folders[name], results[name]) for name in jobs}
    return runs


def test_grpo_raises_the_held_out_reward(grpo_runs):
    """40 steps lift the mean reward of 8 sampled completions of each of the 9 held-out prompts
    from the export's 0.0 to 1.0 (measured: every completion then starts with a digit; none is
    right), and the training reward with it (0.06 at step 1, 1.0 from step 22); the step graph,
    the prefill and the decode graph compile once each."""
    start, learn = grpo_runs["start"][1], grpo_runs["learn"][1]
    before, after = _held_out(start)[1], _held_out(learn)[40]
    assert before <= 0.1 and after >= 0.5, (before, after)
    assert learn["validation_metrics"][40]["rewards/starts_with_a_digit/mean"] == after
    rewards = _logged(learn)
    assert sorted(rewards) == list(range(1, 41))
    first, last = sum(rewards[s] for s in range(1, 6)) / 5, sum(rewards[s] for s in range(36, 41)) / 5
    assert first <= 0.2 and last >= 0.5, rewards
    assert learn["compiles"] == 3  # the replayed step, the prefill, the decode step


def test_fsdp_x_tp_samples_the_same_completions_and_gives_one_devices_losses(grpo_runs):
    """The rollouts sampled on fsdp 4 x tp 2 are one device's (the same rewards at every step), and
    the losses (each rollout's first update: ratio 1; its second: clipped ratios against the
    recorded old log-probs, with the KL to the reference copy) equal one device's within 1e-5."""
    one, mesh = grpo_runs["1 device"][1], grpo_runs["fsdp4 x tp2"][1]
    assert _logged(one) == _logged(mesh)
    assert sorted(one["losses"]) == sorted(mesh["losses"]) == list(range(1, 7))
    for step, loss in one["losses"].items():
        assert mesh["losses"][step] == pytest.approx(loss, abs=1e-5), step
    kl = _logged(one, "kl")
    assert kl[1] == 0 and 0 < max(kl.values()) < 1, kl  # the policy starts as the reference


def test_lora_grpo_uses_the_base_model_as_its_reference(grpo_runs):
    """With LoRA and no reference given, the KL is to the base model (the adapters switched off):
    0 at step 1, where the adapters' B is 0, and above it once they have trained. A reference that
    kept its adapters would be the policy itself, its KL 0 at every step."""
    kl = _logged(grpo_runs["lora"][1], "kl")
    assert sorted(kl) == list(range(1, 7)) and kl[1] == 0
    assert all(kl[s] > 0 for s in range(2, 7)), kl


def test_grpo_resumes_bit_exactly_inside_a_rollout(grpo_runs, straight):
    """Saved at step 3, between the two updates of the second rollout (kept whole in the
    checkpoint), the resumed run repeats the uninterrupted run's losses exactly, and the third
    rollout's sampling too."""
    folder, one = grpo_runs["1 device"]
    import shutil

    shutil.rmtree(folder / "checkpoint" / "step-6")
    resumed, log = train_run(tiny_args(folder, *GRPO_FLAGS, *from_hf(straight), *SMALL, "--training.local_batch_size",
                                       "4", "--checkpoint.enable", "--checkpoint.interval", "3"),
                             model_overrides=TWO_BLOCKS)
    assert "Resumed from" in log and sorted(resumed) == [4, 5, 6]
    assert resumed == {s: one["losses"][s] for s in (4, 5, 6)}
    assert {s: round(r, 3) for s, r in _logged(one).items() if s > 3} == _log_rewards(log)


@pytest.mark.parametrize("flags, message", [
    (["--grpo.num_generations", "1", "--grpo.scale_rewards", "none"],
     "--grpo.num_generations = 1: a group needs 2 completions or more (a completion's advantage is its "
     "reward against its group's)"),
    (["--validation.enable", "--validation.dataset", "python_docs"],
     "--validation.dataset = 'python_docs' with command line: --training.objective = 'grpo': grpo validates "
     "on prompts (prompts or larger_numbers), and only it does"),
    (["--grpo.max_completion_length", "32"], "--grpo.max_completion_length = 32: with max_prompt_length = 48 it "
                                             "needs 80 tokens of KV cache and training row; [training] seq_len is 64"),
    (["--training.dataset", "python_docs"], "--training.dataset = 'python_docs': grpo trains on the prompts of a "
                                            "prompt dataset (prompts or larger_numbers), and only it does"),
    (["--parallelism.pipeline_parallel_degree", "2"], "grpo's rollouts do not run on pipeline"),
    (["--grpo.reward_weights", "1"], "--grpo.reward_weights: 1 weights for 2 reward functions"),
])
def test_bad_settings_are_one_line(flags, message, tmp_path):
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_args(tiny_args(tmp_path, *GRPO_FLAGS, *flags))


def test_an_unimportable_reward_function_stops_the_run_before_anything_is_written(tmp_path):
    """One line, exit 2, before the model is built: nothing written."""
    dump = tmp_path / "dump"
    r = run_train(tiny_args(dump, *GRPO_FLAGS, "--grpo.reward_functions", "accuracy,nosuch_module:score"))
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: command line: --grpo.reward_functions: nosuch_module:score: cannot be imported "
        "(ModuleNotFoundError: No module named 'nosuch_module')"), r.stderr[-2000:]
    assert "Traceback" not in r.stderr and not (dump / "config.toml").exists()


def test_bad_prompts_are_one_line_when_the_data_is_built(tmp_path):
    """Prompts without the answer the accuracy reward compares with, a prompt longer than
    max_prompt_length, a malformed prompt line: one line naming the file (train.py builds the data
    before the model, as the test above shows for the rewards); several hosts of the XLA runtime."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.grpo import build_rollouts

    no_answer = tmp_path / "no_answer.jsonl"
    no_answer.write_text(json.dumps({"prompt": "What is 2 + 2?", "answer": "4"}) + "\n"
                         + json.dumps({"prompt": "What is 3 + 3?"}) + "\n")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "word " * 60, "answer": "1"}) + "\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "answer": "1"}) + "\n" + json.dumps({"question": "p"}) + "\n")
    tokenizer = build_tokenizer("", "llama3")
    for path, message in (
            (no_answer, f"[grpo] reward_functions: accuracy compares with each prompt's \"answer\"; [training] "
                        f"dataset {no_answer} (train split) row 1 has none"),
            (long, f"[grpo] max_prompt_length = 48: prompt 0 of {long} has 122 tokens; raise it or shorten "
                   f"the prompt"),
            (bad, f"{bad}:2: no \"prompt\" (a string or a list of messages) or \"messages\"")):
        config = parse_args(tiny_args(tmp_path, *GRPO_FLAGS, "--training.dataset", "prompts",
                                      "--training.dataset_path", str(path)))
        with pytest.raises(ConfigError) as e:
            build_rollouts(config, tokenizer, batch_size=8)
        assert str(e.value) == message
    with pytest.raises(ConfigError, match=r"^\[training\] objective = \"grpo\" runs on one host of the XLA runtime "
                                          r"for now \(this job has 2\)"):
        build_rollouts(parse_args(tiny_args(tmp_path, *GRPO_FLAGS)), tokenizer, batch_size=8, host_count=2)
