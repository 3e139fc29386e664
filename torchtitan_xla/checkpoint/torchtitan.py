"""Initial weights from a step folder torchtitan wrote for its Llama 3 (`[checkpoint]
initial_load_path`), told apart from this project's checkpoints by what the folder holds.

torchtitan's layout (pytorch/torchtitan, torchtitan/components/checkpoint.py; since 2026
components/checkpointer/dcp.py): `<folder>/step-<N>/` is a plain torch.distributed.checkpoint (DCP)
folder. There is no commit record: torchtitan counts a step folder with a `.metadata` file as a
checkpoint (`_find_load_step`), and DCP writes `.metadata` last, after every data file.
- A model-only save (`last_save_model_only`, the default; a seed checkpoint saved that way;
  scripts/convert_llama_to_dcp.py) holds the model's state dict alone, at the top level:
  `tok_embeddings.weight`, `layers.0.attention.wq.weight`, ..., `norm.weight`, `output.weight`.
- A full training checkpoint holds the same top-level model keys (since July 2025, torchtitan #1347;
  before, nested under `model.`) beside `optimizer.*` (flattened, by parameter name),
  `lr_scheduler.*`, `dataloader.*` (`dp_rank_<i>`, `world_size`) and `train_state.*`.
- Until June 2025 (#1338) its RoPE table `freqs_cis`, a persistent buffer, was saved too (as
  `model.freqs_cis` in full checkpoints; converted Meta weights had it at the top level).
- Since April 2026 (#2878, #2937) torchtitan's Llama 3 is `attention.qkv_linear.wq|wk|wv` and
  `lm_head`; those names are read as `attention.wq|wk|wv` and `output`.
The parameter names are otherwise ours, and RoPE rotates interleaved pairs in both (torchtitan's
`apply_rotary_emb`: `view_as_complex` of adjacent pairs), so weights load unchanged. Only the
model's tensors are read; the RoPE table, optimizer, schedule, data and step are ignored.
"""

from __future__ import annotations

import re
from typing import Any

from torchtitan_xla import storage
from torchtitan_xla.checkpoint.commit import COMMIT_FILE, reader
from torchtitan_xla.errors import ConfigError

METADATA_FILE = ".metadata"
# The first part of a torchtitan Llama's tensor names (its Decoder's submodules).
_MODEL_PARTS = ("tok_embeddings.", "layers.", "norm.", "output.", "lm_head.")
# Our name -> torchtitan's since April 2026.
_RENAMES = ((re.compile(r"^(layers\.\d+\.attention\.)(w[qkv]\.)"), r"\1qkv_linear.\2"),
            (re.compile(r"^output\."), "lm_head."))


def _saved_tensors(path: str) -> dict[str, Any]:
    """The DCP metadata of each key saved in `path` ({} without a readable `.metadata`)."""
    try:
        if not storage.exists(storage.join(path, METADATA_FILE)):
            return {}
        return dict(reader(path).read_metadata().state_dict_metadata)
    except Exception:
        return {}


def _model_prefix(saved: dict[str, Any]) -> str | None:
    """Where torchtitan put the model's tensors: "" (the top level) or "model." (full checkpoints
    before July 2025, told from ours by torchtitan's `dataloader.` keys: ours are
    `dataloader/host_<rank>`); None when `saved` is not torchtitan's."""
    if any(key.startswith(_MODEL_PARTS) for key in saved):
        return ""
    if (any(key.startswith(tuple(f"model.{p}" for p in _MODEL_PARTS)) for key in saved)
            and any(key.startswith("dataloader.") for key in saved)):
        return "model."
    return None


def _candidates(name: str, prefix: str) -> list[str]:
    names = [name] + [pattern.sub(new, name) for pattern, new in _RENAMES if pattern.match(name)]
    return [prefix + n for n in names]


def model_keys(path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, str] | None:
    """None when `path` is this project's checkpoint (it has a COMMITTED record); for a torchtitan
    step folder, its key of each of the model's tensors (`shapes`: name -> shape). Anything else,
    or a torchtitan checkpoint of another model, is a ConfigError of one line naming the key."""
    if storage.exists(storage.join(path, COMMIT_FILE)):
        return None
    where = f"[checkpoint] initial_load_path: {path}"
    saved = _saved_tensors(path)
    prefix = _model_prefix(saved)
    if prefix is None:
        raise ConfigError(f"{where} is not a usable checkpoint: no {COMMIT_FILE} record (this "
                          f"project's checkpoints) and no {METADATA_FILE} with torchtitan's model "
                          f"keys (a torchtitan step folder)")
    keys = {}
    for name, shape in shapes.items():
        key = next((k for k in _candidates(name, prefix) if k in saved), None)
        if key is None:
            missing = sum(not any(k in saved for k in _candidates(n, prefix)) for n in shapes)
            raise ConfigError(f"{where}: a torchtitan checkpoint without {prefix}{name} ({missing} of "
                              f"this model's {len(shapes)} tensors are not in it; check [model] "
                              f"name and flavor)")
        size = tuple(getattr(saved[key], "size", ()))
        if size != tuple(shape):
            raise ConfigError(f"{where}: a torchtitan checkpoint of another model: {key} is "
                              f"{list(size)}, this model's {name} is {list(shape)} (check [model] "
                              f"flavor and the tokenizer's vocabulary)")
        keys[name] = key
    return keys
