#!/usr/bin/env bash
# Make sure a redis-server answers on 127.0.0.1:${REDIS_PORT:-6379}: start Debian's when none does.
# It never touches a server it did not start.
set -euo pipefail
port=${REDIS_PORT:-6379}
ping() { python3 - "$port" <<'PY'
import socket, sys
try:
    s = socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1)
    s.sendall(b"PING\r\n"); ok = s.recv(16).startswith(b"+PONG")
except OSError:
    ok = False
sys.exit(0 if ok else 1)
PY
}
if ping; then echo "redis: answering on $port"; exit 0; fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "redis: installing Debian's redis-server"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
dir=$(mktemp -d /tmp/specgate-redis.XXXX)
redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no --dir "$dir" --logfile "$dir/redis.log"
for _ in $(seq 50); do ping && { echo "redis: started on $port"; exit 0; }; sleep 0.1; done
echo "redis: could not start on $port (log: $dir/redis.log)" >&2; exit 1
