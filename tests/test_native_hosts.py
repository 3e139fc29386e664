"""The native runtime across hosts: two hosts x two processes on loopback (torchrun's rendezvous on
127.0.0.1), each started as `run_train.sh --dry-run` plans it, against one host with four processes;
and preemption of one process of one host."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
from helpers import REPO, free_port, tiny_args
from native_helpers import EAGER, close

# The debug model cut to two layers (as tests/test_native_runtime.py): each layer more costs every
# eager step its collectives, and four processes share two cores.
LAYERS = {"n_layers": 2}


def planned_hosts(flags: list[str], env: dict[str, str]) -> list[tuple[dict[str, str], list[str]]]:
    """`run_train.sh --dry-run`'s plan: each host's variables and command (for every host)."""
    p = subprocess.run([str(REPO / "run_train.sh"), "--dry-run", *flags], capture_output=True, text=True,
                       env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    hosts = []
    for block in re.split(r"^# host \d+.*$", p.stdout, flags=re.M)[1:]:
        lines = block.strip().splitlines()
        variables = dict(shlex.split(line)[0].split("=", 1) for line in lines[:-1])
        hosts.append((variables, shlex.split(lines[-1])))
    return hosts


def host_env(hosts: int) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_", "NNODES", "NODE_RANK"))}
    return dict(base, NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port())) if hosts > 1 else base


def start_hosts(flags: list[str], hosts: int, folder: Path) -> tuple[list, list[subprocess.Popen]]:
    """Every host's torchrun as `run_train.sh --dry-run` plans it (the test worker in train.py's
    place, writing into `folder`), started at once: (the plan, one torchrun process per host)."""
    env = host_env(hosts)
    plan = planned_hosts(flags, env)
    procs = []
    for variables, command in plan:
        assert command[1:3] == ["-m", "torchtitan_xla.launch.torchrun"] and variables["TTX_RUNTIME"] == "native"
        command = [str(REPO / "tests" / "native_driver.py") if c.endswith("train.py") else c for c in command]
        command[command.index("--job.dump_folder") + 1] = str(folder)
        procs.append(subprocess.Popen(command, env=dict(env, **variables, NATIVE_OUT=str(folder / "result.json"),
                                                        NATIVE_OVERRIDES=json.dumps(LAYERS)),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    return plan, procs


def finish_hosts(procs: list[subprocess.Popen], folder: Path, processes: int = 4) -> dict:
    """Wait for every host: rank 0's losses, each rank's batch fingerprints, each host's log."""
    logs = []
    for proc in procs:
        try:
            logs.append(proc.communicate(timeout=600)[1])
        except subprocess.TimeoutExpired:  # a collective only some processes entered
            for p in procs:
                p.kill()
            raise AssertionError("the hosts did not finish within 600 s") from None
        assert proc.returncode == 0, logs[-1][-3000:]
    out = folder / "result.json"
    return {"losses": json.loads(out.read_text())["losses"], "logs": logs,
            "batches": [json.loads(Path(f"{out}.rank{r}").read_text()) for r in range(processes)]}


HOSTS_STEPS = 12
HOSTS_JOB = [*EAGER, "--runtime.backend", "native", "--runtime.device", "cpu",
             "--training.global_batch_size", "8", "--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "4",
             "--training.steps", str(HOSTS_STEPS), "--checkpoint.enable", "--checkpoint.interval", "1000"]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> dict:
    """The debug model (two layers) on two hosts x two processes (fsdp=4), uninterrupted."""
    folder = tmp_path_factory.mktemp("two_hosts")
    plan, procs = start_hosts(tiny_args(folder, *HOSTS_JOB), 2, folder)
    return finish_hosts(procs, folder) | {"plan": plan}


