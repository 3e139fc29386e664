"""Typed job configuration.

One dataclass per TOML section; TOML keys, command-line flags and attribute names are the same
(`[training] steps` == `--training.steps` == `config.training.steps`). Precedence: command line >
TOML file > defaults. Every mistake a user can make in a config is a `ConfigError` whose message is
one line naming the file (or the command line), the key and what was expected.

This module imports neither torch nor torch_xla, so launch scripts can read a config cheaply.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """A user-facing input error: one line, reported without a traceback and exit code 2."""


class RunError(RuntimeError):
    """A failure of what the run writes to (a full disk, a folder it may not write): one line,
    reported without a traceback and exit code 1."""


def opt(default: Any, help: str, *, gt: float | None = None, ge: float | None = None,
        le: float | None = None) -> Any:
    """A config field: its default, its help text (shown by --help and docs/config.md) and
    optional numeric bounds that are checked after all sources are merged."""
    meta = {"help": help, "gt": gt, "ge": ge, "le": le}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class Job:
    config_file: str = opt("", "TOML file to read; command-line flags override its values.")
    dump_folder: str = opt(
        "./outputs", "Folder for everything the run writes (config, TensorBoard, checkpoints).")
    description: str = opt("default job", "Free text describing the job; printed at start.")
    print_config: bool = opt(
        True, "Print the effective config at start (it is always saved to <dump_folder>/config.toml).")


@dataclass
class Model:
    name: Literal["llama2", "llama3"] = opt("llama3", "Model family.")
    flavor: str = opt("debugmodel", "Model size within the family (see docs/config.md for the list).")
    attention: Literal["sdpa", "blockwise", "flash", "splash"] = opt(
        "sdpa", "Attention kernel: sdpa (compiled by XLA, any device); blockwise (causal attention "
        "in 4 query blocks that skip the masked keys, plain XLA ops: faster on the XLA CPU backend); "
        "flash or splash (torch_xla's Pallas kernels, TPU only: elsewhere the run falls back to "
        "sdpa with one warning).")
    tokenizer_path: str = opt(
        "",
        "Tokenizer file: a tiktoken BPE rank file (Llama 3) or a sentencepiece model (Llama 2). "
        "Empty: the project's own small tokenizer, trained from the embedded corpus and cached.")


@dataclass
class Optimizer:
    name: Literal["AdamW", "Adam"] = opt("AdamW", "Optimizer.")
    lr: float = opt(8e-4, "Peak learning rate.", gt=0)
    beta1: float = opt(0.9, "Adam beta1.", ge=0, le=1)
    beta2: float = opt(0.95, "Adam beta2.", ge=0, le=1)
    eps: float = opt(1e-8, "Adam epsilon.", gt=0)
    weight_decay: float = opt(0.1, "Decoupled weight decay (AdamW) or L2 penalty (Adam).", ge=0)


@dataclass
class LRScheduler:
    warmup_steps: int = opt(200, "Steps of linear warmup from lr/(warmup_steps+1) to lr.", ge=0)
    decay_ratio: float | None = opt(
        None,
        "Fraction of the steps spent decaying at the end (warmup-stable-decay). "
        "Unset: decay over all steps after warmup.", ge=0, le=1)
    decay_type: Literal["linear", "sqrt", "cosine"] = opt("linear", "Shape of the decay.")
    min_lr_factor: float = opt(
        0.0, "The lr decays towards lr * min_lr_factor (never reaching exactly 0).", ge=0, le=1)


@dataclass
class Training:
    dataset: Literal["python_docs", "c4", "json", "parquet", "text", "hf", "synthetic"] = opt(
        "python_docs",
        "Dataset (docs/datasets.md): python_docs is embedded and works offline; c4 streams "
        "allenai/c4 (en) from the Hub, or reads a local copy at dataset_path; json / parquet / "
        "text read local files; hf a save_to_disk folder or a Hub id; synthetic is random tokens.")
    dataset_path: str = opt(
        "", "Local file, folder or glob of the dataset (c4: the folder holding en/); empty: the "
        "registry default.")
    dataset_split: str = opt(
        "train", "Split to read: train, or validation (python_docs holds out every tenth topic; c4 "
        "reads c4-validation.* files).")
    shuffle_buffer: int = opt(
        0, "Shuffle documents through a buffer of this many, seeded by debug.seed (0: source "
        "order). The buffer is saved with the data state, so resume stays exact.", ge=0)
    num_workers: int = opt(
        0, "Tokenizing worker processes per host (0: a background thread of the training "
        "process). Resume needs the same value.", ge=0)
    local_batch_size: int = opt(8, "Sequences per data-parallel rank per forward/backward pass.", gt=0)
    global_batch_size: int = opt(
        -1, "Sequences per optimizer step over all data-parallel ranks; a multiple of "
        "local_batch_size x data-parallel degree, the ratio being gradient-accumulation steps. "
        "-1: local_batch_size x data-parallel degree (no accumulation).")
    seq_len: int = opt(2048, "Tokens per sequence.", gt=0)
    max_norm: float = opt(1.0, "Clip gradients to this global L2 norm (0 disables clipping).", ge=0)
    steps: int = opt(10000, "Training steps.", gt=0)
    mixed_precision_param: Literal["float32", "bfloat16"] = opt(
        "bfloat16", "Compute dtype (autocast); parameters and optimizer state stay float32.")
    gc_freq: int = opt(50, "Run Python's garbage collector every this many steps.", gt=0)


@dataclass
class Parallelism:
    data_parallel_replicate_degree: int = opt(
        1, "Replicas of the model (HSDP replicate / DDP dimension).", gt=0)
    data_parallel_shard_degree: int = opt(
        -1, "FSDP dimension: parameters, gradients and optimizer state are sharded over it. "
        "-1: all devices not used by the other degrees.")
    tensor_parallel_degree: int = opt(
        1, "Tensor (Megatron) parallel degree, with sequence parallelism between blocks.", gt=0)
    num_slices: int = opt(
        1, "TPU slices joined over DCN (multi-slice). Slices hold model replicas: "
        "data_parallel_replicate_degree must be a multiple of it.", gt=0)


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save checkpoints, and resume from the newest one at start.")
    folder: str = opt("checkpoint", "Checkpoint folder, inside dump_folder; holds step-<N> folders.")
    interval: int = opt(500, "Save every this many steps (and after the last step).", gt=0)
    async_mode: Literal["disabled", "async"] = opt(
        "disabled", "async: copy the state on the device (the loop waits only for that), then move "
        "it to host memory and write it in the background while training continues; needs device "
        "memory for a second copy of the saved state until it reaches the host.")
    keep_latest_k: int = opt(
        10, "Keep this many newest checkpoints (0: all). Old ones are deleted only after a newer "
        "one is complete.", ge=0)
    load_step: int = opt(-1, "Resume from this step's checkpoint; -1: the newest usable one.", ge=-1)
    last_save_model_only: bool = opt(
        False, "Make the save after the last step model weights only (for export), in export_dtype.")
    export_dtype: Literal["float32", "bfloat16", "float16"] = opt(
        "float32", "dtype of model-only saves and of the HuggingFace export.")
    exclude_from_loading: list[str] = opt(
        [], "Parts not to restore on resume: any of model, optimizer, lr_scheduler, dataloader, "
        "train_state.")
    on_damaged: Literal["fallback", "error"] = opt(
        "fallback", "A checkpoint that fails to load: fall back to the previous one, or stop.")
    initial_load_path: str = opt(
        "", "With no checkpoint to resume from, start from these weights: a checkpoint step folder, "
        "or a HuggingFace Llama folder (with initial_load_in_hf).")
    initial_load_in_hf: bool = opt(False, "initial_load_path is a HuggingFace safetensors folder.")
    last_save_in_hf: bool = opt(
        False, "After the last step also export HuggingFace safetensors + config.json to "
        "<folder>/step-<N>-hf.")
    create_seed_checkpoint: bool = opt(
        False, "Initialise the model, save it as step-0 (weights only) and exit: every run of an "
        "experiment can then start from identical weights.")


@dataclass
class ActivationCheckpoint:
    mode: Literal["none", "full", "selective"] = opt(
        "selective", "Recompute activations in the backward pass instead of keeping them: none, "
        "full (every block), or selective (see selective_ac_option).")
    selective_ac_option: str = opt(
        "2", "For mode selective: an integer N checkpoints every N-th block; 'op' keeps the "
        "outputs of the weight matmuls and recomputes everything else (norms, RoPE, attention "
        "scores, activations).")


@dataclass
class Compile:
    scan_layers: bool = opt(
        False, "Run the blocks as one XLA while loop over stacked weights (torch_xla scan_layers): "
        "compile time stops growing with depth. With scan, activation_checkpoint mode must be "
        "'none' or selective 'op' (done by the min-cut partitioner).")


@dataclass
class Float8:
    enable_float8_linear: bool = opt(
        False, "Run the Linear layers' matmuls as float8 x float8 -> float32 dots (forward: e4m3 "
        "input and weight; backward: e5m2 output gradient), with dynamic tensorwise scales. The "
        "output projection stays in high precision. See docs/float8.md.")
    filter_fqns: list[str] = opt(
        [], "Keep Linear layers whose name contains any of these strings in high precision "
        "(e.g. attention.wo).")
    recipe_name: Literal["tensorwise"] = opt(
        "tensorwise", "Scaling recipe: tensorwise = one dynamic scale per tensor from its "
        "absolute maximum (global over shards).")


@dataclass
class Metrics:
    log_freq: int = opt(10, "Read the loss back and log every this many steps.", gt=0)
    enable_color_printing: bool = opt(True, "Colour the console line (only when printing to a terminal).")
    enable_tensorboard: bool = opt(False, "Write TensorBoard event files.")
    save_tb_folder: str = opt("tb", "TensorBoard folder, inside dump_folder.")
    rank_0_only: bool = opt(
        True, "On multi-host runs, only host 0 prints the step line and writes TensorBoard; "
        "false: every host does, each into <save_tb_folder>/<time>/rank_<host>.")
    peak_flops: float | None = opt(
        None, "Peak FLOP/s of one device, for MFU. Unset: the bf16 peak of the TPU generation "
        "(v4, v5e, v5p, v6e, v7); on other devices MFU is n/a.", gt=0)


@dataclass
class Profiling:
    enable_profiling: bool = opt(
        False, "Write XLA profiler traces (TensorBoard's profile plugin reads them).")
    save_traces_folder: str = opt(
        "profile_traces",
        "Trace folder, inside dump_folder; one iteration_<step> subfolder per trace.")
    profile_freq: int = opt(10, "Trace the steps ending at every multiple of this step.", gt=0)
    profiler_active: int = opt(1, "Steps per trace (at most profile_freq).", gt=0)
    save_xla_metrics_report: bool = opt(
        False, "When the run ends (or fails), write torch_xla's metrics report (compiles, "
        "transfers, executions, CPU fallbacks) to <dump_folder>/xla_metrics_report.txt.")


@dataclass
class Debug:
    seed: int | None = opt(None, "Seed for parameter init and data order; unset: a fixed default.")
    deterministic: bool = opt(False, "Use deterministic algorithms only (same config, same losses).")
    on_recompile: Literal["error", "warn"] = opt(
        "error", "What a graph compile after warm-up (step 2) does: stop the run, or log a warning.")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    debug: Debug = field(default_factory=Debug)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        import tomli_w

        # TOML has no null: an unset optional key is left out, which reads back as unset.
        clean = {s: {k: v for k, v in kv.items() if v is not None} for s, kv in self.to_dict().items()}
        return tomli_w.dumps(clean)


# --------------------------------------------------------------------------------------------
# Schema helpers
# --------------------------------------------------------------------------------------------


def _sections() -> dict[str, type]:
    hints = typing.get_type_hints(JobConfig)
    return {f.name: hints[f.name] for f in dataclasses.fields(JobConfig)}


def _fields(section_cls: type) -> dict[str, tuple[Any, dataclasses.Field]]:
    hints = typing.get_type_hints(section_cls, include_extras=True)
    return {f.name: (hints[f.name], f) for f in dataclasses.fields(section_cls)}


def _optional_inner(tp: Any) -> Any | None:
    """The T in Optional[T], or None if `tp` is not optional."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def type_name(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{type_name(inner)} (optional)"
    if typing.get_origin(tp) is Literal:
        return "{" + ",".join(str(a) for a in typing.get_args(tp)) + "}"
    if typing.get_origin(tp) is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return tp.__name__


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _from_toml(value: Any, tp: Any) -> Any:
    """Check a TOML value against the field type; raises ValueError with what was expected."""
    inner = _optional_inner(tp)
    if inner is not None:
        return _from_toml(value, inner)
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"expected one of {', '.join(map(repr, typing.get_args(tp)))}, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {value!r}")
        return [_from_toml(v, typing.get_args(tp)[0]) for v in value]
    if tp is bool:
        if not isinstance(value, bool):
            raise ValueError(f"expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        return value
    raise TypeError(f"unsupported config type {tp}")  # a bug in this file, not user input


def _from_text(text: str, tp: Any) -> Any:
    """Parse a command-line string into the field type; raises ValueError."""
    inner = _optional_inner(tp)
    if inner is not None:
        return None if text.lower() in ("", "none", "null") else _from_text(text, inner)
    origin = typing.get_origin(tp)
    if origin is list:
        return [_from_text(t.strip(), typing.get_args(tp)[0]) for t in text.split(",") if t.strip()]
    if origin is Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if str(c) == text:
                return c
        raise ValueError(f"expected one of {', '.join(map(str, choices))}, got {text!r}")
    if tp is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"expected true or false, got {text!r}")
    if tp is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"expected an integer, got {text!r}") from None
    if tp is float:
        try:
            return float(text)
        except ValueError:
            raise ValueError(f"expected a number, got {text!r}") from None
    return text


