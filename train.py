"""Train Llama on XLA SPMD from a TOML config: the whole recipe, top to bottom.

    CONFIG_FILE=./train_configs/debug_model.toml ./run_train.sh --training.steps 50
    python train.py --job.config_file train_configs/debug_model.toml --help

One process per host drives all of the host's devices; every sharding is an annotation on one
named mesh and XLA partitions the step. Each step is one compiled graph.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # silence the per-compile GSPMD notice

from torchtitan_xla.config_manager import ConfigError, JobConfig, parse_args  # noqa: E402

if TYPE_CHECKING:
    from torchtitan_xla.metrics import StepStats


def main(job_config: JobConfig) -> list[StepStats]:
    """Run the job; returns what was logged at each logging step."""
    import torch
    import torch.nn.functional as F
    import torch_xla
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    from torchtitan_xla.datasets import build_data_loader, build_tokenizer, check_vocab_size
    from torchtitan_xla.logging import init_logger, logger
    from torchtitan_xla.metrics import MetricLogger, num_flops_per_token
    from torchtitan_xla.models import get_model_args, model_name_to_cls
    from torchtitan_xla.optimizer import build_lr_scheduler, build_optimizer
    from torchtitan_xla.parallelisms import BATCH_AXES, ParallelDims, parallelize_llama
    from torchtitan_xla.utils import GarbageCollection, compile_stats, set_determinism

    init_logger()
    logger.info(f"Starting job: {job_config.job.description}")
    if job_config.job.print_config:
        logger.info("Effective config:\n" + job_config.to_toml())

    # Devices: SPMD from the first XLA call on, one mesh over every device of every host.
    xr.use_spmd()
    device = torch_xla.device()
    parallel_dims = ParallelDims.from_config(job_config.parallelism, xr.global_runtime_device_count())
    mesh = parallel_dims.build_mesh()
    host_rank, host_count = xr.process_index(), xr.process_count()
    logger.info(f"{xr.global_runtime_device_count()} {xr.device_type()} devices, "
                f"{host_count} host(s); mesh {dict(zip(mesh.axis_names, mesh.mesh_shape))}")
    seed = set_determinism(job_config.debug.seed, job_config.debug.deterministic)

    # Tokenizer and data: each host loads its share of the global batch.
    training = job_config.training
    tokenizer = build_tokenizer(job_config.model.tokenizer_path)
    global_batch = training.local_batch_size * parallel_dims.dp_degree
    # Batches arrive on the mesh, sharded over the batch axes and prefetched in the background;
    # with several hosts each one holds only its slice of the batch dimension.
    data_loader = build_data_loader(
        job_config, tokenizer, batch_size=global_batch // host_count,
        host_rank=host_rank, host_count=host_count, device=device,
        input_sharding=xs.ShardingSpec(mesh, (BATCH_AXES, None), minibatch=host_count > 1))

    # Model: built on the meta device, so no full copy ever exists on the host.
    model_args = get_model_args(job_config.model.name, job_config.model.flavor,
                                vocab_size=tokenizer.n_words, max_seq_len=training.seq_len)
    check_vocab_size(tokenizer, model_args.vocab_size)
    with torch.device("meta"):
        model = model_name_to_cls[job_config.model.name](model_args)
    num_params = model.num_params()
    flops_per_token = num_flops_per_token(model_args, model.num_params(exclude_embedding=True),
                                          training.seq_len)
    logger.info(f"Model {job_config.model.name} {job_config.model.flavor}: {num_params:,} parameters, "
                f"vocab {model_args.vocab_size}")

    # Materialise on the XLA device. Tensors are lazy: nothing is computed or allocated until the
    # sync below, so the shardings given by parallelize apply to the init computation itself.
    model.to_empty(device=device)
    parallelize_llama(model, mesh, parallel_dims, job_config)
    model.init_weights()
    model.train()

    optimizer = build_optimizer(model, job_config)
    lr_scheduler = build_lr_scheduler(optimizer, job_config)
    torch_xla.sync()

    # Inputs are all checked by now: only from here on does the run write anything.
    dump_folder = Path(job_config.job.dump_folder)
    dump_folder.mkdir(parents=True, exist_ok=True)
    (dump_folder / "config.toml").write_text(job_config.to_toml())

    metric_logger = MetricLogger(
        flops_per_token=flops_per_token, tokens_per_step=global_batch * training.seq_len,
        num_devices=parallel_dims.world_size, color=job_config.metrics.enable_color_printing)
    autocast_dtype = torch.bfloat16 if training.mixed_precision_param == "bfloat16" else None

    def train_step(inputs: torch.Tensor, labels: torch.Tensor):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=autocast_dtype is not None):
            logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
        loss.backward()
        if training.max_norm > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), training.max_norm)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
        optimizer.step()
        return loss.detach(), grad_norm.detach()

    # One graph per step: any host sync inside (e.g. a stray .item()) is an error, not a silent
    # graph break.
    compiled_step = torch_xla.compile(train_step, full_graph=True, name="train_step")

    gc_handler = GarbageCollection(training.gc_freq)
    data_iterator = iter(data_loader)
    warmup_steps = 2  # step 1 compiles; any compile after step 2 is a bug
    compiles_after_warmup = None
    history: list[StepStats] = []
    logger.info(f"Training {training.steps} steps, global batch {global_batch} x {training.seq_len} "
                f"tokens, seed {seed}")
    metric_logger.reset_timer(0)
    for step in range(1, training.steps + 1):
        gc_handler.run(step)
        data_start = time.perf_counter()
        inputs, labels = next(data_iterator)
        metric_logger.add_data_wait(time.perf_counter() - data_start)
        loss, grad_norm = compiled_step(inputs, labels)
        lr = lr_scheduler.get_last_lr()[0]
        lr_scheduler.step()

        compiles, _ = compile_stats()
        if step == warmup_steps:
            compiles_after_warmup = compiles
        elif compiles_after_warmup is not None and compiles > compiles_after_warmup:
            message = (f"step {step}: XLA compiled a new graph after warm-up ({compiles} compiles, "
                       f"{compiles_after_warmup} at step {warmup_steps}); run with "
                       f"PT_XLA_DEBUG_LEVEL=1 to see why")
            if job_config.debug.on_recompile == "error":
                raise RuntimeError(message)
            logger.warning(message)
            compiles_after_warmup = compiles

        if step == 1 or step % job_config.metrics.log_freq == 0 or step == training.steps:
            # The one host transfer per log step; it waits for this step to finish.
            history.append(metric_logger.log(step, loss.item(), grad_norm.item(), lr))

    data_loader.close()
    logger.info(f"Training completed: {compile_stats()[0]} XLA compiles in total")
    return history


if __name__ == "__main__":
    try:
        main(parse_args())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
