"""The XLA runtime: torch_xla SPMD (see torchtitan_xla/runtime/__init__.py for the interface)."""
