"""Test environment: the XLA CPU backend with one device in this process (tests that need more
devices start a subprocess), and caches in a per-session temporary folder."""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
_CACHE = tempfile.mkdtemp(prefix="ttx-test-cache-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# One intra-op thread per process (torch's default is one per core, read at its import): the two test
# workers share the cores, and a process running torch's CPU kernels beside a busy one spins waiting
# for its threads (a one-process native job took 4x its CPU time: docs/performance.md). torchrun
# gives each of several processes one thread for the same reason. XLA's own kernels ignore it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ["XLA_DISABLE_FUNCTIONALIZATION"] = "1"  # as runtime.configure("replay") sets it, whichever test runs first
os.environ["TORCHTITAN_XLA_CACHE"] = _CACHE
os.environ["HF_DATASETS_CACHE"] = os.path.join(_CACHE, "hf_datasets")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
# torch.compile's on-disk cache (default /tmp/torchinductor_$USER) is keyed without the vector ISA:
# CPU kernels built for AVX-512 and served to a run pinned to AVX2 (ATEN_CPU_CAPABILITY) segfault.
# Each test session compiles into its own (docs/performance.md, "On the other kind of CPU").
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
# XLA's CPU kernels built with LLVM at -O1, not -O2: the tests' short runs spend more time compiling
# than running, and -O1 compiles a step 30% faster (docs/performance.md). Every process of a session
# inherits it, so runs compared with each other are compiled alike.
if "--xla_backend_optimization_level=" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=1".strip()

import pytest  # noqa: E402

# This checkout's package and test helpers first, whatever else is installed.
sys.path[:0] = [str(REPO), str(REPO / "tests")]


def pytest_report_header(config):
    """The CPU this run's numbers come from (CI's log then says which kind it ran on)."""
    from torchtitan_xla.runtime.xla.process import cpu_features, cpu_model, vector_features

    pins = {k: os.environ[k] for k in ("XLA_FLAGS", "ATEN_CPU_CAPABILITY") if os.environ.get(k)}
    return (f"cpu: {cpu_model()} ({vector_features(cpu_features())}; {os.cpu_count()} cores)"
            + (f"; pins: {pins}" if pins else ""))


# The files that take longest (their module fixtures: several processes, many compiles), started
# first and in this order: the two workers (run_tests.sh) then end on short files together, not
# one of them alone on a long one. (xdist hands a worker its next file while it still has two
# tests of the last to run, so a long file started late runs alone.)
LONGEST_FIRST = ["test_native_runtime.py", "test_plan.py", "test_moe_training.py", "test_checkpoint.py",
                 "test_pipeline_parallel.py", "test_native_hosts.py", "test_context_parallel.py",
                 "test_generate.py", "test_multihost.py", "test_train.py", "test_eval.py"]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest as collected


@pytest.fixture(scope="session")
def xla_device():
    import torch_xla
    import torch_xla.runtime as xr

    xr.use_spmd()  # every in-process XLA test runs the way train.py does
    return torch_xla.device()


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """6 steps on one device, saved at 3 and 6, exported to HuggingFace at the end: (folder,
    losses, log). Shared by the checkpoint and HF export tests."""
    from checkpoint_helpers import run

    folder = tmp_path_factory.mktemp("straight")
    losses, log = run(folder, "--training.local_batch_size", "8", "--checkpoint.last_save_in_hf")
    return folder, losses, log


@pytest.fixture(scope="session", autouse=True)
def _xla_backward_first(xla_device):
    """One XLA backward before any test runs backward on the CPU: torch's autograd engine sizes
    its per-device queues at its first backward, and when that one ran on the CPU every later XLA
    backward in the process fails (an INTERNAL ASSERT in engine.cpp)."""
    import torch

    x = torch.ones(2, device=xla_device, requires_grad=True)
    (x * 2).sum().backward()
    return xla_device


@pytest.fixture(scope="session", autouse=True)
def _vector_isas_checked_once():
    """torch.compile's CPU code generator tries each vector ISA the CPU reports by building and
    loading a test library (a Python process started per ISA) in every process that compiles:
    10-15 s of each native compiled job here. Checked once per worker instead; the processes the
    tests start trust the result (TORCHINDUCTOR_VEC_ISA_OK) only when every ISA passed."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64") or "TORCHINDUCTOR_VEC_ISA_OK" in os.environ:
        return
    from torch._inductor import cpu_vec_isa

    reported = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if all(flag in cpu_vec_isa.x86_isa_checker() for flag in str(isa).split())]
    if cpu_vec_isa.valid_vec_isa_list() == reported:
        os.environ["TORCHINDUCTOR_VEC_ISA_OK"] = "1"
