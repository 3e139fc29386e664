"""Check that torch-tpu exposes the API the native runtime would call (written against torch-tpu 0.2.0).

Run it with a Python that has torch >= 2.11 and torch-tpu installed, e.g.

    /tmp/v211/bin/python bench/check_torch_tpu_api.py

No TPU is needed: the script only looks each name up and binds placeholder arguments to its
signature; it calls nothing that touches a device. One line per name: `ok`, `MISSING`,
`signature differs: ...`, or `skipped: ...` (a check that needs a TPU host or an optional package).
Exits 1 if any check fails; skips do not fail.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import sys
import warnings

warnings.filterwarnings("ignore")  # torch-tpu warns on import (tcmalloc) and on experimental APIs

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch_tpu  # noqa: E402,F401  (installs torch.tpu; registers device and backends only on a TPU host)

T = object()  # placeholder for a tensor / store argument

# (dotted name, positional args, keyword args); args None: check only that it exists and is callable.
TABLE = [
    # process group: the factory torch-tpu registers as backends "tpu_dist" and "tpu" (pybind, no signature)
    ("torch_tpu._internal.distributed.tpu_distributed.create_process_group", None, None),
    # launch: sets TORCH_TPU_SLICEBUILDER_ADDRESSES, _TOPOLOGY, _XPROF_SESSION_ID (+ NNODES, NODE_RANK,
    # MASTER_*)
    ("torch.tpu.distributed.set_tpu_launch_env", (), {"nnodes": 2, "nproc_per_node": 4}),
    # mesh: int64 tensor of global ranks shaped mesh_shape, for DeviceMesh("tpu", mesh=...)
    ("torch.tpu.distributed.topology_aware_mesh", ((2, 4),),
     {"dcn_mesh_shape": (2, 1), "allow_split_physical_axes": False, "contiguous_submeshes": False}),
    # device: count / select / sync (torch.tpu's own versions are internal on torch >= 2.11 and raise)
    ("torch.accelerator.is_available", (), {}),
    ("torch.accelerator.current_accelerator", (), {}),
    ("torch.accelerator.device_count", (), {}),
    ("torch.accelerator.current_device_index", (), {}),
    ("torch.accelerator.set_device_index", (0,), {}),
    ("torch.accelerator.synchronize", (None,), {}),
    # memory: HBM statistics for the step log (served by torch-tpu's C++ TpuAllocator)
    ("torch.accelerator.memory_stats", (0,), {}),
    ("torch.accelerator.memory_allocated", (0,), {}),
    ("torch.accelerator.max_memory_allocated", (0,), {}),
    ("torch.accelerator.reset_peak_memory_stats", (0,), {}),
    ("torch.accelerator.get_memory_info", (0,), {}),
    # chip generation ("TPU v5e", "TPU v5p", "TPU v6e", "TPU v7"; "TPU" if unknown) and HBM per device
    ("torch.tpu.get_device_name", (0,), {}),
    ("torch.tpu.get_device_properties", (0,), {}),
    # RNG: seed the TPU generator (torch.manual_seed also reaches it through manual_seed_all)
    ("torch.tpu.manual_seed", (0,), {}),
    ("torch.tpu.manual_seed_all", (0,), {}),
    # attention: Pallas splash attention, a drop-in for F.scaled_dot_product_attention (imports jax)
    ("torch.tpu.ops.splash_sdpa", (T, T, T),
     {"scale": None, "is_causal": True, "local_window_size": None, "enable_gqa": False}),
]


def resolve(name: str):
    """Imports the longest module prefix of `name`, then follows attributes."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(name)


def check(name: str, args, kwargs) -> str:
    try:
        obj = resolve(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] == "jax":
            return "skipped: needs jax, which torch-tpu does not install"
        return f"MISSING ({e})"
    except (AttributeError, ImportError) as e:
        return f"MISSING ({e})"
    if not callable(obj):
        return "MISSING (not callable)"
    if args is None:
        return "ok"
    try:
        inspect.signature(obj).bind(*args, **kwargs)
    except TypeError as e:
        return f"signature differs: {e}; has {inspect.signature(obj)}"
    except ValueError as e:
        return f"signature differs: no Python signature ({e})"
    return "ok"


def check_backends() -> list[tuple[str, str]]:
    """The torch.compile backend is registered on import; the process-group backends only on a TPU host."""
    rows = [("torch.compile backend 'tpu'",
             "ok" if "tpu" in torch._dynamo.list_backends(exclude_tags=()) else "MISSING")]
    if torch._C._get_privateuse1_backend_name() != "tpu":
        why = "skipped: no TPU here; torch-tpu registers 'tpu_dist'/'tpu' only when it finds one"
        return rows + [("dist backend 'tpu_dist' (default for tpu)", why), ("dist backend 'tpu'", why)]
    default = dist.Backend.default_device_backend_map.get("tpu")
    rows.append(("dist backend 'tpu_dist' (default for tpu)",
                 "ok" if default == "tpu_dist"
                 and "tpu" in dist.Backend.backend_capability.get("tpu_dist", [])
                 else f"MISSING (default_device_backend_map['tpu'] = {default!r})"))
    rows.append(("dist backend 'tpu'",
                 "ok" if "tpu" in dist.Backend.backend_capability.get("tpu", []) else "MISSING"))
    return rows


def main() -> int:
    print(f"torch {torch.__version__}, torch-tpu {importlib.metadata.version('torch-tpu')}, "
          f"accelerator {torch.accelerator.current_accelerator()} "
          f"(available: {torch.accelerator.is_available()})")
    rows = [(name, check(name, args, kwargs)) for name, args, kwargs in TABLE] + check_backends()
    width = max(len(name) for name, _ in rows)
    for name, status in rows:
        print(f"{name:<{width}}  {status}")
    failed = [name for name, status in rows if not status.startswith(("ok", "skipped"))]
    print(f"{len(rows) - len(failed)}/{len(rows)} passed or skipped"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
