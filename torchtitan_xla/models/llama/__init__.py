"""Llama flavors with their published hyperparameters (vocab_size comes from the tokenizer)."""

from torchtitan_xla.models.llama.model import ModelArgs, RopeScaling, Transformer

__all__ = ["ModelArgs", "RopeScaling", "Transformer", "llama2_configs", "llama3_configs"]

llama2_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16),
    "7B": ModelArgs(dim=4096, n_layers=32, n_heads=32),
    "13B": ModelArgs(dim=5120, n_layers=40, n_heads=40),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                     ffn_dim_multiplier=1.3, multiple_of=4096),
}

# Llama 3 flavors carry Llama 3.1's RoPE scaling (405B exists only as 3.1); the debug model
# keeps plain RoPE so its numbers stay easy to check.
llama3_configs = {
    "debugmodel": ModelArgs(dim=256, n_layers=8, n_heads=16, rope_theta=500000),
    "8B": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.3,
                    multiple_of=1024, rope_theta=500000, rope_scaling=RopeScaling()),
    "70B": ModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim_multiplier=1.3,
                     multiple_of=4096, rope_theta=500000, rope_scaling=RopeScaling()),
    "405B": ModelArgs(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim_multiplier=1.2,
                      multiple_of=4096, rope_theta=500000, rope_scaling=RopeScaling()),
}
