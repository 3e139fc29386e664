"""The runtime layer's process settings on the XLA CPU backend (runtime/process.py): XLA's
compiler flags per CPU feature and the host malloc the launcher exports, checked down to what the
allocator does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

from torchtitan_xla.config import parse_args
from torchtitan_xla.launch import host_env, resolve_hosts
from torchtitan_xla.runtime import process
from torchtitan_xla.runtime.xla.process import cpu_malloc_env, cpu_xla_flags, find_tcmalloc

CONFIG = str(REPO / "train_configs" / "debug_model.toml")


def test_cpu_malloc_env_leaves_the_users_variables_alone(monkeypatch):
    monkeypatch.setattr(process, "find_tcmalloc", lambda: None)
    assert cpu_malloc_env({}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    assert cpu_malloc_env({"GLIBC_TUNABLES": ""}) == {"GLIBC_TUNABLES": ""}
    monkeypatch.setattr(process, "find_tcmalloc", lambda: "libtcmalloc.so.4")
    assert cpu_malloc_env({})["LD_PRELOAD"] == "libtcmalloc.so.4"
    # an LD_PRELOAD of yours (empty: none) stays as it is, and nothing of ours is added
    for preload in ("", "libjemalloc.so.2"):
        assert cpu_malloc_env({"LD_PRELOAD": preload}) == {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


REGION = "--xla_cpu_copy_insertion_use_region_analysis=true --xla_cpu_use_xnnpack=false"
WIDE = "--xla_cpu_prefer_vector_width=512"


def test_cpu_xla_flags_add_ours_unless_named_and_wide_vectors_only_with_avx512():
    assert cpu_xla_flags("", {"avx2", "avx512f"}) == f"{REGION} {WIDE}"
    assert cpu_xla_flags("", {"avx2"}) == REGION  # no 512-bit vectors to prefer
    # the user's flags stay first and as written; one of ours that they name is theirs
    assert cpu_xla_flags("--xla_dump_to=/d", {"avx512f"}) == f"--xla_dump_to=/d {REGION} {WIDE}"
    assert (cpu_xla_flags("--xla_cpu_prefer_vector_width=256", {"avx512f"})
            == f"--xla_cpu_prefer_vector_width=256 {REGION}")
    assert (cpu_xla_flags("--xla_cpu_copy_insertion_use_region_analysis=false", set())
            == "--xla_cpu_copy_insertion_use_region_analysis=false --xla_cpu_use_xnnpack=false")
    assert (cpu_xla_flags("--xla_cpu_use_xnnpack=true", set())
            == "--xla_cpu_use_xnnpack=true --xla_cpu_copy_insertion_use_region_analysis=true")


def test_cpu_xla_flags_prefer_no_wide_vectors_where_the_users_isa_cap_is_below_avx512():
    """An AVX2-only host emulated on an AVX-512 one (`--xla_cpu_max_isa=AVX2`): XLA's kernels must
    vectorise as that host's do, 8 floats wide; with 512-bit vectors preferred LLVM would split
    16-wide vectors in two and sum in the AVX-512 host's order."""
    for isa in ("AVX2", "avx2", "AVX", "SSE4_2"):
        assert cpu_xla_flags(f"--xla_cpu_max_isa={isa}", {"avx2", "avx512f"}) == f"--xla_cpu_max_isa={isa} {REGION}"
    for isa in ("AVX512", "AVX512_BF16", "AMX"):  # caps at or above AVX-512 keep the wide vectors
        assert cpu_xla_flags(f"--xla_cpu_max_isa={isa}", {"avx512f"}) == f"--xla_cpu_max_isa={isa} {REGION} {WIDE}"
    assert cpu_xla_flags("--xla_cpu_max_isa=AVX512 --xla_cpu_max_isa=AVX2", {"avx512f"}).endswith(REGION)


@pytest.mark.skipif("avx512f" not in process.cpu_features(), reason="needs an AVX-512 host")
def test_an_avx2_cap_compiles_no_avx512_instruction_and_sums_in_8_lanes(tmp_path):
    """What the cap does on this AVX-512 host, in XLA's own dump: no zmm register in the kernels
    XLA compiled, and the LLVM IR's vectors 8 floats wide, as on an AVX2-only host."""
    import shutil

    if not shutil.which("objdump"):
        pytest.skip("needs objdump")
    code = ("import torch, torch_xla\n"
            "x = torch.arange(4096 * 257, dtype=torch.float32).reshape(4096, 257).to(torch_xla.device())\n"
            "print((x / 1e6).exp().sum(dim=1).cpu()[0].item())\n")
    seen = {}
    for name, cap in (("native", ""), ("avx2", "--xla_cpu_max_isa=AVX2")):
        dump = tmp_path / name
        env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1",
                   XLA_FLAGS=f"{cpu_xla_flags(cap, process.cpu_features())} --xla_dump_to={dump}")
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=300)
        asm = "".join(subprocess.run(["objdump", "-d", str(o)], capture_output=True, text=True).stdout
                      for o in dump.glob("*.o"))
        ir = "".join(line for f in dump.glob("*ir-with-opt.ll") for line in f.read_text().splitlines()
                     if not line.startswith("declare"))  # the instructions, not the intrinsics named
        seen[name] = ("zmm" in asm, "<16 x float>" in ir, "<8 x float>" in ir)
    assert seen["native"][:2] == (True, True)
    assert seen["avx2"] == (False, False, True)


