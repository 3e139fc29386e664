"""The loss: label smoothing and z-loss against hand-written float64 formulas; the chunked (cut)
cross-entropy against the full-logits loss in float64, forward and backward; and in the compiled
training step, XLA's own buffer assignment shows the chunked loss never holds the full logits."""

from __future__ import annotations

import pytest
import torch

from torchtitan_xla.losses import IGNORE_INDEX, chunked_token_losses, token_losses

RANKS, TOKENS, DIM, VOCAB = 2, 24, 8, 50


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(RANKS, TOKENS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(VOCAB, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, VOCAB, (RANKS, TOKENS), generator=g)
    labels[0, 5] = labels[1, 0] = IGNORE_INDEX
    upstream = torch.randn(RANKS, TOKENS, generator=g, dtype=torch.float64)
    return h, w, labels, upstream


def test_label_smoothing_and_z_loss_match_their_formulas():
    """Per token, with p = softmax(x): (1 - eps) * -log p[label] + eps * mean_j(-log p[j])
    + z * logsumexp(x)^2, and 0 for an ignored label."""
    h, w, labels, _ = _inputs()
    x = (h @ w.T).detach()
    eps, z = 0.1, 1e-3
    got = token_losses(x, labels, label_smoothing=eps, z_loss=z)
    for r in range(RANKS):
        for t in range(TOKENS):
            y = labels[r, t].item()
            row = [v.item() for v in x[r, t]]
            m = max(row)
            lse = m + torch.tensor([v - m for v in row], dtype=torch.float64).exp().sum().log().item()
            log_p = [v - lse for v in row]
            want = 0.0 if y == IGNORE_INDEX else (
                (1 - eps) * -log_p[y] + eps * -sum(log_p) / VOCAB + z * lse * lse)
            assert got[r, t].item() == pytest.approx(want, rel=1e-12, abs=1e-12), (r, t)
    plain = token_losses(x, labels)  # no smoothing, no z: the usual cross-entropy
    assert torch.equal(plain, torch.nn.functional.cross_entropy(
        x.flatten(0, 1), labels.flatten(), reduction="none").view(RANKS, TOKENS))
    # On logits split along the sequence (context parallelism): reductions over the vocabulary,
    # the same values in float64.
    for eps_, z_ in ((0.0, 0.0), (eps, z)):
        torch.testing.assert_close(token_losses(x, labels, label_smoothing=eps_, z_loss=z_, split_sequence=True),
                                   token_losses(x, labels, label_smoothing=eps_, z_loss=z_), rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("chunk", [1, 4, 24])
@pytest.mark.parametrize("eps, z", [(0.0, 0.0), (0.1, 0.0), (0.0, 1e-3), (0.2, 1e-2)])
def test_chunked_cross_entropy_equals_the_full_logits_loss_and_gradients(chunk, eps, z):
    h, w, labels, upstream = _inputs()
    full = token_losses(h @ w.T, labels, label_smoothing=eps, z_loss=z)
    grads = torch.autograd.grad((full * upstream).sum(), (h, w))
    chunked = chunked_token_losses(h, w, labels, chunk, label_smoothing=eps, z_loss=z)
    chunked_grads = torch.autograd.grad((chunked * upstream).sum(), (h, w))
    torch.testing.assert_close(chunked, full, rtol=1e-13, atol=1e-13)
    for got, want in zip(chunked_grads, grads):  # of the hidden states, of the output weight
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-13)
    assert chunked[0, 5] == 0 and chunked_grads[0][0, 5].abs().max() == 0  # ignored token


def test_chunked_cross_entropy_in_bfloat16_matmuls_tracks_the_full_loss():
    """Under bf16 autocast the chunked projections run in bf16 (as nn.Linear's would), the softmax
    and loss in float32."""
    h, w, labels, _ = _inputs()
    h32, w32 = h.detach().float(), w.detach().float()
    full = token_losses((h32.bfloat16() @ w32.bfloat16().T), labels)
    chunked = chunked_token_losses(h32, w32, labels, 8, dtype=torch.bfloat16)
    assert chunked.dtype == torch.float32
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)


# ---- the compiled training step ----------------------------------------------------------------

VOCAB_XLA, SEQ, BATCH = 8192, 256, 2


def _compiled_step(tmp_path, *loss_flags: str) -> tuple[dict, object]:
    """train.py for 2 steps with XLA dumping its buffer assignments: (losses, the train step's)."""
    import os

    from helpers import tiny_args, train_run

    from torchtitan_xla.runtime.xla.compiled import dump_flags, read_buffer_assignments

    dump = tmp_path / "xla_dump"
    flags = f"{os.environ.get('XLA_FLAGS', '')} {dump_flags(dump)}".strip()
    losses, _ = train_run(
        tiny_args(tmp_path / "run", "--training.steps", "2", "--training.seq_len", str(SEQ),
                  "--training.local_batch_size", str(BATCH), "--activation_checkpoint.mode", "none",
                  *loss_flags),
        model_overrides={"n_layers": 1, "dim": 64, "n_heads": 4, "vocab_size": VOCAB_XLA},
        env={"XLA_FLAGS": flags})
    step = max(read_buffer_assignments(dump), key=lambda b: b.temp_bytes)  # init graph is smaller
    return losses, step


def test_the_chunked_loss_never_holds_the_full_logits_in_the_compiled_step(tmp_path):
    full_logits = BATCH * SEQ * VOCAB_XLA * 4  # float32 [tokens, vocab]
    plain_losses, plain = _compiled_step(tmp_path / "plain")
    chunked_losses, chunked = _compiled_step(tmp_path / "chunked", "--loss.chunk_size", "64")
    # The plain step has [tokens, vocab] temporaries; the chunked step nothing that large: its
    # largest temporary is a parameter-sized gradient or one chunk's logits (64 of 512 tokens).
    assert plain.largest_temporary()[0] >= full_logits, plain.largest_temporary()
    assert chunked.largest_temporary()[0] <= full_logits // 8, chunked.largest_temporary()
    assert chunked.temp_bytes < plain.temp_bytes / 2, (chunked.temp_bytes, plain.temp_bytes)
    # Same loss (float32 on XLA; only the summation order differs).
    assert chunked_losses.keys() == plain_losses.keys() == {1, 2}
    for step in plain_losses:
        assert chunked_losses[step] == pytest.approx(plain_losses[step], rel=1e-5)
