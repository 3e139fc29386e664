"""Metrics: the TensorBoard scalars are the logged values, MFU is the hand-computed number, a real
TensorBoard server serves them, the PNG shows them, logging costs no transfer or graph, and the
profiler traces exactly the configured steps."""

import gzip
import json
import logging
import os
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import REPO, capture_logs, event_scalars, tiny_args

from torchtitan_xla import metrics, peak_flops
from torchtitan_xla.config import ConfigError, parse_args
from torchtitan_xla.goodput import BADPUT

SEQ_LEN = 32  # no other in-process test uses it, so the graph compile counts here are our own
TB_ARGS = ("--training.seq_len", str(SEQ_LEN), "--training.steps", "6", "--metrics.log_freq", "2")
LOG_STEPS = [1, 2, 4, 6]


def _run(dump: Path, *extra: str):
    """train.main in this process: (history, log records, transfers from device, compiles)."""
    import torch_xla.debug.metrics as met

    import train

    def counts():
        transfers = met.metric_data("TransferFromDeviceTime")
        compiles = met.metric_data("CompileTime")
        return (transfers[0] if transfers else 0), (compiles[0] if compiles else 0)

    before = counts()
    with capture_logs() as handler:
        history = train.main(parse_args(tiny_args(dump, *extra)))
    after = counts()
    return history, handler, after[0] - before[0], after[1] - before[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, xla_device):
    """The same short job twice: TensorBoard off (and no peak: MFU n/a), then on with a peak."""
    off_dump, on_dump = tmp_path_factory.mktemp("tb_off"), tmp_path_factory.mktemp("tb_on")
    off = _run(off_dump, *TB_ARGS)
    on = _run(on_dump, *TB_ARGS, "--metrics.enable_tensorboard", "--metrics.peak_flops", "1e12")
    (tb_dir,) = (on_dump / "tb").iterdir()  # one folder per launch
    return {"off": off, "on": on, "tb_dir": tb_dir, "dump": on_dump}


# --------------------------------------------------------------------------------------------
# TensorBoard
# --------------------------------------------------------------------------------------------


def test_tensorboard_scalars_are_the_logged_values(runs):
    history, *_ = runs["on"]
    scalars = event_scalars(runs["tb_dir"])
    # Goodput (docs/metrics.md) once, at the end of the run: its share of the time, and each badput's.
    goodput = {tag: scalars.pop(tag) for tag in list(scalars) if tag.startswith("goodput/")}
    assert set(goodput) == {"goodput/goodput(%)", "goodput/wasted_steps", *(
        f"goodput/badput_{name.replace(' ', '_')}(%)" for name in BADPUT)}
    assert all([s for s, _ in points] == LOG_STEPS[-1:] for points in goodput.values())
    assert 0 < goodput["goodput/goodput(%)"][0][1] < 100 and goodput["goodput/wasted_steps"][0][1] == 0
    assert sum(v for tag, [(_, v)] in goodput.items() if "badput" in tag) == pytest.approx(
        100 - goodput["goodput/goodput(%)"][0][1], abs=1e-3)
    assert {"loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "grad_norm", "lr",
            "loss_metrics/nonfinite_steps", "throughput(tps)", "tflops", "mfu(%)", "time_metrics/end_to_end(s)",
            "time_metrics/data_loading(s)", "time_metrics/data_loading(%)", "xla/num_compiles",
            "xla/compile_time(s)", "memory/host_rss(GiB)", "memory/host_max_rss(GiB)"
            } == set(scalars)
    for tag, points in scalars.items():
        assert [s for s, _ in points] == LOG_STEPS, tag
    # Loss and grad norm are float32 on the device and stored as float32: exactly equal.
    assert [v for _, v in scalars["loss_metrics/global_avg_loss"]] == [s.loss for s in history]
    assert [v for _, v in scalars["grad_norm"]] == [s.grad_norm for s in history]
    # One data-parallel rank: its mean is the global mean.
    assert scalars["loss_metrics/global_max_loss"] == scalars["loss_metrics/global_avg_loss"]
    assert [v for _, v in scalars["lr"]] == [float(np.float32(s.lr)) for s in history]
    # The process's compile count (tests before may have compiled too): the first run compiled the
    # step, this one nothing, so it stays at what it was when this run started.
    compiles = [v for _, v in scalars["xla/num_compiles"]]
    assert compiles == [compiles[0]] * 4 and compiles[0] >= 2 and runs["on"][3] == 0
    rss = [v for _, v in scalars["memory/host_rss(GiB)"]]
    assert all(0.1 < v < 24 for v in rss), rss  # this process's RSS, in GiB, on a 24 GiB machine


