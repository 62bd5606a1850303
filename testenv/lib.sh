# shellcheck shell=bash
# Shared helpers for the kvbox test bench scripts (sourced, not executed).

KVBOX_TESTENV_NS=${KVBOX_TESTENV_NS:-kvbox-test}
KVBOX_TESTENV_CACHE=${KVBOX_TESTENV_CACHE:-/var/cache/kvbox-testenv}
TESTENV_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_DIR=$(cd "$TESTENV_DIR/.." && pwd)

case ":$PATH:" in *:/usr/local/go/bin:*) ;; *) [ -x /usr/local/go/bin/go ] && PATH=$PATH:/usr/local/go/bin ;; esac
case ":$PATH:" in *:/usr/sbin:*) ;; *) PATH=$PATH:/usr/sbin:/sbin ;; esac
export PATH

_log_prefix=${_log_prefix:-testenv}

log()  { printf '[%s] %s\n' "$_log_prefix" "$*" >&2; }
warn() { printf '[%s] WARNING: %s\n' "$_log_prefix" "$*" >&2; }
die()  { printf '[%s] ERROR: %s\n' "$_log_prefix" "$*" >&2; exit 1; }

now_ms() { date +%s%3N; }

# stage NAME FUNC [ARGS...]: run FUNC, print its name and duration; abort on failure.
stage() {
	local name=$1; shift
	local t0 t1 rc
	log "==> $name"
	t0=$(now_ms)
	"$@"; rc=$?
	t1=$(now_ms)
	if [ "$rc" -ne 0 ]; then
		die "stage '$name' failed (exit $rc) after $(fmt_ms $((t1 - t0)))"
	fi
	log "<== $name: ok ($(fmt_ms $((t1 - t0))))"
}

fmt_ms() { printf '%d.%03ds' $(($1 / 1000)) $(($1 % 1000)); }

require_root() { [ "$(id -u)" -eq 0 ] || die "must run as root (try: sudo $0)"; }

in_ns() { ip netns exec "$KVBOX_TESTENV_NS" "$@"; }

# pids_by_comm NAME: pids of processes whose comm is exactly NAME.
pids_by_comm() {
	local d
	for d in /proc/[0-9]*; do
		[ "$(cat "$d/comm" 2>/dev/null)" = "$1" ] && echo "${d#/proc/}"
	done
	return 0
}

# parent_comm PID: the command name of PID's parent.
parent_comm() { cat "/proc/$(awk '/^PPid:/{print $2}' "/proc/$1/status" 2>/dev/null)/comm" 2>/dev/null; }

# netns_of PID: name of the named netns PID runs in ("" = root/unnamed).
netns_of() { ip netns identify "$1" 2>/dev/null; }