def test_two_hosts_on_loopback_train_as_one_host_each_on_its_own_data(two_hosts, tmp_path):
    """NNODES=2 on 127.0.0.1, as run_train.sh plans it (its dry run: torchrun's rendezvous, two
    processes per host for fsdp=4), against one host with four processes: the same losses, and each
    data-parallel rank reads the same batches of the embedded text corpus (a stream split per rank)
    in both, the two hosts' batches disjoint and together the one host's."""
    plan, procs = start_hosts(tiny_args(tmp_path, *HOSTS_JOB), 1, tmp_path)
    one, two = finish_hosts(procs, tmp_path) | {"plan": plan}, two_hosts
    assert [v["NPROC_PER_NODE"] for v, _ in one["plan"]] == ["4"]
    assert [v["NPROC_PER_NODE"] for v, _ in two["plan"]] == ["2", "2"]
    port = two["plan"][0][0]["MASTER_PORT"]
    assert two["plan"][1][0]["TTX_RDZV"] == f"--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --master-port {port}"
    close(two["losses"], one["losses"], rtol=1e-6)
    assert two["batches"] == one["batches"] and all(len(b) == HOSTS_STEPS for b in one["batches"])
    host0, host1 = (set(two["batches"][0] + two["batches"][1]), set(two["batches"][2] + two["batches"][3]))
    assert not host0 & host1 and len(host0) == len(host1) == 2 * HOSTS_STEPS


def copy_folder(src: str, dst: str) -> None:
    """Every file of `src` into `dst`, each a local folder or a gs:// URL."""
    from torchtitan_xla import storage

    for name in storage.file_sizes(src):
        data = storage.read_bytes(storage.join(src, name))
        if storage.is_url(dst):
            fs, path = storage.filesystem(dst)
            fs.pipe_file(f"{path.rstrip('/')}/{name}", data)
        else:
            Path(dst, name).parent.mkdir(parents=True, exist_ok=True)
            Path(dst, name).write_bytes(data)


def test_sigterm_to_one_process_of_one_host_stops_both_hosts_at_one_step_and_resumes_exactly(
        two_hosts, tmp_path):
    """Two hosts x two processes, the checkpoint folder on the Cloud Storage emulator: SIGTERM to
    one process of host 1 only. Every process agrees on the step to stop after, the checkpoint of
    that step is the only one, all exit 0; the same command resumes it on two hosts (from the
    emulator), and on one host with four processes (from a local copy), with the uninterrupted
    run's losses, bit for bit."""
    import signal

    from object_storage import GCS_BUCKET, environment, gcs_server

    from torchtitan_xla.checkpoint import committed_steps

    folder = tmp_path / "preempted"
    with gcs_server() as gcs, environment(gcs):
        bucket = f"gs://{GCS_BUCKET}"
        saved = f"{bucket}/preempted/checkpoint"
        _, (host0, host1) = start_hosts(tiny_args(folder, *HOSTS_JOB, "--checkpoint.folder", saved), 2, folder)
        log0 = []
        for line in host0.stderr:  # rank 0 logs the steps
            log0.append(line)
            if re.search(r"step:\s+3 ", line):
                worker = subprocess.run(["pgrep", "-P", str(host1.pid)], capture_output=True, text=True)
                os.kill(int(worker.stdout.split()[0]), signal.SIGTERM)
                break
        preempted = finish_hosts([host0, host1], folder)
        # Each process says where it stopped: four times the same step.
        stops = re.findall(r"Preempted: stopped after step (\d+)", "".join(log0) + "".join(preempted["logs"]))
        assert len(stops) == 4 and len(set(stops)) == 1, preempted["logs"][0][-3000:]
        stopped = int(stops[0])
        assert 3 <= stopped < HOSTS_STEPS and "SIGTERM received" in preempted["logs"][1]
        assert committed_steps(saved) == [stopped]
        after = {s: v for s, v in two_hosts["losses"].items() if int(s) > stopped}
        resumed = {}
        for hosts, checkpoint in ((2, f"{bucket}/resumed_on_2/checkpoint"), (1, str(tmp_path / "resumed_on_1" / "checkpoint"))):
            again = tmp_path / f"resumed_on_{hosts}"
            copy_folder(saved, checkpoint)
            flags = tiny_args(again, *HOSTS_JOB, "--checkpoint.folder", checkpoint)
            resumed[hosts] = finish_hosts(start_hosts(flags, hosts, again)[1], again)
            assert f"step-{stopped}" in resumed[hosts]["logs"][0]
            assert resumed[hosts]["losses"] == after, hosts
