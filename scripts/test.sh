#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
#
# From a fresh clone: creates/reuses .venv, installs '.[test,demo,hiredis]' (only when
# pyproject.toml changed) and a CPU build of torch (when none is installed), makes sure a redis-server binary exists for the real-backend tests
# (unless REDIS_URL points at a server to use), then runs ruff, mypy and pytest.
# Knobs: see scripts/_env.sh.
set -euo pipefail

# shellcheck source=scripts/_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ACC_ROOT"

acc_ensure_venv
acc_install_project "$ACC_TEST_EXTRAS"
acc_install_torch
acc_ensure_redis

acc_log "ruff check accumulator tests scripts"
ruff check --quiet accumulator tests scripts

acc_log "mypy accumulator"
mypy accumulator

acc_log "python -m pytest $*"
exec python -m pytest "$@"
