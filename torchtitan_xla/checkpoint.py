"""Distributed checkpoints that never lose a run.

Layout (torchtitan's): `<dump_folder>/<checkpoint.folder>/step-<N>/`, a torch.distributed.checkpoint
(DCP) directory written with torch_xla's SPMD planners, so every host writes only its own shards
and a checkpoint loads onto any mesh (resharding). It holds the model, the optimizer, the LR
schedule, each host's data-loader state, the train step and RNG states.

Safety:
- A checkpoint is written into `step-<N>.partial`, then a commit file (`COMMITTED`, listing every
  file and its size) is written, then the folder is renamed to `step-<N>`. Only folders with a
  commit file whose files are all present with the recorded sizes count as checkpoints, so a
  process killed mid-save leaves the previous checkpoint as the newest one.
- A checkpoint that fails to load is reported in one line naming it; the run falls back to the
  previous one (or stops, with `on_damaged = "error"`). It never silently starts from scratch.
- A save that cannot be written (a full disk) stops the run in one line, exit code 1; its partial
  folder is deleted and older checkpoints are kept.
- `keep_latest_k` deletes old checkpoints only after a newer one is committed.
- SIGTERM (Cloud TPU preemption) finishes the current step, saves, and exits 0.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from torchtitan_xla.config_manager import ConfigError, JobConfig, RunError
from torchtitan_xla.logging import logger

COMMIT_FILE = "COMMITTED"
MODEL_ARGS_FILE = "model_args.json"
_PARTIAL = ".partial"


@dataclass
class TrainState:
    """The loop's own state: the last completed step."""

    step: int = 0

    def state_dict(self) -> dict[str, Any]:
        import torch_xla.core.xla_model as xm

        return {"step": self.step, "torch_rng": torch.get_rng_state(), "xla_rng": xm.get_rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        import torch_xla.core.xla_model as xm

        self.step = int(state["step"])
        torch.set_rng_state(state["torch_rng"])
        xm.set_rng_state(int(state["xla_rng"]))


class DamagedCheckpoint(Exception):
    pass


def _save_planner():
    """torch_xla's SPMD save planner, with one fix.

    For a partially replicated tensor (replicated over some mesh axis: every parameter under HSDP,
    the norms under FSDP x TP) a host's plan lists each chunk once per replica. torch's
    `dedup_tensors` then drops *every* copy of a chunk listed twice in one plan, and the tensor is
    silently missing from the checkpoint (torch_xla 2.9 + torch 2.9, found by the FSDP x TP resume
    test). Keeping one write item per chunk per host fixes it; across hosts torch keeps one."""
    import dataclasses

    import torch_xla.experimental.distributed_checkpoint as xc

    class SavePlanner(xc.SPMDSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            seen, items = set(), []
            for item in plan.items:
                key = (item.index.fqn, None if item.index.offset is None else tuple(item.index.offset))
                if key not in seen:
                    seen.add(key)
                    items.append(item)
            return dataclasses.replace(plan, items=items)

    return SavePlanner()


def _writer(path: Path):
    import torch.distributed.checkpoint as dcp

    # per_thread_copy_ahead=0: the overlapping loader asks the device module for CUDA-style
    # streams, which XLA tensors do not have (the state is on the host by then anyway).
    return dcp.FileSystemWriter(str(path), per_thread_copy_ahead=0)


def _step_of(path: Path) -> int | None:
    name = path.name
    if not name.startswith("step-") or not name[5:].isdigit():
        return None
    return int(name[5:])


def committed_steps(folder: Path) -> list[int]:
    """Steps with a committed checkpoint folder, ascending (integrity is checked on load)."""
    if not folder.is_dir():
        return []
    steps = [_step_of(p) for p in folder.iterdir() if (p / COMMIT_FILE).is_file()]
    return sorted(s for s in steps if s is not None)


def _write_commit(path: Path, step: int, contents: list[str]) -> None:
    files = {str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file()}
    record = {"step": step, "contents": contents, "files": files, "time": time.time()}
    tmp = path / (COMMIT_FILE + ".tmp")
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, path / COMMIT_FILE)


def verify(path: Path) -> dict[str, Any]:
    """The commit record, after checking every listed file exists with its recorded size."""
    try:
        record = json.loads((path / COMMIT_FILE).read_text())
    except (OSError, ValueError) as e:
        raise DamagedCheckpoint(f"unreadable {COMMIT_FILE} ({e})") from None
    for name, size in record["files"].items():
        f = path / name
        if not f.is_file():
            raise DamagedCheckpoint(f"missing file {name}")
        if f.stat().st_size != size:
            raise DamagedCheckpoint(f"{name} has {f.stat().st_size} bytes, {size} were written")
    return record


def _first_failure(e: BaseException) -> str:
    """One line for a failed DCP load or save. DCP wraps each rank's error in a
    CheckpointException, a BaseException whose own text is a traceback: report the first wrapped
    error instead; or the OSError under it, which a user can act on (torch.save reports a full
    disk as "unexpected pos 704 vs 598", raised while handling the OSError)."""
    if isinstance(e, CheckpointException) and e.failures:
        e = next(iter(e.failures.values()))[0]
    cause = e
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    e = cause or e
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first}"[:300]


