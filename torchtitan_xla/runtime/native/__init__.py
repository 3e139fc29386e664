"""The native runtime: PyTorch distributed with DTensor and torch.compile, one process per device
(see torchtitan_xla/runtime/__init__.py for the interface)."""
