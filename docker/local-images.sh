#!/usr/bin/env bash
# Build local stand-ins for the official flwr/superlink, flwr/supernode and flwr/superexec images
# at the flwr version locked in uv.lock, tagged exactly like the official ones, so that
# docker/Dockerfile.* build unchanged on a machine with no container registry. On a machine that
# can pull from Docker Hub, skip this script: compose pulls the official images.
#
#   docker/local-images.sh [ROOTFS_DIR]
#
# Needs a running Docker engine (docker/dockerd.sh start) and debootstrap. The base image
# (mheterofl/debian-python:bookworm) is a debootstrapped Debian bookworm with python3, venv and
# CA certificates, imported with `docker import`; it is made once and reused. The host's CA
# bundle is copied into it so that pip reaches the package index the host reaches.
# Builds use the host network: the engine of docker/dockerd.sh has no bridge.
set -euo pipefail
cd "$(dirname "$0")/.."
BASE=mheterofl/debian-python:bookworm
VERSION=$(python3 -c 'import tomllib; print(next(p["version"] for p in tomllib.load(open("uv.lock", "rb"))["package"] if p["name"] == "flwr"))')
start=$(date +%s)

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  rootfs=${1:-$(mktemp -d /tmp/mheterofl-rootfs.XXXXXX)}
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
    http://deb.debian.org/debian >"$rootfs.log" 2>&1 || { tail -20 "$rootfs.log" >&2; exit 1; }
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs" "$rootfs.log"
  echo "base image $BASE imported ($(( $(date +%s) - start )) s)"
fi

log=$(mktemp)
for component in superlink supernode superexec; do
  docker build --network host --target "$component" --build-arg "FLWR_VERSION=$VERSION" \
    -t "flwr/$component:$VERSION" -f docker/local/Dockerfile docker/local >"$log" 2>&1 \
    || { tail -30 "$log" >&2; rm -f "$log"; exit 1; }
  echo "built flwr/$component:$VERSION"
done
rm -f "$log"
echo "local Flower images at $VERSION in $(( $(date +%s) - start )) s"
