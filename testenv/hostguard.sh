#!/usr/bin/env bash
# The host guard: tests never touch the machine they run on. `record FILE`
# writes what of the root namespace a test could change; `check FILE` reads
# it again and fails, naming each part that changed, if anything did. The
# Makefile runs every test, bench and demo target between the two; set-up
# (testenv/setup.sh: its packages, the kvbox-test namespace, the small
# filesystem) runs before `record`, so what it owns is never held against a
# test.
#
#   testenv/hostguard.sh record FILE
#   testenv/hostguard.sh check FILE
#
# What it reads: the hostname and domain name; links, addresses, routes and
# rules (IPv4 and IPv6); the forwarding, rp_filter and every other
# per-interface sysctl of net.ipv4.conf and net.ipv6.conf, ip_forward and
# the bridge's; the iptables, ip6tables and nftables rulesets; /etc/hostname,
# /etc/hosts and /etc/resolv.conf; the mount table; the names in root's home
# and its .ssh files. Counters, lifetimes and expiry times are left out: they
# change with time, not with a test.
set -uo pipefail

# A process inside a named network namespace (kvbox-test) would read that
# namespace, not the host's.
in_root_netns() { [ -z "$(ip netns identify $$ 2>/dev/null)" ]; }

section() { printf '## %s\n' "$1"; }

# run CMD...: its output, or one line saying it failed (so that a tool that is
# missing both times compares equal, and one that starts failing shows).
run() {
	command -v "$1" >/dev/null || { echo "($1 is not installed)"; return 0; }
	"$@" 2>&1 || echo "(failed: $*)"
}

sysctls() {
	local f
	for f in /proc/sys/net/ipv4/ip_forward /proc/sys/net/ipv4/conf/*/* /proc/sys/net/ipv6/conf/*/* /proc/sys/net/bridge/*; do
		[ -f "$f" ] || continue
		printf '%s = %s\n' "${f#/proc/sys/}" "$(tr '\n' ' ' <"$f" 2>/dev/null)"
	done
}

files() {
	local f
	for f in /etc/hostname /etc/hosts /etc/resolv.conf; do
		if [ -e "$f" ] || [ -L "$f" ]; then
			printf '%s -> %s\n' "$f" "$(readlink "$f")"
			sed "s|^|$f: |" "$f" 2>/dev/null
		else
			echo "$f: missing"
		fi
	done
}

home() {
	local h=${HOME:-/root}
	echo "$h: $(ls -A "$h" 2>/dev/null | tr '\n' ' ')"
	[ -d "$h/.ssh" ] && (cd "$h/.ssh" && sha256sum -- * 2>/dev/null)
	return 0
}

state() {
	section hostname;   uname -n; cat /proc/sys/kernel/domainname
	section links;      run ip -o link show | sed -E 's/ (qlen|link-netnsid) [0-9]+//g'
	section addresses;  run ip -o addr show | sed -E 's/ *(valid_lft|preferred_lft) [^ ]+//g'
	section routes;     run ip -4 route show table all
	section routes6;    run ip -6 route show table all | sed -E 's/ expires [^ ]+//g'
	section rules;      run ip -4 rule show; run ip -6 rule show
	section sysctls;    sysctls
	section iptables;   run iptables-save | grep -v '^#' | sed -E 's/\[[0-9]+:[0-9]+\]//g'
	section ip6tables;  run ip6tables-save | grep -v '^#' | sed -E 's/\[[0-9]+:[0-9]+\]//g'
	section nftables;   run nft list ruleset | sed -E 's/counter packets [0-9]+ bytes [0-9]+/counter/g; s/ expires [^ ,}]+//g'
	section files;      files
	section mounts;     sed -E 's/^[0-9]+ [0-9]+ [0-9:]+ ([^ ]+) ([^ ]+) .* - ([^ ]+) ([^ ]+) .*/\2 \3 \4 \1/' /proc/self/mountinfo | sort
	section home;       home
}

# labelled FILE: each line of a record after the name of its part.
labelled() { awk '/^## /{s=$2; next} {print s": "$0}' "$1"; }

usage() { echo "usage: $0 record|check FILE" >&2; exit 2; }
[ $# -eq 2 ] || usage
if ! in_root_netns; then
	echo "hostguard: run it in the root network namespace (this process is in $(ip netns identify $$)): it guards the host's" >&2
	exit 2
fi
case $1 in
record)
	state >"$2"
	;;
check)
	[ -r "$2" ] || { echo "hostguard: no record $2" >&2; exit 2; }
	now=$(mktemp) || exit 2
	trap 'rm -f "$now"' EXIT
	state >"$now"
	if cmp -s "$2" "$now"; then
		echo "hostguard: the host's hostname, network, sysctls, rulesets, /etc files, mounts and home are as they were"
		exit 0
	fi
	echo "hostguard: FAILED: the run changed this machine (its root namespace), which no test may touch:" >&2
	diff <(labelled "$2") <(labelled "$now") | sed -n 's/^< /  before: /p; s/^> /  after:  /p' >&2
	exit 1
	;;
*) usage ;;
esac
