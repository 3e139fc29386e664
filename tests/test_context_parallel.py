"""Context parallelism: sequences of 640 tokens split over `cp` devices (the debug model cut to 2
blocks, float32) give one device's losses on every mesh, load-balanced or not, on packed chat data
too, under activation checkpointing and scan, with sdpa, blockwise (the chunk pairs) and ring
attention, Gemma 3's sliding windows; the compiled step gathers only the keys and values over `cp`,
and blockwise computes only the chunk pairs the causal mask leaves anything of; checkpoints move
between cp and non-cp meshes; the balanced order gives every device the same attention work; bad
settings are one line, exit 2."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO, run_train, tiny_args, train_many

from torchtitan_xla.checkpoint import committed_steps
from torchtitan_xla.config import ConfigError, parse_args

P = "--parallelism."
TWO_BLOCKS = {"n_layers": 2}
# A multiple of 2 x cp for every cp here, and no other dimension of the model's (256, 768, 2256...):
# the HLO checks find the sequence's collectives by their length.
SEQ = 640
# Two sequences per step on every mesh; no decay, so a run of 5 steps and one of 7 share their lrs.
COMMON = ["--model.attention", "sdpa", "--training.seq_len", str(SEQ), "--training.global_batch_size", "2",
          "--lr_scheduler.decay_ratio", "0"]
BLOCKWISE = ["--model.attention", "blockwise"]
# Gemma 3's debug model: both blocks local, a 16-token window.
GEMMA3 = ["--model.name", "gemma3"]
CHAT = ["--training.dataset", "python_docs_chat"]
UNBALANCED = [P + "context_parallel_load_balance", "false"]
RING = [P + "context_parallel_rotate_method", "ring"]
QWEN3 = ["--model.name", "qwen3"]
# Local batch x data-parallel ranks (fsdp) = 2.
CP8 = [P + "context_parallel_degree", "8", "--training.local_batch_size", "2"]
CP4_FSDP2 = [P + "context_parallel_degree", "4", "--training.local_batch_size", "1"]
CP2_FSDP2_TP2 = [P + "context_parallel_degree", "2", P + "tensor_parallel_degree", "2",
                 "--training.local_batch_size", "1"]
MESHES = {
    "cp8": CP8, "cp8_unbalanced_blockwise": [*CP8, *UNBALANCED, *BLOCKWISE],
    # (the order matters to the gathered keys' mask alone: in order on cp8 and cp8 with chat data)
    "cp4_fsdp2": CP4_FSDP2, "cp2_fsdp2_tp2": CP2_FSDP2_TP2, "cp4_fsdp2_blockwise": [*CP4_FSDP2, *BLOCKWISE],
    "cp8_chat_unbalanced": [*CP8, *CHAT, *UNBALANCED],
    # (packed conversations, with full activation checkpointing)
    "cp4_fsdp2_chat_full_ac_blockwise": [*CP4_FSDP2, *CHAT, "--activation_checkpoint.mode", "full", *BLOCKWISE],
    # Sliding windows: the chunk pairs within them; the ring masks them.
    "gemma3_cp4_fsdp2_blockwise": [*GEMMA3, *CP4_FSDP2, *BLOCKWISE], "gemma3_cp8_ring": [*GEMMA3, *CP8, *RING],
    # Ring attention: keys and values passed around the cp devices.
    "cp4_fsdp2_ring": [*CP4_FSDP2, *RING], "cp2_fsdp2_tp2_ring": [*CP2_FSDP2_TP2, *RING],
    "cp8_chat_ring": [*CP8, *CHAT, *RING], "cp8_unbalanced_ring": [*CP8, *UNBALANCED, *RING],
    # Qwen3: grouped-query attention (16 heads, 4 kv heads of 32), query/key norms, tied output.
    "qwen3_cp2_fsdp2_tp2": [*QWEN3, *CP2_FSDP2_TP2], "qwen3_cp4_fsdp2_ring": [*QWEN3, *CP4_FSDP2, *RING],
    "qwen3_cp2_fsdp2_tp2_blockwise": [*QWEN3, *CP2_FSDP2_TP2, *BLOCKWISE],
    "cp4_fsdp2_scan_blockwise": [*CP4_FSDP2, "--compile.scan_layers", *BLOCKWISE],
}
CKPT = ["--checkpoint.enable", "--checkpoint.interval", "3"]
# Only the order of floating-point sums differs between meshes (float32).
MESH_RTOL = 2e-6


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    """One device, the whole sequences: 7 steps saved at 3 and 6, and 5 steps of chat data."""
    out = tmp_path_factory.mktemp("cp1")
    runs = {"one": [*CKPT, "--training.steps", "7"], "chat": CHAT, "qwen3": QWEN3, "gemma3": GEMMA3}
    results = train_many({k: tiny_args(out / k, *COMMON, "--training.local_batch_size", "2", *v)
                          for k, v in runs.items()}, devices=1, model_overrides=TWO_BLOCKS)
    return out, results


@pytest.fixture(scope="module")
def eight_devices(one_device, tmp_path_factory):
    """Every mesh on 8 devices (each compiled step dumped), and the resharding runs: cp=4 x fsdp=2
    resuming the one-device checkpoint of step 3 and running to 5, then fsdp=2 x tp=4 resuming that
    run's step 5 and running to 7."""
    out = tmp_path_factory.mktemp("cp8")
    resumed = out / "resumed"
    shutil.copytree(one_device[0] / "one", resumed)
    for step in committed_steps(resumed / "checkpoint"):
        if step > 3:
            shutil.rmtree(resumed / "checkpoint" / f"step-{step}")
    runs = {k: tiny_args(out / k, *COMMON, *v) for k, v in MESHES.items()}
    runs["cp4_fsdp2_resumed"] = tiny_args(resumed, *COMMON, *CP4_FSDP2, *CKPT)
    runs["fsdp2_tp4_resumed"] = tiny_args(resumed, *COMMON, *CKPT, "--training.local_batch_size", "1",
                                          P + "tensor_parallel_degree", "4", "--training.steps", "7")
    return train_many(runs, devices=8, model_overrides=TWO_BLOCKS, xla_dump=out / "xla")


