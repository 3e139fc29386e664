"""Multi-host launch: from the scheduler's variables to what each host's process needs.

- `hosts`: host discovery (torchrun / Slurm variables, node lists), which host this is;
- `tpu`: the TPU runtime's variables where no metadata server describes the slice; multi-slice;
- `plan`: each host's variables (`--exports`) and the dry run;
- `host_group`: the CPU-side (gloo) group of hosts and `--check-hosts`;
- `__main__`: the command line run_train.sh calls.

Nothing here imports torch or torch_xla at module level: the launcher runs before XLA starts.
"""

from torchtitan_xla.launch.host_group import check_disjoint, check_hosts, init_host_group
from torchtitan_xla.launch.hosts import (
    DEFAULT_MASTER_PORT,
    Hosts,
    check_slices,
    expand_nodelist,
    host_identity,
    parse_nodelist,
    resolve_hosts,
)
from torchtitan_xla.launch.plan import cpu_device_count, dry_run_text, host_env, plan
from torchtitan_xla.launch.tpu import metadata_server_answers, tpu_env, tpu_hosts_per_slice

__all__ = ["DEFAULT_MASTER_PORT", "Hosts", "check_disjoint", "check_hosts", "check_slices",
           "cpu_device_count", "dry_run_text", "expand_nodelist", "host_env", "host_identity",
           "init_host_group", "metadata_server_answers", "parse_nodelist", "plan", "resolve_hosts",
           "tpu_env", "tpu_hosts_per_slice"]
