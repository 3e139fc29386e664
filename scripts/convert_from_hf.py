"""Convert HuggingFace Llama weights into a weights-only checkpoint step folder.

    python scripts/convert_from_hf.py path/to/Llama-3.1-8B outputs/run/checkpoint/step-0

Put the result at `<dump_folder>/<checkpoint.folder>/step-0` and enable checkpointing: training
starts from these weights (a seed checkpoint). Alternatively load HF weights directly at start with
`--checkpoint.initial_load_path DIR --checkpoint.initial_load_in_hf`.
Runs on the CPU; the model arguments are read from the HF config.json (max_position_embeddings as
the context length, Mixtral's router_aux_loss_coef as aux_loss_weight: convert_to_hf.py writes them
back; a run from the step folder takes its aux loss weight from [moe], as every run does).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from torchtitan_xla.checkpoint.commit import write_model_checkpoint  # noqa: E402
from torchtitan_xla.checkpoint.hf import read_hf_state_dict  # noqa: E402
from torchtitan_xla.errors import ConfigError, first_line, run_main  # noqa: E402
from torchtitan_xla.models.llama.hf_folder import read_hf_config  # noqa: E402
from torchtitan_xla.models.llama.state_dict_adapter import from_hf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hf_dir")
    ap.add_argument("out", help="the step folder to write (e.g. .../checkpoint/step-0)")
    args = ap.parse_args()
    try:
        _, model_args = read_hf_config(Path(args.hf_dir) / "config.json", "")
        state = from_hf(read_hf_state_dict(args.hf_dir), model_args)
        name = Path(args.out).name
        step = int(name.removeprefix("step-")) if name.startswith("step-") else 0
        write_model_checkpoint(state, model_args, args.out, step=step)
    except (KeyError, FileNotFoundError) as e:  # a config.json or weights not of a Llama
        raise ConfigError(f"{args.hf_dir}: {first_line(e)}") from None
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
