"""The job configuration: schema (`job_config.py`), reading (`manager.py`), checks of keys against
each other (`checks.py`), where each value came from (`sources.py`), and the generated option
reference (`reference.py`). Imports neither torch nor torch_xla."""

from torchtitan_xla.config.job_config import JobConfig
from torchtitan_xla.config.manager import parse_args, run_command
from torchtitan_xla.config.sources import attributed, renamed_keys, where
from torchtitan_xla.errors import ConfigError, RunError

__all__ = ["ConfigError", "JobConfig", "RunError", "attributed", "parse_args", "renamed_keys", "run_command",
           "where"]
