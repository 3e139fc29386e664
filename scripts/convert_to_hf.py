"""Convert a checkpoint step folder to HuggingFace Llama format (model.safetensors + config.json).

    python scripts/convert_to_hf.py outputs/run/checkpoint/step-1000 hf_out [--dtype bfloat16]
        [--tokenizer PATH]   # the training tokenizer: its HF files and bos/eos ids go along

Runs on the CPU with plain torch.distributed.checkpoint: no XLA device and no process group. The
result loads with `transformers.AutoModelForCausalLM.from_pretrained(hf_out)` (and, with
--tokenizer, `AutoTokenizer.from_pretrained(hf_out)`).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from torchtitan_xla.checkpoint.commit import read_model_state  # noqa: E402
from torchtitan_xla.checkpoint.hf import export_hf  # noqa: E402
from torchtitan_xla.errors import run_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint step folder (step-N)")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokenizer", help="the training tokenizer file (\"\" for the project's own); "
                    "its HF files and BOS/EOS ids go into the export")
    args = ap.parse_args()
    state, model_args = read_model_state(args.checkpoint)
    tokenizer = None
    if args.tokenizer is not None:
        from torchtitan_xla.datasets.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(args.tokenizer)
    export_hf(state, model_args, args.out, dtype=getattr(torch, args.dtype), tokenizer=tokenizer)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
