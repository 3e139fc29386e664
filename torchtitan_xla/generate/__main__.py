"""Generate completions with a trained model, on the mesh of the config:

    python -m torchtitan_xla.generate --job.config_file train_configs/debug_sft.toml \\
        --generate.checkpoint outputs/debug_sft/checkpoint/step-200 \\
        --generate.prompts prompts.jsonl --generate.output out.jsonl \\
        --generate.max_new_tokens 64 --generate.temperature 0

Prompts are JSON lines, {"prompt": text} (encoded with BOS) or {"messages": [...]} (the chat
template of the tokenizer, ending with the assistant's header); `--generate.prompt "..."` gives
one. Each output line is the input line with "completion" and "finish" (eos, stop or length).
The weights: a checkpoint step, a HuggingFace folder or (unset) the newest checkpoint of the
config's run; the KV cache holds [training] seq_len tokens.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torchtitan_xla.config import JobConfig, run_command
from torchtitan_xla.errors import ConfigError

USAGE = ("usage: python -m torchtitan_xla.generate --job.config_file FILE "
         "(--generate.prompts FILE.jsonl | --generate.prompt TEXT) [--generate.checkpoint STEP_OR_HF_FOLDER] "
         "[--section.key VALUE ...]\n\nCompletions of prompts with a KV cache (docs/generation.md). "
         "The options are train.py's:")


def read_prompts(cfg) -> list[dict]:
    """The prompt records, each {"prompt": str} or {"messages": [...]}: one line, exit 2, if not."""
    from torchtitan_xla.datasets.chat import parse_conversation

    if bool(cfg.prompt) == bool(cfg.prompts):
        raise ConfigError("[generate] prompts / prompt: give one of them (a JSON lines file, or one text)")
    if cfg.prompt:
        return [{"prompt": cfg.prompt}]
    path = Path(cfg.prompts)
    if not path.is_file():
        raise ConfigError(f"[generate] prompts: {path}: no such file")
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"[generate] prompts: {path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not (isinstance(record.get("prompt"), str)
                                                or isinstance(record.get("messages"), list)):
            raise ConfigError(f"[generate] prompts: {path}:{n}: expected an object with \"prompt\" "
                              f"(a string) or \"messages\" (a list)")
        if "prompt" not in record:
            try:
                parse_conversation(record, final="user")
            except ConfigError as e:
                raise ConfigError(f"[generate] prompts: {path}:{n}: {e}") from None
        records.append(record)
    if not records:
        raise ConfigError(f"[generate] prompts: {path}: no prompts")
    return records


def encode(records: list[dict], tokenizer) -> list[list[int]]:
    from torchtitan_xla.datasets.chat import generation_prompt, parse_conversation

    out = []
    for record in records:
        if "prompt" in record:
            out.append(tokenizer.encode(record["prompt"], bos=True, eos=False))
        else:
            out.append(generation_prompt(parse_conversation(record, final="user"), tokenizer))
    return out


def main(job_config: JobConfig) -> list[dict]:
    from torchtitan_xla import runtime

    cfg = job_config.generate
    runtime.use(job_config.runtime.backend)
    runtime.configure(job_config.compile.step if job_config.compile.step in runtime.STEP_COMPILERS
                      else "replay")
    from torchtitan_xla import storage
    from torchtitan_xla.datasets import build_tokenizer
    from torchtitan_xla.datasets.chat import end_of_turn_ids, pad_id
    from torchtitan_xla.generate import Generator, Sampling, check_fits
    from torchtitan_xla.inference import inference_config, load_model, weights_folder
    from torchtitan_xla.logging import init_logger, logger
    from torchtitan_xla.storage import check_writable, join

    init_logger()
    sampling = Sampling(cfg.temperature, cfg.top_k, cfg.top_p, cfg.seed)
    records = read_prompts(cfg)
    tokenizer = build_tokenizer(job_config.model.tokenizer_path, job_config.model.name)
    prompts = encode(records, tokenizer)
    try:
        check_fits([len(p) for p in prompts], cfg.max_new_tokens, job_config.training.seq_len)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    out_file = cfg.output or join(job_config.job.dump_folder, "generations.jsonl")
    check_writable(str(Path(out_file).parent) if cfg.output else job_config.job.dump_folder,
                   "[generate] output" if cfg.output else "[job] dump_folder")
    path, is_hf = weights_folder(cfg.checkpoint, job_config, "[generate] checkpoint")
    loaded = load_model(inference_config(job_config), path, is_hf, "[generate] checkpoint",
                        tokenizer=tokenizer)
    if cfg.batch_size % loaded.parallel_dims.dp_degree:
        raise ConfigError(f"[generate] batch_size = {cfg.batch_size}: not a multiple of the "
                          f"data-parallel degree {loaded.parallel_dims.dp_degree}")
    eos = [tokenizer.eos_id, *end_of_turn_ids(tokenizer)]
    generator = Generator(loaded.model, cache_size=job_config.training.seq_len, batch_size=cfg.batch_size,
                          device=loaded.device, eos_ids=eos, pad_id=pad_id(tokenizer),
                          step_compiler=job_config.compile.step, decode_text=tokenizer.decode)
    logger.info(f"Generating for {len(prompts)} prompt(s) from {path}: at most {cfg.max_new_tokens} "
                f"tokens each, {'greedy' if not cfg.temperature else f'temperature {cfg.temperature}'}")
    completions = generator(prompts, cfg.max_new_tokens, sampling, cfg.stop)
    out = []
    for record, completion in zip(records, completions):
        text = tokenizer.decode(completion.tokens)
        finish = completion.finish
        for s in cfg.stop:
            if s in text:
                text, finish = text[:text.index(s)], "stop"
        out.append({**record, "completion": text, "finish": finish})
    storage.makedirs(os.path.dirname(out_file))
    storage.write_text(out_file, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in out))
    logger.info(f"Wrote {len(out)} completion(s) to {out_file}: {generator.stats.summary()} "
                f"({runtime.compile_stats()[0]} compiles in total)")
    if cfg.prompt:
        print(out[0]["completion"])
    return out


if __name__ == "__main__":
    sys.exit(run_command(main, USAGE))