def test_mfu_equals_the_hand_computed_value(runs):
    """debugmodel: dim 256, 8 layers, 16 heads of 16, SwiGLU hidden 768, vocab 2256."""
    layer = 4 * 256 * 256 + 3 * 256 * 768 + 2 * 256  # attention, feed-forward, two norms
    n_no_embedding = 8 * layer + 256 + 256 * 2256  # + final norm + output projection
    flops_per_token = 6 * n_no_embedding + 12 * 8 * 16 * 16 * SEQ_LEN
    assert flops_per_token == 45_172_224
    scalars = event_scalars(runs["tb_dir"])
    for (_, tps), (_, step_time), (_, tflops), (_, mfu) in zip(
            scalars["throughput(tps)"], scalars["time_metrics/end_to_end(s)"], scalars["tflops"],
            scalars["mfu(%)"], strict=True):
        # Stored as float32, so 1e-6 relative. tokens/s: global batch 8 x 32 over 1 device.
        assert tps == pytest.approx(8 * SEQ_LEN / step_time, rel=1e-6)
        assert tflops == pytest.approx(flops_per_token * tps / 1e12, rel=1e-6)
        assert mfu == pytest.approx(100 * flops_per_token * tps / 1e12, rel=1e-6)  # peak 1e12


def test_tensorboard_server_serves_the_loss_over_http(runs):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tensorboard = Path(sys.executable).parent / "tensorboard"
    proc = subprocess.Popen(
        [str(tensorboard), "--logdir", str(runs["dump"] / "tb"), "--host", "127.0.0.1",
         "--port", str(port), "--load_fast=false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline, run_names = time.monotonic() + 30, []
        while not run_names and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                run_names = json.load(urllib.request.urlopen(f"{base}/data/runs", timeout=2))
            except OSError:
                pass
        assert run_names == [runs["tb_dir"].name]
        query = urllib.parse.urlencode({"run": run_names[0], "tag": "loss_metrics/global_avg_loss"})
        points = json.load(urllib.request.urlopen(f"{base}/data/plugin/scalars/scalars?{query}"))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    history, *_ = runs["on"]
    assert [(step, value) for _, step, value in points] == [(s.step, s.loss) for s in history]


def test_plot_runs_draws_the_event_file_data(runs, tmp_path):
    import matplotlib.image
    import matplotlib.pyplot as plt
    from torch.utils.tensorboard import SummaryWriter

    from torchtitan_xla.tools import plot_runs

    other = tmp_path / "other_run"  # a second run to compare with, known values
    with SummaryWriter(str(other / "tb" / "20250101-000000")) as w:
        for step in (1, 5, 9):
            w.add_scalar("loss_metrics/global_avg_loss", 10.0 - step / 2, step)
    out = tmp_path / "curves.png"
    fig = plot_runs.plot_runs([runs["dump"], other], out)
    expected = {str(runs["dump"]): event_scalars(runs["tb_dir"]),
                str(other): event_scalars(other / "tb" / "20250101-000000")}
    loss_ax, tps_ax = fig.axes
    assert loss_ax.get_title() == "loss_metrics/global_avg_loss"
    assert {ln.get_label() for ln in loss_ax.lines} == set(expected)
    for ax in (loss_ax, tps_ax):
        for line in ax.lines:
            points = [(int(x), y) for x, y in line.get_xydata()]
            assert points == expected[line.get_label()][ax.get_title()]
    assert [ln.get_label() for ln in tps_ax.lines] == [str(runs["dump"])]  # other has no tps
    plt.close(fig)
    image = matplotlib.image.imread(out)
    assert image.shape[:2] == (400, 1200)  # two 6x4-inch panels at 100 dpi
    assert len(np.unique(image.reshape(-1, image.shape[-1]), axis=0)) > 10  # not blank

    # The command line: same picture, and one clear line for a folder without event files.
    cli = subprocess.run([sys.executable, "-m", "torchtitan_xla.tools.plot_runs", str(other),
                          "--out", str(tmp_path / "cli.png")], capture_output=True, text=True,
                         cwd=REPO)
    assert cli.returncode == 0 and (tmp_path / "cli.png").stat().st_size > 0, cli.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = subprocess.run([sys.executable, "-m", "torchtitan_xla.tools.plot_runs", str(empty)],
                         capture_output=True, text=True, cwd=REPO)
    assert bad.returncode == 2
    assert bad.stderr == (f"error: {empty}: no TensorBoard event files under it "
                          "(was the run started with --metrics.enable_tensorboard?)\n")


# --------------------------------------------------------------------------------------------
# Cost of logging, console line
# --------------------------------------------------------------------------------------------


def test_logging_adds_no_transfer_and_no_graph(runs):
    off_history, _, off_transfers, _ = runs["off"]
    on_history, _, on_transfers, on_compiles = runs["on"]
    # Exactly one device-to-host transfer per log step, with or without TensorBoard, and one at
    # step 2 (the replayed step's check of its frozen inputs); none anywhere else in the run:
    # init, data, lr schedule, memory or compile statistics.
    assert off_transfers == on_transfers == len(LOG_STEPS) + 1
    # The second run found both of its graphs in the first run's cache: logging changed no graph.
    assert on_compiles == 0
    assert [s.loss for s in on_history] == [s.loss for s in off_history]  # bit for bit


def test_console_line_and_the_one_mfu_warning(runs):
    _, off_log, *_ = runs["off"]
    _, on_log, *_ = runs["on"]
    assert off_log.messages(logging.WARNING) == [
        "MFU: n/a, no peak FLOP/s known for 'CPU' (set metrics.peak_flops)"]
    assert on_log.messages(logging.WARNING) == []
    for log, mfu in ((off_log, "mfu: n/a"), (on_log, "mfu: ")):
        lines = [m for m in log.messages() if m.startswith("step:")]
        assert [int(m.split()[1]) for m in lines] == LOG_STEPS
        for line in lines:
            assert mfu in line and "GiB(host RSS, peak " in line and "eta: " in line
            assert "\033[" not in line  # the log is not a terminal: no colour codes
        assert lines[-1].endswith("eta: 0:00:00")
    assert "mfu: n/a" not in "".join(on_log.messages())
    memory_notes = [m for m in on_log.messages() if m.startswith("memory: showing")]
    # The reason in plain words, not torch_xla's internal `Check failed: device != spmd_device_str`.
    assert memory_notes == ["memory: showing this process's host RSS; device memory statistics are "
                            "unavailable here (torch_xla 2.9 gives none for the SPMD virtual device, "
                            "pytorch/xla#9022)"]
    assert not any("Check failed" in m for m in on_log.messages())


def test_colours_only_on_a_terminal_and_not_under_ci(monkeypatch):
    class Tty:
        def isatty(self):
            return True

    monkeypatch.delenv("CI", raising=False)
    assert metrics._Colors(True, Tty()).green == "\033[32m"
    assert metrics._Colors(False, Tty()).green == ""
    assert metrics._Colors(True, open(os.devnull, "w")).green == ""  # a file
    monkeypatch.setenv("CI", "true")
    assert metrics._Colors(True, Tty()).green == ""


def test_eta_from_the_recent_step_time(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: now[0])
    m = metrics.MetricLogger(flops_per_token=1, tokens_per_step=1, num_devices=1, color=False,
                             total_steps=1010, enabled=False)
    m.reset_timer(0)
    now[0] = 160.0  # 60 s for 10 steps
    stats = m.log(10, 1.0, 1.0, 1e-3)
    assert stats.step_time == 6.0 and stats.eta_seconds == 6000.0
    assert metrics._eta(stats.eta_seconds) == "1:40:00"


# --------------------------------------------------------------------------------------------
# Data-parallel max loss
# --------------------------------------------------------------------------------------------


def test_max_rank_loss_is_the_largest_rank_mean_over_counted_tokens():
    token_losses = torch.tensor([[1.0, 2.0, 3.0, 4.0], [9.0, 9.0, 0.0, 1.0]])  # [dp ranks 2, tokens 4]
    everything = torch.ones_like(token_losses, dtype=torch.bool)
    assert metrics.max_rank_loss(token_losses, everything).item() == 4.75
    assert metrics.max_rank_loss(token_losses).item() == 4.75  # no mask: every token counts
    # Masked labels (loss 0) do not dilute a rank's mean: rank 0 counts 3 and 4 only.
    counted = torch.tensor([[False, False, True, True], [True, True, True, True]])
    assert metrics.max_rank_loss(token_losses * counted, counted).item() == 4.75
    counted[1] = torch.tensor([True, False, False, False])
    assert metrics.max_rank_loss(token_losses * counted, counted).item() == 9.0
    # A rank with nothing counted contributes 0, not NaN.
    assert metrics.max_rank_loss(torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.bool)).item() == 0.0


_DRIVER = """
import dataclasses, json, sys
sys.path.insert(0, {repo!r})
import train
from torchtitan_xla.config import parse_args
history = train.main(parse_args(sys.argv[1:]))
print("HISTORY " + json.dumps([dataclasses.asdict(s) for s in history]))
"""


def test_max_loss_over_two_data_parallel_ranks(tmp_path, xla_device):
    """Two ranks of 4 sequences each: step 1's max is the larger of the two halves' mean losses.
    Rank 0's mean is a one-device run on its 4 sequences; the global loss averages both halves.
    (The data order is the same whatever the layout, as the 8-vs-1-device loss test relies on.)"""
    import train

    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="2")
    p = subprocess.Popen(  # runs while this process computes rank 0's loss
        [sys.executable, "-c", _DRIVER.format(repo=str(REPO)),
         *tiny_args(tmp_path / "dp2", "--training.steps", "2", "--training.local_batch_size", "4")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    rank0 = train.main(parse_args(tiny_args(
        tmp_path / "rank0", "--training.steps", "1", "--training.local_batch_size", "4")))[0].loss
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr[-3000:]
    history = json.loads(next(ln for ln in stdout.splitlines() if ln.startswith("HISTORY "))[8:])
    assert "mesh {'pp': 1, 'dp_replicate': 1, 'fsdp': 2, 'ep': 1, 'cp': 1, 'tp': 1}" in stderr
    first = history[0]
    rank1 = 2 * first["loss"] - rank0
    # 2*loss - rank0 doubles float32 rounding of values near 8: 1e-5 relative covers it.
    assert first["max_loss"] == pytest.approx(max(rank0, rank1), rel=1e-5)
    assert abs(rank0 - rank1) > 1e-3  # the halves differ, so max != mean is really tested
    assert all(s["max_loss"] > s["loss"] for s in history)
    assert f"(max {first['max_loss']:.4f})" in stderr  # on the console when dp > 1


# --------------------------------------------------------------------------------------------
# Peak FLOP/s, memory, which host logs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, generation", [
    ("TPU v4", "v4"), ("v4-8", "v4"), ("TPU v5 lite", "v5e"), ("v5litepod-16", "v5e"),
    ("v5e", "v5e"), ("TPU v5", "v5p"), ("v5p-128", "v5p"), ("TPU v6 lite", "v6e"),
    ("v6e-8", "v6e"), ("TPU7x", "v7"), ("tpu7x-8", "v7"), ("v7", "v7"),
    ("TPU v4 lite", None), ("TPU v3", None), ("CPU", None), ("TPU", None), ("v2-8", None)])
