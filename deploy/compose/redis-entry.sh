#!/bin/sh
# `redis-server ARGS...` runs with protected mode off, as in the official image; anything
# else runs as given.
set -e
if [ "${1:-}" = redis-server ]; then
  shift
  exec redis-server --protected-mode no "$@"
fi
exec "$@"
