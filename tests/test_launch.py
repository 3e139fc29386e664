"""The multi-host launcher: scheduler variables -> hosts -> each host's runtime variables, the
dry run, and bad input (one line, exit 2, before anything starts). No XLA here."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from helpers import REPO

from torchtitan_xla.config import ConfigError, parse_args
from torchtitan_xla.launch import (
    Hosts,
    check_disjoint,
    host_env,
    host_identity,
    parse_nodelist,
    resolve_hosts,
    tpu_env,
    tpu_hosts_per_slice,
)
from torchtitan_xla.runtime import process
from torchtitan_xla.runtime.xla.process import find_tcmalloc

CONFIG = str(REPO / "train_configs" / "debug_model.toml")


def slurm_step(nodes: int, nodelist: str, procid: int, **extra: str) -> dict[str, str]:
    """The variables srun gives a task of a `nodes`-node step with one task per node."""
    return {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_JOB_NODELIST": nodelist,
            "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": str(nodes), "SLURM_STEP_NODELIST": nodelist,
            "SLURM_STEP_NUM_TASKS": str(nodes), "SLURM_PROCID": str(procid),
            "SLURM_NODEID": str(procid), **extra}


# ---- Slurm node lists ---------------------------------------------------------------------


@pytest.mark.parametrize("nodelist, hosts", [
    ("tpu-[0-3,7],gpu01", ["tpu-0", "tpu-1", "tpu-2", "tpu-3", "tpu-7", "gpu01"]),
    ("node[008-011]", ["node008", "node009", "node010", "node011"]),
    ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
    ("vm", ["vm"]),
    ("a,b[2],c-[9-10]", ["a", "b2", "c-9", "c-10"]),
])
def test_parse_nodelist(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["tpu-[3-1]", "tpu-[0-3", "tpu-[a]", "tpu-0]", "n[1-2]x"])
def test_parse_nodelist_rejects_malformed_lists(bad):
    with pytest.raises(ConfigError, match="Slurm node list"):
        parse_nodelist(bad)


# ---- which host is this ---------------------------------------------------------------------


def test_single_host_without_launcher_variables():
    assert resolve_hosts({}) == Hosts(1, 0, None, 29500, None, "single host")


def test_torchrun_variables():
    hosts = resolve_hosts({"NNODES": "4", "NODE_RANK": "2", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"})
    assert hosts == Hosts(4, 2, "h0", 1234, None, "NNODES/NODE_RANK")


def test_slurm_variables_give_rank_hostnames_and_coordinator():
    hosts = resolve_hosts(slurm_step(4, "tpu-[0-3]", 2))
    assert hosts == Hosts(4, 2, "tpu-0", 29500, ("tpu-0", "tpu-1", "tpu-2", "tpu-3"), "Slurm")


def test_slurm_step_nodelist_wins_over_the_job_nodelist():
    # srun on 2 of the job's 4 nodes: the step is what runs
    env = slurm_step(2, "tpu-[2-3]", 1, SLURM_JOB_NUM_NODES="4", SLURM_JOB_NODELIST="tpu-[0-3]")
    hosts = resolve_hosts(env)
    assert (hosts.count, hosts.rank, hosts.master_addr) == (2, 1, "tpu-2")


def test_torchrun_variables_win_over_slurm_when_they_agree():
    env = slurm_step(2, "n[1-2]", 0, NNODES="2", NODE_RANK="1", MASTER_ADDR="10.0.0.1")
    assert resolve_hosts(env) == Hosts(2, 1, "10.0.0.1", 29500, None, "NNODES/NODE_RANK")


@pytest.mark.parametrize("env, message", [
    ({"NNODES": "2"}, "NODE_RANK is not set"),
    ({"NODE_RANK": "0"}, "NNODES is not set"),
    ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "h"}, "expected 0 <= NODE_RANK < NNODES"),
    ({"NNODES": "two", "NODE_RANK": "0"}, "NNODES='two': expected an integer"),
    ({"NNODES": "2", "NODE_RANK": "1"}, "MASTER_ADDR is not set"),
    ({"NNODES": "3", "NODE_RANK": "0", "MASTER_ADDR": "h", "SLURM_JOB_NUM_NODES": "2"},
     "inconsistent host counts: NNODES=3, but the Slurm allocation has 2 node(s)"),
    ({"NNODES": "3", "NODE_RANK": "0", "HOSTNAMES": "a,b"},
     "inconsistent host counts: NNODES=3, but HOSTNAMES lists 2 host(s)"),
    ({"SLURM_JOB_NUM_NODES": "3", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_STEP_ID": "0",
      "SLURM_PROCID": "0"}, "inconsistent host counts: Slurm says 3 node(s), but its node list"),
    ({**slurm_step(2, "n[1-2]", 0), "SLURM_STEP_NUM_TASKS": "4"},
     "srun started 4 task(s) on 2 node(s); XLA needs one process per node"),
    ({"SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_PROCID": "0"},
     "this is the batch script of a 2-node Slurm job"),
])
def test_bad_launcher_variables(env, message):
    with pytest.raises(ConfigError) as e:
        resolve_hosts(env)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_host_identity_prefers_the_runtime_and_checks_it():
    env = {"NNODES": "4", "NODE_RANK": "1", "MASTER_ADDR": "h0"}
    # TPU: the runtime's process index is the identity (the launcher's rank may be ordered
    # differently); the count must agree.
    def count_rank(h):
        return h.count, h.rank

    tpu = host_identity(3, 4, "TPU", env)
    assert count_rank(tpu) == (4, 3)
    assert tpu.group_rank == 1  # the gloo group's rank 0 must be on MASTER_ADDR (NODE_RANK 0)
    assert host_identity(3, 4, "TPU", {}).group_rank is None  # no launcher: process 0 is master
    with pytest.raises(ConfigError, match="inconsistent host counts: the launcher says 4 host"):
        host_identity(0, 8, "TPU", env)
    with pytest.raises(ConfigError, match="formed a mesh of this host alone"):
        host_identity(0, 1, "TPU", env)
    # CPU: processes cannot join one mesh; the launcher's variables are the identity.
    assert count_rank(host_identity(0, 1, "CPU", env)) == (4, 1)
    assert count_rank(host_identity(0, 1, "CPU", {})) == (1, 0)


# ---- TPU runtime variables ------------------------------------------------------------------


@pytest.mark.parametrize("accelerator, hosts", [
    ("v4-8", 1), ("v4-32", 4), ("v5p-128", 16), ("v5litepod-8", 1), ("v5litepod-16", 4),
    ("v6e-256", 64), ("v3-32", 4), ("tpu7x-8", None), ("bogus", None)])
def test_hosts_per_slice(accelerator, hosts):
    assert tpu_hosts_per_slice(accelerator) == hosts


def test_tpu_variables_for_two_slices_under_slurm():
    env = slurm_step(8, "tpu-[0-7]", 5, TPU_ACCELERATOR_TYPE="v4-32", TPU_TOPOLOGY="2x2x4")
    hosts = resolve_hosts(env)
    assert tpu_env(hosts, 5, 2, env) == {
        "MEGASCALE_COORDINATOR_ADDRESS": "tpu-0", "MEGASCALE_PORT": "8081",
        "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
        "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_ID": "1",
        "TPU_WORKER_HOSTNAMES": "tpu-4,tpu-5,tpu-6,tpu-7",
        "TPU_HOST_BOUNDS": "1,1,4", "TPU_PROCESS_BOUNDS": "1,1,4",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1", "TPU_CHIPS_PER_PROCESS_BOUNDS": "2,2,1"}


def test_tpu_variables_for_a_2d_slice():
    env = slurm_step(4, "v5e-[0-3]", 3, TPU_ACCELERATOR_TYPE="v5litepod-16", TPU_TOPOLOGY="4x4")
    out = tpu_env(resolve_hosts(env), 3, 1, env)
    assert (out["TPU_WORKER_ID"], out["TPU_HOST_BOUNDS"]) == ("3", "2,2,1")
    assert not any(k.startswith("MEGASCALE") for k in out)


def test_tpu_variables_leave_platform_settings_alone():
    # GKE's TPU webhook sets the slice's variables itself: only the count is checked.
    env = slurm_step(4, "n[0-3]", 0, TPU_WORKER_HOSTNAMES="a,b,c,d", TPU_WORKER_ID="0")
    assert tpu_env(resolve_hosts(env), 0, 1, env) == {}
    env["TPU_WORKER_HOSTNAMES"] = "a,b"
    with pytest.raises(ConfigError, match="TPU_WORKER_HOSTNAMES lists 2 host"):
        tpu_env(resolve_hosts(env), 0, 1, env)


def test_tpu_variables_with_a_metadata_server():
    env = slurm_step(4, "n[0-3]", 0)
    assert tpu_env(resolve_hosts(env), 0, 1, env, metadata=True) == {}  # a TPU VM: libtpu asks it
    with pytest.raises(ConfigError, match="TPU_ACCELERATOR_TYPE is not set and no TPU metadata"):
        tpu_env(resolve_hosts(env), 0, 1, env, metadata=False)


@pytest.mark.parametrize("extra, slices, message", [
    ({"TPU_ACCELERATOR_TYPE": "v4-32", "TPU_TOPOLOGY": "2x2x4"}, 1,
     "a v4-32 slice has 4 host(s); 1 slice(s) need 4, but the job has 8 (Slurm)"),
    ({"TPU_ACCELERATOR_TYPE": "v4-32"}, 2, "TPU_TOPOLOGY is not set"),
    ({"TPU_ACCELERATOR_TYPE": "v4-32", "TPU_TOPOLOGY": "2x2x2"}, 2, "host bounds (1, 1, 2) hold 2"),
    ({"TPU_ACCELERATOR_TYPE": "v4-32", "TPU_TOPOLOGY": "3x2x4"}, 2, "not made of 2x2x1 hosts"),
])
def test_bad_tpu_variables(extra, slices, message):
    env = slurm_step(8, "tpu-[0-7]", 0, **extra)
    with pytest.raises(ConfigError) as e:
        tpu_env(resolve_hosts(env), 0, slices, env)
    assert message in str(e.value)


def test_torchrun_variables_on_tpu_need_the_hostnames():
    env = {"NNODES": "4", "NODE_RANK": "1", "MASTER_ADDR": "h0", "TPU_ACCELERATOR_TYPE": "v4-32",
           "TPU_TOPOLOGY": "2x2x4"}
    with pytest.raises(ConfigError, match="set HOSTNAMES"):
        tpu_env(resolve_hosts(env), 1, 1, env)
    env["HOSTNAMES"] = "h0,h1,h2,h3"
    assert tpu_env(resolve_hosts(env), 1, 1, env)["TPU_WORKER_HOSTNAMES"] == "h0,h1,h2,h3"


def test_host_env_on_cpu(monkeypatch):
    monkeypatch.setattr(process, "find_tcmalloc", lambda: None)  # as on a host without it
    cfg = parse_args(["--job.config_file", CONFIG, "--parallelism.tensor_parallel_degree", "2"])
    hosts = resolve_hosts({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1"})
    assert host_env(hosts, 1, cfg, {"PJRT_DEVICE": "CPU"}) == {
        "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        "NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    # one host: nothing about hosts; CPU_NUM_DEVICES and GLIBC_TUNABLES from the environment win
    env = {"PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "8", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert host_env(resolve_hosts({}), 0, cfg, env) == env
    # where tcmalloc is installed it is preloaded too, on the CPU backend only
    monkeypatch.setattr(process, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    assert host_env(resolve_hosts({}), 0, cfg, {"PJRT_DEVICE": "CPU"}) == {
        "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
        "LD_PRELOAD": "libtcmalloc_minimal.so.4",
        "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 40)}
    tpu = {"PJRT_DEVICE": "TPU", "TPU_SKIP_MDS_QUERY": "1", "TPU_ACCELERATOR_TYPE": "v4-8"}
    assert "LD_PRELOAD" not in host_env(resolve_hosts({}), 0, cfg, tpu, metadata=False)


def test_check_disjoint():
    check_disjoint([{"rank": 0, "sequences": ["a", "b"]}, {"rank": 1, "sequences": ["c", "d"]}])
    with pytest.raises(ConfigError, match="hosts 0 and 1 read the same training sequence"):
        check_disjoint([{"rank": 0, "sequences": ["a", "b"]}, {"rank": 1, "sequences": ["b"]}])


# ---- run_train.sh: dry run and bad input ----------------------------------------------------


def run_script(args: list[str], env: dict[str, str], script: str = "run_train.sh"):
    """run_train.sh with only the given launcher variables (none inherited from this shell)."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "NNODES", "NODE_RANK", "MASTER_", "TPU_", "MEGASCALE_",
                                 "CPU_NUM_DEVICES", "PJRT_", "XLA_", "LIBTPU_", "GLIBC_",
                                 "LD_PRELOAD", "TCMALLOC_"))}
    base |= {"PYTHON": sys.executable, **env}
    return subprocess.run([str(REPO / script), *args], capture_output=True, text=True, env=base,
                          cwd=REPO, timeout=120)