def _check_bounds(value: Any, f: dataclasses.Field) -> str | None:
    if value is None or isinstance(value, (bool, str, list)):
        return None
    m = f.metadata
    if m.get("gt") is not None and not value > m["gt"]:
        return f"must be > {m['gt']:g}"
    if m.get("ge") is not None and not value >= m["ge"]:
        return f"must be >= {m['ge']:g}"
    if m.get("le") is not None and not value <= m["le"]:
        return f"must be <= {m['le']:g}"
    return None


# --------------------------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------------------------


class _Sources:
    """Where each value came from, so an error can name the file or the command line."""

    def __init__(self) -> None:
        self._where: dict[tuple[str, str], str] = {}

    def set(self, section: str, key: str, where: str) -> None:
        self._where[(section, key)] = where

    def describe(self, section: str, key: str) -> str:
        where = self._where.get((section, key), "default")
        if where == "command line":
            return f"command line: --{section}.{key}"
        return f"{where}: [{section}] {key}"


def _load_toml(path: str) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        with p.open("rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: TOML syntax error: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason})") from None


def _apply_toml(cfg: JobConfig, data: dict[str, Any], path: str, sources: _Sources) -> None:
    sections = _sections()
    for sname, svalues in data.items():
        if sname not in sections:
            raise ConfigError(f"{path}: unknown section [{sname}]{_did_you_mean(sname, list(sections))}")
        if not isinstance(svalues, dict):
            raise ConfigError(f"{path}: [{sname}] must be a table, got {svalues!r}")
        fields = _fields(sections[sname])
        section = getattr(cfg, sname)
        for key, value in svalues.items():
            if key not in fields:
                raise ConfigError(
                    f"{path}: unknown key [{sname}] {key}{_did_you_mean(key, list(fields))}")
            tp, _ = fields[key]
            try:
                setattr(section, key, _from_toml(value, tp))
            except ValueError as e:
                raise ConfigError(f"{path}: [{sname}] {key}: {e}") from None
            sources.set(sname, key, path)


