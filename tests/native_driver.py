"""The native-runtime tests' torchrun worker: train.main on each job of $NATIVE_JOBS in turn, in one
set of processes (starting torch on several processes costs more than a small job's training).

A job is {"args": [train.py flags], "out": path, "overrides": {ModelArgs fields}}; without
$NATIVE_JOBS, one job: the command line's flags, $NATIVE_OUT and $NATIVE_OVERRIDES. Rank 0 writes
to a job's "out" the logged losses and grad norms, the job's own log lines, its seconds and, for every
parameter, its DTensor placements, the spec `parallelisms` gave it, and its global and local
shapes; every rank r writes to <out>.rank<r> a fingerprint of each batch its data loader handed
to training."""

import gc
import hashlib
import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
gc.disable()  # before torch's import, as train.main does (its collector runs on the loop's schedule)

import torchtitan_xla.parallelisms as parallelisms  # noqa: E402
import train  # noqa: E402
from torchtitan_xla.config import parse_args  # noqa: E402
from torchtitan_xla.datasets.loader import DataLoader  # noqa: E402
from torchtitan_xla.logging import init_logger, logger  # noqa: E402

layout = {}
models = []
parallelize = parallelisms.parallelize_llama


def recording(model, mesh, parallel_dims, job_config):
    models[:] = [model]
    out = parallelize(model, mesh, parallel_dims, job_config)
    for name, p in model.named_parameters():
        layout[name] = {"placements": [repr(x) for x in p.placements], "shape": list(p.shape),
                        "spec": list(getattr(p, "_partition_spec", ())),
                        "local": list(p.to_local().shape)}
    return out


parallelisms.parallelize_llama = recording
fingerprints = []
take = DataLoader.__next__


def fingerprinted(self):
    batch = take(self)
    inputs = batch[0].to_local() if hasattr(batch[0], "to_local") else batch[0]
    fingerprints.append(hashlib.sha256(inputs.cpu().numpy().tobytes()).hexdigest()[:16])
    return batch


class JobLog(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


DataLoader.__next__ = fingerprinted
jobs = json.loads(os.environ.get("NATIVE_JOBS", "null")) or [
    {"args": sys.argv[1:], "out": os.environ["NATIVE_OUT"],
     "overrides": json.loads(os.environ.get("NATIVE_OVERRIDES", "{}"))}]
rank = int(os.environ.get("RANK", "0"))
init_logger()  # its stderr handler first (main adds none once the logger has one)
for index, job in enumerate(jobs):
    import torch.distributed as dist

    if index and not dist.is_initialized():
        # main() ended the last job's process group (several processes); this job's gets a store
        # prefix of its own, as the last one's addresses (same group names) are still in
        # torchrun's store.
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"job{index}", store), rank=rank,
                                world_size=int(os.environ["WORLD_SIZE"]))
    layout.clear()
    fingerprints.clear()
    log = JobLog()
    logger.addHandler(log)
    started = time.monotonic()
    try:
        history = train.main(parse_args(job["args"]), model_overrides=job.get("overrides") or {})
    finally:
        logger.removeHandler(log)
    Path(f"{job['out']}.rank{rank}").write_text(json.dumps(fingerprints))
    if rank == 0:
        Path(job["out"]).write_text(json.dumps({
            "losses": {s.step: s.loss for s in history}, "grad_norms": {s.step: s.grad_norm for s in history},
            "validation_metrics": {s.step: s.validation_metrics for s in history if s.validation_metrics},
            "layout": layout, "log": "\n".join(log.lines), "seconds": round(time.monotonic() - started, 1),
            # DeepSeek's expert biases (replicated: each process's copy is the whole).
            "expert_bias": {n: (b.to_local() if hasattr(b, "to_local") else b).tolist()
                            for n, b in models[0].named_buffers() if n.endswith("expert_bias")}}))
