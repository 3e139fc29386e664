"""Draw runs' TensorBoard curves side by side into a PNG, to compare runs without a browser.

    python -m torchtitan_xla.tools.plot_runs outputs/run_a outputs/run_b --out curves.png
    python -m torchtitan_xla.tools.plot_runs outputs/a --tags loss_metrics/global_max_loss 'mfu(%)'

Each RUN_DIR may be a dump folder, its TensorBoard folder or one launch's folder: every folder under
it that holds event files is one curve, labelled with its path. One panel per tag (default: the
loss and tokens/s per device), steps on the x axis.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from torchtitan_xla.errors import ConfigError, run_main

DEFAULT_TAGS = ("loss_metrics/global_avg_loss", "throughput(tps)")


def find_runs(run_dirs: list[Path]) -> dict[str, Path]:
    """label -> folder holding event files, for every such folder under each RUN_DIR."""
    runs: dict[str, Path] = {}
    for run_dir in run_dirs:
        if not run_dir.is_dir():
            raise FileNotFoundError(f"{run_dir}: no such folder")
        folders = sorted({f.parent for f in run_dir.rglob("events.out.tfevents.*")})
        if not folders:
            raise FileNotFoundError(f"{run_dir}: no TensorBoard event files under it "
                                    "(was the run started with --metrics.enable_tensorboard?)")
        for folder in folders:
            runs[str(run_dir if len(folders) == 1 else folder)] = folder
    return runs


def read_scalars(folder: Path) -> dict[str, tuple[list[int], list[float]]]:
    """tag -> (steps, values) of every scalar in the folder's event files, all points kept."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: ([e.step for e in acc.Scalars(tag)], [e.value for e in acc.Scalars(tag)])
            for tag in acc.Tags()["scalars"]}


def plot_runs(run_dirs: list[Path], out: Path, tags: tuple[str, ...] = DEFAULT_TAGS):
    """Write the PNG; returns the matplotlib Figure (its lines hold exactly the plotted data)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    runs = {label: read_scalars(folder) for label, folder in find_runs(run_dirs).items()}
    fig, axes = plt.subplots(1, len(tags), figsize=(6 * len(tags), 4), squeeze=False)
    for ax, tag in zip(axes[0], tags, strict=True):
        for label, scalars in runs.items():
            if tag in scalars:
                ax.plot(*scalars[tag], label=label)
        if not ax.lines:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(tag)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    ap.add_argument("--out", type=Path, default=Path("curves.png"), help="PNG to write")
    ap.add_argument("--tags", nargs="+", default=list(DEFAULT_TAGS),
                    help="TensorBoard scalar tags, one panel each")
    args = ap.parse_args(argv)
    try:
        fig = plot_runs(args.run_dirs, args.out, tuple(args.tags))
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