def _all_flags() -> dict[str, tuple[str, str, Any]]:
    """'section.key' -> (section, key, type) for every option."""
    out = {}
    for sname, scls in _sections().items():
        for key, (tp, _) in _fields(scls).items():
            out[f"{sname}.{key}"] = (sname, key, tp)
    return out


def _split_cli(argv: list[str]) -> list[tuple[str, str | None]]:
    """Turn argv into (flag, value-or-None) pairs; a bare boolean flag has value None."""
    flags = _all_flags()
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("--"):
            raise ConfigError(
                f"command line: unexpected argument {tok!r} (options look like --section.key value)")
        name, eq, inline = tok[2:].partition("=")
        section, dot, key = name.partition(".")
        key = key.replace("-", "_")
        section = section.replace("-", "_")
        flag = f"{section}.{key}"
        negated = flag not in flags and key.startswith("no_") and f"{section}.{key[3:]}" in flags
        if negated:
            flag = f"{section}.{key[3:]}"
            if flags[flag][2] is not bool:
                raise ConfigError(f"command line: --{name} is only valid for boolean options")
            if eq:
                raise ConfigError(f"command line: --{name} takes no value")
            pairs.append((flag, "false"))
            i += 1
            continue
        if flag not in flags:
            close = difflib.get_close_matches(flag, list(flags), n=1)
            hint = f" (did you mean --{close[0]}?)" if close else ""
            raise ConfigError(f"command line: unknown option --{name}{hint}")
        tp = flags[flag][2]
        if eq:
            pairs.append((flag, inline))
            i += 1
        elif tp is bool:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and nxt.lower() in _TRUE | _FALSE:
                pairs.append((flag, nxt))
                i += 2
            else:
                pairs.append((flag, None))
                i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: --{name} needs a value ({type_name(tp)})")
            pairs.append((flag, argv[i + 1]))
            i += 2
    return pairs


