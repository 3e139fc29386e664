"""Convert a checkpoint step folder to HuggingFace Llama format (model.safetensors + config.json).

    python scripts/convert_to_hf.py outputs/run/checkpoint/step-1000 hf_out [--dtype bfloat16]
        [--tokenizer PATH]   # to record bos/eos ids in config.json

Runs on the CPU with plain torch.distributed.checkpoint: no XLA device and no process group. The
result loads with `transformers.LlamaForCausalLM.from_pretrained(hf_out)`.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from torchtitan_xla.checkpoint import read_model_state  # noqa: E402
from torchtitan_xla.config_manager import ConfigError  # noqa: E402
from torchtitan_xla.hf_checkpoint import export_hf  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint step folder (step-N)")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokenizer", help="tokenizer file, to record its bos/eos ids")
    args = ap.parse_args()
    try:
        state, model_args = read_model_state(args.checkpoint)
        bos = eos = None
        if args.tokenizer:
            from torchtitan_xla.datasets.tokenizer import build_tokenizer

            tok = build_tokenizer(args.tokenizer)
            bos, eos = tok.bos_id, tok.eos_id
        export_hf(state, model_args, args.out, dtype=getattr(torch, args.dtype), bos_id=bos, eos_id=eos)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