def test_tpu_generation_from_device_kind_or_accelerator_type(kind, generation):
    assert peak_flops.tpu_generation(kind) == generation


def test_peak_flops_table_override_and_float8_hook():
    assert peak_flops.resolve_peak_flops("v5p-8", None) == (
        459e12, "TPU v5p bf16 peak 459 TFLOP/s per device")
    assert peak_flops.resolve_peak_flops("tpu7x-8", None)[0] == 1153.5e12  # 2307 per 2-device chip
    assert peak_flops.resolve_peak_flops("v6e-8", 5e9) == (5e9, "metrics.peak_flops = 5e+09")
    assert peak_flops.resolve_peak_flops("CPU", None) == (
        None, "no peak FLOP/s known for 'CPU' (set metrics.peak_flops)")
    assert peak_flops.resolve_peak_flops("v6e-8", None, float8=True)[0] is None
    assert peak_flops.resolve_peak_flops("v6e-8", 1e15, float8=True)[0] == 1e15


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 NVL", 835e12), ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H200", 989e12), ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA B200", 2.25e15),
    ("NVIDIA GB200", 2.5e15), ("AMD Instinct MI300X", 1307e12), ("NVIDIA GeForce RTX 4090", None)])
def test_gpu_peak_comes_from_the_device_name(name, peak):
    """torch.cuda.get_device_name's text: the longest matching model wins (H100 NVL, not H100)."""
    assert peak_flops.resolve_peak_flops(name, None)[0] == peak


