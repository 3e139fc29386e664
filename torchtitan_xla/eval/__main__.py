"""Evaluate a checkpoint on zero-shot tasks, on the mesh of the config:

    python -m torchtitan_xla.eval --job.config_file train_configs/debug_model.toml \\
        --eval.checkpoint outputs/debug_model/checkpoint/step-200 \\
        --eval.tasks multiple_choice:boolq.jsonl,lambada:lambada.jsonl,perplexity:wiki.txt

The model's shape comes from the weights (the checkpoint's model_args.json or the HF config.json);
the config gives the tokenizer, seq_len, the mesh and [eval]. Results: a table on the console and
<dump_folder>/<eval.output_file>.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from torchtitan_xla.config import JobConfig, attributed, parse_args
from torchtitan_xla.errors import ConfigError, run_main

USAGE = ("usage: python -m torchtitan_xla.eval --job.config_file FILE --eval.tasks KIND:PATH[,...] "
         "[--eval.checkpoint STEP_OR_HF_FOLDER] [--section.key VALUE ...]\n\n"
         "Zero-shot tasks (multiple_choice, lambada, perplexity; docs/evaluation.md) on a checkpoint "
         "step, a HuggingFace folder, or (unset) the newest checkpoint of the config's run. The "
         "options are train.py's:")


def _weights(job_config: JobConfig) -> tuple[str | Path, bool]:
    """(the folder to load, whether it is a HuggingFace folder), checked before XLA starts."""
    from torchtitan_xla import storage
    from torchtitan_xla.checkpoint import commit

    given = job_config.eval.checkpoint
    if not given:
        folder = storage.join(job_config.job.dump_folder, job_config.checkpoint.folder)
        steps = commit.committed_steps(folder)
        if not steps:
            raise ConfigError(f"[eval] checkpoint: empty and no committed checkpoint in {folder}")
        return commit.step_folder(folder, steps[-1]), False
    if storage.is_url(given):  # a checkpoint step in a bucket (HF folders are read locally)
        try:
            commit.verify(given)
        except commit.DamagedCheckpoint as e:
            raise ConfigError(f"[eval] checkpoint: {given}: not a usable checkpoint step ({e})") from None
        return given, False
    path = Path(given)
    if not path.is_dir():
        raise ConfigError(f"[eval] checkpoint: {path}: no such folder")
    if (path / "config.json").is_file():
        return path, True
    try:
        commit.verify(str(path))
    except commit.DamagedCheckpoint as e:
        raise ConfigError(f"[eval] checkpoint: {path}: neither a HuggingFace folder (no config.json) "
                          f"nor a usable checkpoint step ({e})") from None
    return path, False


def main(job_config: JobConfig) -> dict:
    from torchtitan_xla import runtime

    # Evaluation runs on the XLA runtime, whichever runtime trained (the checkpoints are the same).
    runtime.use("xla")
    runtime.configure(job_config.compile.step if job_config.compile.step in runtime.STEP_COMPILERS
                      else "replay")

    import torch

    from torchtitan_xla.checkpoint.commit import read_lora_settings, read_model_state
    from torchtitan_xla.checkpoint.hf import load_hf_into_model, load_into_model
    from torchtitan_xla.datasets import build_tokenizer, check_vocab_size
    from torchtitan_xla.eval import evaluate, parse_task, write_results
    from torchtitan_xla.logging import init_logger, logger
    from torchtitan_xla.lora import merge
    from torchtitan_xla.models import get_model_class
    from torchtitan_xla.models.llama.hf_args import read_hf_config
    from torchtitan_xla.parallelisms import BATCH_AXES, ParallelDims, parallelize_llama
    from torchtitan_xla.storage import check_writable, join

    init_logger()
    tasks = [parse_task(spec) for spec in job_config.eval.tasks]
    if not tasks:
        raise ConfigError("[eval] tasks: none given; e.g. --eval.tasks multiple_choice:boolq.jsonl")
    path, is_hf = _weights(job_config)
    out_file = join(job_config.job.dump_folder, job_config.eval.output_file)
    check_writable(job_config.job.dump_folder, "[job] dump_folder")
    if is_hf:
        model_args = read_hf_config(path / "config.json", "[eval] checkpoint")[1]
        state = None
    else:
        state, model_args = read_model_state(path)
        lora = read_lora_settings(path)
        if lora is not None:  # a LoRA run's checkpoint: evaluate the adapted model
            state = merge(state, lora["alpha"])
    model_args = dataclasses.replace(model_args, max_seq_len=job_config.training.seq_len)

    device = runtime.init_devices()
    parallel_dims = ParallelDims.from_config(job_config.parallelism, runtime.device_count())
    mesh = parallel_dims.build_mesh(runtime.device_type())
    tokenizer = build_tokenizer(job_config.model.tokenizer_path, job_config.model.name)
    check_vocab_size(tokenizer, model_args.vocab_size)
    parallel_dims.check_model(model_args.n_heads, model_args.kv_heads, model_args.dim,
                              model_args.ffn_hidden_dim, model_args.num_experts, model_args.n_layers)
    with torch.device("meta"):
        model = get_model_class(job_config.model.name)(model_args)
    model.to_empty(device=device)
    parallelize_llama(model, mesh, parallel_dims, job_config)
    model.init_weights()
    if is_hf:
        load_hf_into_model(model, model_args, path, mesh, where="[eval] checkpoint")
    else:
        load_into_model(model, state, mesh, source=f"[eval] checkpoint: {path}",
                        described_by="model_args.json")
    model.eval()
    logger.info(f"Evaluating {path} ({model.num_params():,} parameters) on {len(tasks)} task(s)")
    out = evaluate(model, tokenizer, job_config, tasks, dp_degree=parallel_dims.dp_degree, device=device,
                   sharding=runtime.input_sharding(mesh, (BATCH_AXES, None)),
                   progress=sys.stderr.isatty())
    write_results(out, out_file)
    return out


def cli() -> None:
    job_config = parse_args(usage=USAGE)
    with attributed(job_config):  # an error names the file or flag that set its key
        main(job_config)


if __name__ == "__main__":
    sys.exit(run_main(cli))
