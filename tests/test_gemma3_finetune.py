"""Fine-tuning Gemma 3 as a user does: a Gemma-style tokenizer.json (trained here from the embedded
corpus), a short pre-training of Gemma 3's debug model exported to HuggingFace, then full SFT and
LoRA on the embedded chat set rendered in Gemma's chat format, from that export: the held-out
masked loss falls; the exports load in transformers and peft (Gemma3ForCausalLM underneath) and
carry the tokenizer with Gemma's chat template."""

import json

import pytest
import torch
from checkpoint_helpers import TWO_BLOCKS
from data_helpers import train_gemma_style_tokenizer
from helpers import chat_finetune_jobs, train_many

GEMMA3 = ["--model.name", "gemma3", "--model.flavor", "debugmodel"]


@pytest.fixture(scope="module")
def gemma3_runs(tmp_path_factory):
    """In one process: 6 steps of pre-training exported to HF, then 30 steps of SFT and of LoRA
    (rank 8) from that export with validation on the held-out topics every 10. Two blocks, both
    local (a 16-token window: conversations are longer)."""
    out = tmp_path_factory.mktemp("gemma3")
    tokenizer = train_gemma_style_tokenizer(out / "tokenizer")
    return out, train_many(chat_finetune_jobs(out, GEMMA3, tokenizer, "6e-3", "8e-3"), devices=1,
                           model_overrides=TWO_BLOCKS)


@pytest.mark.parametrize("kind", ["sft", "lora"])
def test_gemma3_fine_tuning_lowers_the_held_out_masked_loss(kind, gemma3_runs):
    """Gemma-rendered conversations, only the answers' tokens counted: the loss on the held-out topics
    falls at every validation, by 3% at least over the last 20 steps (SFT 11%, LoRA 5% measured;
    the training loss's batches differ too much in difficulty over 30 steps to compare)."""
    _, runs = gemma3_runs
    validation = runs[kind]["validation"]
    assert sorted(validation) == [10, 20, 30]
    assert validation[30] < validation[20] < validation[10], (kind, validation)
    assert validation[30] < 0.97 * validation[10], (kind, validation)


def test_gemma3_exports_load_in_transformers_and_peft(gemma3_runs):
    """The SFT run's export loads in AutoModelForCausalLM (Gemma3ForCausalLM) and computes the
    checkpoint's logits (ours, from the same DCP step, 1e-5); the LoRA run's PEFT folder names Gemma's
    HF modules, loads with its base through AutoPeftModelForCausalLM and gives the merged export's
    logits; the exported tokenizer renders Gemma's chat format."""
    import peft
    import transformers

    from torchtitan_xla.checkpoint.hf import read_hf_state_dict
    from torchtitan_xla.models import get_model_args
    from torchtitan_xla.models.llama import Transformer
    from torchtitan_xla.models.llama.state_dict_adapter import from_hf

    out, _ = gemma3_runs
    tokens = torch.randint(0, 800, (2, 64), generator=torch.Generator().manual_seed(3))
    sft = out / "sft" / "checkpoint" / "step-30-hf"
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(sft)).eval()
    assert type(exported).__name__ == "Gemma3ForCausalLM"
    args = get_model_args("gemma3", "debugmodel", vocab_size=800, **TWO_BLOCKS)
    ours = Transformer(args)
    ours.load_state_dict(from_hf(read_hf_state_dict(sft), args))
    with torch.no_grad():
        torch.testing.assert_close(exported(tokens).logits, ours(tokens), rtol=0, atol=1e-5)

    step = out / "lora" / "checkpoint"
    config = json.loads((step / "step-30-peft" / "adapter_config.json").read_text())
    assert config["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                               "up_proj", "down_proj"])
    adapted = peft.AutoPeftModelForCausalLM.from_pretrained(str(step / "step-30-peft")).eval()
    assert type(adapted.get_base_model()).__name__ == "Gemma3ForCausalLM"
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(step / "step-30-hf")).eval()
    with torch.no_grad():
        theirs = adapted(tokens).logits
        torch.testing.assert_close(theirs, merged(tokens).logits, rtol=0, atol=1e-5)
    with adapted.disable_adapter(), torch.no_grad():  # the adapters act
        assert (theirs - adapted(tokens).logits).abs().max() > 1e-3
    chat = transformers.AutoTokenizer.from_pretrained(str(sft), local_files_only=True)
    text = chat.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<bos><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"
