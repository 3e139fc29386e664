"""Per-device memory for parameters, gradients and Adam state, without running anything.

    python -m torchtitan_xla.memory_estimate --devices 256 --job.config_file train_configs/llama3_8b.toml

Builds the model on the meta device and takes each parameter's shard shape from the partition spec
the parallelize code assigns (`param_specs`, the same function `apply_tp` / `apply_fsdp` use), so
the numbers follow the code. Activations are not included: they depend on the compiler's schedule
and on activation checkpointing.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from torchtitan_xla.config import JobConfig, parse_args
from torchtitan_xla.errors import run_main

# float32 master weights and gradients; Adam keeps exp_avg and exp_avg_sq in float32.
BYTES_PARAM, BYTES_GRAD, BYTES_OPTIM = 4, 4, 8
# Vocabulary of the real tokenizers, used when the tokenizer file is not at hand.
DEFAULT_VOCAB = {"llama2": 32000, "llama3": 128256}


@dataclass
class Estimate:
    mesh: dict[str, int]
    num_params: int
    params_per_device: int  # elements on the most loaded device
    largest_shard: tuple[str, tuple[int, ...], tuple]  # name, local shape, partition spec

    @property
    def bytes_per_device(self) -> dict[str, int]:
        n = self.params_per_device
        return {"parameters": n * BYTES_PARAM, "gradients": n * BYTES_GRAD,
                "optimizer": n * BYTES_OPTIM, "total": n * (BYTES_PARAM + BYTES_GRAD + BYTES_OPTIM)}


def shard_shape(shape: tuple[int, ...], spec: tuple, axis_sizes: dict[str, int]) -> tuple[int, ...]:
    """Local shape of a tensor sharded by `spec` (XLA pads uneven shards: ceil division)."""
    out = []
    for size, axes in zip(shape, spec):
        names = (axes,) if isinstance(axes, str) else (axes or ())
        out.append(math.ceil(size / math.prod(axis_sizes[a] for a in names)))
    return tuple(out)


def estimate(job_config: JobConfig, num_devices: int, vocab_size: int | None = None) -> Estimate:
    import torch

    from torchtitan_xla.models import get_model_args, get_model_class
    from torchtitan_xla.parallelisms import MESH_AXES, ParallelDims
    from torchtitan_xla.parallelisms.parallelize_llama import param_specs

    name = job_config.model.name
    args = get_model_args(name, job_config.model.flavor, vocab_size=vocab_size or DEFAULT_VOCAB[name],
                          max_seq_len=job_config.training.seq_len)
    dims = ParallelDims.from_config(job_config.parallelism, num_devices)
    dims.check_model(args.n_heads, args.kv_heads, args.dim, args.ffn_hidden_dim)
    with torch.device("meta"):
        model = get_model_class(name)(args)
    sizes = dict(zip(MESH_AXES, dims.mesh_shape))
    specs = param_specs(model, dims)
    total, largest = 0, ("", (), ())
    for pname, p in model.named_parameters():
        local = shard_shape(tuple(p.shape), specs[pname], sizes)
        total += math.prod(local)
        if math.prod(local) > math.prod(largest[1] or (0,)):
            largest = (pname, local, specs[pname])
    return Estimate(sizes, model.num_params(), total, largest)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=True)
    ap.add_argument("--devices", type=int, required=True, help="number of devices (chips) in the mesh")
    ap.add_argument("--vocab-size", type=int, help="default: the real Llama 2 / 3 tokenizer's")
    opts, rest = ap.parse_known_args(argv)
    cfg = parse_args(rest)
    est = estimate(cfg, opts.devices, opts.vocab_size)
    mesh = ", ".join(f"{k}={v}" for k, v in est.mesh.items())
    print(f"{cfg.model.name} {cfg.model.flavor}: {est.num_params / 1e9:.2f}B parameters on "
          f"{opts.devices} devices ({mesh})")
    for what, n in est.bytes_per_device.items():
        print(f"  {what:<11} {n / 2**30:8.2f} GiB per device")
    name, shape, spec = est.largest_shard
    print(f"  largest shard: {name} {list(shape)} spec {spec}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(lambda: main(sys.argv[1:])))
