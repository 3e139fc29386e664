"""Distributed checkpoints that never lose a run.

Layout (torchtitan's): `<dump_folder>/<checkpoint.folder>/step-<N>/`, a torch.distributed.checkpoint
(DCP) directory written with torch_xla's SPMD planners, so every host writes only its own shards
and a checkpoint loads onto any mesh (resharding). It holds the model, the optimizer, the LR
schedule, each host's data-loader state, the train step and RNG states.

Safety:
- Steps are committed (commit.py): a process killed mid-save leaves the previous checkpoint as the
  newest one, and `keep_latest_k` deletes old ones only after a newer one is committed. The same
  on a local folder and on gs:// or s3:// (storage.py).
- A checkpoint that fails to load is reported in one line naming it; the run falls back to the
  previous one (or stops, with `on_damaged = "error"`). It never silently starts from scratch.
- A save that cannot be written (a full disk) stops the run in one line, exit code 1; its
  uncommitted folder is deleted and older checkpoints are kept.
- SIGTERM finishes the current step, saves it on every host, and exits 0 (preemption.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pickle
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from torchtitan_xla import runtime, storage
from torchtitan_xla.checkpoint import commit
from torchtitan_xla.checkpoint.commit import LORA_FILE, MODEL_ARGS_FILE, DamagedCheckpoint
from torchtitan_xla.config import JobConfig
from torchtitan_xla.errors import ConfigError, RunError, first_line
from torchtitan_xla.logging import logger

if TYPE_CHECKING:
    from torchtitan_xla.optimizer.nonfinite import NonFiniteGuard


@dataclass
class TrainState:
    """The loop's own state: the last completed step."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "torch_rng": torch.get_rng_state(), "xla_rng": runtime.rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        runtime.set_rng_state(state["xla_rng"])


def _loader_key(host_rank: int) -> str:
    return f"dataloader/host_{host_rank}"


def _saved_metadata(path: str) -> dict[str, Any]:
    """The checkpoint step's DCP metadata: each saved key and its tensor's size."""
    try:
        return commit.reader(path).read_metadata().state_dict_metadata
    except Exception as e:
        raise DamagedCheckpoint(f"metadata unreadable: {type(e).__name__}") from None


def dcp_load(states: dict[str, Any], path: str, process_group) -> None:
    """Load `path` in place into the (sharded) tensors of `states`, which must be materialised
    (`runtime.materialise()`, outside the caller's try: a device error is not a damaged file)."""
    import torch.distributed.checkpoint as dcp

    commit.quiet_dcp()
    with torch.no_grad():
        dcp.load(states, storage_reader=commit.reader(path),
                 planner=runtime.checkpointing.load_planner(), process_group=process_group)


