"""Convert a checkpoint step folder to HuggingFace format (Llama or Mixtral: safetensors + config.json).

    python scripts/convert_to_hf.py outputs/run/checkpoint/step-1000 hf_out [--dtype bfloat16]
        [--tokenizer PATH]   # the training tokenizer: its HF files and bos/eos ids go along
        [--peft DIR]         # a LoRA checkpoint: also its adapters alone, as a PEFT folder
        [--base-model PATH]  # with --peft: the HF base the adapters apply to (the run's
                             # initial_load_path), written absolute into adapter_config.json

A LoRA checkpoint (one with lora.json) is exported merged, W + (alpha / r) B A. The config.json
says what the checkpoint's model_args.json does: the flavor's context length, Mixtral's
router_aux_loss_coef from the run's [moe] aux_loss_weight (checkpoint/hf.py).

Runs on the CPU with plain torch.distributed.checkpoint: no XLA device and no process group. The
result loads with `transformers.AutoModelForCausalLM.from_pretrained(hf_out)` (and, with
--tokenizer, `AutoTokenizer.from_pretrained(hf_out)`).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from torchtitan_xla.checkpoint.commit import LORA_FILE, read_lora_settings, read_model_state  # noqa: E402
from torchtitan_xla.checkpoint.hf import export_hf, export_peft  # noqa: E402
from torchtitan_xla.errors import ConfigError, run_main  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="a checkpoint step folder (step-N)")
    ap.add_argument("out", help="output folder")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokenizer", help="the training tokenizer file (\"\" for the project's own); "
                    "its HF files and BOS/EOS ids go into the export")
    ap.add_argument("--peft", help="LoRA checkpoints: also write the adapters as a PEFT folder here")
    ap.add_argument("--base-model", help="with --peft: the base model's HF folder (made absolute) or hub "
                    "id, for adapter_config.json's base_model_name_or_path")
    args = ap.parse_args()
    state, model_args = read_model_state(args.checkpoint)
    lora = read_lora_settings(args.checkpoint)
    if args.peft and lora is None:
        raise ConfigError(f"--peft: {args.checkpoint} holds no LoRA adapters (no {LORA_FILE})")
    if args.base_model and not args.peft:
        raise ConfigError("--base-model: names the base of a PEFT folder; give --peft DIR as well")
    tokenizer = None
    if args.tokenizer is not None:
        from torchtitan_xla.datasets.tokenizer import build_tokenizer

        tokenizer = build_tokenizer(args.tokenizer)
    dtype = getattr(torch, args.dtype)
    export_hf(state, model_args, args.out, dtype=dtype, tokenizer=tokenizer, lora=lora)
    print(f"wrote {args.out}")
    if args.peft:
        export_peft(state, model_args, lora, args.peft, dtype=dtype, base_model=args.base_model)
        print(f"wrote {args.peft}" + ("" if args.base_model else " (no --base-model: its "
                                       "base_model_name_or_path is null)"))
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
