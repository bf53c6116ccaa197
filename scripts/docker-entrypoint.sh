#!/bin/sh
# Entrypoint of the app image (scripts/Dockerfile, used by docker-compose.yml): runs
# `accumulator ARGS...` -- `docker compose run --rm cli ls`, `... cli show compose/emb`.
#
# The Redis URL is put together here, inside the container, from the password in
# $REDISCLI_AUTH (redis-cli's variable): redis://:PASSWORD@$REDIS_HOST:$REDIS_PORT/$REDIS_DB
# (defaults: redis, 6379, 0) and handed to accumulator as $REDIS_URL, so the password is on
# no command line (`ps`) and not in the image. An ACCUMULATOR_REDIS_URL or REDIS_URL given
# to the container is used as it is instead. The compose profiles `sentinel` and `cluster`
# set REDIS_SCHEME (redis+sentinel, redis+cluster), REDIS_ADDRESS (host:port[,host:port...])
# and REDIS_PATH (the Sentinels' service name) instead of the host, port and database.
#
# DEMO_ARGS: flags inserted right after `demo` (the flags every process of one job shares,
# split on spaces), so each demo service's command only adds its role.
set -euf

if [ -z "${ACCUMULATOR_REDIS_URL:-}" ] && [ -z "${REDIS_URL:-}" ]; then
    if [ -z "${REDISCLI_AUTH:-}" ]; then
        echo "accumulator-entrypoint: REDISCLI_AUTH (the Redis password) is not set;" \
            "set REDIS_PASSWORD in .env (cp .env.example .env)" >&2
        exit 2
    fi
    case "$REDISCLI_AUTH" in
        *[!A-Za-z0-9._~-]*)
            echo "accumulator-entrypoint: the Redis password may only contain letters," \
                "digits and . _ ~ - (e.g. openssl rand -hex 32)" >&2
            exit 2
            ;;
    esac
    case "${REDIS_SCHEME:-redis}" in
        redis | redis+sentinel | redis+cluster) ;;
        *)
            echo "accumulator-entrypoint: REDIS_SCHEME must be redis, redis+sentinel or" \
                "redis+cluster" >&2
            exit 2
            ;;
    esac
    case "${REDIS_ADDRESS:-}${REDIS_PATH:-}" in
        *[!A-Za-z0-9.:,_-]*)
            echo "accumulator-entrypoint: REDIS_ADDRESS and REDIS_PATH must be plain" \
                "host:port lists and names" >&2
            exit 2
            ;;
    esac
    address="${REDIS_ADDRESS:-${REDIS_HOST:-redis}:${REDIS_PORT:-6379}}"
    REDIS_URL="${REDIS_SCHEME:-redis}://:${REDISCLI_AUTH}@${address}/${REDIS_PATH:-${REDIS_DB:-0}}"
    export REDIS_URL
fi

if [ "${1:-}" = demo ] && [ -n "${DEMO_ARGS:-}" ]; then
    shift
    # shellcheck disable=SC2086  # a list of flags: split on purpose (globbing is off: set -f)
    set -- demo $DEMO_ARGS "$@"
fi

exec accumulator "$@"
