#!/usr/bin/env bash
# Start or stop a Docker engine for the compose demo on a machine whose containers may use only
# loopback: no bridge (its private-range addresses are not allowed there), no iptables rules.
# Every service then runs on the host network (docker/compose.loopback.yml).
#
#   docker/dockerd.sh start   # prints "started <pid>" or "running" (an engine already answers)
#   docker/dockerd.sh stop    # stops only an engine this script started (its pid file)
set -euo pipefail
STATE=${MHFL_DOCKERD_DIR:-/tmp/mheterofl-dockerd}
PIDFILE=$STATE/dockerd.pid

case "${1:-}" in
start)
  if docker info >/dev/null 2>&1; then echo running; exit 0; fi
  command -v dockerd >/dev/null || { echo "no dockerd: run docker/setup-host.sh first" >&2; exit 1; }
  [ "$(id -u)" = 0 ] || { echo "dockerd must be started as root" >&2; exit 1; }
  mkdir -p "$STATE"
  setsid dockerd --bridge=none --iptables=false --ip6tables=false --pidfile "$PIDFILE" \
    >"$STATE/dockerd.log" 2>&1 </dev/null &
  for _ in $(seq 60); do
    if docker info >/dev/null 2>&1; then echo "started $(cat "$PIDFILE")"; exit 0; fi
    sleep 1
  done
  echo "dockerd did not answer within 60 s; log: $STATE/dockerd.log" >&2
  exit 1
  ;;
stop)
  [ -f "$PIDFILE" ] || { echo "no engine started by this script"; exit 0; }
  pid=$(cat "$PIDFILE")
  kill "$pid" 2>/dev/null || true
  for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
  if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid"; fi
  rm -f "$PIDFILE"
  echo "stopped $pid"
  ;;
*)
  echo "usage: $0 start|stop" >&2; exit 2
  ;;
esac
