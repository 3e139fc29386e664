"""Data: tokenizers, datasets, and the loader that feeds the training step."""

from __future__ import annotations

from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan_xla.config_manager import JobConfig
from torchtitan_xla.datasets.text_datasets import PackedTextDataset, load_documents
from torchtitan_xla.datasets.tokenizer import Tokenizer, build_tokenizer

__all__ = ["build_data_loader", "build_tokenizer", "Tokenizer"]


def build_data_loader(job_config: JobConfig, tokenizer: Tokenizer, *, batch_size: int,
                      host_rank: int = 0, host_count: int = 1) -> StatefulDataLoader:
    """This host's loader: `batch_size` packed sequences per step, resumable via state_dict()."""
    t = job_config.training
    dataset = PackedTextDataset(
        load_documents(t.dataset, t.dataset_path), tokenizer, t.seq_len,
        host_rank=host_rank, host_count=host_count, name=t.dataset)
    return StatefulDataLoader(dataset, batch_size=batch_size, num_workers=0)
