#!/usr/bin/env bash
# Make sure a Docker engine and Compose answer, as `make test-deploy` needs them:
#  - install Debian's docker.io (and docker-compose when no `docker compose` plugin is
#    there) when missing, as root;
#  - start `dockerd --bridge=none --iptables=false` when no engine answers (containers use
#    the host's network only, on loopback; nothing is bridged or NATed). It is left running,
#    logging to /var/log/edgecache-dockerd.log.
# Exits 0 when `docker info` works, 1 (with the reason on stderr) when no engine can be had.
set -uo pipefail

LOG=${EDGECACHE_DOCKERD_LOG:-/var/log/edgecache-dockerd.log}
is_root() { [ "$(id -u)" = 0 ]; }
engine_up() { timeout 20 docker info >/dev/null 2>&1; }
fail() { echo "docker-engine: $*" >&2; exit 1; }

apt_install() {
    is_root && command -v apt-get >/dev/null || return 1
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 \
        || { apt-get update -q >/dev/null 2>&1 \
             && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1; }
}

if ! command -v docker >/dev/null || ! { engine_up || command -v dockerd >/dev/null; }; then
    echo "docker-engine: installing Debian's docker.io ..."
    apt_install docker.io || fail "no Docker here and docker.io cannot be installed (not root, or no apt)"
fi

if ! engine_up; then
    is_root || fail "no Docker engine answers and this is not root, so none can be started"
    command -v dockerd >/dev/null || fail "no dockerd binary (docker.io did not install it)"
    echo "docker-engine: starting dockerd --bridge=none --iptables=false (log: $LOG)"
    setsid nohup dockerd --bridge=none --iptables=false >>"$LOG" 2>&1 </dev/null &
    for _ in $(seq 60); do
        engine_up && break
        sleep 1
    done
    engine_up || { tail -20 "$LOG" >&2; fail "dockerd did not come up within 60 s (see $LOG)"; }
fi

if ! docker compose version >/dev/null 2>&1 && ! docker-compose version >/dev/null 2>&1; then
    echo "docker-engine: installing Debian's docker-compose ..."
    apt_install docker-compose || fail "neither 'docker compose' nor 'docker-compose' can be had"
fi
echo "docker-engine: $(docker version --format 'engine {{.Server.Version}}' 2>/dev/null)," \
    "$(docker compose version 2>/dev/null || docker-compose version --short 2>/dev/null | sed 's/^/docker-compose /')"
