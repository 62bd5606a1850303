#!/usr/bin/env bash
# Undo testenv/setup.sh's runtime state: stop the libvirtd and virtlogd that run inside the
# test namespace (only those, by pid) and delete the namespace. Packages, the image cache
# and kvbox's state dir are left alone.
#
#   sudo testenv/teardown.sh           # refuses while domains are running
#   sudo testenv/teardown.sh --force   # destroys every domain of that libvirtd first
set -uo pipefail
_log_prefix=teardown
. "$(dirname "$0")/lib.sh"
require_root
FORCE=${1:-}

ns_pids() { # ns_pids NAME: pids of NAME processes inside the test namespace
	local pid
	for pid in $(pids_by_comm "$1"); do
		[ "$(netns_of "$pid")" = "$KVBOX_TESTENV_NS" ] && echo "$pid"
	done
	return 0
}

lv=$(ns_pids libvirtd)
if [ -n "$lv" ]; then
	running=$(virsh -c qemu:///system list --name 2>/dev/null | sed '/^$/d')
	if [ -n "$running" ]; then
		[ "$FORCE" = --force ] || die "domains still running ($(echo "$running" | paste -sd' ')); rerun with --force to destroy them"
		for d in $running; do virsh -c qemu:///system destroy "$d" >/dev/null && log "destroyed $d"; done
	fi
fi
for name in libvirtd virtlogd; do
	for pid in $(ns_pids "$name"); do
		log "stopping $name (pid $pid)"
		kill -TERM "$pid"
		for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		kill -0 "$pid" 2>/dev/null && die "$name (pid $pid) did not stop within 5s"
	done
done
if ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$KVBOX_TESTENV_NS"; then
	left=$(ip netns pids "$KVBOX_TESTENV_NS" 2>/dev/null | paste -sd' ')
	[ -z "$left" ] || die "processes still in $KVBOX_TESTENV_NS: $left (not deleting it)"
	ip netns del "$KVBOX_TESTENV_NS" && log "deleted netns $KVBOX_TESTENV_NS"
fi
log "done"
