#!/usr/bin/env bash
# The README's main job: the warm-pool story on the default Debian image.
#
#   make demo
#
# Sets this machine up (packages, libvirtd inside the network namespace
# kvbox-test, the Debian image), then: a box "dev" is set up like an agent's
# sandbox (a git repo, a dev server listening, caches warm), frozen into the
# snapshot "warm" while it runs, and cloned twice; each clone answers on its
# own address with the server started before the snapshot, under its own
# name. Every kvbox command and every packet to a box runs inside kvbox-test:
# the host's own networking is never touched.
set -uo pipefail
_log_prefix=demo
. "$(dirname "$0")/lib.sh"
require_root
cd "$REPO_DIR"

K=(ip netns exec "$KVBOX_TESTENV_NS" "$REPO_DIR/bin/kvbox")
in_ns_q() { ip netns exec "$KVBOX_TESTENV_NS" "$@"; }

n=0
step() { # step TITLE CMD...: run, print its output and time; stop the demo on failure
	local title=$1 t0 rc
	shift
	n=$((n + 1))
	printf '\n\033[1m[%d] %s\033[0m\n$ %s\n' "$n" "$title" "$(demo_cmdline "$@")"
	t0=$(now_ms)
	"$@"
	rc=$?
	printf '   (%s)\n' "$(fmt_ms $(($(now_ms) - t0)))"
	[ "$rc" -eq 0 ] || die "step $n failed (exit $rc)"
}
demo_cmdline() { local s="$*"; echo "${s#ip netns exec $KVBOX_TESTENV_NS $REPO_DIR/bin/}"; }

T0=$(now_ms)
echo "kvbox demo: everything below runs inside the network namespace $KVBOX_TESTENV_NS; the host's networking is left alone."
step "set up this machine (packages, libvirtd in $KVBOX_TESTENV_NS)" bash testenv/setup.sh demo
# debootstrap downloads Debian's packages: this one step runs in the root namespace
# (it talks to the Debian mirror, never to a box).
step "build the default Debian image (cached after the first run)" "$REPO_DIR/bin/kvbox" images build debian

# A previous demo's boxes and snapshot go first.
# (rm --force of a box that is not there succeeds too, as rm -f does: ask ls.)
have=" $("${K[@]}" ls 2>/dev/null | awk 'NR > 1 { printf "%s ", $1 }')"
for b in agent-1 agent-2 dev; do
	case "$have" in *" $b "*) "${K[@]}" rm --force "$b" >/dev/null && log "removed $b from an earlier demo" ;; esac
done
"${K[@]}" snapshots rm warm >/dev/null 2>&1 && log "removed snapshot warm from an earlier demo"

step "a new box from the Debian image" "${K[@]}" new dev
step "set it up: a git repo, a dev server on :8000, caches warm" "${K[@]}" exec dev -- sh -ec '
	printf "systemd: %s\n" "$(systemctl is-system-running --wait)"
	mkdir -p /srv/app && cd /srv/app
	git init -q -b main . && git config user.email demo@kvbox && git config user.name demo
	echo "<h1>hello from the app</h1>" > index.html
	git add index.html && git commit -q -m "first page"
	setsid python3 -m http.server 8000 --directory /srv/app </dev/null >/var/log/devserver.log 2>&1 &
	python3 -c "import json, http.client, sqlite3; print(\"caches warm\")"
	git log --oneline
	for i in $(seq 50); do python3 - <<PY && break || sleep 0.2
import urllib.request; urllib.request.urlopen("http://127.0.0.1:8000/", timeout=1)
PY
	done
	echo "dev server listening"'
step "freeze it: memory, CPU state and disk, while dev keeps running" "${K[@]}" snapshots new -v dev warm
step "a warm clone" "${K[@]}" new -v --from warm agent-1
step "another warm clone" "${K[@]}" new -v --from warm agent-2

show_box() {
	local b=$1 ip
	ip=$("${K[@]}" ip "$b") || return 1
	printf '%s: hostname %s, address %s\n' "$b" "$("${K[@]}" exec "$b" -- hostname)" "$ip"
	printf '%s: GET http://%s:8000/ -> ' "$b" "$ip"
	in_ns_q curl -sS --max-time 5 "http://$ip:8000/" || return 1
	printf '%s: git log: %s\n' "$b" "$("${K[@]}" exec "$b" -- git -C /srv/app log --oneline)"
}
show_boxes() { show_box dev && show_box agent-1 && show_box agent-2; }
step "each clone answers on its own address, with the server started before the snapshot" show_boxes
step "kvbox ls" "${K[@]}" ls
step "kvbox snapshots ls" "${K[@]}" snapshots ls
step "remove the clones" "${K[@]}" rm --force agent-1 agent-2

printf '\ndemo done in %s. Left for you: box dev and snapshot warm. Try:\n' "$(fmt_ms $(($(now_ms) - T0)))"
printf '  ip netns exec %s bin/kvbox connect dev\n  ip netns exec %s bin/kvbox new --from warm agent-3\n' "$KVBOX_TESTENV_NS" "$KVBOX_TESTENV_NS"
printf 'Clean up: ip netns exec %s bin/kvbox rm --force dev && ip netns exec %s bin/kvbox snapshots rm warm\n' "$KVBOX_TESTENV_NS" "$KVBOX_TESTENV_NS"
