"""Know before paying for a pod: a job's per-device memory (with activations), the collectives of
its step and a roofline on a TPU slice, from the config alone (a meta-device model, seconds).

    python -m torchtitan_xla.plan --job.config_file train_configs/llama3_70b.toml [--plan.tpu v5p-256]
    CONFIG_FILE=llama3_70b.toml ./run_train.sh --plan

memory.py holds the memory model (calibrated against the XLA CPU backend's buffer assignment of the
compiled step), comms.py the collectives' theory and the audit of a compiled step's HLO against it,
tpus.py the chips' published figures, calibrate.py the compile-and-read runs behind both checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torchtitan_xla.config import JobConfig, attributed, parse_args
from torchtitan_xla.errors import ConfigError

from . import comms, memory
from .tpus import Slice, parse_slice

# A plan within this fraction of HBM is called tight: the memory model's error on its grid.
TIGHT = 0.10


@dataclass
class Roofline:
    """One optimizer step on one device: model FLOPs at the chip's peak, the FLOPs actually run
    (with recomputation), and the bytes sent at its ICI bandwidth. A projection, not a measurement."""

    model_seconds: float
    compute_seconds: float
    comm_seconds: float

    @property
    def mfu_bound(self) -> float:
        """MFU if communication hides entirely behind compute."""
        return self.model_seconds / max(self.compute_seconds, self.comm_seconds)

    @property
    def mfu_serial(self) -> float:
        """MFU if nothing overlaps."""
        return self.model_seconds / (self.compute_seconds + self.comm_seconds)


@dataclass
class Plan:
    slice: Slice
    mesh: dict[str, int]
    memory: memory.Memory
    collectives: dict[str, float]  # bytes sent per device per step, by kind
    roofline: Roofline
    # (flags, device total, host bytes per host) of each change that fits
    knobs: list[tuple[list[str], int, int]] = field(default_factory=list)

    @property
    def hbm(self) -> int:
        return self.slice.chip.hbm_bytes

    @property
    def host_bytes(self) -> int:
        """What the job keeps in each host's memory (offloaded activations and optimizer), for a
        whole host."""
        return self.memory.host * min(self.slice.chip.chips_per_host, self.slice.chips)

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.hbm and self.host_bytes <= self.slice.chip.host_bytes

    @property
    def tight(self) -> bool:
        return self.fits and self.memory.total > (1 - TIGHT) * self.hbm


def pipeline_bubble(dims) -> float:
    """The fraction of a pipelined step each stage idles: (S - 1) / (M R + S - 1); 0 without."""
    return (dims.pp - 1) / (dims.pp_microbatches * dims.pp_repeats + dims.pp - 1)


def recompute_factor(policy: str) -> float:
    """FLOPs run per model FLOP: a fully recomputed block runs its forward (a third) twice."""
    if policy == "full":
        return 4 / 3
    if policy.startswith("every-"):
        return 1 + 1 / (3 * int(policy.removeprefix("every-")))
    return 1.0  # none; op recomputes only elementwise work


def build_plan(job_config: JobConfig, tpu: str, *, with_knobs: bool = True,
               argv: list[str] | None = None) -> Plan:
    """The plan of `job_config` on slice `tpu`; `argv` (the command line that made the config) lets
    it try the knobs that would make a job that does not fit fit."""
    from torchtitan_xla.lora import frozen_matmul_params
    from torchtitan_xla.metrics import num_flops_per_token
    from torchtitan_xla.models.llama.moe import inactive_expert_params
    from torchtitan_xla.parallelisms import MESH_AXES, ParallelDims

    with attributed(job_config):  # errors name the file or flag that set the key
        target = parse_slice(tpu)
        p = job_config.parallelism
        stages = p.pipeline_parallel_degree
        if p.num_slices > 1 and (stages == 1 or stages % p.num_slices):
            raise ConfigError(f"[parallelism] num_slices = {p.num_slices}: the plan covers one slice "
                              f"(ICI), or pipeline stages across slices; plan one slice's share of the job")
        try:
            # Stages across slices: every slice holds pp / num_slices of them, each device the
            # same share of the work; the permutes between the slices run over DCN.
            dims = ParallelDims.from_config(p, target.chips * p.num_slices)
            mem = memory.estimate(job_config, dims)
        except ConfigError as e:
            raise ConfigError(f"{e} (on {tpu}: {target.chips} chips, one device each)") from None
    args, model = memory.build_meta_model(job_config)
    training = job_config.training
    global_batch = (training.global_batch_size if training.global_batch_size > 0
                    else training.local_batch_size * dims.dp_degree)
    microbatches = global_batch // (training.local_batch_size * dims.dp_degree)
    policy = memory.activation_shape(job_config, args, dims, training.local_batch_size).policy
    act_bytes, reduce_bytes = comms.dtype_bytes(training)
    sent = comms.theory(model, dims, tokens=training.local_batch_size * training.seq_len,
                        seq_len=training.seq_len, microbatches=microbatches, policy=policy,
                        act_bytes=act_bytes, reduce_bytes=reduce_bytes)
    active = model.num_params(exclude_embedding=True) - inactive_expert_params(model)
    flops = num_flops_per_token(args, active, training.seq_len, frozen=frozen_matmul_params(model))
    tokens_per_device = global_batch * training.seq_len / dims.world_size
    model_seconds = flops * tokens_per_device / target.chip.peak_bf16_flops
    # Pipeline stages run every one of the schedule's iterations, the bubble's on nothing.
    bubble = 1 / (1 - pipeline_bubble(dims))
    roofline = Roofline(model_seconds, model_seconds * recompute_factor(policy) * bubble,
                        sum(sent.values()) / target.chip.ici_bytes_per_s)
    plan = Plan(target, dict(zip(MESH_AXES, dims.mesh_shape)), mem, sent, roofline)
    if with_knobs and not plan.fits and argv is not None:
        plan.knobs = _knobs_that_fit(job_config, argv, tpu, global_batch)
    return plan


def _knobs_that_fit(cfg: JobConfig, argv: list[str], tpu: str,
                    global_batch: int) -> list[tuple[list[str], int, int]]:
    """Each single change that makes the job fit (activation checkpointing, each block's input on
    the host, the attention kernel, loss chunking, half the local batch with gradient accumulation
    keeping the global batch, twice the context parallel degree, the optimizer on the host (the
    native runtime's), FSDP over the replicas, a slice twice the size); if none does, all the
    memory savers at once, then with the optimizer on the host too."""
    t, ac = cfg.training, cfg.activation_checkpoint
    keep_global = ["--training.global_batch_size", str(global_batch)]
    savers = []
    if ac.mode != "full":
        savers += [["--activation_checkpoint.mode", "selective",
                    "--activation_checkpoint.selective_ac_option", "op"],
                   ["--activation_checkpoint.mode", "full"]]
    if not ac.offload and cfg.parallelism.pipeline_parallel_degree == 1 and not cfg.compile.scan_layers:
        savers.append(["--activation_checkpoint.mode", "full",
                       "--activation_checkpoint.offload", "decoder_layer_input"])
    if cfg.model.attention in ("sdpa", "blockwise"):
        savers.append(["--model.attention", "splash"])
    if cfg.loss.chunk_size == 0 and (t.local_batch_size * t.seq_len) % 1024 == 0:
        savers.append(["--loss.chunk_size", "1024"])
    if t.local_batch_size > 1:
        savers.append(["--training.local_batch_size", str(t.local_batch_size // 2), *keep_global])
    cp = cfg.parallelism.context_parallel_degree
    if cp > 1:  # each sequence over twice the devices (fewer data-parallel ranks: more microbatches)
        savers.append(["--parallelism.context_parallel_degree", str(2 * cp), *keep_global])
    offload = []
    if not cfg.optimizer.offload and cfg.optimizer.name in ("AdamW", "Adam"):
        offload = [["--optimizer.offload"] if cfg.runtime.backend == "native"
                   else ["--runtime.backend", "native", "--optimizer.offload"]]
    target = parse_slice(tpu)
    bigger = f"{target.chip.name}-{2 * target.chips * target.chip.cores_per_chip}"
    scale = [["--plan.tpu", bigger, *keep_global]]
    if cfg.parallelism.data_parallel_replicate_degree > 1:
        scale.insert(0, ["--parallelism.data_parallel_replicate_degree", "1"])
    fitting = []
    for flags in [*savers, *offload, *scale]:
        plan = _plan_with(argv, flags)
        if plan and plan.fits:
            fitting.append((flags, plan.memory.total, plan.host_bytes))
    if not fitting and savers:
        together = [flags for flags in savers if "selective" not in flags  # full recomputation instead
                    and "--training.local_batch_size" not in flags]
        together.append(["--training.local_batch_size", "1", *keep_global])
        tries = [together]
        if offload:  # with the optimizer on the host: the savers the native runtime runs (not splash)
            tries.append([*(f for f in together if _plan_with(argv, [*f, *offload[0]])), offload[0]])
        for flags in ([x for f in group for x in f] for group in tries):
            plan = _plan_with(argv, flags)
            if plan and plan.fits:
                fitting.append((flags, plan.memory.total, plan.host_bytes))
                break
    return fitting


def _plan_with(argv: list[str], flags: list[str]) -> Plan | None:
    """The plan with `flags` added to the command line; None if they make it invalid."""
    try:
        cfg = parse_args([*argv, *flags])
        return build_plan(cfg, cfg.plan.tpu, with_knobs=False)
    except ConfigError:
        return None