def test_dry_run_prints_every_host_and_starts_nothing():
    # PJRT_DEVICE=TPU on a machine without TPU: starting XLA would fail, so it was not started.
    env = {"PJRT_DEVICE": "TPU", "TPU_ACCELERATOR_TYPE": "v4-16", "TPU_TOPOLOGY": "2x2x2",
           "MASTER_PORT": "4000", **slurm_step(4, "tpu-[0-3]", 2)}
    p = run_script(["--dry-run", "--training.steps", "3", "--parallelism.num_slices", "2",
                    "--parallelism.data_parallel_replicate_degree", "2"], env)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    blocks = p.stdout.split("# host ")
    assert blocks[0] == "# 4 host(s), from Slurm; the same command runs on each\n"
    command = (f"{sys.executable} {REPO}/train.py --job.config_file {CONFIG} --training.steps 3 "
               f"--parallelism.num_slices 2 --parallelism.data_parallel_replicate_degree 2")
    for rank, block in enumerate(blocks[1:]):
        lines = block.strip().splitlines()
        assert lines[0] == f"{rank} (tpu-{rank})" + ("  <- this host" if rank == 2 else "")
        slice_id, worker = divmod(rank, 2)
        assert lines[1:-1] == [
            "HOSTNAMES=tpu-0,tpu-1,tpu-2,tpu-3", "MASTER_ADDR=tpu-0", "MASTER_PORT=4000",
            "MEGASCALE_COORDINATOR_ADDRESS=tpu-0", "MEGASCALE_NUM_SLICES=2", "MEGASCALE_PORT=8081",
            f"MEGASCALE_SLICE_ID={slice_id}", "NNODES=4", f"NODE_RANK={rank}", "PJRT_DEVICE=TPU",
            "TPU_ACCELERATOR_TYPE=v4-16", "TPU_CHIPS_PER_HOST_BOUNDS=2,2,1",
            "TPU_CHIPS_PER_PROCESS_BOUNDS=2,2,1", "TPU_HOST_BOUNDS=1,1,2", "TPU_PROCESS_BOUNDS=1,1,2",
            "TPU_SKIP_MDS_QUERY=1", "TPU_TOPOLOGY=2x2x2",
            f"TPU_WORKER_HOSTNAMES=tpu-{2 * slice_id},tpu-{2 * slice_id + 1}", f"TPU_WORKER_ID={worker}"]
        assert lines[-1] == command


