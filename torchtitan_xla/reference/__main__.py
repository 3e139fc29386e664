"""Score the training pairs under the reference model once and store the log-probabilities with
them, so that training runs no reference model (`[preference] precomputed_reference = true`, as
TRL's `precompute_ref_log_probs`):

    python -m torchtitan_xla.reference --job.config_file train_configs/debug_dpo.toml \\
        --preference.reference_output pairs_with_reference.jsonl

The pairs are the config's training set (`[training] dataset`, `dataset_path`, `dataset_split`);
the reference is the one training would load (`[preference] reference`, else `[checkpoint]
initial_load_path`), on the config's mesh, rows cut at `[training] seq_len` as training cuts
them. Each output line is a pair, its prompt as chat messages, with TRL's "ref_chosen_logps" and
"ref_rejected_logps"; train on it with `--training.dataset preference --training.dataset_path
FILE --preference.precomputed_reference`.
"""

from __future__ import annotations

import json
import os
import sys

from torchtitan_xla.config import JobConfig, run_command
from torchtitan_xla.errors import ConfigError

USAGE = ("usage: python -m torchtitan_xla.reference --job.config_file FILE --preference.reference_output "
         "FILE.jsonl [--section.key VALUE ...]\n\nThe training pairs with their reference "
         "log-probabilities (docs/posttrain.md). The options are train.py's:")


def main(job_config: JobConfig) -> list[dict]:
    import contextlib

    import torch
    from torch.utils.data import default_collate
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchtitan_xla import runtime, storage
    from torchtitan_xla.batch import Batch
    from torchtitan_xla.config.job_config import PREFERENCE_DATASETS
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.datasets.loader import DataLoader
    from torchtitan_xla.datasets.preference import REFERENCE_KEYS, PreferenceDataset, encode_pairs
    from torchtitan_xla.datasets.sources import _from_generator, load_documents
    from torchtitan_xla.inference import inference_config, load_model, weights_folder
    from torchtitan_xla.logging import init_logger, logger
    from torchtitan_xla.losses import IGNORE_INDEX, build_loss_fn
    from torchtitan_xla.parallelisms import BATCH_AXES, ParallelDims
    from torchtitan_xla.parallelisms.context_parallel import balance_batches
    from torchtitan_xla.reference import KEY, configured_reference, policy_kernels, scoring_step

    t, cfg = job_config.training, job_config.preference
    if not cfg.reference_output:
        raise ConfigError("[preference] reference_output: empty; give the JSON lines file to write")
    if t.dataset not in PREFERENCE_DATASETS:
        raise ConfigError(f"[training] dataset = {t.dataset!r}: not preference pairs (expected one of "
                          f"{', '.join(PREFERENCE_DATASETS)})")
    source = configured_reference(job_config)
    folder, is_hf = weights_folder(source, job_config, KEY)
    out_folder = os.path.dirname(cfg.reference_output) or "."
    storage.check_writable(out_folder, "[preference] reference_output")
    init_logger()
    runtime.use(job_config.runtime.backend)
    runtime.configure(job_config.compile.step if job_config.compile.step in runtime.STEP_COMPILERS
                      else "replay")

    # Every pair, in order, as training reads them (packed or not).
    pairs = [json.loads(r["pair"]) for r in load_documents(t.dataset, t.dataset_path, t.dataset_split)]
    device = runtime.init_devices()
    if runtime.process_count() > 1:
        raise ConfigError("python -m torchtitan_xla.reference runs as one process (on the native "
                          "runtime: one device)")
    parallel_dims = ParallelDims.from_config(job_config.parallelism, runtime.device_count())
    mesh = parallel_dims.build_mesh(runtime.device_type())
    rows = t.local_batch_size * parallel_dims.dp_degree
    tokenizer = build_tokenizer(job_config.model.tokenizer_path, job_config.model.name)
    dataset = PreferenceDataset(_from_generator(encode_pairs, column="pair", pairs=pairs), tokenizer,
                                t.seq_len, packing=t.packing, infinite=False, name=t.dataset)
    dataset.check_documents(0, f"[training] dataset_path: {t.dataset_path}" if t.dataset_path
                            else f"[training] dataset: {t.dataset}")
    # As training's loader: context parallelism's load-balanced order included.
    def collate(examples: list[tuple]) -> tuple:  # the last batch filled up with empty rows
        empty = tuple(torch.full_like(c, IGNORE_INDEX if k == 1 else 0) for k, c in enumerate(examples[0]))
        return default_collate(examples + [empty] * (rows - len(examples)))

    loader = DataLoader(StatefulDataLoader(dataset, batch_size=rows, collate_fn=collate), device=device,
                        input_sharding=runtime.input_sharding(mesh, (BATCH_AXES, None), hosts=1),
                        batch_transform=balance_batches(parallel_dims, t.seq_len))
    model = load_model(inference_config(job_config), folder, is_hf, KEY, tokenizer=tokenizer,
                       on=(device, mesh, parallel_dims),
                       prepare=lambda m: policy_kernels(m, job_config, mesh)).model
    # The log-probabilities training's reference graph gives: the plain loss, training's precision.
    autocast_dtype = torch.bfloat16 if t.mixed_precision_param == "bfloat16" else None
    loss_fn = build_loss_fn(job_config, dp_degree=parallel_dims.dp_degree, autocast_dtype=autocast_dtype,
                            plain=True)
    score = scoring_step(model, loss_fn, contextlib.nullcontext, job_config)
    logger.info(f"Scoring {len(pairs):,} pairs under the reference {source}, {rows} rows at a time")
    logps: list[float] = []  # each document's, in order: the pairs' chosen and rejected
    for loaded in loader:
        batch = Batch.of(loaded)
        slots, documents = runtime.to_host([score(batch), batch.document_ids.amax(-1)])
        logps += [x for row, k in zip(slots.tolist(), documents.tolist()) for x in row[:k]]
    out = [{"prompt": prompt, "chosen": chosen, "rejected": rejected,
            REFERENCE_KEYS[0]: logps[2 * i], REFERENCE_KEYS[1]: logps[2 * i + 1]}
           for i, (prompt, chosen, rejected, _) in enumerate(pairs)]
    storage.makedirs(out_folder)
    storage.write_text(cfg.reference_output, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    logger.info(f"Wrote {len(out):,} pairs with their reference log-probabilities to {cfg.reference_output} "
                f"({runtime.compile_stats()[0]} compiles in total)")
    return out


if __name__ == "__main__":
    sys.exit(run_command(main, USAGE))
