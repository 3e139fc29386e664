"""The native runtime (`[runtime] backend = "native"`): real processes on the CPU with gloo, each a
device of one DeviceMesh, against one process and against the XLA runtime.

Every run trains the debug model at the test size on synthetic data, whose global batch is the same
whatever the number of processes (datasets/packing.py), so losses can be compared step by step."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO, run_train, tiny_args, train_run

NATIVE = ["--runtime.backend", "native", "--training.dataset", "synthetic", "--training.steps", "10",
          "--training.global_batch_size", "8"]
EAGER = ["--compile.step", "eager"]
EXPORT = ["--checkpoint.last_save_in_hf", "true"]  # after the last step, into checkpoint/step-10-hf


def native(folder: Path, processes: int, *extra: str, overrides: dict | None = None,
           timeout: int = 900) -> dict:
    """train.py's main on `processes` torchrun processes (tests/native_driver.py): rank 0's
    losses, grad norms and parameter layouts. `overrides`: ModelArgs fields."""
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(processes), str(REPO / "tests" / "native_driver.py"), *tiny_args(folder, *NATIVE, *extra)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "PJRT_"))}
    env["NATIVE_OUT"], env["NATIVE_OVERRIDES"] = str(out), json.dumps(overrides or {})
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    assert p.returncode == 0, p.stderr[-4000:]
    result = json.loads(out.read_text())
    result["log"], result["folder"] = p.stderr, folder
    return result


def close(got: dict, expected: dict, rtol: float) -> None:
    assert got.keys() == expected.keys()
    for step, value in expected.items():
        assert abs(got[step] - value) <= rtol * abs(value), (step, got[step], value)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """The reference: the same global batch on one process (every mesh axis of size 1)."""
    return native(tmp_path_factory.mktemp("one"), 1, *EAGER, "--training.local_batch_size", "8",
                  *EXPORT)


MESHES = {
    "fsdp=8": ["--training.local_batch_size", "1"],
    "fsdp=4 x tp=2": ["--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "4",
                      "--parallelism.tensor_parallel_degree", "2", *EXPORT],
    "dp_replicate=2 x fsdp=4": ["--training.local_batch_size", "1",
                                "--parallelism.data_parallel_replicate_degree", "2",
                                "--parallelism.data_parallel_shard_degree", "4"],
}


def expected_placements(spec: list, sizes: dict[str, int]) -> list[str]:
    """DTensor placements of a partition spec on the mesh (MESH_AXES order): Shard(d) for an axis
    of more than one device on dimension d, Replicate otherwise."""
    from torchtitan_xla.parallelisms import MESH_AXES

    out = []
    for axis in MESH_AXES:
        dims = [d for d, a in enumerate(spec) if a == axis or (isinstance(a, list) and axis in a)]
        out.append(f"Shard(dim={dims[0]})" if dims and sizes[axis] > 1 else "Replicate()")
    return out


@pytest.mark.parametrize("mesh", MESHES)
def test_eight_processes_give_the_one_process_losses_with_each_parameter_sharded_by_its_spec(
        mesh, one_process, tmp_path):
    import torch

    from torchtitan_xla.models import get_model_args, get_model_class
    from torchtitan_xla.parallelisms import ParallelDims
    from torchtitan_xla.parallelisms.parallelize_llama import param_specs

    run = native(tmp_path, 8, *EAGER, *MESHES[mesh])
    # float32, the same sums in another order (reductions across processes): 2.4e-7 measured.
    close(run["losses"], one_process["losses"], rtol=1e-6)
    close(run["grad_norms"], one_process["grad_norms"], rtol=1e-6)

    flags = dict(zip(MESHES[mesh][::2], MESHES[mesh][1::2]))
    rep = int(flags.get("--parallelism.data_parallel_replicate_degree", 1))
    tp = int(flags.get("--parallelism.tensor_parallel_degree", 1))
    dims = ParallelDims(dp_replicate=rep, dp_shard=8 // (rep * tp), tp=tp)
    sizes = dict(zip(("dp_replicate", "fsdp", "ep", "tp"), dims.mesh_shape))
    with torch.device("meta"):
        model = get_model_class("llama3")(get_model_args("llama3", "debugmodel", vocab_size=2256,
                                                          max_seq_len=64))
    specs = param_specs(model, dims)
    layout = run["layout"]
    assert layout.keys() == specs.keys()
    for name, spec in specs.items():
        got = layout[name]
        assert got["spec"] == [list(a) if isinstance(a, tuple) else a for a in spec], name
        assert got["placements"] == expected_placements(got["spec"], sizes), name
        # The block each process holds: the spec really splits the tensor.
        shards = [1] * len(got["shape"])
        for axis, size in sizes.items():
            for d, a in enumerate(got["spec"]):
                if size > 1 and (a == axis or (isinstance(a, list) and axis in a)):
                    shards[d] *= size
        assert got["local"] == [n // s for n, s in zip(got["shape"], shards)], name
    assert any(s > 1 for got in layout.values() for s in
               [n // m for n, m in zip(got["shape"], got["local"])])
    if "--checkpoint.last_save_in_hf" in flags:
        # The HF export after training: every process gathers, process 0 writes the whole weights.
        from safetensors.torch import load_file

        def weights(folder: Path) -> dict:
            return {k: v for f in sorted((folder / "checkpoint" / "step-10-hf").glob("*.safetensors"))
                    for k, v in load_file(f).items()}

        got, want = weights(tmp_path), weights(one_process["folder"])
        assert got.keys() == want.keys() and len(got) == len(layout)
        # After 10 AdamW steps: the 8 processes' sums round otherwise, and Adam's normalised update
        # turns that into up to 4.3e-6 on a few elements (measured); a block gathered to the wrong
        # place would be off by the weights' own size (0.02-5).
        for name, value in want.items():
            torch.testing.assert_close(got[name], value, rtol=0, atol=1e-5, msg=name)


def test_gradient_accumulation_and_activation_checkpointing_keep_the_one_process_losses(one_process, tmp_path):
    """tp=2 on two processes, the global batch of 8 as two microbatches of 4, every block
    recomputed in the backward (full activation checkpointing): the one-process losses and
    gradient norms (batch 8 at once, nothing recomputed) within float32 reordering."""
    run = native(tmp_path, 2, *EAGER, "--training.local_batch_size", "4", "--parallelism.tensor_parallel_degree", "2",
                 "--activation_checkpoint.mode", "full")
    assert "2 accumulation step(s)" in run["log"] and "Activation checkpointing: full" in run["log"]
    close(run["losses"], one_process["losses"], rtol=1e-6)
    close(run["grad_norms"], one_process["grad_norms"], rtol=1e-6)


COMPILES = re.compile(r"step:\s+(\d+) .* compiles: (\d+)")


def test_compiled_step_gives_the_eager_losses_and_compiles_nothing_after_warm_up(tmp_path):
    """The default step on the native runtime (`[compile] step` left at its default) is
    torch.compile per block, here on two processes (tp=2) against one eager process. Ten blocks,
    more than dynamo's recompile limit (8): the blocks must share their graphs. A compile after
    step 2 would stop the run (on_recompile = "error")."""
    deep = {"n_layers": 10}
    eager = native(tmp_path / "eager", 1, *EAGER, "--training.local_batch_size", "8", overrides=deep)
    run = native(tmp_path / "compiled", 2, "--training.local_batch_size", "8",
                 "--parallelism.tensor_parallel_degree", "2", "--debug.on_recompile", "error",
                 overrides=deep)
    assert "Compiling 10 blocks (torch.compile)" in run["log"]
    # Inductor fuses the blocks' element-wise ops (other roundings).
    close(run["losses"], eager["losses"], rtol=2e-5)
    compiles = {int(s): int(n) for s, n in COMPILES.findall(run["log"])}
    assert compiles[1] > 0 and len(set(c for s, c in compiles.items() if s >= 2)) == 1, compiles


@pytest.fixture(scope="module")
def seed(tmp_path_factory) -> Path:
    """A seed checkpoint (the initial weights alone) written by the XLA runtime."""
    folder = tmp_path_factory.mktemp("seed")
    p = run_train(tiny_args(folder, "--checkpoint.create_seed_checkpoint"))
    assert p.returncode == 0, p.stderr[-3000:]
    return folder / "checkpoint" / "step-0"


def test_both_runtimes_give_the_same_losses_from_one_seed_checkpoint(seed, tmp_path):
    """XLA and native, one process and fsdp=4 x tp=2, 20 steps from the same initial weights."""
    start = ["--checkpoint.initial_load_path", str(seed), "--training.steps", "20",
             "--training.local_batch_size", "8"]
    xla, _ = train_run(tiny_args(tmp_path / "xla", "--training.dataset", "synthetic",
                                 "--training.global_batch_size", "8", *start))
    one = native(tmp_path / "native1", 1, *EAGER, *start)
    mesh = native(tmp_path / "native8", 8, *EAGER, *start, "--training.local_batch_size", "2",
                  "--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2")
    expected = {str(k): v for k, v in xla.items()}
    # XLA CPU and eager PyTorch round float32 differently (fusions, dot kernels).
    close(one["losses"], expected, rtol=1e-5)
    close(mesh["losses"], expected, rtol=1e-5)


def test_the_loss_is_vocab_parallel_on_sharded_logits(tmp_path):
    """token_losses on logits sharded over the vocabulary (fsdp=2 x tp=2, four processes) equals
    F.cross_entropy (with label smoothing, z-loss, ignored labels) on the whole logits in float64,
    values and gradients, for three shapes; and runs only all-reduces of per-token values: the
    logits are never gathered (tests/native_loss_worker.py)."""
    out = tmp_path / "loss.json"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                        str(REPO / "tests" / "native_loss_worker.py")], capture_output=True, text=True,
                       env=dict(os.environ, NATIVE_OUT=str(out)), timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for case in json.loads(out.read_text()):
        assert case["placements"] == "(Shard(dim=0), Shard(dim=2))"
        assert case["value"] <= 1e-14 * case["scale"] and case["grad"] <= 1e-14, case
        assert case["collectives"] == ["c10d_functional.all_reduce"], case


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


def free_port() -> int:
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        return free.getsockname()[1]


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
        assert command[1:3] == ["-m", "torch.distributed.run"] and variables["TTX_RUNTIME"] == "native"
        command = [str(REPO / "tests" / "native_driver.py") if c.endswith("train.py") else c for c in command]
        command[command.index("--job.dump_folder") + 1] = str(folder)
        procs.append(subprocess.Popen(command, env=dict(env, **variables, NATIVE_OUT=str(folder / "result.json")),
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
HOSTS_JOB = [*EAGER, "--runtime.backend", "native", "--training.global_batch_size", "8",
             "--training.local_batch_size", "2", "--parallelism.data_parallel_shard_degree", "4",
             "--training.steps", str(HOSTS_STEPS), "--checkpoint.enable", "--checkpoint.interval", "1000"]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> dict:
    """The debug model on two hosts x two processes (fsdp=4), uninterrupted."""
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


def test_sigterm_to_one_process_of_one_host_stops_both_hosts_at_one_step_and_resumes_exactly(
        two_hosts, tmp_path):
    """Two hosts x two processes: SIGTERM to one process of host 1 only. Every process agrees on
    the step to stop after, the checkpoint of that step is the only one, all exit 0; the same
    command resumes it on two hosts, and on one host with four processes, with the uninterrupted
    run's losses, bit for bit."""
    import shutil
    import signal

    from torchtitan_xla.checkpoint import committed_steps

    folder = tmp_path / "preempted"
    _, (host0, host1) = start_hosts(tiny_args(folder, *HOSTS_JOB), 2, folder)
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
    assert committed_steps(folder / "checkpoint") == [stopped]
    after = {s: v for s, v in two_hosts["losses"].items() if int(s) > stopped}
    resumed = {}
    for hosts in (2, 1):
        again = tmp_path / f"resumed_on_{hosts}"
        shutil.copytree(folder / "checkpoint", again / "checkpoint")
        resumed[hosts] = finish_hosts(start_hosts(tiny_args(again, *HOSTS_JOB), hosts, again)[1], again)
        assert f"step-{stopped}" in resumed[hosts]["logs"][0]
        assert resumed[hosts]["losses"] == after, hosts


