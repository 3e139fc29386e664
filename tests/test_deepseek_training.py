"""Training DeepSeek-V3's debug model (cut to 2 blocks: one dense, one with 16 experts) on the XLA
CPU backend: the expert bias balances the load where a frozen bias lets it collapse, it is saved
and resumed bit-exactly, and the HF export carries it. (Meshes: tests/test_moe_training.py.)"""

import json
import shutil

import torch
from helpers import tiny_args, train_many, train_run

TWO_BLOCKS = {"n_layers": 2}
DEEPSEEK = ["--model.name", "deepseek_v3"]
BIAS = "layers.1.feed_forward.expert_bias"


def test_the_expert_bias_keeps_the_load_balanced(tmp_path):
    """100 steps on the embedded corpus without any balancing loss (aux and z weights 0), the bias
    updated at 4e-3 per step against frozen at zero: the loss falls in both, and from step 60 on
    the experts' load max/min (logged every 10 steps) stays under 10 with the bias while without it
    a few experts take (nearly) every token: over 30. Measured here: 1.8-4.8 against 74-336 (the
    200-step run of the 4-block flavor: docs/moe.md)."""
    common = [*DEEPSEEK, "--training.steps", "100", "--metrics.log_freq", "10", "--lr_scheduler.warmup_steps",
              "10", "--moe.aux_loss_weight", "0", "--moe.z_loss_weight", "0"]
    runs = train_many({name: tiny_args(tmp_path / name, *common, "--moe.bias_update_rate", rate)
                       for name, rate in (("bias", "4e-3"), ("frozen", "0"))}, devices=1, model_overrides=TWO_BLOCKS)
    late = {name: [r[3] for step, r in run["router"].items() if step >= 60] for name, run in runs.items()}
    assert len(late["bias"]) == 5 and max(late["bias"]) < 10 < 30 < min(late["frozen"]), late
    for run in runs.values():
        assert run["losses"][100] < 0.9 * run["losses"][1]
    assert runs["frozen"]["expert_bias"][BIAS] == [0.0] * 16
    assert any(runs["bias"]["expert_bias"][BIAS])


def test_the_bias_resumes_bit_exactly_and_exports_to_hf(tmp_path):
    """Resumed at step 2, steps 3-4 give the uninterrupted run's losses and the same bias, bit for bit
    (a buffer in the checkpoint); it moved between steps 2 and 4; the HF export's
    e_score_correction_bias is it, and DeepseekV3ForCausalLM computes the checkpoint's logits."""
    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    from torchtitan_xla.checkpoint import read_model_state
    from torchtitan_xla.models.llama.model import Transformer

    args = tiny_args(tmp_path, *DEEPSEEK, "--training.steps", "4", "--checkpoint.enable", "--checkpoint.interval",
                     "2", "--checkpoint.last_save_in_hf")
    straight, _ = train_run(args, model_overrides=TWO_BLOCKS)
    ckpt = tmp_path / "checkpoint"
    bias = read_model_state(ckpt / "step-4")[0][BIAS]
    shutil.rmtree(ckpt / "step-4")
    shutil.rmtree(ckpt / "step-4-hf")
    resumed, log = train_run(args, model_overrides=TWO_BLOCKS)
    assert "Resumed from" in log
    assert resumed == {s: straight[s] for s in (3, 4)}
    state, model_args = read_model_state(ckpt / "step-4")
    assert torch.equal(state[BIAS], bias) and not torch.equal(read_model_state(ckpt / "step-2")[0][BIAS], bias)

    hf_dir = ckpt / "step-4-hf"
    assert json.loads((hf_dir / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]
    assert torch.equal(load_file(str(hf_dir / "model.safetensors"))["model.layers.1.mlp.gate.e_score_correction_bias"],
                       bias)
    ours = Transformer(model_args)
    ours.load_state_dict(state)
    hf = DeepseekV3ForCausalLM.from_pretrained(str(hf_dir), attn_implementation="sdpa").eval()
    tokens = torch.randint(0, model_args.vocab_size, (2, 64), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        # float32 on both sides: summation order and RoPE angle precision (as Mixtral's export test).
        torch.testing.assert_close(ours(tokens), hf(tokens).logits, rtol=0, atol=1e-5)
