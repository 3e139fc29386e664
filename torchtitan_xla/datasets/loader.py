"""The object train.py iterates: this host's batches, prefetched onto the device mesh.

A background thread takes batches from the host loader (a torchdata `StatefulDataLoader`, with
tokenizing worker processes or not), records the loader's state right after each batch, and copies
the batch to the devices with the batch-axis sharding (each device receives only its rows). The
training loop's `next()` only blocks when that thread is behind.

The thread runs ahead of the loop, so the loader's own state is ahead of the last batch the
loop took. `state_dict()` therefore returns the state recorded with the last batch *handed out*:
restoring it replays exactly the batches the interrupted run had prefetched but not trained on.

A state restored on another number of data-parallel ranks (another mesh, another runtime) can only
continue a dataset whose rows are a function of their global position (`seek`, synthetic data):
it continues at the global batch the state counted. A text stream is split per rank, so its
order depends on the number of ranks and cannot be re-split.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from torchtitan_xla.errors import ConfigError

_END = object()


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


def _unwrap_worker_error(error: BaseException) -> BaseException:
    """A ConfigError raised in a DataLoader worker process arrives as ConfigError("Caught
    ConfigError in DataLoader worker process N. Original Traceback ..."): keep its one line."""
    text = str(error)
    if isinstance(error, ConfigError) and text.startswith("Caught ConfigError"):
        last = text.rstrip().splitlines()[-1]
        return ConfigError(last.partition("ConfigError: ")[2] or last)
    return error


class DataLoader:
    """Iterate for (inputs, labels) batches of [batch_size, seq_len] (chat datasets: (inputs,
    labels, positions, document_ids); preference pairs may add their stored reference
    log-probabilities [batch_size, 1]): on `device` with `input_sharding` when a device is given,
    on the host otherwise.

    `state_dict()` is this host's state, with the host's identity (rank, host count, workers);
    the checkpoint stores each host's under its own key. Restoring with a different host count,
    rank or worker count is refused (a stream cannot be re-split exactly)."""

    def __init__(self, host_loader, *, host_rank: int = 0, host_count: int = 1,
                 num_workers: int = 0, device=None, input_sharding=None, prefetch: int = 2,
                 batch_transform=None):
        self.host_loader = host_loader
        self._transform = batch_transform  # on the host, before the transfer (context parallelism)
        self.host_rank, self.host_count, self.num_workers = host_rank, host_count, num_workers
        self._device, self._input_sharding = device, input_sharding
        self._queue: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._state: dict | None = None  # host loader state after the last batch handed out
        self._batches = 0  # batches handed out, resumes included
        self._finished = False

    # -- iteration ---------------------------------------------------------------------------

    def __iter__(self) -> DataLoader:
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="data-prefetch", daemon=True)
            self._thread.start()
        return self

    def __next__(self):
        if self._thread is None:
            iter(self)
        if self._finished:
            raise StopIteration
        item = self._queue.get()
        if item is _END:
            self._finished = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._finished = True
            raise _unwrap_worker_error(item.error)
        batch, self._state = item
        self._batches += 1
        return batch

    def _produce(self) -> None:
        try:
            batches = iter(self.host_loader)
            while not self._stop.is_set():
                try:
                    batch = next(batches)
                except StopIteration:
                    self._put(_END)
                    return
                state = self.host_loader.state_dict()
                if self._transform is not None:
                    batch = self._transform(batch)
                if self._device is not None:
                    from torchtitan_xla import runtime

                    batch = tuple(runtime.to_device(list(batch), self._device, self._input_sharding))
                self._put((batch, state))
        except BaseException as e:  # handed to the training loop, which raises it
            self._put(_Failure(e))

    def _put(self, item) -> None:
        if not self._stop.is_set():
            self._queue.put(item)  # blocks while the loop is `prefetch` batches behind

    def close(self) -> None:
        """Stop the prefetch thread (and with it the worker processes)."""
        self._stop.set()
        while self._thread is not None and self._thread.is_alive():
            try:  # unblock a pending put; the thread then sees the stop flag
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.1)
        self._thread = None
        self._finished = True

    def metrics(self) -> dict[str, float]:
        """What the source reports besides its batches (grpo's rollouts: rewards, lengths): nothing."""
        return {}

    # -- checkpointing -----------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # "loader": the StatefulDataLoader's state after the last batch handed out (None: none yet).
        return {"host_rank": self.host_rank, "host_count": self.host_count,
                "num_workers": self.num_workers, "loader": self._state, "batches": self._batches}

    @property
    def reshardable(self) -> bool:
        """Whether a state saved on another number of data-parallel ranks can be restored here."""
        return self.num_workers == 0 and hasattr(self.host_loader.dataset, "seek")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError("DataLoader.load_state_dict must be called before iterating")
        if state["host_count"] != self.host_count and self.reshardable and "batches" in state:
            self._batches = state["batches"]
            self.host_loader.dataset.seek(self._batches)
            return
        if (state["host_count"], state["host_rank"]) != (self.host_count, self.host_rank):
            raise ConfigError(
                f"data loader checkpoint: saved by host {state['host_rank']} of "
                f"{state['host_count']}, restored on host {self.host_rank} of {self.host_count}; "
                f"the data stream cannot be re-split across a different number of hosts")
        if state["num_workers"] != self.num_workers:
            raise ConfigError(
                f"[training] num_workers = {self.num_workers}: the data loader checkpoint was "
                f"saved with num_workers = {state['num_workers']}; resume with the same value")
        self._state, self._batches = state["loader"], state.get("batches", 0)
        if self._state is not None:
            self.host_loader.load_state_dict(self._state)
