"""What run_train.sh needs to know before starting Python on XLA.

    python -m torchtitan_xla.launch --cpu-devices [train.py options]

prints the number of virtual XLA CPU devices the job's mesh needs: the product of the fixed
parallel degrees (a `data_parallel_shard_degree` of -1 counts as 1, so the default job runs on one
device). CPU_NUM_DEVICES in the environment takes precedence (run_train.sh checks it first).
"""

from __future__ import annotations

import sys

from torchtitan_xla.config_manager import ConfigError, JobConfig, parse_args


def cpu_device_count(job_config: JobConfig) -> int:
    p = job_config.parallelism
    shard = max(p.data_parallel_shard_degree, 1)
    return p.data_parallel_replicate_degree * shard * p.tensor_parallel_degree


def main(argv: list[str]) -> int:
    if not argv or argv[0] != "--cpu-devices":
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        print(cpu_device_count(parse_args(argv[1:])))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
