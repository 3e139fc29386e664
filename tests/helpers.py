"""Running train.py (or run_train.sh) in a subprocess and reading back what it logged."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEP_LINE = re.compile(r"step:\s+(\d+)\s+loss:\s+([0-9.]+)")


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str

    @property
    def losses(self) -> dict[int, float]:
        return {int(s): float(v) for s, v in STEP_LINE.findall(self.stderr)}


class LogRecords(logging.Handler):
    """What the project's logger emitted while installed (see `capture_logs`)."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def messages(self, level=logging.INFO) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@contextlib.contextmanager
def capture_logs():
    """`with capture_logs() as log:` ... `log.messages(logging.WARNING)`."""
    from torchtitan_xla.logging import logger

    handler = LogRecords()
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def event_scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar TensorBoard holds under `folder`: tag -> [(step, value)]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _env(devices: int, extra: dict[str, str | None] | None) -> dict[str, str]:
    """This environment on the CPU backend with `devices` devices; `extra` values of None unset."""
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES=str(devices))
    for k, v in (extra or {}).items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return env


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous or a test server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_train(args: list[str], *, devices: int = 1, script: str = "train.py",
              env: dict[str, str | None] | None = None, timeout: int = 600) -> Run:
    """train.py (or run_train.sh) with `devices` virtual XLA CPU devices."""
    full_env = _env(devices, env)
    full_env["PYTHON"] = sys.executable  # run_train.sh: use this interpreter, install nothing
    if script == "train.py":
        cmd = [sys.executable, str(REPO / "train.py"), *args]
    else:
        cmd = [str(REPO / script), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)
    return Run(p.returncode, p.stdout, p.stderr)


def tiny_args(dump_folder: Path, *extra: str) -> list[str]:
    """The debug model at a small size that compiles and steps in seconds."""
    return ["--job.config_file", str(REPO / "train_configs" / "debug_model.toml"),
            "--job.dump_folder", str(dump_folder), "--job.no-print_config",
            "--training.seq_len", "64", "--training.steps", "5", "--metrics.log_freq", "1",
            "--lr_scheduler.warmup_steps", "2", *extra]


_DRIVER = """
import json, sys
sys.path.insert(0, {repo!r})
{prelude}
import train
from torchtitan_xla.config import parse_args
history = train.main(parse_args(sys.argv[2:]), model_overrides=json.loads(sys.argv[1]))
print("LOSSES " + json.dumps({{s.step: s.loss for s in history}}), flush=True)
"""


