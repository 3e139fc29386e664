"""Data: tokenizers, datasets, and the loader that feeds the training step."""

from __future__ import annotations

from torchtitan_xla.config import JobConfig
from torchtitan_xla.datasets.loader import DataLoader
from torchtitan_xla.datasets.tokenizer import Tokenizer, build_tokenizer, check_vocab_size

__all__ = ["DataLoader", "Tokenizer", "build_data_loader", "build_tokenizer", "check_vocab_size"]

DEFAULT_SEED = 0


def build_data_loader(job_config: JobConfig, tokenizer: Tokenizer, *, batch_size: int,
                      host_rank: int = 0, host_count: int = 1, split: str | None = None,
                      infinite: bool = True, drop_last: bool = False, device=None,
                      input_sharding=None, batch_transform=None) -> DataLoader:
    """This host's loader: `batch_size` packed sequences per step (the host's share of the
    global batch), read from this host's share of the dataset, resumable via state_dict().
    Batches are (inputs, labels), each [batch_size, seq_len] int64; for the chat and preference
    datasets (inputs, labels, positions, document_ids), labels -100 where not trained (chat.py,
    preference.py: pairs of documents, packed or in rows 2i and 2i + 1; with [preference]
    precomputed_reference, a fifth [batch_size, slots] float32 column of their stored reference
    log-probabilities).

    With `device` (and `input_sharding`), batches arrive on the device mesh, prefetched in a
    background thread; without, they stay on the host (tests, benchmarks). `batch_transform`:
    applied to each host batch first (context parallelism's reordering)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from torchtitan_xla.config.job_config import PREFERENCE_DATASETS
    from torchtitan_xla.datasets.packing import ChatDataset, PackedTextDataset, SyntheticDataset
    from torchtitan_xla.datasets.preference import PreferenceDataset
    from torchtitan_xla.datasets.sources import CHAT_DATASETS, load_documents

    t = job_config.training
    seed = job_config.debug.seed if job_config.debug.seed is not None else DEFAULT_SEED
    split = split or t.dataset_split
    if t.dataset == "synthetic":
        dataset = SyntheticDataset(tokenizer.n_words, t.seq_len, batch_size=batch_size,
                                   host_rank=host_rank, host_count=host_count, seed=seed, split=split)
    else:
        documents = load_documents(t.dataset, t.dataset_path, split)
        stream = dict(host_rank=host_rank, host_count=host_count, shuffle_buffer=t.shuffle_buffer,
                      seed=seed, infinite=infinite, name=t.dataset)
        if t.dataset in PREFERENCE_DATASETS:
            dataset = PreferenceDataset(documents, tokenizer, t.seq_len, packing=t.packing, **stream,
                                        reference=job_config.preference.precomputed_reference)
        elif t.dataset in CHAT_DATASETS:
            dataset = ChatDataset(documents, tokenizer, t.seq_len, packing=t.packing, **stream)
        else:
            dataset = PackedTextDataset(documents, tokenizer, t.seq_len, **stream)
        dataset.check_documents(t.num_workers, f"[training] dataset_path: {t.dataset_path}"
                                if t.dataset_path else f"[training] dataset: {t.dataset}")
    workers = t.num_workers
    host_loader = StatefulDataLoader(
        dataset, batch_size=batch_size, num_workers=workers, drop_last=drop_last,
        multiprocessing_context=_worker_context() if workers else None,
        persistent_workers=workers > 0, prefetch_factor=2 if workers else None)
    return DataLoader(host_loader, host_rank=host_rank, host_count=host_count, num_workers=workers,
                      device=device, input_sharding=input_sharding, batch_transform=batch_transform)


def _worker_context():
    """Workers fork from a clean server process that has the heavy libraries imported: not from
    this process (whose XLA runtime already runs threads: forking it is unsafe), and without
    paying a fresh interpreter's imports per worker as "spawn" would. This package itself is not
    preloaded: the server ignores sys.path (Python 3.11), each worker imports it after receiving
    this process's sys.path, so it is the same checkout."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "datasets", "tiktoken", "sentencepiece"])
    return ctx
