"""Two hosts on loopback, launched the multi-host way (NNODES, NODE_RANK, MASTER_ADDR,
MASTER_PORT) through run_train.sh. On the CPU backend the processes cannot share one XLA mesh;
what is real and checked here: the launcher's host ids, the gloo group, the data shards, and
checkpoint coordination (a step saved by both hosts, then resumed by both; a preemption signal
that reaches one host only)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp
from helpers import REPO, free_port, tiny_args

from torchtitan_xla.checkpoint import committed_steps
from torchtitan_xla.config import parse_args
from torchtitan_xla.datasets import build_data_loader, build_tokenizer


def start_two(args: list[str], port: int) -> list[subprocess.Popen]:
    """The same run_train.sh command as host 0 and host 1, at the same time (run_train.sh execs
    Python: each Popen's pid is that host's training process)."""
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env |= {"PYTHON": sys.executable, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1",
                "NNODES": "2", "NODE_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([str(REPO / "run_train.sh"), *args], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=REPO))
    return procs


def finish(procs: list[subprocess.Popen], timeout: int = 600) -> list[subprocess.CompletedProcess]:
    """Wait for every host; hosts still running after `timeout` seconds (a collective that only
    some hosts entered waits for ever) are killed and fail the test."""
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"the hosts did not finish within {timeout} s") from None
    return results


def launch_two(args: list[str], port: int, timeout: int = 600) -> list[subprocess.CompletedProcess]:
    return finish(start_two(args, port), timeout)


def test_two_hosts_agree_on_ids_and_read_disjoint_shards(tmp_path):
    args = tiny_args(tmp_path)
    port = free_port()
    reports = []
    for r in launch_two(["--check-hosts", *args], port):
        assert r.returncode == 0, r.stderr[-3000:]
        line = next(ln for ln in r.stdout.splitlines() if ln.startswith("CHECK_HOSTS "))
        reports.append(json.loads(line[len("CHECK_HOSTS "):]))
    assert [r["rank"] for r in reports] == [0, 1]
    # What each host reported, as gathered over the gloo group: the same table on both.
    assert reports[0]["hosts"] == reports[1]["hosts"]
    table = reports[0]["hosts"]
    assert [(h["rank"], h["count"], h["coordinator"]) for h in table] == [
        (0, 2, f"127.0.0.1:{port}"), (1, 2, f"127.0.0.1:{port}")]
    # Each host's shard is what the loader gives that host index, and the shards are disjoint.
    cfg = parse_args(args)
    tokenizer = build_tokenizer(cfg.model.tokenizer_path)
    for rank in range(2):
        loader = build_data_loader(cfg, tokenizer, batch_size=1, host_rank=rank, host_count=2)
        expected = [hashlib.sha256(x.numpy().tobytes()).hexdigest()[:16]
                    for _, (x, _) in zip(range(16), loader)]
        assert table[rank]["sequences"] == expected
    assert len(table[0]["sequences"]) == 16
    assert not set(table[0]["sequences"]) & set(table[1]["sequences"])


def _run_two(dump: Path, steps: int, *extra: str) -> list[subprocess.CompletedProcess]:
    args = tiny_args(dump, "--training.steps", str(steps), "--checkpoint.enable",
                     "--checkpoint.interval", "2", "--lr_scheduler.warmup_steps", "1", *extra)
    runs = launch_two(args, free_port())
    for r in runs:
        assert r.returncode == 0, r.stderr[-3000:]
    return runs


def test_two_hosts_train_checkpoint_and_resume(tmp_path):
    first = _run_two(tmp_path, steps=2)
    groups = [re.search(r"Host group \(gloo\): 2 hosts, coordinator (\S+); 0=\S+, 1=\S+", r.stderr)
              for r in first]
    assert all(groups), first[0].stderr[-2000:]
    assert groups[0].group(1) == groups[1].group(1)
    assert all("CPU backend: the 2 processes cannot form one mesh" in r.stderr for r in first)
    # Host 0 logs the steps (metrics.rank_0_only); each host has its half of the global batch.
    assert "step:     2" in first[0].stderr
    # One committed step, written by both hosts, holding each host's own data-loader state.
    step = tmp_path / "checkpoint" / "step-2"
    assert (step / "COMMITTED").is_file()
    assert sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    keys = dcp.FileSystemReader(str(step)).read_metadata().state_dict_metadata
    assert sorted(k for k in keys if k.startswith("dataloader")) == ["dataloader/host_0",
                                                                      "dataloader/host_1"]
    # The same command again, for more steps: both hosts resume from step 2 (and save step 3
    # in the background, over the checkpoint's own gloo group).
    second = _run_two(tmp_path, 3, "--checkpoint.async_mode", "async")
    for r in second:
        assert f"Resumed from {step} (step 2)" in r.stderr, r.stderr[-2000:]
    assert "step:     3" in second[0].stderr and "step:     1 " not in second[0].stderr
    assert (tmp_path / "checkpoint" / "step-3" / "COMMITTED").is_file()


def test_sigterm_to_one_host_stops_both_at_the_same_step_with_one_checkpoint(tmp_path):
    """Preemption reaches the hosts at different times: here only host 1 gets SIGTERM. Both must
    save the same step (the hosts agree on stopping before deciding to save), exit 0, and resume
    from that step."""
    args = tiny_args(tmp_path, "--training.steps", "400", "--checkpoint.enable",
                     "--checkpoint.interval", "1000")
    host0, host1 = start_two(args, free_port())
    log0 = []
    for line in host0.stderr:  # host 0 logs the steps (rank_0_only)
        log0.append(line)
        if re.search(r"step:\s+3 ", line):
            host1.send_signal(signal.SIGTERM)
            break
    rest0, rest1 = finish([host0, host1], timeout=300)
    err0, err1 = "".join(log0) + rest0.stderr, rest1.stderr
    assert (host0.returncode, host1.returncode) == (0, 0), (err0[-2000:], err1[-2000:])
    assert "SIGTERM received" in err1 and "SIGTERM received" not in err0
    stops = [re.findall(r"Preempted: stopped after step (\d+)", err) for err in (err0, err1)]
    assert stops[0] == stops[1] and len(stops[0]) == 1, stops
    stopped = int(stops[0][0])
    assert 3 <= stopped < 400
    # One checkpoint, of that step, written by both hosts.
    assert committed_steps(tmp_path / "checkpoint") == [stopped]
    step = tmp_path / "checkpoint" / f"step-{stopped}"
    assert sorted(p.name for p in step.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    # The same command (for two more steps) resumes both hosts from it.
    again = launch_two([*args, "--training.steps", str(stopped + 2)], free_port())
    for r in again:
        assert r.returncode == 0, r.stderr[-2000:]
        assert f"Resumed from {step} (step {stopped})" in r.stderr
    assert f"step: {stopped + 1:>5}" in again[0].stderr and "step:     1 " not in again[0].stderr
