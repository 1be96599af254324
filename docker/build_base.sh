#!/usr/bin/env bash
# Build a Debian base image with Python 3.11 from Debian's own packages, for machines that cannot pull
# python:3.11-slim from a registry. Needs root, debootstrap and a running Docker engine:
#
#   sudo docker/build_base.sh                 # makes the image swarm-base
#   sudo docker/build_base.sh my-base trixie  # another name or suite (trixie ships Python 3.13)
#
# Environment: MIRROR (default http://deb.debian.org/debian), ROOTFS_DIR (default: a temporary directory,
# removed afterwards).
set -euo pipefail

IMAGE="${1:-swarm-base}"
SUITE="${2:-bookworm}"  # bookworm's python3 is 3.11
MIRROR="${MIRROR:-http://deb.debian.org/debian}"

if [[ $EUID -ne 0 ]]; then
    echo "error: debootstrap needs root" >&2
    exit 1
fi
for tool in debootstrap docker tar; do
    command -v "$tool" >/dev/null || { echo "error: $tool not found (apt-get install -y debootstrap docker.io)" >&2; exit 1; }
done

ROOTFS="${ROOTFS_DIR:-$(mktemp -d /tmp/swarm-rootfs.XXXXXX)}"
cleanup() { [[ -z "${ROOTFS_DIR:-}" ]] && rm -rf "$ROOTFS"; }
trap cleanup EXIT

# minbase: essential packages only; python3-venv brings ensurepip, which the image's venv needs for pip
debootstrap --variant=minbase --include=python3,python3-venv "$SUITE" "$ROOTFS" "$MIRROR"
# what an image does not need: package lists and caches
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb
tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' - "$IMAGE"
docker run --rm "$IMAGE" python3 --version
echo "built $IMAGE from Debian $SUITE"
