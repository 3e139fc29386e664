"""Checkpoints: the commit protocol (`commit`), the manager that saves and resumes the run
(`manager`), a fine-tuning start's initial weights (`initial`), HuggingFace export and import
(`hf`), torchtitan's step folders as initial weights (`torchtitan`), and stopping on preemption
(`preemption`)."""

from torchtitan_xla.checkpoint.commit import (
    COMMIT_FILE,
    MODEL_ARGS_FILE,
    DamagedCheckpoint,
    committed_steps,
    read_model_state,
    verify,
    write_model_checkpoint,
)
from torchtitan_xla.checkpoint.initial import check_initial_load_path, load_initial_weights
from torchtitan_xla.checkpoint.manager import CheckpointManager, TrainState
from torchtitan_xla.checkpoint.preemption import Preemption

__all__ = ["COMMIT_FILE", "MODEL_ARGS_FILE", "CheckpointManager", "DamagedCheckpoint", "Preemption",
           "TrainState", "check_initial_load_path", "committed_steps", "load_initial_weights",
           "read_model_state", "verify", "write_model_checkpoint"]
