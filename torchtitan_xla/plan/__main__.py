"""`python -m torchtitan_xla.plan --job.config_file X.toml [--plan.tpu v5p-256] [flags]`: whether
the job fits the slice's HBM, with what margin, what would make it fit, its collectives and its
roofline. Exit 0: fits; 1: does not fit; 2: bad input (one line)."""

from __future__ import annotations

import math
import sys

from torchtitan_xla.config import parse_args, where
from torchtitan_xla.config.checks import native_refusal
from torchtitan_xla.errors import ConfigError, run_main
from torchtitan_xla.parallelisms.parallel_dims import BATCH_AXES
from torchtitan_xla.plan import memory

GiB = 2**30
USAGE = ("usage: python -m torchtitan_xla.plan --job.config_file FILE [--plan.tpu SLICE] "
         "[--section.key VALUE ...]\n\n"
         "Whether the job fits the TPU slice's memory, its collectives and roofline, from the config "
         "alone. Exit 0: fits; 1: does not fit; 2: bad input. The options are train.py's:")


def _gib(n: float) -> str:
    return f"{n / GiB:8.2f} GiB"


def runtime_line(cfg) -> str:
    """Which runtime the job is meant for on the slice, and whether the other one runs it."""
    if cfg.runtime.backend == "native":
        return "runtime: native (TorchTPU: one process per chip, DTensor, torch.compile; not verified on TPU)"
    refusal = native_refusal(cfg)
    other = ("the native runtime (TorchTPU) runs it too ([runtime] backend = \"native\"; not verified on "
             "a TPU)" if refusal is None else
             "not on the native runtime yet: [{}] {} = {!r}, {}".format(*refusal))
    return f"runtime: xla (torch_xla SPMD: one process per host); {other}"


def _offloaded(cfg) -> str:
    names = {"decoder_layer_input": "each block's input", "qkv_proj": "its attention projections"}
    what = [names[n] for n in cfg.activation_checkpoint.offload]
    if cfg.optimizer.offload:
        what.append("the optimizer's state with float32 weights and gradients")
    return " and ".join(what) + ", offloaded"


