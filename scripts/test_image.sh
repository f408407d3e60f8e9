#!/usr/bin/env bash
# Build the CPU container image (docker/Dockerfile.cpu) and check that it serves: one chat
# request answered from inside the image's filesystem (scripts/image_check.py). `make test`
# (CI) runs it before the test suite.
#
# What these machines allow: podman builds images (RUN steps under --isolation chroot), but no
# container registry is reachable and containers cannot be started (the sandbox refuses the
# runtime's cgroups). So the base image is Debian 12 from debootstrap (Python 3.11, as in
# python:3.11-slim) given to the build as BASE_IMAGE, torch's CPU wheel comes from the local
# pip configuration through a package index served on 127.0.0.1 (TORCH_INDEX_URL), and the
# image's command runs with chroot in the built filesystem. Needs root (or sudo), apt-get and
# PyPI. The base image and the build's layers are kept in $PAGEDSERVE_IMAGE_CACHE (default
# ~/.cache/pagedserve-image), so a later run rebuilds only what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
    exec sudo --preserve-env=PAGEDSERVE_IMAGE_CACHE,VENV "$0" "$@"
fi
VENV="${VENV:-.venv}"
PY="$VENV/bin/python"
CACHE="${PAGEDSERVE_IMAGE_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/pagedserve-image}"
IMAGE=localhost/pagedserve:cpu
BASE=localhost/pagedserve-base:bookworm
TORCH_VERSION=2.13.0
PODMAN=(podman --root "$CACHE/storage" --runroot "$CACHE/run" --storage-driver overlay)
START=$SECONDS
say() { echo "image: [$((SECONDS - START)) s] $*"; }

# 1. Tools (Debian's packages).
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    say "apt-get install podman debootstrap"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        podman debootstrap >/dev/null
fi
mkdir -p "$CACHE"

# 2. The base image: Debian 12 with python3 and venv, and this machine's CA certificates and
# pip's use of them (a TLS-inspecting proxy may sit between pip and PyPI).
if ! "${PODMAN[@]}" image exists "$BASE"; then
    say "building the base image $BASE with debootstrap (Debian 12, Python 3.11)"
    rootfs="$CACHE/base-rootfs"
    rm -rf "$rootfs"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
        bookworm "$rootfs" http://deb.debian.org/debian >"$CACHE/debootstrap.log" \
        || { tail -20 "$CACHE/debootstrap.log"; exit 1; }
    cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/ca-certificates.crt"
    printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$rootfs/etc/pip.conf"
    rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | "${PODMAN[@]}" import --quiet - "$BASE" >/dev/null
    rm -rf "$rootfs"
fi

# 3. torch's CPU wheel for Python 3.11, from this machine's pip configuration, served as a
# package index on a free loopback port (the build's RUN steps share the host's network).
index="$CACHE/torch-index"
mkdir -p "$index/torch"
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_28_x86_64 -d "$index/torch" "torch==$TORCH_VERSION"
if ! ls "$index/torch" | grep -q "^torch-$TORCH_VERSION+cpu-cp311"; then
    echo "image: error: pip found no CPU build of torch $TORCH_VERSION for Python 3.11" \
         "(found: $(ls "$index/torch")); put its wheel where pip looks (find-links)" >&2
    exit 1
fi
# A fixed port when free: the index's address is a build argument, hence part of the key of the
# build's cached layers (another port rebuilds torch's layer and those after it).
port=$("$PY" -c '
import socket
s = socket.socket()
try:
    s.bind(("127.0.0.1", 18765))
except OSError:
    s.bind(("127.0.0.1", 0))
print(s.getsockname()[1])')
"$PY" -m http.server "$port" --bind 127.0.0.1 --directory "$index" >"$CACHE/index.log" 2>&1 &
index_pid=$!
container=""
cleanup() {
    kill "$index_pid" 2>/dev/null || true
    if [ -n "$container" ]; then
        "${PODMAN[@]}" umount "$container" >/dev/null 2>&1 || true
        "${PODMAN[@]}" rm "$container" >/dev/null 2>&1 || true
    fi
}
trap cleanup EXIT

# 4. The image, as a user builds it, with the two local stand-ins as build arguments.
say "building $IMAGE from docker/Dockerfile.cpu"
"${PODMAN[@]}" build --isolation chroot -f docker/Dockerfile.cpu -t "$IMAGE" \
    --build-arg BASE_IMAGE="$BASE" --build-arg TORCH_INDEX_URL="http://127.0.0.1:$port/" . \
    >"$CACHE/build.log" 2>&1 || { tail -40 "$CACHE/build.log"; exit 1; }
say "built $IMAGE ($("${PODMAN[@]}" image inspect --format '{{.Size}}' "$IMAGE" \
    | awk '{printf "%.0f MB", $1 / 1e6}'))"

# 5. Its filesystem (a container created, never started) and its command, run with chroot.
container=$("${PODMAN[@]}" create "$IMAGE")
rootfs=$("${PODMAN[@]}" mount "$container")
"${PODMAN[@]}" image inspect --format '{{json .Config}}' "$IMAGE" >"$CACHE/config.json"
"$PY" scripts/image_check.py "$rootfs" "$CACHE/config.json"
say "done"
