#!/usr/bin/env bash
# need_tools.sh TOOL:PACKAGE...: each TOOL on PATH, installed from Debian (as root) when missing;
# exits non-zero, with apt's own output, when one cannot be had. Sourced, it only defines
# apt_install and need_command (scripts/ci_deps.sh uses them).
fail() { echo "${0##*/}: $*" >&2; exit 1; }

apt_updated=
apt_install() {  # package...: installed, or apt's output shown and the run failed
	[ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 ||
		fail "$* missing: install it (apt-get install $*) or run as root, where this installs it"
	local log
	log=$(mktemp)
	if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >"$log" 2>&1; then
		if [ -z "$apt_updated" ]; then
			apt_updated=1
			apt-get update -q >>"$log" 2>&1 || true
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >>"$log" 2>&1 && { rm -f "$log"; return 0; }
		fi
		cat "$log" >&2
		fail "apt-get install $* failed"
	fi
	rm -f "$log"
}

need_command() {  # command package
	command -v "$1" >/dev/null 2>&1 || apt_install "$2"
	command -v "$1" >/dev/null 2>&1 || fail "$1 is still missing after installing $2"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
	set -euo pipefail
	for pair in "$@"; do need_command "${pair%%:*}" "${pair#*:}"; done
fi