def report(plan, cfg) -> str:
    m, r, chip = plan.memory, plan.roofline, plan.slice.chip
    t, ac = cfg.training, cfg.activation_checkpoint
    policy = ac.mode if ac.mode != "selective" else f"selective {ac.selective_ac_option}"
    loss = f"chunks of {cfg.loss.chunk_size} tokens" if cfg.loss.chunk_size else "full logits"
    mesh = " x ".join(f"{k} {v}" for k, v in plan.mesh.items())
    ranks = math.prod(plan.mesh[a] for a in BATCH_AXES)
    microbatches = max(t.global_batch_size // (t.local_batch_size * ranks), 1)
    name, shape, spec = m.largest_shard
    cp = plan.mesh["cp"]
    host_chips = min(chip.chips_per_host, plan.slice.chips)
    lines = [
        f"{cfg.model.name} {cfg.model.flavor} on {plan.slice.name}"
        + (f" x {cfg.parallelism.num_slices} slices" if cfg.parallelism.num_slices > 1 else "")
        + f": {plan.slice.chips} {chip.name} chips, "
        f"{chip.hbm_bytes / GiB:g} GiB HBM each; mesh {mesh}",
        runtime_line(cfg),
        "per device:",
        f"  parameters   {_gib(m.parameters)}   (float32; largest shard {name} {list(shape)} {spec})",
        f"  gradients    {_gib(m.gradients)}",
        f"  optimizer    {_gib(m.optimizer)}   ({cfg.optimizer.name}"
        + (", on the host)" if cfg.optimizer.offload else ")"),
        *([f"  reference    {_gib(m.reference)}   ({cfg.training.objective}'s frozen reference "
           f"model, float32)"] if m.reference else []),
        *([f"  kv cache     {_gib(m.kv_cache)}   (grpo's rollouts: every row of the step x {t.seq_len} "
           f"slots, float32; held while generating, beside the gradients, not the activations)"]
          if m.kv_cache else []),
        f"  activations  {_gib(m.activations)}   (seq {t.seq_len} x batch {t.local_batch_size} per rank"
        + (f" and microbatch ({microbatches} microbatches)" if microbatches > 1 else "")
        + (f", split over cp {cp}: {t.seq_len // cp} tokens per device" if cp > 1 else "") + ", "
        f"AC {policy}, attention {cfg.model.attention}, loss on {loss}, {t.mixed_precision_param})",
        *([f"  host         {_gib(m.host)}   ({_offloaded(cfg)}; {plan.host_bytes / GiB:.2f} GiB of a "
           f"host's {chip.host_bytes / GiB:.0f} GiB for its {host_chips} chips; the copies' and host "
           f"updates' time is not modelled)"] if m.host else []),
        f"  total        {_gib(m.total)}   of {chip.hbm_bytes / GiB:g} GiB: "
        + (f"fits, margin {(plan.hbm - m.total) / GiB:.2f} GiB"
           + (" (tight: within the memory model's 10%)" if plan.tight else "")
           if plan.fits else f"does not fit by {(m.total - plan.hbm) / GiB:.2f} GiB"),
    ]
    args = memory.model_args(cfg)
    if args.num_experts:
        lines.append("  (mixture of experts: the dispatch tensors and the experts' slots counted from their "
                     "shapes, not fitted: 0.86-1.21 of the compiler's on the CPU debug models, docs/plan.md)")
    if args.mla:
        lines.append("  (latent attention: counted as Llama blocks of its mean width, not fitted: 4-28% over "
                     "the compiler's on the CPU debug model, docs/plan.md)")
    if cp > 1:
        scores = ("blockwise's chunk pairs as its fitted term (0.95 of the compiler's at cp 4 and 8)"
                  if cfg.model.attention == "blockwise"
                  else "sdpa scores [heads, seq/cp, seq] in the fitted terms")
        lines.append(f"  (context parallelism: each device's {scores}, the whole sequence's keys and values "
                     "and the weights gathered per block counted from their shapes: 0.92-1.02 of the "
                     "compiler's on the CPU debug model, docs/plan.md)")
    if plan.mesh["pp"] > 1:
        p = cfg.parallelism
        stages, micro = p.pipeline_parallel_degree, p.pipeline_microbatches or p.pipeline_parallel_degree
        rounds = p.pipeline_repeats if p.pipeline_schedule == "circular" else 1
        lines.append(f"  (pipeline: {stages} stages, {micro} microbatches x {rounds} round(s), bubble "
                     f"{(stages - 1) / (micro * rounds + stages - 1):.1%} of the step; every iteration's "
                     f"activations kept for the backward, counted from the fit's blocks: 1.00-1.04 of the "
                     f"compiler's without checkpointing, docs/plan.md)")
        if ac.mode == "full":
            lines.append("  (WARNING: with full checkpointing in a pipeline, the compiled step on the XLA "
                         "CPU backend kept 0.8 of what no checkpointing keeps, 3-5x what this counts: the "
                         "cause is not found, so this verdict may be optimistic; docs/plan.md)")
    if not plan.fits:
        lines.append("  would fit with:" if plan.knobs else "  no single knob makes it fit (AC, "
                     "host offload, loss chunks, smaller batch, more FSDP, a slice twice the size)")
        lines += [f"    {' '.join(flags)}   ({total / GiB:.2f} GiB"
                  + (f"; {host / GiB:.2f} GiB on each host" if host else "") + ")"
                  for flags, total, host in plan.knobs]
    sent = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in plan.collectives.items() if v)
    lines += [
        f"collectives per device per step (theory): {sent or 'none'}",
        f"roofline per step: compute {r.compute_seconds:.3f} s at {chip.peak_bf16_flops / 1e12:g} TFLOP/s "
        f"(model FLOPs {r.model_seconds:.3f} s), communication {r.comm_seconds:.3f} s at "
        f"{chip.ici_bytes_per_s / 1e9:g} GB/s ICI"
        + (" (the permutes between slices at DCN speed are not modelled)" if cfg.parallelism.num_slices > 1
           else ""),
        f"  MFU at most {r.mfu_bound:.0%} (communication hidden), {r.mfu_serial:.0%} if nothing "
        f"overlaps: a projection from published peaks, not measured on TPU (docs/plan.md)",
        f"verdict: {'FITS' if plan.fits else 'DOES NOT FIT'} on {plan.slice.name}",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    from torchtitan_xla.plan import build_plan

    cfg = parse_args(argv, usage=USAGE)
    if not cfg.plan.tpu:
        raise ConfigError(f"{where(cfg, 'plan', 'tpu')} is not set: name the slice to plan for, "
                          f"e.g. --plan.tpu v5p-256")
    plan = build_plan(cfg, cfg.plan.tpu, argv=argv)
    print(report(plan, cfg))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(run_main(lambda: main(sys.argv[1:])))