def train_process(args: list[str], *, devices: int = 1, model_overrides: dict | None = None,
                  prelude: str = "", env: dict[str, str | None] | None = None) -> subprocess.Popen:
    """Start train.main in a fresh process (stdout/stderr piped); `prelude` runs first."""
    code = _DRIVER.format(repo=str(REPO), prelude=prelude)
    return subprocess.Popen([sys.executable, "-c", code, json.dumps(model_overrides or {}), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(devices, env))


def losses_of(stdout: str) -> dict[int, float]:
    line = next(ln for ln in stdout.splitlines() if ln.startswith("LOSSES "))
    return {int(k): v for k, v in json.loads(line[len("LOSSES "):]).items()}


def train_run(args: list[str], *, devices: int = 1, model_overrides: dict | None = None,
              prelude: str = "", env: dict[str, str | None] | None = None,
              timeout: int = 600) -> tuple[dict[int, float], str]:
    """train.main in a fresh process with `devices` virtual devices: (exact losses, its log)."""
    p = train_process(args, devices=devices, model_overrides=model_overrides, prelude=prelude, env=env)
    out, err = p.communicate(timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"training failed ({p.returncode}):\n{err[-4000:]}")
    return losses_of(out), err


def train_losses(args: list[str], *, devices: int = 1, model_overrides: dict | None = None,
                 env: dict[str, str | None] | None = None, timeout: int = 600) -> dict[int, float]:
    """Run train.main in a fresh process with `devices` virtual devices; the exact losses."""
    return train_run(args, devices=devices, model_overrides=model_overrides, env=env, timeout=timeout)[0]


_MULTI_DRIVER = """
import gc
gc.disable()  # before torch's import, as train.main does (its collector runs on the loop's schedule)
import json, logging, sys, warnings
from pathlib import Path
sys.path.insert(0, {repo!r})
import torch, torch_xla
import torch_xla.distributed.spmd as xs
import train
import torchtitan_xla.optimizer as optimizer_module
import torchtitan_xla.parallelisms as parallelisms_module
from torchtitan_xla.config import parse_args
from torchtitan_xla.logging import init_logger, logger
from torchtitan_xla.runtime import compile_stats

class Lines(logging.Handler):
    # Each run's log lines and warnings (every warning each time: not once per process).
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

lines = Lines()
init_logger()  # (its stderr handler first: it adds none to a logger that has one)
logger.addHandler(lines)
warnings.simplefilter("always")
_show = warnings.showwarning

def showwarning(message, category, filename, lineno, file=None, line=None):
    lines.lines.append(f"{{filename}}:{{lineno}}: {{category.__name__}}: {{message}}")
    _show(message, category, filename, lineno, file, line)

warnings.showwarning = showwarning
captured = {{}}
real_parallelize, real_build_optimizer = parallelisms_module.parallelize_llama, optimizer_module.build_optimizer

def parallelize(model, mesh, *args, **kwargs):
    captured.update(model=model, mesh=mesh)
    return real_parallelize(model, mesh, *args, **kwargs)

def build_optimizer(model, job_config):
    captured["optimizer"] = real_build_optimizer(model, job_config)
    return captured["optimizer"]

parallelisms_module.parallelize_llama, optimizer_module.build_optimizer = parallelize, build_optimizer

def spec(t):
    return torch_xla._XLAC._get_xla_sharding_spec(t)

def expected(shape, partition_spec):
    # The sharding XLA reports for a fresh tensor annotated with this partition spec.
    t = torch.zeros(shape, device=torch_xla.device())
    if any(a is not None for a in partition_spec):
        xs.mark_sharding(t, captured["mesh"], partition_spec)
    torch_xla.sync()
    return spec(t)

results = {{}}
model_overrides = json.loads(sys.argv[2])
dump = Path(sys.argv[3]) if len(sys.argv) > 3 else None
dumped = set()
for name, args in json.loads(sys.argv[1]).items():
    before = compile_stats()[0]
    lines.lines = []
    history = train.main(parse_args(args), model_overrides=model_overrides)
    compiles = compile_stats()[0] - before
    model, opt = captured["model"], captured["optimizer"]
    params = {{}}
    for pname, p in model.named_parameters():
        ps = getattr(p, "_partition_spec", (None,) * p.dim())
        # every optimizer state tensor of the parameter's shape, by name (exp_avg, momentum_buffer...)
        state = {{k: spec(v) for k, v in opt.state[p].items()
                  if isinstance(v, torch.Tensor) and v.shape == p.shape}}
        params[pname] = dict(partition_spec=[list(a) if isinstance(a, tuple) else a for a in ps],
                             actual=spec(p), expected=expected(p.shape, ps), **state)
    results[name] = dict(losses={{s.step: s.loss for s in history}},
                         grad_norms={{s.step: s.grad_norm for s in history}},
                         router={{s.step: s.router for s in history if s.router is not None}},
                         validation={{s.step: s.validation_loss for s in history
                                     if s.validation_loss is not None}},
                         validation_metrics={{s.step: s.validation_metrics for s in history
                                             if s.validation_metrics is not None}},
                         objective={{s.step: s.objective for s in history if s.objective is not None}},
                         compiles=compiles, params=params, log=lines.lines,
                         expert_bias={{n: b.cpu().tolist() for n, b in model.named_buffers()
                                      if n.endswith("expert_bias")}})
    if dump:
        modules = set(map(str, dump.glob("*after_optimizations.txt"))) - dumped
        dumped |= modules
        results[name]["hlo"] = sorted(modules)
print("RESULTS " + json.dumps(results))
"""


# How long a process of several runs may take before it counts as hung: not a test of speed. Alone
# on two cores a debug-model run takes 10-40 s; with the other test worker and other processes on
# the same cores several times that (the pipeline tests' 14 runs once took over 900 s).
HANG_LIMIT_S, HANG_LIMIT_PER_RUN_S = 600, 300


def train_many(runs: dict[str, list[str]], *, devices: int, model_overrides: dict | None = None,
               timeout: int | None = None, xla_dump: Path | None = None) -> dict:
    """Several train.main runs in one fresh process with `devices` devices (saves start-up time).
    For each: logged losses, its log lines and warnings ("log"), compiles during the run, and for
    every parameter its partition spec, the sharding XLA reports for it and for its optimizer state
    of its shape (exp_avg, ...), and the sharding a fresh tensor with that partition spec gets;
    DeepSeek's expert biases after the run. With `xla_dump`, XLA dumps every
    compiled module there and each run lists its optimized HLO files ("hlo"). `timeout`: by default
    a limit that only a hung process reaches (HANG_LIMIT_S + HANG_LIMIT_PER_RUN_S per run)."""
    if timeout is None:
        timeout = HANG_LIMIT_S + HANG_LIMIT_PER_RUN_S * len(runs)
    env = None
    if xla_dump:
        from torchtitan_xla.runtime.xla.compiled import dump_flags

        env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(xla_dump)}".strip()}
    p = subprocess.run([sys.executable, "-c", _MULTI_DRIVER.format(repo=str(REPO)), json.dumps(runs),
                        json.dumps(model_overrides or {}), *([str(xla_dump)] if xla_dump else [])],
                       capture_output=True, text=True, env=_env(devices, env), timeout=timeout)
    if p.returncode != 0:
        raise AssertionError(f"training failed ({p.returncode}):\n{p.stderr[-4000:]}")
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULTS "))
    results = json.loads(line[len("RESULTS "):])
    for r in results.values():
        r["losses"] = {int(k): v for k, v in r["losses"].items()}
        r["validation"] = {int(k): v for k, v in r["validation"].items()}
        r["validation_metrics"] = {int(k): v for k, v in r["validation_metrics"].items()}
        r["objective"] = {int(k): v for k, v in r["objective"].items()}
        r["router"] = {int(k): v for k, v in r["router"].items()}
    return results