@pytest.mark.parametrize("device", ["CPU", "TPU"])
def test_configure_sets_the_cpu_flags_on_the_cpu_backend_only(device, monkeypatch):
    # As on a TPU host (configure first checks that libtpu and the chips are there).
    monkeypatch.setattr("torchtitan_xla.runtime.xla.process.check_pjrt_device", lambda env: None)
    env = {"PJRT_DEVICE": device, "XLA_FLAGS": "--xla_dump_to=/d"}
    process.configure("replay", env)
    expected = cpu_xla_flags("--xla_dump_to=/d", process.cpu_features()) if device == "CPU" else "--xla_dump_to=/d"
    assert env["XLA_FLAGS"] == expected and (device == "TPU" or REGION in env["XLA_FLAGS"])


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
# Python that mallocs straight from libc (whichever malloc the process has), for the tests below.
LIBC_MALLOC = ("import ctypes, re, resource\n"
               "libc = ctypes.CDLL(None)\n"
               "libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]\n"
               "libc.free.argtypes = [ctypes.c_void_p]\n")


def run_python(code: str, malloc_env: dict[str, str]) -> str:
    """Run `code` in a fresh Python whose malloc variables are exactly `malloc_env`; its stdout."""
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", LIBC_MALLOC + code], env=env | malloc_env,
                         capture_output=True, text=True, check=True)
    assert out.stderr == ""  # nothing from the allocator either
    return out.stdout


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(),
                    reason="the kernel's transparent huge pages are off")
def test_cpu_malloc_setting_gives_the_process_huge_pages():
    """What host_env exports on CPU must reach glibc: a fresh 256 MB malloc, the kind of block XLA
    CPU allocates for every execution's temporaries, is backed by transparent huge pages."""
    code = ("p = libc.malloc(256 << 20)\n"
            "ctypes.memset(p, 1, 256 << 20)\n"
            "smaps = open('/proc/self/smaps_rollup').read()\n"
            "print(re.search(r'AnonHugePages:\\s+(\\d+) kB', smaps).group(1))\n")

    def huge_page_mib(malloc_env: dict[str, str]) -> float:
        return int(run_python(code, malloc_env)) / 1024

    cfg = parse_args(["--job.config_file", CONFIG])
    exported = host_env(resolve_hosts({}), 0, cfg, {"PJRT_DEVICE": "CPU"})
    assert huge_page_mib({"GLIBC_TUNABLES": exported["GLIBC_TUNABLES"]}) >= 200
    if "[madvise]" in THP.read_text():  # huge pages only where asked for: none without it
        assert huge_page_mib({}) < 200


@pytest.mark.skipif(find_tcmalloc() is None, reason="tcmalloc is not installed on this host")
def test_preloaded_tcmalloc_hands_a_freed_block_back_without_page_faults():
    """What tcmalloc is preloaded for: XLA CPU frees each execution's temporary buffer and mallocs
    it again the next step. Under the exported variables a 256 MB block written, freed and
    allocated again is not faulted in again; under glibc alone (huge pages) it is, every time."""
    code = ("faults = []\n"
            "for _ in range(3):\n"
            "    p = libc.malloc(256 << 20)\n"
            "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "    ctypes.memset(p, 1, 256 << 20)\n"
            "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
            "    libc.free(p)\n"
            "print(*faults)\n")

    def faults(malloc_env: dict[str, str]) -> list[int]:
        return [int(f) for f in run_python(code, malloc_env).split()]

    cfg = parse_args(["--job.config_file", CONFIG])
    exported = host_env(resolve_hosts({}), 0, cfg, {"PJRT_DEVICE": "CPU"})
    assert exported["LD_PRELOAD"] == find_tcmalloc()
    first, *again = faults({k: v for k, v in exported.items() if k != "CPU_NUM_DEVICES"})
    assert first > 1000 and max(again) < 16, (first, again)
    glibc = faults({"GLIBC_TUNABLES": exported["GLIBC_TUNABLES"]})
    assert min(glibc) > 100, glibc
