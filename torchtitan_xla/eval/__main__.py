"""Evaluate a checkpoint on zero-shot tasks, on the mesh of the config:

    python -m torchtitan_xla.eval --job.config_file train_configs/debug_model.toml \\
        --eval.checkpoint outputs/debug_model/checkpoint/step-200 \\
        --eval.tasks multiple_choice:boolq.jsonl,lambada:lambada.jsonl,perplexity:wiki.txt

The model's shape comes from the weights (the checkpoint's model_args.json or the HF config.json);
the config gives the tokenizer, seq_len, the mesh and [eval]. Results: a table on the console and
<dump_folder>/<eval.output_file>.
"""

from __future__ import annotations

import sys

from torchtitan_xla.config import JobConfig, run_command
from torchtitan_xla.errors import ConfigError

USAGE = ("usage: python -m torchtitan_xla.eval --job.config_file FILE --eval.tasks KIND:PATH[,...] "
         "[--eval.checkpoint STEP_OR_HF_FOLDER] [--section.key VALUE ...]\n\n"
         "Tasks (multiple_choice, lambada, perplexity, generate_until; docs/evaluation.md) on a checkpoint "
         "step, a HuggingFace folder, or (unset) the newest checkpoint of the config's run. The "
         "options are train.py's:")


def main(job_config: JobConfig) -> dict:
    from torchtitan_xla import runtime

    # Evaluation runs on the XLA runtime, whichever runtime trained (the checkpoints are the same).
    runtime.use("xla")
    runtime.configure(job_config.compile.step if job_config.compile.step in runtime.STEP_COMPILERS
                      else "replay")

    from torchtitan_xla.eval import evaluate, parse_task, write_results
    from torchtitan_xla.eval.tasks import GENERATIVE, fewshot_docs, fewshot_for_each
    from torchtitan_xla.inference import hf_eos_ids, inference_config, load_model, weights_folder
    from torchtitan_xla.logging import init_logger, logger
    from torchtitan_xla.parallelisms import BATCH_AXES
    from torchtitan_xla.storage import check_writable, join

    init_logger()
    tasks = [parse_task(spec) for spec in job_config.eval.tasks]
    if not tasks:
        raise ConfigError("[eval] tasks: none given; e.g. --eval.tasks multiple_choice:boolq.jsonl")
    for task in (t for t in tasks if t.kind in GENERATIVE):  # checked before the model loads
        fewshot_for_each(job_config.eval, task, fewshot_docs(job_config.eval, job_config.training.seq_len))
    path, is_hf = weights_folder(job_config.eval.checkpoint, job_config, "[eval] checkpoint")
    out_file = join(job_config.job.dump_folder, job_config.eval.output_file)
    check_writable(job_config.job.dump_folder, "[job] dump_folder")
    loaded = load_model(inference_config(job_config), path, is_hf, "[eval] checkpoint")
    model, mesh = loaded.model, loaded.mesh
    logger.info(f"Evaluating {path} ({model.num_params():,} parameters) on {len(tasks)} task(s)")
    out = evaluate(model, loaded.tokenizer, job_config, tasks, dp_degree=loaded.parallel_dims.dp_degree,
                   device=loaded.device,
                   sharding=runtime.input_sharding(mesh, (BATCH_AXES, None)),
                   progress=sys.stderr.isatty(), eos_ids=hf_eos_ids(path) if is_hf else None)
    write_results(out, out_file)
    return out


if __name__ == "__main__":
    sys.exit(run_command(main, USAGE))
