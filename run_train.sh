#!/usr/bin/env bash
# Train from a TOML config; extra arguments override it.
#
#   ./run_train.sh                                     # train_configs/debug_model.toml
#   CONFIG_FILE=llama3_8b.toml ./run_train.sh          # a bare name resolves in train_configs/
#   CONFIG_FILE=./train_configs/debug_model.toml ./run_train.sh --training.steps 50
#
# First use creates ./.venv and installs the package, unless the active Python already has
# torch_xla (a TPU VM). With no TPU it runs on the XLA CPU backend with as many virtual devices
# as the config's parallel degrees need (or CPU_NUM_DEVICES, if set).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=scripts/setup_env.sh
source "$REPO/scripts/setup_env.sh"
setup_python

CONFIG_FILE="${CONFIG_FILE:-$REPO/train_configs/debug_model.toml}"
if [[ ! -f "$CONFIG_FILE" && -f "$REPO/train_configs/$CONFIG_FILE" ]]; then
  CONFIG_FILE="$REPO/train_configs/$CONFIG_FILE"
fi

if [[ -z "${PJRT_DEVICE:-}" ]]; then
  if compgen -G "/dev/accel*" >/dev/null || compgen -G "/dev/vfio/[0-9]*" >/dev/null; then
    export PJRT_DEVICE=TPU
  else
    export PJRT_DEVICE=CPU
  fi
fi
if [[ "$PJRT_DEVICE" == CPU && -z "${CPU_NUM_DEVICES:-}" ]]; then
  CPU_NUM_DEVICES="$("$PY" -m torchtitan_xla.launch --cpu-devices --job.config_file "$CONFIG_FILE" "$@")" || exit 2
  export CPU_NUM_DEVICES
fi

exec "$PY" "$REPO/train.py" --job.config_file "$CONFIG_FILE" "$@"
