#!/bin/sh
# Container entrypoint: the same two commands `make serve` runs (Makefile targets `models` and `serve`),
# with the listen address opened up for the container network.
#
#   1. `specgate models pull` fills the model volume ($SPECGATE_HOME) on the first start; on later starts
#      it finds the converted models there and returns at once.
#   2. `exec` hands PID 1 to the gateway itself so `docker stop` / Kubernetes deliver SIGTERM to it and it
#      drains (readiness false, in-flight requests finish, then exit) instead of being killed by a shell.
#
# SPECGATE_PULL_MODELS: space-separated aliases to pull (default: the pinned default pair).
# SPECGATE_SKIP_PULL=1: trust the volume (e.g. Kubernetes, where an init container already pulled).
# Neither is a gateway setting (gateway/settings.py ignores SPECGATE_* names that are not sections);
# SPECGATE_MODELS would be one: the JSON list of models to serve.
set -eu

if [ "${SPECGATE_SKIP_PULL:-0}" != "1" ]; then
    # shellcheck disable=SC2086  # word splitting of the alias list is intended
    specgate models pull ${SPECGATE_PULL_MODELS:-}
fi
exec specgate serve --host 0.0.0.0 "$@"
