"""tests/test_native_runtime.py's torchrun worker for DTensor numerics on the native runtime's
(fsdp, tp) mesh: "loss", token_losses on logits sharded over the vocabulary against
F.cross_entropy on the whole logits in float64, values and gradients, and the collectives it ran;
"rules", the sharding rules the runtime adds (select, logsumexp) against plain tensors, for each
layout; "float8", float8_dot's rule (torchtitan_xla.float8) on the layouts a linear layer meets,
against the plain op; "bf16_step", the debug model on the mesh under bf16 autocast: its collectives
with their dtypes, its loss and gradients against one process. Rank 0 writes $NATIVE_OUT."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from torchtitan_xla import runtime  # noqa: E402
from torchtitan_xla.float8 import E4M3, E5M2, float8_dot, tensorwise_scale  # noqa: E402
from torchtitan_xla.losses import IGNORE_INDEX, token_losses  # noqa: E402

dist.init_process_group("gloo")
runtime.use("native")
mesh = runtime.build_mesh((2, dist.get_world_size() // 2), ("fsdp", "tp"), device_type="cpu")
report = []
for batch, seq, vocab, eps, z in [(2, 5, 12, 0.0, 0.0), (4, 3, 20, 0.1, 1e-3), (2, 7, 8, 0.2, 1e-2)]:
    g = torch.Generator().manual_seed(batch * seq * vocab)
    x = torch.randn(batch, seq, vocab, dtype=torch.float64, generator=g) * 4
    labels = torch.randint(vocab, (batch, seq), generator=g)
    labels[0, 1] = labels[-1, -1] = IGNORE_INDEX
    upstream = torch.randn(batch, seq, dtype=torch.float64, generator=g)
    whole = x.clone().requires_grad_()
    want = F.cross_entropy(whole.flatten(0, 1), labels.flatten(), reduction="none", label_smoothing=eps,
                           ignore_index=IGNORE_INDEX).view(batch, seq)
    want = want + z * torch.logsumexp(whole, -1).square() * (labels != IGNORE_INDEX)
    (want * upstream).sum().backward()
    sharded = distribute_tensor(x, mesh, [Shard(0), Shard(2)]).requires_grad_()
    dlabels = distribute_tensor(labels, mesh, [Shard(0), Replicate()])
    dup = distribute_tensor(upstream, mesh, [Shard(0), Replicate()])
    with CommDebugMode() as comm:
        got = token_losses(sharded, dlabels, label_smoothing=eps, z_loss=z)
        (got * dup).sum().backward()
    report.append({"value": (got.full_tensor() - want).abs().max().item(),
                   "grad": (sharded.grad.full_tensor() - whole.grad).abs().max().item(),
                   "scale": want.abs().max().item(), "placements": repr(sharded.placements),
                   "collectives": sorted(str(k) for k in comm.get_comm_counts())})

RULE_OPS = {"x[..., 0]": lambda t: t[..., 0], "x.select(1, 2)": lambda t: t.select(1, 2),
            "logsumexp(-1)": lambda t: torch.logsumexp(t, -1),
            "logsumexp((0, 1), keepdim)": lambda t: torch.logsumexp(t, (0, 1), keepdim=True), "x + 1": lambda t: t + 1}
rules = []
plain = torch.randn(4, 6, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
for layout in ([Replicate(), Replicate()], [Shard(0), Replicate()], [Replicate(), Shard(2)], [Shard(1), Shard(2)]):
    x = distribute_tensor(plain, mesh, layout)
    # In turn on the same x: a rule that rewrote x's shape fails at the next op.
    for name, op in RULE_OPS.items():
        value, want = op(x), op(plain)
        whole = value.full_tensor()
        rules.append({"layout": repr(layout), "op": name, "placements": repr(value.placements),
                      "shape": list(whole.shape) == list(want.shape),
                      "error": (whole - want).abs().max().item() if whole.shape == want.shape else None})

R = Replicate()
# (a, b, contracted dims, dtypes, a's layout, b's layout) on (fsdp, tp): x [batch, seq, in] and
# w [out, in] of a column- and a row-parallel layer's forward, and the weight gradient g.T @ x.
F8_CASES = {"column-parallel": ((4, 6, 32), (48, 32), [2], [1], E4M3, E4M3, [Shard(0), R], [R, Shard(0)]),
            "row-parallel": ((4, 6, 32), (48, 32), [2], [1], E4M3, E4M3, [Shard(0), Shard(2)], [R, Shard(1)]),
            "replicated": ((2, 8, 32), (16, 32), [2], [1], E4M3, E4M3, [R, R], [R, R]),
            "weight gradient": ((4, 8, 48), (4, 8, 32), [0, 1], [0, 1], E5M2, E4M3, [Shard(0), Shard(2)],
                                [Shard(0), R])}
float8 = []
for name, (sa, sb, a_dims, b_dims, fa, fb, la, lb) in F8_CASES.items():
    g = torch.Generator().manual_seed(len(name))
    a, b = torch.randn(sa, generator=g), torch.randn(sb, generator=g)
    want = float8_dot(a, b, tensorwise_scale(a, fa), tensorwise_scale(b, fb), a_dims, b_dims, fa, fb, torch.float32)
    da, db = distribute_tensor(a, mesh, la), distribute_tensor(b, mesh, lb)
    scales = tensorwise_scale(da, fa), tensorwise_scale(db, fb)  # whole-tensor maxima: all-reduces
    with CommDebugMode() as comm:
        got = float8_dot(da, db, *scales, a_dims, b_dims, fa, fb, torch.float32)
    float8.append({"case": name, "placements": repr(got.placements),
                   "collectives": sorted(str(k) for k in comm.get_comm_counts()),
                   "error": ((got.full_tensor() - want).abs().max() / want.abs().max()).item()})


class Collectives(TorchDispatchMode):
    """Each collective the process runs: (op, dtype, shape of its input)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and func.__name__.split(".")[0] != "wait_tensor":
            self.seen.append((func.__name__.split(".")[0], str(args[0].dtype).removeprefix("torch."),
                              list(args[0].shape)))
        return func(*args, **(kwargs or {}))