def test_dry_run_single_host_on_cpu():
    p = run_script(["--dry-run", "--parallelism.tensor_parallel_degree", "2"], {"PJRT_DEVICE": "CPU"})
    assert p.returncode == 0, p.stderr
    tcmalloc = find_tcmalloc()  # preloaded where installed
    preload = [f"LD_PRELOAD={tcmalloc}", "PJRT_DEVICE=CPU",
               f"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD={1 << 40}"] if tcmalloc else ["PJRT_DEVICE=CPU"]
    assert p.stdout.splitlines() == [
        "# 1 host(s), from single host; the same command runs on each", "# host 0",
        "CPU_NUM_DEVICES=2", "GLIBC_TUNABLES=glibc.malloc.hugetlb=1", *preload,
        f"{sys.executable} {REPO}/train.py --job.config_file {CONFIG} --parallelism.tensor_parallel_degree 2"]


@pytest.mark.parametrize("args, env, message", [
    ([], {"NNODES": "2", "NODE_RANK": "0"},
     "error: MASTER_ADDR is not set: NNODES=2 needs the coordinator's address (the host with "
     "NODE_RANK=0) on every host"),
    ([], {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "h", "SLURM_JOB_NUM_NODES": "3"},
     "error: inconsistent host counts: NNODES=2, but the Slurm allocation has 3 node(s)"),
    ([], {"CPU_NUM_DEVICES": "abc"}, "error: CPU_NUM_DEVICES='abc': expected a positive integer (the "
     "number of virtual XLA CPU devices; unset, run_train.sh chooses)"),
    ([], {"CPU_NUM_DEVICES": "0"}, "error: CPU_NUM_DEVICES='0': expected a positive integer (the "
     "number of virtual XLA CPU devices; unset, run_train.sh chooses)"),
    (["--parallelism.num_slices", "2", "--parallelism.data_parallel_replicate_degree", "2"],
     slurm_step(3, "n[1-3]", 0),
     "error: command line: --parallelism.num_slices = 2, but the job has 3 host(s) (Slurm): expected "
     "a multiple of 2 hosts, the same number per slice"),
])
def test_bad_input_stops_run_train_with_one_line(args, env, message, tmp_path):
    p = run_script(["--job.dump_folder", str(tmp_path / "out"), *args], {"PJRT_DEVICE": "CPU", **env})
    assert (p.returncode, p.stdout, p.stderr) == (2, "", message + "\n")
    assert not (tmp_path / "out").exists()  # nothing started


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["--training.steps", "3", "--help"], ["--plan", "--help"],
                                  ["--dry-run", "-h"]])