def test_tpu_kind_comes_from_the_accelerator_type(monkeypatch):
    import torch_xla.runtime as xr

    monkeypatch.setattr(xr, "device_type", lambda: "TPU")
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5litepod-16")
    kind = peak_flops.detect_device_kind()
    assert kind == "v5litepod-16"
    assert peak_flops.resolve_peak_flops(kind, None)[0] == 197e12


def test_memory_shows_hbm_where_the_runtime_has_it_else_labelled_host_rss(monkeypatch, xla_device):
    import torch_xla.core.xla_model as xm

    host = metrics.MemoryMonitor(xla_device).read()  # CPU under SPMD: no allocator statistics
    assert host.source == "host RSS" and host.limit_gib is None
    assert set(host.scalars()) == {"memory/host_rss(GiB)", "memory/host_max_rss(GiB)"}
    monkeypatch.setattr(xm, "get_memory_info", lambda device: {
        "bytes_used": 10 * 2**30, "peak_bytes_used": 12 * 2**30, "bytes_limit": 16 * 2**30})
    hbm = metrics.MemoryMonitor(xla_device).read()
    assert str(hbm) == "10.00/16.00GiB(HBM, peak 12.00)"
    assert hbm.scalars() == {"memory/active(GiB)": 10.0, "memory/max_active(GiB)": 12.0,
                             "memory/max_active(%)": 75.0}