OPTIMIZER_MESHES = {"Lion": ["--parallelism.tensor_parallel_degree", "2"],
                    "Adafactor": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"],
                    "Muon": ["--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "4"]}


@pytest.mark.parametrize("optimizer", OPTIMIZER_MESHES)
def test_every_optimizer_gives_the_xla_runtimes_losses(optimizer, seed, tmp_path):
    """Beyond AdamW: each optimizer, 6 steps from one seed checkpoint, on two native processes
    (sharded moments, factored statistics over split dimensions, Newton-Schulz products of
    FSDP-sharded matrices) against the XLA runtime on one device. Measured: 3.5e-7 (all three also
    on fsdp=2 x tp=2, by hand)."""
    start = ["--checkpoint.initial_load_path", str(seed), "--training.steps", "6", "--optimizer.name", optimizer,
             "--training.local_batch_size", "8"]
    xla, _ = train_run(tiny_args(tmp_path / "xla", "--training.dataset", "synthetic", "--training.global_batch_size",
                                 "8", *start))
    mesh = native(tmp_path / "native", 2, *EAGER, *start, *OPTIMIZER_MESHES[optimizer])
    close(mesh["losses"], {str(k): v for k, v in xla.items()}, rtol=1e-5)


BAD = [
    (["--runtime.device", "tpu"], r"--runtime\.device.* = \"tpu\": torch-tpu is not installed"),
    (["--runtime.device", "cuda"], r"--runtime\.device.* = \"cuda\": torch sees no CUDA GPU"),
    (["--parallelism.tensor_parallel_degree", "2"],
     r"tensor_parallel_degree \(2\) = 2 does not divide the 1 devices \(tensor_parallel_degree from "
     r"the command line\)"),
    (["--compile.step", "lazy"], r"--compile\.step = \"lazy\" is torch_xla's; with \[runtime\] backend"),
    (["--compile.scan_layers"], r"--compile\.scan_layers = True is not available with \[runtime\] backend"),
]


@pytest.mark.parametrize("flags,message", BAD, ids=[b[0][0] for b in BAD])
def test_bad_native_input_is_one_line_before_any_model_is_built(flags, message, tmp_path):
    if "cuda" in flags:
        import torch

        if torch.cuda.is_available():
            pytest.skip("this machine has a GPU")
    p = run_train(tiny_args(tmp_path, "--runtime.backend", "native", *flags), env={"XLA_USE_SPMD": None})
    assert p.returncode == 2, p.stderr[-3000:]
    lines = p.stderr.strip().splitlines()
    assert re.search(message, lines[-1]), lines[-1]
    assert not any("Traceback" in line or "Model llama3" in line for line in lines), p.stderr


def test_a_checkpoint_resumes_on_the_other_runtime_as_if_never_interrupted(tmp_path):
    """XLA (fsdp=4 x tp=2) saves step 10, the native runtime (fsdp=2 x tp=2, four processes)
    resumes it; and the reverse, native (fsdp=2 x tp=2, saving asynchronously) to XLA (fsdp=4 x
    tp=2). Steps 11-20 equal
    the uninterrupted run's. The data loader's state moves too, from one data-parallel rank (XLA's
    one host loads the global batch) to two, and back: synthetic data continues at its global
    batch on any layout (datasets/loader.py)."""
    import shutil

    steps = ["--training.steps", "20", "--training.dataset", "synthetic",
             "--training.global_batch_size", "8", "--checkpoint.enable", "--checkpoint.interval", "10"]
    xla_mesh = ["--parallelism.data_parallel_shard_degree", "4", "--parallelism.tensor_parallel_degree", "2",
                "--training.local_batch_size", "2"]
    native_mesh = ["--parallelism.data_parallel_shard_degree", "2", "--parallelism.tensor_parallel_degree", "2",
                   "--training.local_batch_size", "4"]

    def resume_folder(src: Path, name: str) -> Path:
        folder = tmp_path / name
        shutil.copytree(src / "checkpoint" / "step-10", folder / "checkpoint" / "step-10")
        return folder

    xla, _ = train_run(tiny_args(tmp_path / "xla", *steps, *xla_mesh), devices=8)
    on_native = native(resume_folder(tmp_path / "xla", "on_native"), 4, *EAGER, *steps, *native_mesh)
    assert "Resumed from" in on_native["log"] or "step-10" in on_native["log"]
    assert sorted(map(int, on_native["losses"])) == list(range(11, 21))
    close(on_native["losses"], {str(s): v for s, v in xla.items() if s > 10}, rtol=1e-5)

    # Asynchronous saves: a device copy of each block, written while training goes on.
    base = native(tmp_path / "native", 4, *EAGER, *steps, *native_mesh, "--checkpoint.async_mode", "async")
    assert "Checkpoint step-10: staged" in base["log"]
    on_xla, _ = train_run(tiny_args(resume_folder(tmp_path / "native", "on_xla"), *steps, *xla_mesh),
                          devices=8)
    assert sorted(on_xla) == list(range(11, 21))
    close({str(s): v for s, v in on_xla.items()},
          {s: v for s, v in base["losses"].items() if int(s) > 10}, rtol=1e-5)
