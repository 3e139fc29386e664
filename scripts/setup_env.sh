# Sourced by run_train.sh and tests/run_tests.sh: choose the Python to run with, installing what
# is missing. Sets PY.
#
#  - The active Python (or $PYTHON) when its torch already drives an accelerator: torch_xla (a TPU
#    VM has it), torch-tpu, or a CUDA build of torch (a GPU machine's): this package's other
#    dependencies are added to it, its torch is left untouched. Without torch_xla only the native
#    runtime ([runtime] backend = "native") runs there.
#  - Otherwise ./.venv, created and installed on first use (and again when pyproject.toml changes).
#
# Usage: setup_python [dev]

_TTX_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

# Whether Python $1 has modules $2...: looked up, not imported (importing torch_xla takes
# seconds, and every host runs this at every launch).
_has_modules() {
  local py="$1"; shift
  "$py" -c 'import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))' \
    "$@" >/dev/null 2>&1
}

# torch_xla 2.9's wheel carries its own older copy of torchax (0.0.6) in the same top-level
# `torchax/` directory as the torchax wheel, and whichever pip unpacks last wins. With the old copy,
# scan_layers (call_jax under SPMD) dies with SIGSEGV, so the pinned torchax goes back on top.
_restore_torchax() {
  "$PY" -m pip install --quiet --force-reinstall --no-deps \
    "$("$PY" "$_TTX_REPO/scripts/requirements.py" | grep '^torchax')"
}

# Whether Python $1's torch is a CUDA build: torch/version.py read, not imported.
_cuda_torch() {
  "$1" -c 'import importlib.util as u, pathlib, re, sys
s = u.find_spec("torch")
sys.exit(s is None or not re.search(r"^cuda\b.*= *.[0-9]", (pathlib.Path(s.origin).parent / "version.py").read_text(), re.M))' \
    >/dev/null 2>&1
}

# Prints Python $1's name if its torch drives a device of its own: torch_xla, torch-tpu, or a CUDA
# build where there is a GPU (PyPI's torch is a CUDA build, also on CPU-only machines).
_device_python() {
  if _has_modules "$1" torch_xla || _has_modules "$1" torch_tpu \
      || { command -v nvidia-smi >/dev/null && _cuda_torch "$1"; }; then
    echo "$1"
  fi
}

# This host's accelerator, from its device files (torchtitan_xla/runtime/host_devices.py, run with
# the system's Python before anything is installed): tpu, cuda or cpu. Sets TTX_ACCELERATOR.
detect_accelerator() {
  TTX_ACCELERATOR="$("${PYTHON:-python3}" "$_TTX_REPO/torchtitan_xla/runtime/host_devices.py")"
}

# The extras ./.venv gets for extras $1 on this host: a TPU host adds `tpu` (torch_xla's libtpu).
# A GPU host needs nothing more: PyPI's torch is a CUDA build, which the native runtime uses.
venv_extras() {
  local extras="${1:-}"
  if [[ "$TTX_ACCELERATOR" == tpu ]]; then extras="${extras:+$extras,}tpu"; fi
  echo "$extras"
}

# What ./.venv records once installed with extras $1: pyproject.toml's checksum and the extras.
_stamp() {
  echo "$(cksum < "$_TTX_REPO/pyproject.toml" | cut -d' ' -f1)-${1:-base}"
}

setup_python() {
  detect_accelerator
  local extras
  extras="$(venv_extras "${1:-}")"
  local base="${PYTHON:-python3}"
  local spec="$_TTX_REPO"
  if [[ -n "$extras" ]]; then spec="$_TTX_REPO[$extras]"; fi
  local stamp_id
  stamp_id="$(_stamp "$extras")"

  if [[ -n "$(_device_python "$base")" ]]; then
    PY="$(command -v "$base")"
    local keep=(torch torch_xla)  # what pip must not replace
    # torch_xla's bridge to JAX: nothing without torch_xla uses them
    if ! _has_modules "$PY" torch_xla; then keep+=(jax jaxlib torchax); fi
    if ! _has_modules "$PY" torchtitan_xla tiktoken sentencepiece tomli_w datasets torchdata transformers \
        || { [[ -n "$extras" ]] && ! _has_modules "$PY" pytest xdist; }; then
      echo "[setup] adding torchtitan_xla to $PY (its torch left as it is)" >&2
      "$PY" -m pip install --quiet --no-deps -e "$_TTX_REPO"
      "$PY" -m pip install --quiet -r <("$PY" "$_TTX_REPO/scripts/requirements.py" $extras --exclude "${keep[@]}")
      if _has_modules "$PY" torch_xla; then _restore_torchax; fi
    fi
    # A TPU VM's torch_xla without its TPU runtime (libtpu, torch_xla's `tpu` extra).
    if [[ "$TTX_ACCELERATOR" == tpu ]] && _has_modules "$PY" torch_xla && ! _has_modules "$PY" libtpu \
        && [[ -z "${TPU_LIBRARY_PATH:-}" ]]; then
      echo "[setup] adding libtpu to $PY (torch_xla's tpu extra)" >&2
      "$PY" -m pip install --quiet "torch_xla[tpu]==$("$PY" -c 'import importlib.metadata as m; print(m.version("torch_xla").split("+")[0])')"
    fi
    return 0
  fi

  PY="$_TTX_REPO/.venv/bin/python"
  if [[ ! -x "$PY" ]]; then
    echo "[setup] creating $_TTX_REPO/.venv" >&2
    "$base" -m venv "$_TTX_REPO/.venv"
  fi
  if [[ ! -f "$_TTX_REPO/.venv/.installed-$stamp_id" ]]; then
    echo "[setup] installing torchtitan_xla${extras:+[$extras]} into .venv (first run: several minutes," \
         "torch pulls ~3 GB of wheels)" >&2
    "$PY" -m pip install --quiet --upgrade pip
    "$PY" -m pip install --quiet -e "$spec"
    _restore_torchax
    rm -f "$_TTX_REPO"/.venv/.installed-*
    touch "$_TTX_REPO/.venv/.installed-$stamp_id"
    # a dev install also satisfies the base install (and on a TPU host, dev,tpu satisfies tpu)
    if [[ "${1:-}" == dev ]]; then touch "$_TTX_REPO/.venv/.installed-$(_stamp "$(venv_extras "")")"; fi
  fi
  return 0
}