def _materialise() -> None:
    """Run every pending computation (the step, the snapshot, the initial weights) and wait for it."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()


def _host_copy(states: dict[str, Any]) -> dict[str, Any]:
    """`states` (materialised) with this host's shards of every XLA tensor copied to host memory
    in one batch (torch_xla's helper for async checkpointing), so writing needs no device access.

    Safe on a background thread while the loop traces and runs the next step, because it only
    transfers buffers: sharded tensors shard by shard, replicated ones from their first copy. It
    must stay that way (torch_xla 2.9, FSDP x TP on 8 devices, write overlapping later steps): a
    sync on the writer thread broke the training thread's step in 3 of 11 runs ("Check failed:
    tensor_data" while tracing), and whole-tensor transfers of sharded tensors compiled gather
    graphs there in 6 of 6 (caught by the loop's recompile check)."""
    from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

    return _sharded_cpu_state_dict(states)


def _device_snapshot(states: dict[str, Any]) -> dict[str, Any]:
    """A copy of `states` the training loop cannot change: every XLA tensor cloned into new device
    buffers (XLA keeps each one's sharding, so every host still writes only its own shards),
    every host tensor cloned (a host tensor could be changed in place by the loop), the
    containers rebuilt.

    Why copy on the device: each step donates the buffers of the parameters and the optimizer
    state to its outputs, so the step-N buffers stop existing while step N+1 runs; a copy to the
    host, the alternative, blocks for the whole transfer. The clone costs one memcpy of the state
    on the device (at HBM bandwidth on a TPU) and holds a second copy of it in device memory until
    the background thread has moved it to the host."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, spec = tree_flatten(states)
    with torch.no_grad():
        copies = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in flat]
    # A clone is lazy: until materialised it still reads the original's buffer, which the next
    # step donates. This makes the copies (and fails here if the device cannot hold them).
    _materialise()
    return tree_unflatten(copies, spec)


# How an allocation failure reads: XLA's CPU client, and the TPU runtime's RESOURCE_EXHAUSTED.
_OUT_OF_MEMORY = ("Out of memory", "RESOURCE_EXHAUSTED", "Ran out of memory")


def _loader_key(host_rank: int) -> str:
    return f"dataloader/host_{host_rank}"


def _saved_loader_hosts(path: Path) -> int:
    """How many hosts saved a data-loader state into this checkpoint step."""
    import torch.distributed.checkpoint as dcp

    try:
        keys = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    except Exception as e:
        raise DamagedCheckpoint(f"metadata unreadable: {type(e).__name__}") from None
    return sum(k.startswith("dataloader/host_") for k in keys)


class CheckpointManager:
    def __init__(self, job_config: JobConfig, *, model: torch.nn.Module, model_args, optimizer,
                 lr_scheduler, data_loader, train_state: TrainState, host_rank: int = 0,
                 host_count: int = 1, process_group=None):
        self.cfg = job_config.checkpoint
        self.model_args = model_args
        self.enabled = self.cfg.enable or self.cfg.create_seed_checkpoint
        self.folder = Path(job_config.job.dump_folder) / self.cfg.folder
        self.model, self.optimizer, self.lr_scheduler = model, optimizer, lr_scheduler
        self.data_loader, self.train_state = data_loader, train_state
        self.host_rank, self.host_count = host_rank, host_count
        self.process_group = process_group
        self._executor = ThreadPoolExecutor(max_workers=1) if self.cfg.async_mode == "async" else None
        # Writes use their own process group: an async write's collectives run in a background
        # thread and must not interleave with the loop's (the per-step preemption agreement).
        self._write_group = process_group
        if self._executor is not None and host_count > 1 and self.enabled:
            import torch.distributed as dist

            self._write_group = dist.new_group(backend="gloo")
        self._pending: Future | None = None
        self._preempted = threading.Event()
        if self._executor is not None and self.cfg.enable:
            self._rehearse_snapshot()

    def _rehearse_snapshot(self) -> None:
        """Make one device snapshot of the state at start and drop it. A device that cannot hold
        even the copy async saves need then fails before the first step, not hours later (whether
        the step also fits beside the copy, which it must while the background thread moves the
        copy to the host, still shows only at the first save); and the first save does not pay for
        memory the process never touched (on the XLA CPU backend that made the first save block
        the loop ~10x longer than later ones: docs/performance.md)."""
        start = time.perf_counter()
        try:
            _device_snapshot(self._states(model_only=False))
        except RuntimeError as e:
            if not any(m in str(e) for m in _OUT_OF_MEMORY):
                raise
            raise ConfigError(
                "[checkpoint] async_mode = \"async\" needs device memory for a second copy of the "
                "state, and a trial copy did not fit; use async_mode = \"disabled\" (device said: "
                f"{str(e).strip().splitlines()[0][:200]})") from None
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
        states[_loader_key(self.host_rank)] = pickle.dumps(self.data_loader.state_dict())
        return states

    # ---- saving -----------------------------------------------------------------------------

    def should_save(self, step: int, last_step: int) -> bool:
        if not self.cfg.enable:
            return False
        return step % self.cfg.interval == 0 or step == last_step or self._preempted.is_set()

    def save(self, step: int, *, model_only: bool = False) -> float:
        """Save the state after `step` (only the weights, in export_dtype, with `model_only`);
        returns the seconds the training loop was blocked."""
        start = time.perf_counter()
        self.wait()  # one save at a time; time spent here counts as blocked
        waited_s = time.perf_counter() - start
        states = self._states(model_only)
        if model_only and self.cfg.export_dtype != "float32":
            dtype = getattr(torch, self.cfg.export_dtype)
            states["model"] = {k: v.to(dtype) for k, v in states["model"].items()}
        if self._executor is None:
            _materialise()
            self._write(step, _host_copy(states), model_only)
        else:
            # Only the device-side snapshot blocks the loop; the copy to host memory and the
            # write run in the background while training continues.
            snapshot = [_device_snapshot(states)]
            self._pending = self._executor.submit(self._write_snapshot, step, snapshot, model_only)
        blocked = time.perf_counter() - start
        # Waiting means saves come faster than they are written: the interval is too short.
        waited = f", of which {waited_s:.2f}s waiting for the previous save" if waited_s >= 0.01 else ""
        logger.info(f"Checkpoint step-{step}: {'staged' if self._executor else 'saved'}"
                    f"{' (model only)' if model_only else ''}, loop blocked {blocked:.2f}s{waited}")
        return blocked

    def _write_snapshot(self, step: int, snapshot: list[dict[str, Any]], model_only: bool) -> None:
        start = time.perf_counter()
        # Popped, so the device copy is freed as soon as the host has its own, not after the
        # (longer) disk write.
        staged = _host_copy(snapshot.pop())
        logger.info(f"Checkpoint step-{step}: copied to host memory in {time.perf_counter() - start:.2f}s")
        self._write(step, staged, model_only)

    def _write(self, step: int, states: dict[str, Any], model_only: bool) -> None:
        import torch.distributed.checkpoint as dcp

        start = time.perf_counter()
        final = self.folder / f"step-{step}"
        partial = self.folder / f"step-{step}{_PARTIAL}"
        try:
            if self.host_rank == 0:
                shutil.rmtree(partial, ignore_errors=True)  # left by a process killed mid-save
                partial.mkdir(parents=True)
            self._barrier()
            dcp.save(states, storage_writer=_writer(partial), planner=_save_planner(),
                     process_group=self._write_group)
            if self.host_rank == 0:
                # What the weights are, so converters need neither the config nor the tokenizer.
                from torchtitan_xla.hf_checkpoint import model_args_to_json

                (partial / MODEL_ARGS_FILE).write_text(model_args_to_json(self.model_args))
                _write_commit(partial, step, sorted(states))
        except (Exception, CheckpointException) as e:  # DCP gives every host the same exception
            if self.host_rank == 0:
                shutil.rmtree(partial, ignore_errors=True)  # a full disk needs the space back
            steps = committed_steps(self.folder)
            newest = f"step-{steps[-1]} is the newest checkpoint" if steps else "no checkpoint was written"
            raise RunError(f"checkpoint step-{step} could not be written in {self.folder}: "
                           f"{_first_failure(e)}; {newest}") from None
        if self.host_rank == 0:
            if final.exists():  # an older save of the same step (e.g. a re-run)
                shutil.rmtree(final)
            os.replace(partial, final)
            self._purge()
            size = sum(json.loads((final / COMMIT_FILE).read_text())["files"].values())
            seconds = time.perf_counter() - start
            logger.info(f"Checkpoint step-{step} written: {size / 1e9:.3f} GB in {seconds:.2f}s "
                        f"({size / 1e9 / seconds:.2f} GB/s)")
        self._barrier()

    def export_hf(self, step: int, tokenizer) -> Path | None:
        """HuggingFace safetensors + config.json of the current weights, in export_dtype."""
        from torchtitan_xla.hf_checkpoint import export_hf, gather_state_dict

        if self.host_count > 1:
            logger.warning("last_save_in_hf: with several hosts, convert the saved checkpoint with "
                           "scripts/convert_to_hf.py instead (one host cannot gather every shard)")
            return None
        out = self.folder / f"step-{step}-hf"
        export_hf(gather_state_dict(self.model), self.model_args, out,
                  dtype=getattr(torch, self.cfg.export_dtype), bos_id=tokenizer.bos_id,
                  eos_id=tokenizer.eos_id)
        logger.info(f"HuggingFace export written to {out}")
        return out

    def _purge(self) -> None:
        k = self.cfg.keep_latest_k
        steps = committed_steps(self.folder)
        if k > 0 and len(steps) > k:
            for old in steps[:-k]:  # the newest (just committed) always stays
                shutil.rmtree(self.folder / f"step-{old}", ignore_errors=True)

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
        steps = committed_steps(self.folder)
        if self.cfg.load_step >= 0:
            if self.cfg.load_step not in steps:
                raise ConfigError(f"[checkpoint] load_step = {self.cfg.load_step}: no committed "
                                  f"checkpoint step-{self.cfg.load_step} in {self.folder}")
            steps = [self.cfg.load_step]
        for step in reversed(steps):
            path = self.folder / f"step-{step}"
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
            size = sum(verify(path)["files"].values())
            seconds = time.perf_counter() - start
            logger.info(f"Resumed from {path} (step {self.train_state.step}): {size / 1e9:.3f} GB "
                        f"in {seconds:.2f}s ({size / 1e9 / seconds:.2f} GB/s)")
            return True
        return False

    def _load(self, path: Path) -> None:
        import torch.distributed.checkpoint as dcp
        import torch_xla.experimental.distributed_checkpoint as xc

        record = verify(path)
        # The tensors loaded into may still be in flight (the initial weights' computation runs
        # asynchronously): torch_xla's load planner reads each shard's placement from the device
        # data and fails on a pending tensor ("...while an async operation is in flight").
        _materialise()
        contents = set(record["contents"])
        exclude = set(self.cfg.exclude_from_loading)
        model_only = contents == {"model"}
        states = self._states(model_only=model_only)
        loader_key = _loader_key(self.host_rank)
        for key in exclude:
            states.pop(loader_key if key == "dataloader" else key, None)
        if loader_key in states:
            saved_hosts = _saved_loader_hosts(path)
            if saved_hosts != self.host_count:
                raise ConfigError(
                    f"checkpoint {path}: its data-loader state was saved by {saved_hosts} host(s), "
                    f"this run has {self.host_count}; add dataloader to "
                    f"[checkpoint] exclude_from_loading to restart the data from the beginning")
        try:
            with torch.no_grad():  # loads in place into the (sharded) parameters and states
                dcp.load(states, storage_reader=dcp.FileSystemReader(str(path)),
                         planner=xc.SPMDLoadPlanner(), process_group=self.process_group)
        except (Exception, CheckpointException) as e:  # a truncated or garbled file, in many ways
            raise DamagedCheckpoint(_first_failure(e)) from None
        self.model.load_state_dict(states["model"])
        if model_only:
            # A seed or exported checkpoint: weights only, training starts at its step.
            self.train_state.step = record["step"]
            return
        if "optimizer" in states:
            self.optimizer.load_state_dict(states["optimizer"])
        if "lr_scheduler" in states:
            self.lr_scheduler.load_state_dict(states["lr_scheduler"])
        if "train_state" in states:
            self.train_state.load_state_dict(states["train_state"])
        else:
            self.train_state.step = record["step"]
        if loader_key in states:
            self.data_loader.load_state_dict(pickle.loads(states[loader_key]))

    def load_initial_weights(self, mesh) -> None:
        """Fine-tuning start: weights from `initial_load_path` (HF folder or a checkpoint step)."""
        import torch.distributed.checkpoint as dcp
        import torch_xla.experimental.distributed_checkpoint as xc

        from torchtitan_xla.hf_checkpoint import load_hf_into_model

        path = Path(self.cfg.initial_load_path)
        if not path.is_dir():
            raise ConfigError(f"[checkpoint] initial_load_path: not a folder: {path}")
        if self.cfg.initial_load_in_hf:
            load_hf_into_model(self.model, self.model_args, path, mesh)
        else:
            _materialise()  # as in _load: the planner needs the weights' data, not in flight
            try:
                verify(path)
                states = {"model": self.model.state_dict(keep_vars=True)}
                with torch.no_grad():
                    dcp.load(states, storage_reader=dcp.FileSystemReader(str(path)),
                             planner=xc.SPMDLoadPlanner(), process_group=self.process_group)
            except (Exception, CheckpointException) as e:
                reason = e if isinstance(e, DamagedCheckpoint) else _first_failure(e)
                raise ConfigError(
                    f"[checkpoint] initial_load_path: {path} is not a usable checkpoint: {reason}") from None
            self.model.load_state_dict(states["model"])
        kind = " (HuggingFace)" if self.cfg.initial_load_in_hf else ""
        logger.info(f"Initial weights loaded from {path}{kind}")

    # ---- preemption -------------------------------------------------------------------------

    def install_preemption_handler(self) -> None:
        """On SIGTERM: finish the step, save, exit 0 (see `preempted`)."""
        if not self.cfg.enable:
            return

        def on_sigterm(signum, frame):
            logger.warning("SIGTERM received: saving a checkpoint after this step, then exiting")
            self._preempted.set()

        signal.signal(signal.SIGTERM, on_sigterm)

    @property
    def preempted(self) -> bool:
        """True once any host got SIGTERM. Hosts agree on it every step (they may receive the
        signal during different steps, and must all save the same one)."""
        flag = self._preempted.is_set()
        if self.host_count > 1 and self.cfg.enable:
            import torch.distributed as dist

            t = torch.tensor([int(flag)])
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
            flag = bool(t.item())
            if flag:
                self._preempted.set()
        return flag


def read_model_state(step_dir: str | Path) -> tuple[dict[str, torch.Tensor], Any]:
    """(full model tensors on the host, ModelArgs) of a checkpoint step folder, with plain DCP on
    the CPU: no XLA device or process group needed (used by the conversion scripts)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_xla.hf_checkpoint import model_args_from_json

    path = Path(step_dir)
    try:
        verify(path)
    except DamagedCheckpoint as e:
        raise ConfigError(f"checkpoint {path}: {e}") from None
    metadata = dcp.FileSystemReader(str(path)).read_metadata()
    states = {"model": {}}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model."):
            states["model"][key[len("model."):]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(states, storage_reader=dcp.FileSystemReader(str(path)), no_dist=True)
    return states["model"], model_args_from_json((path / MODEL_ARGS_FILE).read_text())


def write_model_checkpoint(state_dict: dict[str, torch.Tensor], args, step_dir: str | Path,
                           step: int = 0) -> None:
    """A weights-only checkpoint step folder from host tensors (seed / converted checkpoints)."""
    import torch.distributed.checkpoint as dcp

    from torchtitan_xla.hf_checkpoint import model_args_to_json

    final = Path(step_dir)
    partial = final.with_name(final.name + _PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    dcp.save({"model": state_dict}, storage_writer=_writer(partial), no_dist=True)
    (partial / MODEL_ARGS_FILE).write_text(model_args_to_json(args))
    _write_commit(partial, step, ["model"])
    if final.exists():
        shutil.rmtree(final)
    os.replace(partial, final)

