"""Train Llama from a TOML config: the whole recipe, top to bottom.

    CONFIG_FILE=./train_configs/debug_model.toml ./run_train.sh --training.steps 50
    python train.py --job.config_file train_configs/debug_model.toml --help

Every sharding is a partition spec on one named mesh; the runtime (`[runtime] backend`) applies
them: XLA SPMD (one process per host drives all its devices, one compiled graph per step), or
native PyTorch distributed (one process per device, DTensors, torch.compile).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from functools import partial
from typing import TYPE_CHECKING

from torchtitan_xla.config import JobConfig, attributed, parse_args
from torchtitan_xla.errors import run_main

if TYPE_CHECKING:
    from torchtitan_xla.metrics import StepStats


def main(job_config: JobConfig, *, model_overrides: dict | None = None) -> list[StepStats]:
    """Run the job; returns what was logged at each logging step.

    `model_overrides` replace fields of the flavor's ModelArgs (benchmarks and tests use it to vary
    depth or size without adding flavors)."""
    from torchtitan_xla.goodput import Ledger, so_far
    from torchtitan_xla.utils import GarbageCollection, out_of_memory_as_one_line

    # Where the run's time goes (goodput/): from here, before torch's import.
    ledger = Ledger(time.time())
    # First: Python's automatic collector re-scans every object that torch's import and the model's
    # build create (a quarter of the import's CPU time); the loop collects on its own schedule.
    gc_handler = GarbageCollection(job_config.training.gc_freq)

    from torchtitan_xla import runtime

    # Process-wide switches (XLA: functionalization, its CPU flags) before the first tensor.
    runtime.use(job_config.runtime.backend)
    runtime.configure(job_config.compile.step)

    import torch

    from torchtitan_xla.batch import Batch
    from torchtitan_xla.checkpoint import (
        CheckpointManager,
        Preemption,
        TrainState,
        check_initial_load_path,
        load_initial_weights,
    )
    from torchtitan_xla.checkpoint.hf import match_initial_hf_weights
    from torchtitan_xla.datasets import build_data_loader, build_tokenizer, check_vocab_size
    from torchtitan_xla.errors import ConfigError
    from torchtitan_xla.eval import evaluate, parse_task, write_results
    from torchtitan_xla.float8 import convert_to_float8_training
    from torchtitan_xla.grpo import build_rollouts
    from torchtitan_xla.launch import host_identity, init_host_group
    from torchtitan_xla.logging import init_logger, logger
    from torchtitan_xla.lora import apply_lora, frozen_matmul_params, init_adapters
    from torchtitan_xla.losses import IGNORE_INDEX, build_loss_fn
    from torchtitan_xla.metrics import build_metric_logger, max_rank_loss, num_flops_per_token
    from torchtitan_xla.models import get_model_args, get_model_class, moe_overrides
    from torchtitan_xla.models.llama.attention_kernels import apply_attention_kernel
    from torchtitan_xla.models.llama.moe import inactive_expert_params
    from torchtitan_xla.models.llama.moe_kernels import apply_grouped_mm
    from torchtitan_xla.objectives import build_objective
    from torchtitan_xla.optimizer import (
        NonFiniteGuard,
        build_lr_scheduler,
        build_optimizer,
        optimizer_state_tensors,
        step_with_lr,
    )
    from torchtitan_xla.parallelisms import BATCH_AXES, MESH_AXES, ParallelDims, parallelize_llama
    from torchtitan_xla.parallelisms.compute_dtype import apply_reduce_dtype
    from torchtitan_xla.parallelisms.context_parallel import balance_batches
    from torchtitan_xla.profiling import maybe_enable_profiling
    from torchtitan_xla.reference import build_reference, reference_source
    from torchtitan_xla.routing import Routers
    from torchtitan_xla.storage import check_writable, join, makedirs, write_text
    from torchtitan_xla.utils import set_determinism
    from torchtitan_xla.validate import build_validator, validates_pairs, validation_config

    init_logger()
    logger.info(f"Starting job: {job_config.job.description}")

    # Where the run writes: shown to be writable now, not at the first checkpoint hours later.
    # Each may be a local folder or a gs:// or s3:// URL (storage.py).
    dump_folder = job_config.job.dump_folder
    check_writable(dump_folder, "[job] dump_folder")
    ckpt = job_config.checkpoint
    if ckpt.enable or ckpt.create_seed_checkpoint or ckpt.last_save_in_hf:
        check_writable(join(dump_folder, job_config.checkpoint.folder), "[checkpoint] folder")
    check_initial_load_path(ckpt)  # also when a resume will not read it
    reference_source(job_config)  # dpo, ipo: the reference model's folder exists
    if job_config.eval.at_end and any(t.startswith("generate_until:") for t in job_config.eval.tasks):
        raise ConfigError("[eval] at_end = true: generate_until tasks run from the saved checkpoint "
                          "only, with python -m torchtitan_xla.eval")

    # Devices: one mesh over every device of every host (XLA: SPMD from its first call on; native:
    # the process group of one process per device).
    device = runtime.init_devices(job_config.runtime.device)
    if runtime.PROCESS_PER_DEVICE and runtime.process_index() > 0:
        init_logger(logging.WARNING)  # one process per device: the others say only what goes wrong
    device_type = runtime.device_type()
    parallel_dims = ParallelDims.from_config(job_config.parallelism, runtime.device_count())
    # Which host this is: the runtime's answer, or the launcher's where the runtime cannot know
    # (CPU). Several hosts also share a CPU-side (gloo) group for checkpoints and preemption.
    hosts = host_identity(runtime.process_index(), runtime.process_count(), device_type,
                          per_device=runtime.PROCESS_PER_DEVICE)
    host_rank, host_count = hosts.rank, hosts.count
    process_group = init_host_group(hosts) if host_count > 1 else None
    ledger.record("devices")
    # One writer per job: the first process of the first host.
    ledger.writer = job_config.metrics.goodput and host_rank == 0 and runtime.process_index() == 0
    if host_count > 1 and runtime.process_count() == 1:
        logger.warning(f"{device_type} backend: the {host_count} processes cannot form one "
                       f"mesh; each trains its own replica on its share of the batch (host ids, "
                       f"data shards and the gloo group are real: a launch test, not training)")
    training = job_config.training
    global_batch = (training.global_batch_size if training.global_batch_size > 0
                    else training.local_batch_size * parallel_dims.dp_degree)
    mesh = parallel_dims.build_mesh(device_type)
    # Which block of the batch this process loads: its host's (XLA), or its data-parallel rank's
    # (native: tensor-parallel peers load the same block).
    data_rank, data_count = runtime.data_shard(mesh, BATCH_AXES, hosts)
    accumulation_steps = parallel_dims.check_batch(
        global_batch, training.local_batch_size, training.seq_len, data_count)
    logger.info(f"{runtime.device_count()} {device_type} devices, "
                f"{host_count} host(s); mesh {dict(zip(MESH_AXES, parallel_dims.mesh_shape))}")
    seed = set_determinism(job_config.debug.seed, job_config.debug.deterministic)

    # Tokenizer and data: each host loads its share of the global batch.
    tokenizer = build_tokenizer(job_config.model.tokenizer_path, job_config.model.name)
    # Batches arrive on the mesh, sharded over the batch axes and prefetched in the background;
    # each process holds only its block of the batch dimension. (Context parallel devices take
    # whole sequences, ints, and cut their part of the activations: no gather of key positions.)
    # Load-balanced context parallelism reorders each sequence on the host first.
    input_sharding = runtime.input_sharding(mesh, (BATCH_AXES, None), hosts=data_count)
    # grpo's batches are its rollouts of the policy (grpo/): their prompts and rewards are read and
    # checked now, and they sample once the model is built.
    build_batches = build_rollouts if training.objective == "grpo" else build_data_loader
    data_loader = build_batches(
        job_config, tokenizer, batch_size=global_batch // data_count, host_rank=data_rank,
        host_count=data_count, device=device, input_sharding=input_sharding,
        batch_transform=balance_batches(parallel_dims, training.seq_len))

    # Model: built on the meta device, so no full copy ever exists on the host.
    model_args = get_model_args(job_config.model.name, job_config.model.flavor,
                                **{"vocab_size": tokenizer.n_words, "max_seq_len": training.seq_len,
                                   **moe_overrides(job_config.moe), **(model_overrides or {})})
    # Fine-tuning from HF weights: the same architecture, checked now, and their vocabulary.
    model_args = match_initial_hf_weights(job_config.checkpoint, model_args,
                                          f"{job_config.model.name} {job_config.model.flavor}")
    check_vocab_size(tokenizer, model_args.vocab_size)
    parallel_dims.check_model(model_args.n_heads, model_args.kv_heads, model_args.dim,
                              model_args.ffn_hidden_dim, model_args.num_experts, model_args.n_layers)
    with torch.device("meta"):
        model = get_model_class(job_config.model.name)(model_args)
    logger.info(f"Model {job_config.model.name} {job_config.model.flavor}: {model.num_params():,} "
                f"parameters, vocab {model_args.vocab_size}")
    # Float8 linears replace nn.Linear before parallelize, which finds their weights by name; LoRA
    # freezes the model and adds adapters beside the target weights, under their layers' names.
    convert_to_float8_training(model, job_config.float8)
    apply_lora(model, job_config.lora)
    # Under bf16 autocast: the dtype the weights' gradients are summed across devices in.
    apply_reduce_dtype(model, getattr(torch, training.mixed_precision_reduce))
    # MFU's FLOPs: active parameters only (an MoE token runs top_k of its experts).
    flops_per_token = num_flops_per_token(
        model_args, model.num_params(exclude_embedding=True) - inactive_expert_params(model),
        training.seq_len, frozen=frozen_matmul_params(model))
    apply_attention_kernel(model, job_config.model.attention, mesh, device_type)
    apply_grouped_mm(model, job_config.moe.grouped_mm, mesh, device_type)

    # Materialise on the device. XLA tensors are lazy: nothing is computed or allocated until the
    # sync below, so the shardings given by parallelize apply to the init computation itself.
    # (Native: parameters are DTensors by now, each random one drawn whole and cut, as on one device.)
    model.to_empty(device=device)
    parallelize_llama(model, mesh, parallel_dims, job_config)
    with runtime.initialising():
        model.init_weights()
        init_adapters(model)  # LoRA: A random, B zero, so the adapted model starts as the base model
    model.train()

    optimizer = build_optimizer(model, job_config)
    lr_scheduler = build_lr_scheduler(optimizer, job_config)
    # A step with a non-finite loss or gradient norm leaves everything its update writes as it was
    # (and no checkpoint is saved of weights that are not finite). Its counters, like the
    # optimizer's state, are made by the initialisation's graph, as the step's outputs are.
    nonfinite = NonFiniteGuard(device, skip=training.skip_nonfinite_steps,
                               max_in_a_row=training.max_consecutive_nonfinite)
    runtime.sync()

    # Checkpoints: resume from the newest usable one; otherwise start from initial weights if given.
    train_state = TrainState()
    checkpoint = CheckpointManager(
        job_config, model=model, model_args=model_args, optimizer=optimizer,
        lr_scheduler=lr_scheduler, data_loader=data_loader, train_state=train_state,
        host_rank=host_rank, host_count=host_count, process_group=process_group,
        data_rank=data_rank, data_count=data_count, nonfinite=nonfinite)
    if job_config.checkpoint.create_seed_checkpoint:
        checkpoint.save(0, model_only=True)
        if process_group is not None:
            torch.distributed.destroy_process_group()
        logger.info("Seed checkpoint written; exiting")
        return []
    with ledger.span("restore"):
        if not checkpoint.load() and job_config.checkpoint.initial_load_path:
            load_initial_weights(job_config.checkpoint, model, model_args, mesh, process_group)

    autocast_dtype = torch.bfloat16 if training.mixed_precision_param == "bfloat16" else None
    # The objective (objectives.py) turns the loss function's per-token losses into the step's
    # loss; preference objectives read plain log-probabilities (no label smoothing or z-loss).
    objective = build_objective(job_config, accumulation_steps=accumulation_steps,
                                dp_degree=parallel_dims.dp_degree)
    loss_fn = build_loss_fn(job_config, dp_degree=parallel_dims.dp_degree, autocast_dtype=autocast_dtype,
                            plain=training.objective != "lm")
    if training.objective == "grpo":  # its batches: the policy's own completions, scored (grpo/)
        data_loader.sample_from(model, loss_fn)
    # dpo, ipo, grpo with a KL penalty: each batch's log-probabilities under the frozen reference,
    # in a graph of its own.
    reference = build_reference(job_config, model, loss_fn, tokenizer=tokenizer,
                                on=(device, mesh, parallel_dims)) if objective.needs_reference else None

    # Validation (its data checked now): the plain loss on held-out batches of one microbatch's
    # shape, in its own graph; on held-out pairs, the preference objective and its rewards.
    validator = None
    if job_config.validation.enable:
        val_config = validation_config(job_config)
        val_batch = training.local_batch_size * parallel_dims.dp_degree
        # Held-out pairs: the preference objective of one validation batch, with the reference.
        pairs = validates_pairs(job_config)
        validator = build_validator(
            job_config, model=model,
            loss_fn=build_loss_fn(job_config, dp_degree=parallel_dims.dp_degree,
                                  autocast_dtype=autocast_dtype, plain=True),
            objective=build_objective(job_config, accumulation_steps=1)
            if pairs else None,
            reference=reference if pairs else None,
            make_loader=lambda: build_batches(
                val_config, tokenizer,
                batch_size=val_batch // data_count,
                host_rank=data_rank, host_count=data_count, infinite=False, drop_last=True,
                device=device, input_sharding=input_sharding),
            host_count=data_count)

    # Evaluation after the last step: its task files are read and checked now.
    eval_tasks = [parse_task(spec) for spec in job_config.eval.tasks] if job_config.eval.at_end else []
    if eval_tasks and host_count > 1 and not runtime.PROCESS_PER_DEVICE:
        raise ConfigError("[eval] at_end = true runs on one host only on the XLA runtime; evaluate "
                          "the saved checkpoint with python -m torchtitan_xla.eval")

    # Inputs are all checked by now: the config is shown once it is known to start, and only from
    # here on does the run write anything.
    if job_config.job.print_config:
        logger.info("Effective config:\n" + job_config.to_toml())
    makedirs(dump_folder)
    write_text(join(dump_folder, "config.toml"), job_config.to_toml())
    ledger.open(dump_folder)
    # SIGTERM stops the run after a step every host agrees on, with a checkpoint of that step.
    preemption = Preemption(host_count=host_count, process_group=process_group)
    if job_config.checkpoint.enable:
        preemption.install()

    metric_logger = build_metric_logger(
        job_config, flops_per_token=flops_per_token,
        tokens_per_step=global_batch * training.seq_len, num_devices=parallel_dims.world_size,
        dp_degree=parallel_dims.dp_degree, host_rank=host_rank, device=device,
        float8=job_config.float8.enable_float8_linear)
    trainable = [p for p in model.parameters() if p.requires_grad]
    # MoE: router losses weighted like the loss, their statistics logged, DeepSeek-V3's expert
    # bias moved after each update (routing.py).
    routers = Routers(model, job_config.moe, accumulation_steps, optimizer)
    updated = [*trainable, *optimizer_state_tensors(optimizer), *routers.state]

    # On the native runtime's whole-step compile these are its compiled programs: each
    # microbatch's forward and loss (its backward is the same graph's, run by `backward()`), and
    # the update with everything the log line reads. Elsewhere they run as written.
    @partial(runtime.region, job_config.compile.step)
    def forward_loss(mb: Batch, totals):
        token_losses = loss_fn(model, mb.inputs, mb.labels, *mb.packing)
        routers.observe()
        mb_loss, mb_metrics = objective(token_losses, mb, totals)
        # The loss alone carries gradients out; copies, since AOTAutograd still expects gradients
        # for a detached view of an intermediate.
        detached = [None if t is None else t.detach().clone() for t in (mb_metrics, token_losses)]
        return mb_loss, *detached

    # (Two graphs: the optimizer's own kernel runs between them, optimizer/__init__.py.)
    @partial(runtime.region, job_config.compile.step)
    def update(lrs: torch.Tensor, loss, metrics, rank_token_losses, rank_counted) -> torch.Tensor:
        grads = [p.grad for p in trainable if p.grad is not None]
        grad_norm = runtime.kernels.total_norm(grads)  # over sharded gradients
        if training.max_norm > 0:  # torch's clip_grads_with_norm_, whose grouping dynamo cannot trace
            scale = (training.max_norm / (grad_norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale)
        loss_and_norm = torch.stack(runtime.whole([loss, grad_norm.detach()]))
        nonfinite.update(loss_and_norm.isfinite().all(), updated, lambda: step_with_lr(optimizer, lrs),
                         optimizer)
        max_loss = max_rank_loss(torch.cat(rank_token_losses, dim=1),
                                 torch.cat(rank_counted, 1) if rank_counted else None)
        stats = [loss_and_norm, torch.stack([*runtime.whole([max_loss]), *nonfinite.state])]
        if objective.metric_names:
            stats += runtime.whole([metrics])
        router_stats = routers.stats()
        return torch.cat(stats if router_stats is None else [*stats, *runtime.whole([router_stats])])

    def train_step(lrs: torch.Tensor, batch: Batch) -> torch.Tensor:
        """One optimizer step on the batch (its tensors by name: batch.py); returns everything the
        log line needs from the device, as one tensor: one transfer per log step."""
        model.zero_grad(set_to_none=True)  # (an offloaded optimizer's own parameters are host copies)
        # The objective's normaliser over the whole step (all microbatches and ranks): the loss is
        # the step's, not a mean of microbatch means (chat batches mask different numbers of labels).
        totals = objective.totals(batch)
        loss, metrics, rank_token_losses, rank_counted = 0.0, 0.0, [], []
        routers.start()
        # Every microbatch spans all data-parallel ranks in the same order: [dp ranks, ...].
        for mb in batch.microbatches(parallel_dims.dp_degree, accumulation_steps):
            mb_loss, mb_metrics, token_losses = forward_loss(mb, totals)
            mb_loss.backward()
            loss = loss + mb_loss.detach()
            if mb_metrics is not None:
                metrics = metrics + mb_metrics
            rank_token_losses.append(token_losses)
            if batch.packed:
                rank_counted.append((mb.labels != IGNORE_INDEX).view(parallel_dims.dp_degree, -1,
                                                                      mb.labels.shape[-1]))
        return update(lrs, loss, metrics, rank_token_losses, rank_counted)

    # One graph per step: any host sync inside (e.g. a stray .item()) is an error, not a silent
    # graph break. With `replay` the graph is traced at the first two steps and then replayed, so
    # everything the step reads and writes must be on the device: the batch, the lr, this state.
    compiled_step = runtime.build_step(
        job_config.compile.step, train_step,
        [*model.parameters(), *model.buffers(), *optimizer_state_tensors(optimizer), *nonfinite.state])

    data_iterator = iter(data_loader)
    first_step = train_state.step + 1
    compile_guard = runtime.CompileGuard(first_step, job_config.debug.on_recompile)
    history: list[StepStats] = []
    goodput_freq = job_config.metrics.goodput_freq if ledger.writer else 0
    logger.info(f"Training steps {first_step}..{training.steps}, global batch {global_batch} x "
                f"{training.seq_len} tokens ({accumulation_steps} accumulation step(s)), seed {seed}, "
                f"{job_config.compile.step} step")
    metric_logger.reset_timer(train_state.step)
    ledger.record("ready", step=first_step)
    steps_done = lambda: train_state.step - first_step + 1  # noqa: E731 (this run's, so far)
    with (maybe_enable_profiling(job_config) as profiler,
          out_of_memory_as_one_line(steps_done, runtime.checkpointing.is_out_of_memory)):
        for step in range(first_step, training.steps + 1):
            if profiler is not None:
                profiler.step(step)
            gc_handler.run(step)
            step_start, compile_start = time.time(), runtime.compile_stats()[1]
            batch = Batch.of(next(data_iterator))
            data_wait = time.time() - step_start
            metric_logger.add_data_wait(data_wait)
            if reference is not None:  # its own graph; the step reads its result as data
                batch = batch.replace(reference_logps=reference(batch))
            # Every group's lr as one device tensor: the step reads it as data.
            lrs = lr_scheduler.get_last_lr()
            step_stats = compiled_step(torch.tensor(lrs, device=device), batch)
            lr = lrs[0]
            lr_scheduler.step()
            compile_guard.check(step)

            validating = validator is not None and validator.due(step)
            # Agreed before the save decision, so that every host saves the same step or none.
            stopping = job_config.checkpoint.enable and preemption.agreed_stop()
            saving = checkpoint.should_save(step, training.steps, stopping=stopping)
            logging_step = (step == first_step or step % job_config.metrics.log_freq == 0
                            or step == training.steps or validating)
            if logging_step or saving:
                # The one host transfer per log or checkpoint step; it waits for this step to finish.
                loss, grad_norm, max_loss, nonfinite_steps, in_a_row, *rest = step_stats.tolist()
                named, router = rest[:len(objective.metric_names)], rest[len(objective.metric_names):]
                if logging_step:
                    history.append(metric_logger.log(
                        step, loss, grad_norm, lr, max_loss, tuple(router) or None,
                        nonfinite_steps=nonfinite_steps,
                        objective=dict(zip(objective.metric_names, named)) | data_loader.metrics() or None))
                nonfinite.check(step, in_a_row)  # too many in a row: one line, before any save
            ledger.record("step", step=step, start=step_start, end=time.time(), data=data_wait,
                          compile=runtime.compile_stats()[1] - compile_start)
            if goodput_freq and step % goodput_freq == 0:
                metric_logger.emit(so_far(ledger).scalars(), step)
            if validating:
                # Its graph compiles at its first two calls, and never again (the guard checks).
                with (compile_guard.allowed() if validator.warming_up else contextlib.nullcontext(),
                      ledger.span("other", what="validation")):
                    result = validator.run()
                metric_logger.log_validation(step, result)
                history[-1].validation_loss = result.loss
                history[-1].validation_metrics = result.metrics or None

            train_state.step = step
            if saving:
                model_only = step == training.steps and job_config.checkpoint.last_save_model_only
                with compile_guard.allowed():  # saving compiles small transfer graphs
                    blocked = checkpoint.save(step, model_only=model_only)
                ledger.record("save", step=step, seconds=blocked)
            if stopping:
                logger.warning(f"Preempted: stopped after step {step}; re-run the same command to resume")
                break
    if ledger.writer:
        metric_logger.emit(so_far(ledger).scalars(), train_state.step)
    metric_logger.close()
    data_loader.close()

    checkpoint.close()
    if eval_tasks and train_state.step == training.steps:
        # Every process builds the same batches of requests, each device scores its block.
        results = evaluate(model, tokenizer, job_config, eval_tasks, dp_degree=parallel_dims.dp_degree,
                           device=device, sharding=runtime.input_sharding(mesh, (BATCH_AXES, None)),
                           progress=host_rank == 0 and sys.stderr.isatty())
        if host_rank == 0:
            write_results(results, join(dump_folder, job_config.eval.output_file))
    if job_config.checkpoint.last_save_in_hf and train_state.step == training.steps:
        checkpoint.export_hf(train_state.step, tokenizer)
    if process_group is not None:
        torch.distributed.destroy_process_group()
    ledger.close(train_state.step)
    logger.info(f"Training completed: {runtime.compile_stats()[0]} compiles in total")
    return history


def cli() -> None:
    job_config = parse_args()
    with attributed(job_config):  # an error names the file or flag that set its key
        main(job_config)


if __name__ == "__main__":
    sys.exit(run_main(cli))
