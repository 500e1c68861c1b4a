#!/usr/bin/env bash
# Headless Chromium for the dashboard's screenshot test: Debian's package, installed when missing.
# If it cannot be installed the test skips (and says so), the rest of the suite still runs.
set -u
command -v chromium >/dev/null 2>&1 && { echo "chromium: $(chromium --version 2>/dev/null | head -1)"; exit 0; }
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "chromium: installing Debian's chromium"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) \
    || echo "chromium: install failed; the dashboard screenshot test will skip" >&2
else
  echo "chromium: not installed and cannot install here; the dashboard screenshot test will skip" >&2
fi
exit 0