def _validate(cfg: JobConfig, sources: _Sources) -> None:
    for sname, scls in _sections().items():
        section = getattr(cfg, sname)
        for key, (_, f) in _fields(scls).items():
            problem = _check_bounds(getattr(section, key), f)
            if problem:
                raise ConfigError(f"{sources.describe(sname, key)} = {getattr(section, key)!r}: {problem}")
    parts = {"model", "optimizer", "lr_scheduler", "dataloader", "train_state"}
    for part in cfg.checkpoint.exclude_from_loading:
        if part not in parts:
            raise ConfigError(
                f"{sources.describe('checkpoint', 'exclude_from_loading')}: unknown part {part!r}; "
                f"expected any of {', '.join(sorted(parts))}")
    ac = cfg.activation_checkpoint
    if ac.selective_ac_option != "op" and not (ac.selective_ac_option.isdigit()
                                               and int(ac.selective_ac_option) > 0):
        raise ConfigError(
            f"{sources.describe('activation_checkpoint', 'selective_ac_option')} = "
            f"{ac.selective_ac_option!r}: expected 'op' or a positive integer N (every N-th block)")
    if cfg.compile.scan_layers and not (
            ac.mode == "none" or (ac.mode == "selective" and ac.selective_ac_option == "op")):
        raise ConfigError(
            f"{sources.describe('compile', 'scan_layers')} = true cannot be combined with "
            f"[activation_checkpoint] mode = {ac.mode!r}"
            + (f", selective_ac_option = {ac.selective_ac_option!r}" if ac.mode == "selective" else "")
            + ": under scan use mode 'none' or selective 'op'")
    if cfg.training.global_batch_size == 0 or cfg.training.global_batch_size < -1:
        raise ConfigError(
            f"{sources.describe('training', 'global_batch_size')} = "
            f"{cfg.training.global_batch_size}: must be -1 (no accumulation) or > 0")
    p = cfg.parallelism
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ConfigError(
            f"{sources.describe('parallelism', 'data_parallel_shard_degree')} = "
            f"{p.data_parallel_shard_degree}: must be -1 (all remaining devices) or > 0")
    prof = cfg.profiling
    if prof.profiler_active > prof.profile_freq:
        raise ConfigError(
            f"{sources.describe('profiling', 'profiler_active')} = {prof.profiler_active}: "
            f"must be <= profiling.profile_freq ({prof.profile_freq}), so that one trace ends "
            f"before the next starts")
    from torchtitan_xla.models import flavors_of  # torch-free registry of names

    known = flavors_of(cfg.model.name)
    if cfg.model.flavor not in known:
        raise ConfigError(
            f"{sources.describe('model', 'flavor')} = {cfg.model.flavor!r}: unknown flavor for "
            f"{cfg.model.name}; expected one of {', '.join(known)}")


