"""Command-line tools that work on a run's outputs (`python -m torchtitan_xla.tools.<name>`)."""
