#!/usr/bin/env bash
# Build the local Debian base image (no image registry needed): debootstrap a minimal
# Debian with python3, then `docker import` it. The edge node and S3-origin images build
# FROM it here (BASE_IMAGE=edgecache-base:bookworm); elsewhere they use python:3.11-slim.
#
#   deploy/base-image/build.sh            # builds once; a no-op while the image exists
#   EDGECACHE_BASE_REBUILD=1 deploy/base-image/build.sh
#
# Needs root (debootstrap), a running Docker engine and Debian's package mirror.
# The host's CA bundle ($PIP_CERT, else the system bundle) becomes the base's trust store
# and pip's `cert`, so builds on this base reach PyPI through whatever the host trusts.
set -euo pipefail

TAG=${EDGECACHE_BASE_IMAGE:-edgecache-base:bookworm}
SUITE=${EDGECACHE_BASE_SUITE:-bookworm}     # bookworm's python3 is 3.11, as python:3.11-slim
MIRROR=${EDGECACHE_BASE_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates,iproute2
HOST_CA=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}

# The recipe (this script, the suite and the CA bundle) labels the image: a changed recipe
# rebuilds it, an unchanged one is reused.
recipe=$( { cat "$0"; echo "$SUITE $MIRROR $PACKAGES"; cat "$HOST_CA" 2>/dev/null || true; } \
    | sha256sum | cut -c1-16)
have=$(docker image inspect --format '{{ index .Config.Labels "edgecache.base.recipe" }}' \
    "$TAG" 2>/dev/null || true)
if [ "$have" = "$recipe" ] && [ -z "${EDGECACHE_BASE_REBUILD:-}" ]; then
    echo "base image $TAG is up to date (recipe $recipe)"
    exit 0
fi

if ! command -v debootstrap >/dev/null; then
    [ "$(id -u)" = 0 ] || { echo "debootstrap is missing and this is not root" >&2; exit 1; }
    apt-get install -y -q debootstrap >/dev/null \
        || { apt-get update -q >/dev/null && apt-get install -y -q debootstrap >/dev/null; }
fi

started=$SECONDS
rootfs=$(mktemp -d /var/tmp/edgecache-base.XXXXXX)
trap 'rm -rf "$rootfs" "$rootfs.log"' EXIT
echo "debootstrap $SUITE (minbase + $PACKAGES) into $rootfs ..."
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" \
    > "$rootfs.log" 2>&1 || { tail -30 "$rootfs.log" >&2; exit 1; }
rm -f "$rootfs.log"

# Lean: no package lists, caches, docs, man pages or translations.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/cache/debconf/*-old \
    "$rootfs"/var/log/* "$rootfs"/usr/share/doc/* "$rootfs"/usr/share/man/* \
    "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* "$rootfs"/tmp/* \
    "$rootfs"/usr/lib/python3*/__pycache__ 2>/dev/null || true
find "$rootfs"/usr/lib/python3* -name __pycache__ -prune -exec rm -rf {} + 2>/dev/null || true
cat > "$rootfs/etc/apt/sources.list" <<SOURCES
deb $MIRROR $SUITE main
SOURCES
if [ -f "$HOST_CA" ]; then
    cp "$HOST_CA" "$rootfs/etc/ssl/certs/ca-certificates.crt"
fi
printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' > "$rootfs/etc/pip.conf"

tar -C "$rootfs" --numeric-owner -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change "LABEL edgecache.base.recipe=$recipe" \
    --change "LABEL org.opencontainers.image.description=\"Debian $SUITE minbase, python3\"" \
    --change 'CMD ["python3"]' \
    - "$TAG" >/dev/null
echo "built base image $TAG in $((SECONDS - started)) s:" \
    "$(docker image inspect --format '{{.Size}}' "$TAG" | numfmt --to=iec-i --suffix=B)"