def parse_args(argv: list[str] | None = None) -> JobConfig:
    """Build the JobConfig from defaults, then the TOML file, then command-line flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(help_text())
        raise SystemExit(0)
    pairs = _split_cli(argv)
    cfg = JobConfig()
    sources = _Sources()
    config_file = next((v for f, v in pairs if f == "job.config_file"), None)
    if config_file:
        _apply_toml(cfg, _load_toml(config_file), config_file, sources)
    flags = _all_flags()
    for flag, text in pairs:
        sname, key, tp = flags[flag]
        try:
            value = True if text is None else _from_text(text, tp)
        except ValueError as e:
            raise ConfigError(f"command line: --{flag}: {e}") from None
        setattr(getattr(cfg, sname), key, value)
        sources.set(sname, key, "command line")
    _validate(cfg, sources)
    return cfg


# --------------------------------------------------------------------------------------------
# Help and generated docs
# --------------------------------------------------------------------------------------------


def _default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        value = f.default
    if value is None:
        return "unset"
    if isinstance(value, list):
        return ",".join(map(str, value)) or "(empty)"
    if isinstance(value, bool):
        return str(value).lower()
    return repr(value) if isinstance(value, str) else str(value)


def help_text() -> str:
    lines = [
        "usage: train.py [--job.config_file FILE] [--section.key VALUE ...]",
        "",
        "Precedence: command line > TOML file > default. Booleans: --section.key, "
        "--section.no-key or --section.key false. Lists: a,b,c.",
    ]
    for sname, scls in _sections().items():
        lines += ["", f"[{sname}]"]
        for key, (tp, f) in _fields(scls).items():
            lines.append(f"  --{sname}.{key} {type_name(tp)}  (default: {_default_text(f)})")
            lines.append(f"      {f.metadata['help']}")
    return "\n".join(lines)


def markdown_reference() -> str:
    """docs/config.md, generated from the dataclasses (tests/test_config.py keeps it in sync)."""
    from torchtitan_xla.models import all_flavors

    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by `python -m torchtitan_xla.config_manager --markdown`; do not edit. -->",
        "",
        "Every option is a TOML key in its section and a command-line flag `--section.key`.",
        "Precedence: command line > TOML file (`--job.config_file`) > the defaults below.",
        "Booleans: `--section.key`, `--section.no-key` or `--section.key false`; lists: `a,b,c`.",
        "A mistake (unknown section or key, wrong type, value out of range, missing file) stops",
        "the run with one line naming the file or flag, and exit code 2.",
    ]
    for sname, scls in _sections().items():
        out += ["", f"## [{sname}]", "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, (tp, f) in _fields(scls).items():
            out.append(f"| `{key}` | {type_name(tp)} | `{_default_text(f)}` | {f.metadata['help']} |")
    out += ["", "## Model flavors", "", "| model.name | model.flavor |", "|---|---|"]
    for name, flavors in all_flavors().items():
        out.append(f"| `{name}` | {', '.join(f'`{x}`' for x in flavors)} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] == ["--markdown"]:
        sys.stdout.write(markdown_reference())
    else:
        print(help_text())