def test_help_through_run_train_lists_every_option_and_exits_0(args):
    """The help is printed by the program that reads the options (was eval'd by the launcher: exit 127)."""
    p = run_script(args, {"PJRT_DEVICE": "CPU"})
    assert (p.returncode, p.stderr) == (0, ""), p.stderr
    program = "python -m torchtitan_xla.plan" if "--plan" in args else "train.py"
    assert p.stdout.startswith(f"usage: {program} --") or p.stdout.startswith(f"usage: {program} [--")
    assert "--training.steps int  (default: 10000)" in p.stdout


def test_eval_help_names_the_evaluation_and_what_it_needs():
    p = subprocess.run([sys.executable, "-m", "torchtitan_xla.eval", "--help"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert (p.returncode, p.stderr) == (0, "")
    assert p.stdout.startswith("usage: python -m torchtitan_xla.eval --job.config_file FILE --eval.tasks "
                               "KIND:PATH[,...] [--eval.checkpoint STEP_OR_HF_FOLDER]")
    assert "--eval.tasks list[str]" in p.stdout


def test_native_launch_refuses_a_device_the_host_lacks_in_one_line(tmp_path):
    """run_train.sh's exports for the native runtime: a GPU or TPU the host does not have is one
    line, exit 2, before torchrun starts (whose own check is a traceback); the CPU gets one process
    per device the degrees ask for, sharing the cores."""
    from torchtitan_xla.runtime.native.process import launch_env

    bare = {"TTX_DEV_ROOT": str(tmp_path)}  # a stand-in /dev with no device files
    with pytest.raises(ConfigError, match=r'device = "cuda": this host has no NVIDIA GPU'):
        launch_env(8, "cuda", bare)
    with pytest.raises(ConfigError, match=r'device = "tpu": this host has no TPU chips'):
        launch_env(8, "tpu", bare)
    cpu = launch_env(8, "cpu", {}, hosts=2)
    assert (cpu["TTX_RUNTIME"], cpu["NPROC_PER_NODE"]) == ("native", "4")
    assert cpu["OMP_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 4))
    assert launch_env(8, "cpu", {"NPROC_PER_NODE": "2"})["NPROC_PER_NODE"] == "2"
    p = subprocess.run([str(REPO / "run_train.sh"), "--runtime.backend", "native", "--runtime.device",
                        "cuda", "--job.dump_folder", str(tmp_path)], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable))
    if not shutil.which("nvidia-smi"):
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().splitlines() == [
            'error: command line: --runtime.device = "cuda": this host has no NVIDIA GPU (no '
            'nvidia-smi); set NPROC_PER_NODE if it has one']


def _stand_in_dev(root, *files: str):
    """A folder standing in for /dev, holding empty device files `files` (e.g. accel0, vfio/0)."""
    for name in files:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    return root


@pytest.mark.parametrize("files,accelerator", [((), "cpu"), (("accel0", "accel1"), "tpu"),
                                               (("vfio/0", "vfio/vfio"), "tpu"), (("nvidia0",), "cuda")],
                         ids=["none", "tpu-v4", "tpu-v5", "gpu"])
def test_the_setup_installs_torch_xlas_tpu_runtime_on_a_tpu_host(tmp_path, files, accelerator):
    """scripts/setup_env.sh's choice of extras for ./.venv, by the device files of a stand-in /dev
    (nothing installed): a TPU host adds `tpu`, torch_xla's own extra that brings libtpu."""
    dev = _stand_in_dev(tmp_path / "dev", *files)
    script = f'source {REPO}/scripts/setup_env.sh; detect_accelerator; echo "$TTX_ACCELERATOR|$(venv_extras dev)|$(venv_extras)"'
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True,
                       env=dict(os.environ, TTX_DEV_ROOT=str(dev), PYTHON=sys.executable))
    tpu = accelerator == "tpu"
    assert p.stdout.strip() == f"{accelerator}|dev{',tpu' if tpu else ''}|{'tpu' if tpu else ''}", p.stderr
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["tpu"] == [f"torch_xla[tpu]=={process.TORCH_XLA_VERSION}"]
    assert f"torch_xla=={process.TORCH_XLA_VERSION}" in project["dependencies"]


def test_a_tpu_run_without_libtpu_is_one_line_naming_it_and_its_install_command(tmp_path):
    """PJRT_DEVICE=TPU on this CPU machine, whose Python has torch_xla but not its TPU runtime (as a
    TPU VM's before the set-up adds it): one line, exit 2, before XLA starts (torch_xla's own
    failure is a 30-line traceback ending `libtpu not found`)."""
    from torchtitan_xla.runtime.xla.process import libtpu_found

    assert not libtpu_found({}), "this test needs a Python without libtpu"
    line = (f"error: PJRT_DEVICE=TPU: this Python has no libtpu, the TPU runtime torch_xla loads; install "
            f"it with: {sys.executable} -m pip install 'torch_xla[tpu]=={process.TORCH_XLA_VERSION}'")
    p = subprocess.run([str(REPO / "run_train.sh"), "--training.steps", "1", "--job.dump_folder",
                        str(tmp_path / "out")], capture_output=True, text=True,
                       env=dict(os.environ, PYTHON=sys.executable, PJRT_DEVICE="TPU"))
    assert (p.returncode, p.stderr.strip().splitlines()) == (2, [line]), p.stderr
    # train.py itself, as the launcher would start it: the same line.
    p = subprocess.run([sys.executable, str(REPO / "train.py"), "--training.steps", "1", "--job.dump_folder",
                        str(tmp_path / "out")], capture_output=True, text=True,
                       env=dict(os.environ, PJRT_DEVICE="TPU"))
    assert (p.returncode, p.stderr.strip().splitlines()[-1]) == (2, line), p.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("env,message", [
    ({"TPU_LIBRARY_PATH": "/opt/libtpu.so", "PJRT_DEVICE": "TPU"},
     "PJRT_DEVICE=TPU: this host has no TPU chips (no /dev/accel* or /dev/vfio/N); unset PJRT_DEVICE to "
     "run on the CPU"),
    ({"PJRT_DEVICE": "CUDA"}, "PJRT_DEVICE=CUDA: the XLA runtime runs on TPU or CPU here (torch_xla 2.9.0 "
                              "has no CUDA backend); on a GPU use --runtime.backend native")],
    ids=["tpu without chips", "cuda"])
def test_a_pjrt_device_this_host_cannot_reach_is_one_line(tmp_path, env, message):
    from torchtitan_xla.runtime.xla.process import check_pjrt_device

    with pytest.raises(ConfigError) as e:
        check_pjrt_device({"TTX_DEV_ROOT": str(tmp_path), **env})
    assert str(e.value) == message
    if "TPU_LIBRARY_PATH" in env:  # with a chip nothing is missing
        check_pjrt_device({"TTX_DEV_ROOT": str(_stand_in_dev(tmp_path, "accel0")), **env})


def test_a_gpu_machines_python_is_kept_and_the_xla_runtime_refused_there(tmp_path, monkeypatch):
    """scripts/setup_env.sh keeps a Python whose torch drives a device (torch_xla, torch-tpu, a
    CUDA build where nvidia-smi is) instead of making .venv; on such a Python without torch_xla
    the default runtime is refused in one line by the launcher."""
    def kept(cuda: str, gpu: bool, extra: str = "") -> bool:
        stub = tmp_path / f"stub-{cuda}-{gpu}-{extra}"
        (stub / "torch").mkdir(parents=True)
        (stub / "torch" / "__init__.py").write_text("")
        (stub / "torch" / "version.py").write_text(f"__version__ = '2.11.0'\ncuda: Optional[str] = {cuda}\n")
        if extra:
            (stub / extra).mkdir()
            (stub / extra / "__init__.py").write_text("")
        bin_dir = tmp_path / f"bin-{gpu}"
        bin_dir.mkdir(exist_ok=True)
        if gpu:
            (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n")
            (bin_dir / "nvidia-smi").chmod(0o755)
        python = tmp_path / "python"  # this Python without its site-packages: the stubs alone
        python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
        python.chmod(0o755)
        script = f'source {REPO}/scripts/setup_env.sh; _device_python "$1"'
        p = subprocess.run(["bash", "-c", script, "bash", str(python)], capture_output=True, text=True,
                           env={"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(stub)})
        return p.stdout.strip() == str(python)

    assert kept("'13.0'", gpu=True)
    assert not kept("'13.0'", gpu=False)  # PyPI's CUDA torch on a CPU-only machine: .venv
    assert not kept("None", gpu=True)
    assert kept("None", gpu=False, extra="torch_tpu")

    import importlib.util

    from torchtitan_xla.runtime.xla import process

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch_xla" else real(name, *a))
    with pytest.raises(ConfigError, match=r'backend = "xla": this Python \(.*\) has no torch_xla; with '
                                          r'torch-tpu or on a GPU use backend = "native"'):
        process.launch_env(1, "auto", {})


def test_tpu_launch_takes_torch_tpus_variables(tmp_path):
    """On a TPU host the native launch adds what torch.tpu.distributed.set_tpu_launch_env sets
    (here a stand-in with its 0.2.0 signature: the real one needs chips); its failure is one line."""
    from torchtitan_xla.runtime.native.process import tpu_launch_env

    tpu = tmp_path / "torch" / "tpu"
    tpu.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tpu / "__init__.py").write_text("")
    (tpu / "distributed.py").write_text(
        "import os\n"
        "def set_tpu_launch_env(*, nnodes=None, nproc_per_node=None):\n"
        "    if os.environ.get('FAIL'):\n"
        "        raise ValueError('set_tpu_launch_env(): expected TPU devices, got none')\n"
        "    os.environ.setdefault('TORCH_TPU_TOPOLOGY', f'{nnodes},{nproc_per_node},1')\n"
        "    os.environ.setdefault('MASTER_PORT', '29500')\n")
    env = {"PYTHONPATH": str(tmp_path), "PATH": os.environ["PATH"], "MASTER_PORT": "1234"}
    assert tpu_launch_env(2, 4, env) == {"TORCH_TPU_TOPOLOGY": "2,4,1"}  # what is set stays
    with pytest.raises(ConfigError, match=r'^\[runtime\] device = "tpu": torch-tpu\'s launch setup failed: '
                                          r'ValueError: set_tpu_launch_env\(\): expected TPU devices, got none$'):
        tpu_launch_env(1, 4, dict(env, FAIL="1"))