# ---- transformers in float64 ---------------------------------------------------------------------

def hf_rope(model, hf) -> None:
    """Give our model transformers' RoPE tables: transformers computes the angles in float32 whatever
    the model's dtype, so in float64 the two differ by float32 rounding unless they share them."""
    import torch

    inv_freq = hf.model.rotary_emb.inv_freq.float()
    angles = torch.arange(model.args.max_seq_len, dtype=torch.float32)[:, None] * inv_freq[None, :]
    model.rope_cos.copy_(angles.cos().double())
    model.rope_sin.copy_(angles.sin().double())


def rmsnorm_in_input_dtype(self, hidden_states):
    """transformers' LlamaRMSNorm, without its cast to float32 (which would make a float64 model
    float32 in every norm)."""
    import torch

    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def chat_finetune_jobs(out: Path, model: list[str], tokenizer: Path, sft_lr: str, lora_lr: str) -> dict:
    """A user's fine-tuning, for train_many: "pretrain", 6 steps of the model exported to HF; then
    "sft" and "lora" (rank 8), 30 steps each on the embedded chat set from that export, validation
    on the held-out topics every 10 steps, each exported to HF after its last step (LoRA: and to
    PEFT)."""
    common = [*model, "--model.tokenizer_path", str(tokenizer)]
    base = out / "pretrain" / "checkpoint" / "step-6-hf"
    export = ["--checkpoint.enable", "--checkpoint.interval", "30", "--checkpoint.last_save_in_hf"]
    learn = [*common, "--training.dataset", "python_docs_chat", "--training.seq_len", "256",
             "--checkpoint.initial_load_path", str(base), "--checkpoint.initial_load_in_hf", "--training.steps", "30",
             "--training.local_batch_size", "4", "--validation.enable", "--validation.freq", "10",
             "--validation.steps", "-1", *export]
    return {"pretrain": tiny_args(out / "pretrain", *common, "--training.steps", "6", "--training.local_batch_size",
                                  "8", "--checkpoint.enable", "--checkpoint.last_save_in_hf"),
            "sft": tiny_args(out / "sft", *learn, "--optimizer.lr", sft_lr),
            "lora": tiny_args(out / "lora", *learn, "--optimizer.lr", lora_lr, "--lora.rank", "8")}


def decode_through_cache(model, tokens, prompt: int):
    """The logits of `tokens` [batch, seq] computed as generation does: the first `prompt` tokens at
    once into a fresh KV cache, then one token at a time (one document, positions from 0)."""
    import torch

    from torchtitan_xla.generate.cache import KVCache

    batch, seq = tokens.shape
    cache = KVCache(len(model.layers), batch, seq, "cpu")
    documents = torch.ones(batch, seq, dtype=torch.long)
    steps = []
    for start, end in [(0, prompt), *((t, t + 1) for t in range(prompt, seq))]:
        positions = torch.arange(start, end).expand(batch, -1)
        cache.write(torch.arange(start, end), positions, documents[:, start:end])
        steps.append(model(tokens[:, start:end], positions, documents[:, start:end], cache=cache))
    return torch.cat(steps, dim=1)


def assert_packed_row_is_each_documents_own(model, hf, lengths: list[int], vocab: int, atol: float) -> None:
    """One row of documents of `lengths` tokens packed (positions restarting at each): each
    document's logits from `model` are transformers' `hf` on that document alone."""
    import torch

    tokens = torch.randint(0, vocab, (1, sum(lengths)), generator=torch.Generator().manual_seed(2))
    documents = torch.cat([torch.full((n,), d + 1) for d, n in enumerate(lengths)])[None]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = model(tokens, positions, documents)
    start = 0
    for n in lengths:
        expected = hf(tokens[:, start:start + n]).logits
        torch.testing.assert_close(packed[:, start:start + n], expected, rtol=0, atol=atol)
        start += n