def bf16_step(reduce: str) -> dict:
    """The debug model (2 blocks) on fsdp=2 x tp=2 under bfloat16 autocast, gradients reduced in
    `reduce`: one forward and backward's collectives, and its loss and gradients against the same
    weights on one process."""
    from torchtitan_xla.config import parse_args
    from torchtitan_xla.models import get_model_args, get_model_class
    from torchtitan_xla.parallelisms import BATCH_AXES, ParallelDims, parallelize_llama
    from torchtitan_xla.parallelisms.compute_dtype import apply_reduce_dtype

    cfg = parse_args(["--job.config_file", "train_configs/debug_model.toml", "--parallelism.data_parallel_shard_degree",
                      "2", "--parallelism.tensor_parallel_degree", "2", "--training.mixed_precision_param", "bfloat16"])
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    args = get_model_args("llama3", "debugmodel", vocab_size=256, max_seq_len=32, n_layers=2)
    torch.manual_seed(0)
    plain = get_model_class("llama3")(args)
    model = get_model_class("llama3")(args)
    model.load_state_dict(plain.state_dict())
    model_mesh = dims.build_mesh("cpu")
    apply_reduce_dtype(model, getattr(torch, reduce))
    parallelize_llama(model, model_mesh, dims, cfg)
    tokens = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(1))
    sharded = runtime.input_sharding(model_mesh, (BATCH_AXES, None))(tokens)
    from torch.distributed.tensor.experimental import implicit_replication

    with Collectives() as seen, implicit_replication(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(sharded).float().square().mean()
        loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = plain(tokens).float().square().mean()
    want.backward()
    grads = {n: (p.grad.full_tensor() - q.grad).abs().max().item() / q.grad.abs().max().item()
             for (n, p), q in zip(model.named_parameters(), plain.parameters())}
    return {"collectives": seen.seen, "loss": loss.full_tensor().item(), "want": want.item(), "grads": grads,
            "shapes": {n: list(p.shape) for n, p in plain.named_parameters()}}


steps = {reduce: bf16_step(reduce) for reduce in ("float32", "bfloat16")}
if dist.get_rank() == 0:
    Path(os.environ["NATIVE_OUT"]).write_text(json.dumps({"loss": report, "rules": rules, "float8": float8,
                                                          "bf16_steps": steps}))
dist.destroy_process_group()