def _host_logger(tmp_path, host_rank, *flags):
    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--metrics.enable_tensorboard", *flags])
    return metrics.build_metric_logger(cfg, flops_per_token=10, tokens_per_step=8, num_devices=1,
                                       dp_degree=1, host_rank=host_rank)


def test_rank_0_only_decides_which_hosts_log(tmp_path, xla_device):
    with capture_logs() as handler:
        quiet = _host_logger(tmp_path / "a", 1)  # rank_0_only (default), host 1
        quiet.log(1, 2.0, 1.0, 1e-3)
        quiet.close()
        assert not (tmp_path / "a").exists() and handler.messages() == []
        assert handler.messages(logging.WARNING) == []  # not even the MFU warning

        loud = _host_logger(tmp_path / "b", 1, "--metrics.no-rank_0_only")
        loud.log(1, 2.0, 1.0, 1e-3)
        loud.close()
    (rank_dir,) = (tmp_path / "b" / "tb").glob("*/rank_1")
    assert event_scalars(rank_dir)["loss_metrics/global_avg_loss"] == [(1, 2.0)]
    assert "mfu(%)" not in event_scalars(rank_dir)  # no peak known: no made-up value
    assert any(m.startswith("step:     1  loss:   2.0000") for m in handler.messages())


# --------------------------------------------------------------------------------------------
# Profiling
# --------------------------------------------------------------------------------------------


def _traced_executions(trace_dir: Path) -> int:
    """Step-graph executions in a trace (the CPU backend's PJRT client names them this way)."""
    (trace,) = trace_dir.glob("plugins/profile/*/*.trace.json.gz")
    events = json.load(gzip.open(trace))["traceEvents"]
    return sum(e.get("name") == "PjRtComputationClient::ExecuteReplicated" for e in events)


def test_profiler_traces_exactly_the_configured_windows(tmp_path, xla_device):
    history, log, _, compiles = _run(
        tmp_path, "--training.seq_len", "24", "--training.steps", "6",
        "--profiling.enable_profiling", "--profiling.profile_freq", "3",
        "--profiling.profiler_active", "2",
        "--profiling.save_xla_metrics_report")
    traces = tmp_path / "profile_traces"
    assert sorted(p.name for p in traces.iterdir()) == ["iteration_3", "iteration_6"]
    for window in traces.iterdir():
        assert len(list(window.glob("plugins/profile/*/*.xplane.pb"))) == 1  # TensorBoard's format
        assert _traced_executions(window) == 2  # steps 2-3 and 5-6, each run once on the device
    assert compiles == 2 and len(history) == 6  # tracing added no graph
    assert "Profiler: steps 2-3 traced to" in "\n".join(log.messages())
    report = (tmp_path / "xla_metrics_report.txt").read_text()
    assert "Metric: CompileTime\n  TotalSamples: " in report and "TransferFromDeviceTime" in report


def test_an_error_still_closes_the_trace_and_writes_the_report(tmp_path, xla_device):
    """What train.py's loop gets when a step raises (e.g. the recompile error) inside a window."""
    from torchtitan_xla.profiling import maybe_enable_profiling

    cfg = parse_args(["--job.dump_folder", str(tmp_path), "--profiling.enable_profiling",
                      "--profiling.profile_freq", "2", "--profiling.profiler_active", "2",
                      "--profiling.save_xla_metrics_report"])
    x = torch.ones(4, device=xla_device)
    with pytest.raises(RuntimeError, match="boom"):
        with maybe_enable_profiling(cfg) as profiler:
            profiler.step(1)  # opens the window of steps 1-2
            (x * 3).sum().tolist()
            raise RuntimeError("boom")
    assert list((tmp_path / "profile_traces" / "iteration_2").glob("plugins/profile/*/*.xplane.pb"))
    assert "Metric: TransferFromDeviceTime" in (tmp_path / "xla_metrics_report.txt").read_text()


def test_profiler_window_longer_than_its_period_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^command line: --profiling.profiler_active = 5: "
                                          r"must be <= profiling.profile_freq \(4\)"):
        parse_args(["--profiling.profile_freq", "4", "--profiling.profiler_active", "5"])
