#!/usr/bin/env bash
# The base image for hosts that reach no image registry: Debian bookworm from Debian's own
# archive (debootstrap), imported into the engine at DOCKER_HOST as ${1:-roundhouse-base:bookworm}.
# It carries what the Dockerfiles here expect of `python:3.11-slim-bookworm`: python3.11 with
# its venv module, CA certificates, apt with the security archive. Needs root and debootstrap.
set -euo pipefail
tag=${1:-roundhouse-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
root=$(mktemp -d /var/tmp/roundhouse-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -20 "$root.log"; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
cat >"$root/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb http://deb.debian.org/debian-security bookworm-security main
SOURCES
# Where TLS goes through a proxy that signs with its own CA (as on the CI machines), the
# image must trust it too: the build host's bundle (CA_BUNDLE, else SSL_CERT_FILE, else the
# system's) replaces the image's, and pip (which otherwise trusts only its own certifi copy)
# is pointed at it.
ca=${CA_BUNDLE:-${SSL_CERT_FILE:-/etc/ssl/certs/ca-certificates.crt}}
if [ -f "$ca" ]; then cp "$ca" "$root/etc/ssl/certs/ca-certificates.crt"; fi
# Nothing else of the build host's stays in the image: the downloaded packages and lists go.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
# An imported image has no configuration: PATH and the locale as the official images set them.
tar -C "$root" --numeric-owner -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'CMD ["/bin/bash"]' - "$tag" >/dev/null
echo "$tag"
