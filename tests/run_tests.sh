#!/usr/bin/env bash
# Run the test suite; first use creates ./.venv with the dev extras (see scripts/setup_env.sh).
#   ./tests/run_tests.sh [pytest options]      (-n 0: in this process, one test at a time)
# Two worker processes (TEST_WORKERS), each taking whole files: a file's module fixtures (its
# shared runs) are computed once.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/setup_env.sh
source "$REPO/scripts/setup_env.sh"
setup_python dev
cd "$REPO"
# Files in conftest.py's order (the longest first), not xdist's (the most tests first).
exec "$PY" -m pytest tests -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
