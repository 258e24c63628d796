#!/usr/bin/env bash
# Installs everything NFShunt's demo and tests need on a fresh Debian 12 machine, as root:
# Debian packages (Open vSwitch, Mininet, iptables, conntrack, iperf3 ...), a virtualenv
# at $NFSHUNT_VENV (default /opt/nfshunt-venv) built on Debian's python3 (Mininet's
# Python module is packaged for it), the pinned Python dependencies and NFShunt itself.
# Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${NFSHUNT_VENV:-/opt/nfshunt-venv}
PKGS=(openvswitch-switch mininet iptables conntrack iperf3 ethtool iproute2 iputils-ping
      python3-venv python3-pip tcpdump python3-scipy python3-matplotlib
      gcc libc6-dev libnetfilter-queue-dev openssl systemd conntrackd keepalived curl prometheus
      python3-yaml)

if [ "$(id -u)" != 0 ]; then
    echo "install-deps: run as root (it installs Debian packages and drives network namespaces)" >&2
    exit 1
fi
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "install-deps: installing Debian packages: ${missing[*]}"
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
# Debian's prometheus (the dashboard test's server, with promtool) starts its own server on
# :9090 and enables it at boot wherever policy-rc.d lets it; the test runs one of its own in a
# testbed namespace. The packaged service is stopped and disabled once, when installed here.
if [[ " ${missing[*]-} " == *" prometheus "* ]]; then
    if [ -d /run/systemd/system ]; then
        systemctl disable --now prometheus.service
    else
        /etc/init.d/prometheus stop >/dev/null 2>&1 || true   # its pidfile's daemon only
        update-rc.d prometheus disable >/dev/null   # its rc links, and its systemd unit's
    fi
fi
# The IDS API's process runs as this user (ids.user), with no capability (nfshunt/ids/confine.py).
if ! getent passwd nfshunt-ids >/dev/null; then
    echo "install-deps: creating the system user nfshunt-ids"
    useradd --system --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin nfshunt-ids
fi
if [ ! -x "$VENV/bin/python" ]; then
    echo "install-deps: creating $VENV"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check -e ".[test]"
# The command on the system PATH, where keepalived's notify script (run with a minimal PATH)
# and admins find it; an nfshunt installed there some other way is left alone.
if [ ! -e /usr/local/bin/nfshunt ] || [ -L /usr/local/bin/nfshunt ]; then
    ln -sfn "$VENV/bin/nfshunt" /usr/local/bin/nfshunt
fi
# The testbed's NFQUEUE delay program, for kernels without netem.
"$VENV/bin/python" -c 'import sys; sys.path.insert(0, "mininet"); from nfshunt_testbed import linkemu; linkemu.build_nfqdelay()'
# The jitter experiment's cyclic UDP stream (sender and receiver).
"$VENV/bin/python" -c 'import sys; sys.path.insert(0, "mininet"); from nfshunt_testbed import cyclicstream; cyclicstream.build_cyclic()'
# Open vSwitch's daemons (no systemd needed; userspace datapath when the kernel has no module).
if ! ovs-vsctl --timeout=3 show >/dev/null 2>&1; then
    /usr/share/openvswitch/scripts/ovs-ctl start --system-id=random >/dev/null 2>&1 || true
    ovs-vsctl --timeout=5 show >/dev/null
fi
echo "install-deps: ready ($VENV)"