@pytest.mark.parametrize("mesh", MESHES)
def test_every_mesh_gives_one_devices_losses(mesh, one_device, eight_devices):
    """cp=8, cp=4 x fsdp=2, cp=2 x fsdp=2 x tp=2, balanced or in order, gathering the keys and
    values (sdpa, blockwise) or passing them around the ring, on packed conversations, with full
    activation checkpointing and with scan, Qwen3's grouped-query attention, Gemma 3's windows: the
    one-device (sdpa) losses of the same two sequences, step by step, and no compile after the
    first step."""
    reference = one_device[1][next((k for k in ("chat", "qwen3", "gemma3") if k in mesh), "one")]["losses"]
    run = eight_devices[mesh]
    assert set(run["losses"]) == {1, 2, 3, 4, 5}
    for step, loss in run["losses"].items():
        assert loss == pytest.approx(reference[step], rel=MESH_RTOL), (mesh, step)
    assert run["compiles"] <= 2  # init and the step: nothing recompiles


def test_checkpoints_move_between_cp_and_non_cp_meshes(one_device, eight_devices):
    """Saved on one device at step 3, resumed on cp=4 x fsdp=2 to step 5, resumed from that on
    fsdp=2 x tp=4 to step 7: the one-device run's losses at every step."""
    reference = one_device[1]["one"]["losses"]
    cp, fsdp = eight_devices["cp4_fsdp2_resumed"]["losses"], eight_devices["fsdp2_tp4_resumed"]["losses"]
    assert set(cp) == {4, 5} and set(fsdp) == {6, 7}
    for step, loss in {**cp, **fsdp}.items():
        assert loss == pytest.approx(reference[step], rel=MESH_RTOL), step


def _step_module(run: dict) -> str:
    """The training step's optimized HLO: the module with the most collectives (the init graph can
    be longer)."""
    from torchtitan_xla.runtime.xla.compiled import collective_ops

    return max((Path(f).read_text() for f in run["hlo"]), key=lambda text: len(collective_ops(text)))


def _step_collectives(run: dict):
    from torchtitan_xla.runtime.xla.compiled import collective_ops

    return collective_ops(_step_module(run))


def _dims(shape: str) -> list[int]:
    return [int(d) for d in re.findall(r"\[([0-9,]*)\]", shape)[0].split(",") if d]


@pytest.mark.parametrize("mesh, cp, tp, kv_heads, head_dim", [
    ("cp4_fsdp2", 4, 1, 16, 16), ("cp2_fsdp2_tp2", 2, 2, 16, 16), ("cp8", 8, 1, 16, 16),
    ("qwen3_cp2_fsdp2_tp2", 2, 2, 4, 32), ("cp4_fsdp2_blockwise", 4, 1, 16, 16),
    ("qwen3_cp2_fsdp2_tp2_blockwise", 2, 2, 4, 32)])
