#!/usr/bin/env bash
# One-time set-up of a Debian bookworm machine with no container registry (our development
# machines) for the compose demo. Run as root from the checkout:
#
#   docker/setup-host.sh
#
# 1. Docker engine and debootstrap from Debian (docker.io, debootstrap).
# 2. Compose v2: bookworm has none (its docker-compose 1.29 rejects docker/compose.yml), so the
#    docker-compose package of Debian trixie is downloaded (trixie's package list is fetched into
#    a temporary folder; the machine's apt sources are not changed) and its single binary is
#    installed as a Docker CLI plugin in /usr/local/lib/docker/cli-plugins.
# 3. Local stand-ins for the flwr/* images (docker/local-images.sh), under an engine started by
#    docker/dockerd.sh and stopped again afterwards.
# Each step is skipped when what it makes is already there. A machine that can pull from Docker
# Hub needs only an engine and the compose plugin from its usual sources.
set -euo pipefail
cd "$(dirname "$0")/.."
[ "$(id -u)" = 0 ] || { echo "run as root" >&2; exit 1; }

if ! command -v dockerd >/dev/null || ! command -v debootstrap >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io debootstrap
fi

if ! docker compose version >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  mkdir -p "$tmp/parts" "$tmp/lists/partial" "$tmp/cache"
  printf 'Types: deb\nURIs: http://deb.debian.org/debian\nSuites: trixie\nComponents: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n' \
    >"$tmp/parts/trixie.sources"
  apt_opts=(-q -o Dir::Etc::SourceList=/dev/null -o "Dir::Etc::SourceParts=$tmp/parts"
            -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache=$tmp/cache")
  apt-get "${apt_opts[@]}" update >/dev/null
  (cd "$tmp" && apt-get "${apt_opts[@]}" download docker-compose >/dev/null)
  dpkg-deb -x "$tmp"/docker-compose_*.deb "$tmp/pkg"
  install -D -m 0755 "$tmp/pkg/usr/libexec/docker/cli-plugins/docker-compose" \
    /usr/local/lib/docker/cli-plugins/docker-compose
  rm -rf "$tmp"
fi
docker compose version

started=$(docker/dockerd.sh start)
echo "docker engine: $started"
trap '[[ $started == started* ]] && docker/dockerd.sh stop' EXIT
docker/local-images.sh
