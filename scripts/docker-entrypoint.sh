#!/bin/sh
# Entrypoint of the app image (scripts/Dockerfile, used by docker-compose.yml): runs
# `accumulator ARGS...` -- `docker compose run --rm cli ls`, `... cli show compose/emb`.
#
# The Redis URL is put together here, inside the container, from the password in
# $REDISCLI_AUTH (redis-cli's variable): redis://:PASSWORD@$REDIS_HOST:$REDIS_PORT/$REDIS_DB
# (defaults: redis, 6379, 0) and handed to accumulator as $REDIS_URL, so the password is on
# no command line (`ps`) and not in the image. An ACCUMULATOR_REDIS_URL or REDIS_URL given
# to the container is used as it is instead.
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
    REDIS_URL="redis://:${REDISCLI_AUTH}@${REDIS_HOST:-redis}:${REDIS_PORT:-6379}/${REDIS_DB:-0}"
    export REDIS_URL
fi

if [ "${1:-}" = demo ] && [ -n "${DEMO_ARGS:-}" ]; then
    shift
    # shellcheck disable=SC2086  # a list of flags: split on purpose (globbing is off: set -f)
    set -- demo $DEMO_ARGS "$@"
fi

exec accumulator "$@"
