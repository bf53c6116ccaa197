# The Redis image of docker-compose.yml: the pinned official image plus our accsum module
# (accumulator/module/accsum.c), built in a first stage from the same image. With it, dense
# accumulators keep each round's running sum in Redis (see the README).
#
#   docker compose build redis                                   # builds it for the demo
#   docker build -f scripts/redis.Dockerfile -t redis-accsum .   # by hand; context: repo root
#
# The compiler flags are the library's own (accumulator/_module.py; a test checks they agree).
# Bump the base's version and digest together, in both stages.
FROM redis:7.4.10-alpine@sha256:e7723ff73d963f5cc6d9c4643ea3d989527a402a319239054e9472a7fb9219a2 AS build
# hadolint ignore=DL3018
RUN apk add --no-cache gcc musl-dev
COPY accumulator/module/accsum.c /src/accsum.c
RUN cc -O3 -std=c99 -fPIC -shared -Wall -Wextra -o /src/accsum.so /src/accsum.c

FROM redis:7.4.10-alpine@sha256:e7723ff73d963f5cc6d9c4643ea3d989527a402a319239054e9472a7fb9219a2
COPY --from=build /src/accsum.so /usr/local/lib/redis/accsum.so
