#!/usr/bin/env bash
# Train from a TOML config; extra arguments override it. The same command on every host.
#
#   ./run_train.sh                                     # train_configs/debug_model.toml
#   CONFIG_FILE=llama3_8b.toml ./run_train.sh          # a bare name resolves in train_configs/
#   CONFIG_FILE=./train_configs/debug_model.toml ./run_train.sh --training.steps 50
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 ./run_train.sh      # on host0; NODE_RANK=1 on the other
#   ./run_train.sh --dry-run [...]      # per host: the variables and the command; starts nothing
#   ./run_train.sh --check-hosts [...]  # join all hosts (gloo) and compare their data; no XLA
#   ./run_train.sh --plan [...]         # memory, collectives and roofline on the config's [plan] tpu
#   ./run_train.sh --help               # every option, its type, default and meaning
#
# Hosts come from NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT, else from Slurm (inside srun), else
# this is one host (or a TPU VM pod that its metadata server describes). See docs/multihost.md.
#
# First use creates ./.venv and installs the package, unless the active Python already has
# torch_xla (a TPU VM). With no TPU it runs on the XLA CPU backend with as many virtual devices
# as the config's parallel degrees need (or CPU_NUM_DEVICES, if set). With --runtime.backend
# native it starts one process per device with torchrun (on the CPU: one per device the degrees
# ask for, or NPROC_PER_NODE).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/setup_env.sh
source "$REPO/scripts/setup_env.sh"
setup_python

MODE=train
case "${1:-}" in
  --dry-run) MODE=dry-run; shift ;;
  --check-hosts) MODE=check-hosts; shift ;;
  --plan) MODE=plan; shift ;;
esac
# Help is printed by the program that reads the options, never through the launcher's `eval` below.
for arg in "$@"; do
  case "$arg" in
    -h|--help)
      if [[ "$MODE" == plan ]]; then exec "$PY" -m torchtitan_xla.plan --help; fi
      exec "$PY" "$REPO/train.py" --help ;;
  esac
done

CONFIG_FILE="${CONFIG_FILE:-$REPO/train_configs/debug_model.toml}"
if [[ ! -f "$CONFIG_FILE" && -f "$REPO/train_configs/$CONFIG_FILE" ]]; then
  CONFIG_FILE="$REPO/train_configs/$CONFIG_FILE"
fi

if [[ -z "${PJRT_DEVICE:-}" ]]; then
  # TTX_ACCELERATOR: this host's, from its device files (setup_python)
  if [[ "$TTX_ACCELERATOR" == tpu ]]; then export PJRT_DEVICE=TPU; else export PJRT_DEVICE=CPU; fi
fi

# This checkout's package, whatever else the Python has installed.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
ARGS=(--job.config_file "$CONFIG_FILE" "$@")
if [[ "$MODE" == plan ]]; then
  exec "$PY" -m torchtitan_xla.plan "${ARGS[@]}"
fi
if [[ "$MODE" == dry-run ]]; then
  exec "$PY" -m torchtitan_xla.launch --dry-run "${ARGS[@]}"
fi
# Which host this is and what its runtime needs; bad input stops here with one line, exit 2.
EXPORTS="$("$PY" -m torchtitan_xla.launch --exports "${ARGS[@]}")" || exit 2
unset TTX_RUNTIME TTX_RDZV  # set by the exports for the native runtime only
eval "$EXPORTS"
if [[ "$MODE" == check-hosts ]]; then
  exec "$PY" -m torchtitan_xla.launch --check-hosts "${ARGS[@]}"
fi
if [[ "${TTX_RUNTIME:-xla}" == native ]]; then
  # The native runtime: one process per device, started by torchrun (its variables tell each one
  # its rank), with the hosts' rendezvous or, on one host, a private one (TTX_RDZV); an error
  # the processes stop on is printed once (launch/torchrun.py).
  read -r -a RDZV <<< "$TTX_RDZV"
  TTX_ERROR_DIR="$(mktemp -d)" LOGLEVEL="${LOGLEVEL:-CRITICAL}" exec "$PY" -m torchtitan_xla.launch.torchrun "${RDZV[@]}" --nproc-per-node "$NPROC_PER_NODE" \
    "$REPO/train.py" "${ARGS[@]}"
fi
exec "$PY" "$REPO/train.py" "${ARGS[@]}"