def test_the_step_gathers_keys_and_values_over_cp_and_nothing_else_of_the_sequence(
        mesh, cp, tp, kv_heads, head_dim, eight_devices):
    """The compiled step's optimized HLO: whatever has the whole sequence's length is a block's keys
    or values [rows, seq, kv heads / tp, head_dim] (grouped-query attention: the kv heads only),
    all-gathered over the cp group forward (2 per block) and their gradients reduce-scattered back
    backward (blockwise: as its 2 cp chunks, [rows, kv heads / tp, 2 cp, seq / 2cp, head_dim]);
    nothing is permuted, and no other activation is gathered whole but the embedding's gradient,
    which its FSDP backward gathers from every device that splits the tokens, as without cp (with
    fsdp > 1 as [tokens, dim] rows)."""
    rows = 2 // (8 // cp // tp)  # local batch: 2 sequences over the fsdp ranks
    kv = [rows, SEQ, kv_heads // tp, head_dim]
    chunked = [rows, kv_heads // tp, 2 * cp, SEQ // (2 * cp), head_dim]
    whole = [(kind, group, _dims(shape)) for kind, _, group, shape in _step_collectives(eight_devices[mesh])
             if SEQ in _dims(shape) or _dims(shape) == chunked or kind == "collective-permute"]
    gathers = [w for w in whole if w == ("all-gather", cp, kv)]
    assert len(gathers) == 4, whole  # k and v of 2 blocks
    # Their gradients [rows, heads, seq, head_dim] (one of them transposed), summed over the cp
    # devices whose queries read them.
    scattered = [w for w in whole if w[0] == "reduce-scatter"]
    keys = chunked if "blockwise" in mesh else sorted(kv)
    assert len(scattered) == 4 and all(g == cp and (sorted(d), d)["blockwise" in mesh] == keys
                                       for _, g, d in scattered), whole
    embedding = [("all-gather", cp, [rows, SEQ, 256])] if cp == 8 else []
    assert [w for w in whole if w not in gathers + scattered] == embedding, whole


@pytest.mark.parametrize("cp, balanced", [(2, True), (4, True), (4, False)], ids=["cp2", "cp4", "cp4_in_order"])
def test_chunk_pairs_equal_whole_sequence_attention(cp, balanced):
    """Blockwise attention over a cp-split sequence (the chunk pairs), float64, on the sequence as
    context parallelism stores it: values and gradients (queries, keys, values, sinks) within 1e-12
    of the einsum kernel's with the position mask, for one document and a packed row, without a
    window and with windows shorter than, equal to plus one and longer than a chunk, with and
    without sinks. Every device has 2 cp + 1 pairs balanced (no padding); with a window no longer
    than a chunk, 2 per query chunk (its own and the one before)."""
    from torchtitan_xla.models.llama.layers import masked_attention, position_mask
    from torchtitan_xla.parallelisms.chunk_pair_attention import ChunkPairAttention, chunk_order, chunk_pairs
    from torchtitan_xla.parallelisms.context_parallel import load_balanced_order

    b, heads, kv_heads, seq, d = 2, 4, 2, 48, 8
    chunk = seq // len(chunk_order(cp, balanced))
    torch.manual_seed(0)
    order = load_balanced_order(seq, cp) if balanced else torch.arange(seq)
    one = (torch.ones(b, seq, dtype=torch.long), torch.arange(seq).expand(b, seq))
    packed = torch.tensor([[1] * 20 + [2] * 17 + [3] * 11, [1] * 30 + [2] * 18])
    packed = (packed, torch.cat([torch.arange(n) for row in packed for n in row.unique_consecutive(
        return_counts=True)[1].tolist()]).view(b, seq))
    for window in (0, chunk // 2, chunk + 1, 2 * chunk + 3):
        q_slot, _, real = chunk_pairs(cp, chunk_order(cp, balanced), chunk, window)
        if balanced and not window:
            assert [sum(r) for r in real] == [2 * cp + 1] * cp
        if window and window <= chunk:
            assert len(q_slot[0]) == 2 * len(chunk_order(cp, balanced)) // cp
        for (documents, positions), sinks in ((one, False), (packed, True), (packed, False)):
            q = torch.randn(b, heads, seq, d, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(b, kv_heads, seq, d, dtype=torch.float64, requires_grad=True) for _ in "kv")
            sink = torch.randn(heads, dtype=torch.float64, requires_grad=True) if sinks else None
            documents, positions = documents[:, order], positions[:, order]
            kernel = ChunkPairAttention(None, cp, balanced, window)
            kernel.paired = kernel.paired_ids = lambda t: t  # (no mesh here)
            ours = kernel(q, k, v, documents, positions, sinks=sink)
            reference = masked_attention(q, k, v, position_mask(documents, positions, window), sinks=sink)
            torch.testing.assert_close(ours, reference, rtol=0, atol=1e-12)
            grad = torch.randn_like(ours)
            inputs = [q, k, v] + [sink] * sinks
            for a, e in zip(torch.autograd.grad(ours, inputs, grad), torch.autograd.grad(reference, inputs, grad)):
                torch.testing.assert_close(a, e, rtol=0, atol=1e-12)


def _largest_f32(run: dict) -> int:
    """Elements of the largest f32 tensor of the step's module (per device): on these meshes, a
    block's attention scores (the logits [rows, seq / cp, vocab / tp] are smaller)."""
    shapes = re.findall(r"f32\[([0-9,]+)\]", _step_module(run))
    return max(math.prod(int(d) for d in shape.split(",")) for shape in shapes)


@pytest.mark.parametrize("mesh, rows, heads, queries, keys", [
    ("cp4_fsdp2", 1, 16, SEQ // 4, SEQ),  # sdpa: [rows, heads, seq / cp, seq]
    ("cp4_fsdp2_blockwise", 1, 16, 9 * SEQ // 8, SEQ // 8),  # 2 cp + 1 pairs of chunks seq / 2cp long
    ("qwen3_cp2_fsdp2_tp2_blockwise", 1, 8, 5 * SEQ // 4, SEQ // 4),  # 5 pairs; 16 heads over tp
    ("cp8_unbalanced_blockwise", 2, 16, 8 * SEQ // 8, SEQ // 8)])  # in order: the last device's 8
def test_blockwise_computes_only_the_chunk_pairs_the_causal_mask_leaves(mesh, rows, heads, queries, keys,
                                                                         eight_devices):
    """Each device's attention scores in the compiled step: sdpa's [rows, heads, seq / cp, seq];
    blockwise's [rows, heads, pairs, chunk, chunk]: balanced, 2 cp + 1 pairs of the 2 cp chunks
    (the causal half and the diagonal's other half) where sdpa has 4 cp; in order, the last
    device's cp (the others pad to it). (The pairs' tables and values: the test above.)"""
    assert _largest_f32(eight_devices[mesh]) == rows * heads * queries * keys


def attention_work(positions: torch.Tensor, document_ids: torch.Tensor, cp: int) -> list[int]:
    """(query, key) pairs each of the `cp` devices attends over for one sequence laid out as given
    (positions, document_ids [seq]): the work of a kernel that skips masked pairs (splash), as
    counted from the mask each device holds: its own queries against every key."""
    queries, docs = positions.view(cp, -1), document_ids.view(cp, -1)
    seen = ((positions[None, None, :] <= queries[:, :, None])
            & (document_ids[None, None, :] == docs[:, :, None]))
    return seen.sum((1, 2)).tolist()


def _work(batch: tuple, cp: int) -> list[list[int]]:
    """Per sequence of a host batch (inputs, labels[, positions, document_ids]), the (query, key)
    pairs each of the cp devices attends over in that layout (`attention_work`)."""
    inputs = batch[0]
    positions, documents = batch[2:] if len(batch) > 2 else (
        torch.arange(inputs.shape[1]).expand_as(inputs), torch.ones_like(inputs))
    return [attention_work(p, d, cp) for p, d in zip(positions, documents)]


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_balanced_order_gives_every_device_the_same_attention_work(cp):
    """A causal sequence of SEQ tokens: split in order, device i attends over (2i+1) times the
    pairs of device 0 (the last one 2cp-1 times); in the balanced order (device i holding chunks i
    and 2cp-1-i, as the host delivers it) every device the same number, exactly. Measured as the
    unmasked (query, key) pairs of each device's queries: the work of a kernel that skips masked
    blocks; the einsum sdpa computes every pair of its [seq / cp, seq] block either way."""
    from torchtitan_xla.parallelisms import ParallelDims
    from torchtitan_xla.parallelisms.context_parallel import balance_batches, load_balanced_order

    order = load_balanced_order(SEQ, cp)
    assert sorted(order.tolist()) == list(range(SEQ))
    batch = (torch.arange(2 * SEQ).view(2, SEQ), torch.arange(2 * SEQ).view(2, SEQ) + 1)
    balanced = balance_batches(ParallelDims(1, 8 // cp, 1, cp=cp), SEQ)(batch)
    assert torch.equal(balanced[0], batch[0][:, order]) and torch.equal(balanced[1], batch[1][:, order])
    part = SEQ // cp  # device i's queries i * part ... (i + 1) * part - 1 each see themselves and all before
    in_order = [part * part * i + part * (part + 1) // 2 for i in range(cp)]
    assert _work(batch, cp) == [in_order] * 2
    assert in_order[-1] / in_order[0] > 2 * cp - 2  # (cp - 1/2) part^2 against part^2 / 2, nearly
    assert _work(balanced, cp) == [[SEQ * (SEQ + 1) // 2 // cp] * cp] * 2
    assert ParallelDims(1, 8 // cp, 1, cp=cp, cp_load_balance=False).cp_load_balance is False
    assert balance_batches(ParallelDims(1, 8 // cp, 1, cp=cp, cp_load_balance=False), SEQ) is None


def test_balanced_order_of_packed_conversations(tmp_path):
    """Packed chat rows (conversations of a few hundred tokens, padding at the end): attention stays
    within a conversation, so the work is spread by where conversations and padding fall, not by
    the causal triangle, and the balanced order changes it little. Measured on the project's chat
    data, the first 8 rows of 1024 tokens, cp = 4: the busiest device's work over the mean, 1.314 in
    order and 1.285 balanced (16 rows of 4096, cp = 8: 1.22 and 1.21; docs/parallelisms.md). The same
    pairs either way."""
    from torchtitan_xla.datasets import build_data_loader, build_tokenizer
    from torchtitan_xla.parallelisms import ParallelDims
    from torchtitan_xla.parallelisms.context_parallel import balance_batches

    cfg = parse_args(tiny_args(tmp_path, *COMMON, *CHAT, *CP4_FSDP2, "--training.seq_len", "1024"))
    tokenizer = build_tokenizer(cfg.model.tokenizer_path, cfg.model.name)
    loader = build_data_loader(cfg, tokenizer, batch_size=8)
    batch = next(iter(loader))
    loader.close()
    in_order, balanced = _work(batch, 4), _work(balance_batches(ParallelDims(1, 2, 1, cp=4), 1024)(batch), 4)
    assert [sum(w) for w in in_order] == [sum(w) for w in balanced]

    def busiest(work):
        return sum(max(w) for w in work) / sum(sum(w) / 4 for w in work)

    assert (round(busiest(in_order), 3), round(busiest(balanced), 3)) == (1.314, 1.285)


@pytest.mark.parametrize("flags, message", [
    (["--model.attention", "sdpa", P + "context_parallel_degree", "8", "--training.seq_len", "1000"],
     "error: command line: --training.seq_len (1000) must be a multiple of 2 x context_parallel_degree "
     "(8): load balancing gives each device two of 16 equal chunks (context_parallel_degree from the "
     "command line)"),
    (["--model.attention", "sdpa", P + "context_parallel_degree", "4", P + "tensor_parallel_degree", "2",
      P + "context_parallel_load_balance", "false", "--training.seq_len", "1028"],
     "error: command line: --training.seq_len (1028) must be a multiple of context_parallel_degree (4) x "
     "tensor_parallel_degree (2) (context_parallel_degree from the command line; tensor_parallel_degree "
     "from the command line)"),
    (["--model.attention", "flash", P + "context_parallel_degree", "2"],
     "error: command line: --model.attention = 'flash' cannot take context parallelism ([parallelism] "
     "context_parallel_degree = 2): its causal mask is by index, not by the positions of a split "
     "sequence; use sdpa or blockwise"),
], ids=["seq_not_2cp", "seq_not_cp_tp", "flash"])
def test_bad_context_parallel_settings_are_one_line_exit_2(flags, message, tmp_path):
    run = run_train(tiny_args(tmp_path / "out", *flags), devices=8)
    assert run.returncode == 2, run.stderr[-3000:]
    config = REPO / "train_configs" / "debug_model.toml"
    assert run.stderr.strip().splitlines()[-1] == message.format(config=config)
    assert "Traceback" not in run.stderr and not run.losses


def test_context_parallel_is_refused_where_it_cannot_run_yet():
    """The native runtime, kernels with an index mask, and what would gather the split sequence:
    each before anything is built, naming the key and why."""
    native = ["--runtime.backend", "native", "--model.attention", "sdpa", P + "context_parallel_degree", "2"]
    with pytest.raises(ConfigError, match=re.escape(
            'context_parallel_degree = 2 is not available with [runtime] backend = "native" yet: its key '
            'and value gathers')):
        parse_args(tiny_args(Path("unused"), *native))
    for kernel in ("flash", "splash"):
        with pytest.raises(ConfigError, match=re.escape(
                f"attention = {kernel!r} cannot take context parallelism ([parallelism] "
                f"context_parallel_degree = 2)")):
            parse_args(tiny_args(Path("unused"), "--model.attention", kernel, P + "context_parallel_degree", "2"))
    with pytest.raises(ConfigError, match=re.escape(
            "command line: --parallelism.context_parallel_degree = 2: context parallelism with a mixture "
            "of experts (mixtral debugmodel) is not supported yet")):
        parse_args(tiny_args(Path("unused"), "--model.name", "mixtral", "--model.attention", "sdpa",
                             P + "context_parallel_degree", "2"))
    # Those that flatten [batch, seq] into tokens, which would gather the split sequence.
    for flags, shown in ((["--loss.chunk_size", "128"], "--loss.chunk_size = 128"),
                         (["--lora.rank", "8"], "--lora.rank = 8"),
                         (["--float8.enable_float8_linear"], "--float8.enable_float8_linear = True")):
        with pytest.raises(ConfigError, match=re.escape(
                f"command line: {shown} is not supported with context parallelism ([parallelism] "
                f"context_parallel_degree = 2) yet")):
            parse_args(tiny_args(Path("unused"), "--model.attention", "sdpa", P + "context_parallel_degree", "2",
                                 *flags))


@pytest.mark.parametrize("mesh, cp, tp, kv_heads, head_dim", [
    ("cp4_fsdp2_ring", 4, 1, 16, 16), ("cp2_fsdp2_tp2_ring", 2, 2, 16, 16), ("qwen3_cp4_fsdp2_ring", 4, 1, 4, 32)])
def test_ring_attention_passes_keys_and_values_by_collective_permutes(mesh, cp, tp, kv_heads, head_dim,
                                                                      eight_devices):
    """Ring attention's compiled step: each block passes its keys and values on cp - 1 times, one
    chunk [rows, kv heads / tp, 1, seq / cp, head_dim] per collective permute (and their gradients
    back in the backward: 4 (cp - 1) per block in all), with the chunk's positions and document ids
    (int64); nothing of the sequence's length is gathered (on these meshes the embedding's gradient
    is gathered as [tokens, dim] rows)."""
    rows = 2 // (8 // cp // tp)
    chunk = [rows, kv_heads // tp, 1, SEQ // cp, head_dim]
    ops = _step_collectives(eight_devices[mesh])
    permutes = [(_dims(shape), shape[:3]) for kind, _, _, shape in ops if kind == "collective-permute"]
    float_chunks = [d for d, dtype in permutes if dtype == "f32" and d == chunk]
    ids = [d for d, dtype in permutes if dtype == "s64" and d == [rows, 1, SEQ // cp]]
    assert len(float_chunks) == 2 * 4 * (cp - 1), permutes  # 2 blocks x (k, v; forward, backward)
    assert len(ids) == 2 * 2 * (cp - 1), permutes  # positions and document ids, forward
    assert not [shape for kind, _, _, shape in ops if kind == "all-gather" and SEQ in _dims(shape)]
    # Bytes: the plan's theory.
    from torchtitan_xla.parallelisms import ParallelDims
    from torchtitan_xla.plan import comms
    from torchtitan_xla.plan.memory import build_meta_model

    cfg = parse_args(tiny_args(Path("unused"), *COMMON, *MESHES[mesh]))
    dims = ParallelDims.from_config(cfg.parallelism, 8)
    _, model = build_meta_model(cfg, **TWO_BLOCKS)
    theory = comms.theory(model, dims, tokens=rows * SEQ, seq_len=SEQ, microbatches=1, policy="none")
    assert comms.measured(ops)["collective-permute"] == pytest.approx(theory["collective-permute"], rel=0.05)