class CheckpointManager:
    def __init__(self, job_config: JobConfig, *, model: torch.nn.Module, model_args, optimizer,
                 lr_scheduler, data_loader, train_state: TrainState, host_rank: int = 0,
                 host_count: int = 1, process_group=None, data_rank: int | None = None,
                 data_count: int | None = None, nonfinite: NonFiniteGuard | None = None):
        self.cfg = job_config.checkpoint
        self.model_args = model_args
        # The [lora] settings, saved beside the weights: exports merge or rename the adapters.
        self.lora = dataclasses.asdict(job_config.lora) if job_config.lora.rank else None
        self.initial_hf = self.cfg.initial_load_path if self.cfg.initial_load_in_hf else ""
        self.enabled = self.cfg.enable or self.cfg.create_seed_checkpoint
        self.folder = storage.join(job_config.job.dump_folder, self.cfg.folder)
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.data_loader, self.train_state = data_loader, train_state
        self.host_rank, self.host_count = host_rank, host_count
        # Whose data-loader state this process saves: its block of the batch (its host's on XLA,
        # its data-parallel rank's on the native runtime, where tensor-parallel peers share one).
        self.data_rank = host_rank if data_rank is None else data_rank
        self.data_count = host_count if data_count is None else data_count
        self.process_group = process_group
        self.nonfinite = nonfinite
        self._executor = ThreadPoolExecutor(max_workers=1) if self.cfg.async_mode == "async" else None
        # Writes use their own process group: an async write's collectives run in a background
        # thread and must not interleave with the loop's (the per-step preemption agreement).
        self._write_group = process_group
        if self._executor is not None and host_count > 1 and self.enabled:
            import torch.distributed as dist

            self._write_group = dist.new_group(backend="gloo")
        self._pending: Future | None = None
        if self._executor is not None and self.cfg.enable:
            self._rehearse_snapshot()

    def _rehearse_snapshot(self) -> None:
        """Make one device snapshot of the state at start and drop it. A device that cannot hold
        even the copy async saves need then fails before the first step, not hours later (whether
        the step also fits beside the copy still shows only at the first save); and the first save
        does not pay for memory the process never touched (docs/performance.md)."""
        start = time.perf_counter()
        try:
            runtime.checkpointing.device_snapshot(self._states(model_only=False))
        except RuntimeError as e:
            if not runtime.checkpointing.is_out_of_memory(e):
                raise
            raise ConfigError(
                "[checkpoint] async_mode = \"async\" needs device memory for a second copy of the "
                "state, and a trial copy did not fit; use async_mode = \"disabled\" (device said: "
                f"{first_line(e, typed=False, limit=200)})") from None
        logger.info(f"Checkpoint: async saves snapshot the state on the device; a trial snapshot "
                    f"fits ({time.perf_counter() - start:.2f}s)")

    # ---- what is saved ----------------------------------------------------------------------

    def _states(self, model_only: bool) -> dict[str, Any]:
        # keep_vars: the parameters themselves. A detached copy loses torch_xla's record of its
        # sharding, and would be gathered whole and written by one host instead of shard-wise.
        states: dict[str, Any] = {"model": self.model.state_dict(keep_vars=True)}
        if model_only:
            return states
        states["optimizer"] = self.optimizer.state_dict()
        states["lr_scheduler"] = self.lr_scheduler.state_dict()
        states["train_state"] = self.train_state.state_dict()
        # Each host saves its own loader state (hosts read different data), pickled, under a
        # top-level key of its own: of a key several hosts write DCP keeps one copy, and torch_xla's
        # planner stores a dict without tensors as one key. The host count is checked on load.
        states[_loader_key(self.data_rank)] = pickle.dumps(self.data_loader.state_dict())
        return states

    # ---- saving -----------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int, *, stopping: bool = False) -> bool:
        """At every `interval`, after the last step, and when the run stops early (preempted:
        every host passes the same `stopping`)."""
        if not self.cfg.enable:
            return False
        return step % self.cfg.interval == 0 or step == last_step or stopping

    def save(self, step: int, *, model_only: bool = False) -> float:
        """Save the state after `step` (only the weights, in export_dtype, with `model_only`);
        returns the seconds the training loop was blocked."""
        start = time.perf_counter()
        if not self._weights_finite(f"checkpoint step-{step}"):
            return time.perf_counter() - start
        waiting = time.perf_counter()
        self.wait()  # one save at a time; time spent here counts as blocked
        waited_s = time.perf_counter() - waiting
        states = self._states(model_only)
        if model_only and self.cfg.export_dtype != "float32":
            dtype = getattr(torch, self.cfg.export_dtype)
            states["model"] = {k: v.to(dtype) for k, v in states["model"].items()}
        if self._executor is None:
            runtime.materialise()
            self._write(step, runtime.checkpointing.host_copy(states), model_only)
        else:
            # Only the device-side snapshot blocks the loop; the copy to host memory and the
            # write run in the background while training continues.
            snapshot = [runtime.checkpointing.device_snapshot(states)]
            self._pending = self._executor.submit(self._write_snapshot, step, snapshot, model_only)
        blocked = time.perf_counter() - start
        # Waiting means saves come faster than they are written: the interval is too short.
        waited = f", of which {waited_s:.2f}s waiting for the previous save" if waited_s >= 0.01 else ""
        logger.info(f"Checkpoint step-{step}: {'staged' if self._executor else 'saved'}"
                    f"{' (model only)' if model_only else ''}, loop blocked {blocked:.2f}s{waited}")
        return blocked

    def _weights_finite(self, what: str) -> bool:
        """Whether every weight is finite; if not, `what` is not written (and said so): a
        checkpoint of NaN weights would be the newest, and keep_latest_k would delete good ones.
        Counted (a graph of its own) only once a step was not finite: until then every update was
        of a finite loss and gradient, and the weights are as finite as those loaded."""
        if self.nonfinite is not None and not self.nonfinite.seen():
            return True
        counts = [(~p.detach().isfinite()).sum() for p in self.model.parameters()]
        bad = int(torch.stack(runtime.whole(counts)).sum().item())
        if bad:
            steps = commit.committed_steps(self.folder)
            newest = f"step-{steps[-1]} stays the newest checkpoint" if steps else "there is no checkpoint"
            logger.error(f"{what} not written: {bad:,} weights are NaN or inf; {newest}")
        return not bad

    def _write_snapshot(self, step: int, snapshot: list[dict[str, Any]], model_only: bool) -> None:
        start = time.perf_counter()
        # Popped, so the device copy is freed as soon as the host has its own, not after the
        # (longer) disk write.
        staged = runtime.checkpointing.host_copy(snapshot.pop())
        logger.info(f"Checkpoint step-{step}: copied to host memory in {time.perf_counter() - start:.2f}s")
        self._write(step, staged, model_only)

    def _write(self, step: int, states: dict[str, Any], model_only: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        from torchtitan_xla.checkpoint.hf import model_args_to_json

        start = time.perf_counter()
        path = commit.step_folder(self.folder, step)
        try:
            if self.host_rank == 0:
                commit.begin(path)  # an earlier save of this step, or one killed midway
            self._barrier()
            commit.quiet_dcp()
            dcp.save(states, storage_writer=commit.writer(path),
                     planner=runtime.checkpointing.save_planner(), process_group=self._write_group)
            if self.host_rank == 0:
                # What the weights are, so converters need neither the config nor the tokenizer.
                storage.write_text(storage.join(path, MODEL_ARGS_FILE), model_args_to_json(self.model_args))
                if self.lora is not None:
                    storage.write_text(storage.join(path, LORA_FILE), json.dumps(self.lora, indent=1))
                record = commit.write_commit(path, step, sorted(states))
        except (Exception, CheckpointException) as e:  # every host gets the same exception
            if self.host_rank == 0:
                with contextlib.suppress(Exception):  # a full disk needs the space back
                    commit.delete_step(path)
            steps = []
            with contextlib.suppress(Exception):  # the store itself may be what failed
                steps = commit.committed_steps(self.folder)
            newest = f"step-{steps[-1]} is the newest checkpoint" if steps else "no checkpoint was written"
            raise RunError(f"checkpoint step-{step} could not be written in {self.folder}: "
                           f"{commit.dcp_failure(e)}; {newest}") from None
        if self.host_rank == 0:
            commit.purge(self.folder, self.cfg.keep_latest_k)
            size = sum(record["files"].values())
            seconds = time.perf_counter() - start
            logger.info(f"Checkpoint step-{step} written: {size / 1e9:.3f} GB in {seconds:.2f}s "
                        f"({size / 1e9 / seconds:.2f} GB/s)")
        self._barrier()

    def export_hf(self, step: int, tokenizer) -> str | None:
        """HuggingFace weights, config.json and tokenizer of the current model, in export_dtype;
        with LoRA, merged, and the adapters alone as a PEFT folder <folder>/step-<N>-peft."""
        from torchtitan_xla.checkpoint.hf import export_hf, export_peft, gather_state_dict

        if not self._weights_finite(f"HuggingFace export step-{step}"):
            return None
        if self.host_count > 1 and not runtime.PROCESS_PER_DEVICE:
            logger.warning("last_save_in_hf: with several hosts, convert the saved checkpoint with "
                           "scripts/convert_to_hf.py instead (one host cannot gather every shard)")
            return None
        # With a process per device (native) all gather every parameter, process 0 writes.
        state = gather_state_dict(self.model, keep=self.host_rank == 0)
        if self.host_rank != 0:
            return None
        out, dtype = storage.join(self.folder, f"step-{step}-hf"), getattr(torch, self.cfg.export_dtype)
        with storage.local_folder(out) as local:
            export_hf(state, self.model_args, local, dtype=dtype, tokenizer=tokenizer, lora=self.lora)
        logger.info(f"HuggingFace export written to {out}" + (" (LoRA merged)" if self.lora else ""))
        if self.lora is not None:
            peft_out = storage.join(self.folder, f"step-{step}-peft")
            with storage.local_folder(peft_out) as local:
                export_peft(state, self.model_args, self.lora, local, dtype=dtype,
                            base_model=self.initial_hf)
            logger.info(f"PEFT adapter written to {peft_out}")
        return out

    def wait(self) -> None:
        """Block until a pending asynchronous save is on disk (re-raising its error)."""
        if self._pending is not None:
            self._pending.result()
            self._pending = None

    def close(self) -> None:
        self.wait()
        if self._executor is not None:
            self._executor.shutdown()

    def _barrier(self) -> None:
        if self.host_count > 1:
            import torch.distributed as dist

            dist.barrier(group=self._write_group)

    # ---- loading ----------------------------------------------------------------------------

    def load(self) -> bool:
        """Resume from the newest usable checkpoint (or `load_step`); False if there is none."""
        steps = commit.committed_steps(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise ConfigError(f"[checkpoint] load_step = {self.cfg.load_step}: no committed "
                                  f"checkpoint step-{self.cfg.load_step} in {self.folder}")
            steps = [self.cfg.load_step]
        for step in reversed(steps):
            path = commit.step_folder(self.folder, step)
            start = time.perf_counter()
            try:
                self._load(path)
            except DamagedCheckpoint as e:
                older = [s for s in steps if s < step]
                if self.cfg.on_damaged == "error" or not older:
                    raise ConfigError(f"checkpoint {path} is damaged: {e}"
                                      + ("" if older else "; no older checkpoint to fall back to")) from None
                logger.error(f"checkpoint {path} is damaged: {e}; falling back to step-{older[-1]}")
                continue
            size = sum(commit.verify(path)["files"].values())
            seconds = time.perf_counter() - start
            logger.info(f"Resumed from {path} (step {self.train_state.step}): {size / 1e9:.3f} GB "
                        f"in {seconds:.2f}s ({size / 1e9 / seconds:.2f} GB/s)")
            return True
        return False

    def _load(self, path: str) -> None:
        from torch.distributed.checkpoint.api import CheckpointException

        record = commit.verify(path)
        contents = set(record["contents"])
        exclude = set(self.cfg.exclude_from_loading)
        model_only = contents == {"model"}
        states = self._states(model_only=model_only)
        loader_key = _loader_key(self.data_rank)
        for key in exclude:
            states.pop(loader_key if key == "dataloader" else key, None)
        saved = _saved_metadata(path)
        mismatch = commit.model_mismatch(saved, states.get("model", {}))
        if mismatch:  # another flavor or [lora] / [moe] settings wrote it: not damaged, no fallback
            raise ConfigError(f"[checkpoint] folder: {path} holds another model's weights ({mismatch}); "
                              f"resume with the config that wrote it, or start in a new [job] dump_folder")
        if loader_key in states:
            saved_hosts = sum(k.startswith("dataloader/host_") for k in saved)
            if saved_hosts != self.data_count and self.data_loader.reshardable:
                # Every rank's state counts the same global batches: rank 0's continues any layout.
                states[_loader_key(0)] = states.pop(loader_key)
                loader_key = _loader_key(0)
            elif saved_hosts != self.data_count:
                raise ConfigError(
                    f"checkpoint {path}: its data-loader state was saved by {saved_hosts} host(s), "
                    f"this run loads data on {self.data_count}; add dataloader to "
                    f"[checkpoint] exclude_from_loading to restart the data from the beginning")
        # The tensors loaded into may still be in flight (the initial weights' computation runs
        # asynchronously): torch_xla's load planner needs their data.
        runtime.materialise()
        try:
            dcp_load(states, path, self.process_group)
        except (Exception, CheckpointException) as e:  # a truncated or garbled file, in many ways
            raise DamagedCheckpoint(commit.dcp_failure(e)) from None
        self.model.load_state_dict(states["model"])
        if model_only:
            # A seed or exported checkpoint: weights only, training starts at its step.
            self.train_state.step = record["step"]
            return
        if "optimizer" in states:
            # How this process runs the update (capturable on an XLA device, not on the CPU) is
            # its own, whichever runtime saved the state.
            how = [{k: g[k] for k in ("capturable", "foreach", "fused") if k in g}
                   for g in self.optimizer.param_groups]
            self.optimizer.load_state_dict(states["optimizer"])
            for group, kept in zip(self.optimizer.param_groups, how):
                group.update(kept)
        if "lr_scheduler" in states:
            self.lr_scheduler.load_state_dict(states["lr_scheduler"])
        if "train_state" in states:
            self.train_state.load_state_dict(states["train_state"])
        else:
            self.train_state.step = record["step"]
        if loader_key in states:
            self.data_loader.load_state_dict(pickle.loads(states[loader_key]))
