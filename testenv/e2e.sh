#!/usr/bin/env bash
# e2e.sh: make e2e. The end-to-end suite (./testenv, -tags e2e) inside the namespace
# $KVBOX_TESTENV_NS, after setup.sh images (which waits for make test's background image
# build). KVBOX_E2E_BESIDE names jobs that run beside the suite, each in a session of its own,
# their output kept and printed after the suite's:
#   fuzz   testenv/fuzz.sh FUZZTIME FUZZ_TARGETS at the lowest priority (nice 19, autogroup 19):
#          it takes the CPU the guests leave idle, so the suite's guests keep theirs;
#   fleet  make test-kubernetes's steps (testenv/fleet.sh build, which waits for the background
#          build; kvbox-node's vet and unit tests; its end-to-end test), with the source box of
#          its snapshot in a state dir, bridge and subnet of its own (FLEET_STATE_DIR,
#          FLEET_BRIDGE, FLEET_SUBNET), so that no test of the suite meets its box or network.
# make test sets "fuzz fleet". E2E_RUN, a go test -run pattern, runs part of the suite. The one test that restarts libvirtd runs alone, first.
set -uo pipefail
_log_prefix=e2e
. "$(dirname "$0")/lib.sh"
GO=${GO:-go}
cd "$REPO_DIR" || exit 1
beside=" ${KVBOX_E2E_BESIDE:-} "
RESTART_TEST=TestSnapshotSurvivesLibvirtdRestart
FLEET_STATE_DIR=${FLEET_STATE_DIR:-/var/lib/kvbox-fleet-src}
FLEET_BRIDGE=${FLEET_BRIDGE:-kvbfsrc}
FLEET_SUBNET=${FLEET_SUBNET:-172.28.200.0/24}

in_ns() { ip netns exec "$KVBOX_TESTENV_NS" "$@"; }

bash "$TESTENV_DIR/setup.sh" images || exit 1

# restart_test: the test that stops and starts the namespace's libvirtd, which any other guest
# or node beside it would lose.
t0=$(now_ms)
restart_out=$(mktemp) || exit 1
in_ns "$GO" test -tags e2e -count=1 -timeout 10m -v -run "^${RESTART_TEST}\$" ./testenv 2>&1 | tee "$restart_out"
[ "${PIPESTATUS[0]}" -eq 0 ] || exit 1
# A renamed test would leave -run matching nothing, and go test passing.
grep -q -- "^--- PASS: $RESTART_TEST " "$restart_out" || die "$RESTART_TEST did not run (renamed? testenv/e2e.sh names it)"
rm -f "$restart_out"
log "$RESTART_TEST alone: $(fmt_ms $(($(now_ms) - t0)))"

out=$(mktemp -d /tmp/kvbox-e2e-beside.XXXXXX) || exit 1
trap 'rm -rf "$out"' EXIT
names=() pids=()

# start NAME NICE CMD...: CMD detached in its own session (its own autogroup, at NICE),
# output to $out/NAME.log, its exit code to $out/NAME.rc.
start() {
	local name=$1 prio=$2
	shift 2
	log "beside the suite: $name (log printed after the suite)"
	setsid -w bash -c 'echo "$1" >/proc/self/autogroup 2>/dev/null; n=$1 o=$2; shift 2
		t0=$(date +%s%3N); nice -n "$n" "$@" >"$o.log" 2>&1; rc=$?
		echo "$rc $(( $(date +%s%3N) - t0 ))" >"$o.rc"' beside "$prio" "$out/$name" "$@" </dev/null &
	names+=("$name") pids+=($!)
}

fleet_job() {
	bash "$TESTENV_DIR/fleet.sh" build || return 1
	(cd integrations/kubernetes && test -z "$(gofmt -l .)" && "$GO" vet ./... && "$GO" vet -tags e2e ./...) || return 1
	(cd integrations/kubernetes && "$GO" test -count=1 ./...) || return 1
	KVBOX_STATE_DIR=$FLEET_STATE_DIR bash "$TESTENV_DIR/setup.sh" import-tiny || return 1
	(cd integrations/kubernetes && KVBOX_STATE_DIR=$FLEET_STATE_DIR KVBOX_BRIDGE=$FLEET_BRIDGE KVBOX_SUBNET=$FLEET_SUBNET \
		ip netns exec "$KVBOX_TESTENV_NS" "$GO" test -tags e2e -count=1 -timeout 20m -v ./e2e)
}

case $beside in *" fuzz "*)
	# shellcheck disable=SC2086 # FUZZ_TARGETS is a list
	start fuzz 19 env GO="$GO" bash "$TESTENV_DIR/fuzz.sh" "${FUZZTIME:-20s}" ${FUZZ_TARGETS:?FUZZ_TARGETS not set (make e2e sets it)} ;;
esac
case $beside in *" fleet "*)
	export -f fleet_job
	export GO FLEET_STATE_DIR FLEET_BRIDGE FLEET_SUBNET TESTENV_DIR KVBOX_TESTENV_NS
	start fleet 0 bash -c fleet_job ;;
esac

t0=$(now_ms)
in_ns "$GO" test -tags e2e -count=1 -timeout 80m -v -skip "^${RESTART_TEST}\$" ${E2E_RUN:+-run "$E2E_RUN"} ./testenv
rc=$?
log "the suite: $(fmt_ms $(($(now_ms) - t0))), exit $rc"

for i in "${!names[@]}"; do
	name=${names[$i]}
	if ! kill -0 "${pids[$i]}" 2>/dev/null; then :; else log "waiting for $name"; fi
	wait "${pids[$i]}"
	read -r jrc jms <"$out/$name.rc" 2>/dev/null || { jrc=1; jms=0; }
	log "==== $name (beside the suite): exit $jrc after $(fmt_ms "$jms") ===="
	cat "$out/$name.log"
	log "==== end of $name ===="
	[ "$jrc" -eq 0 ] || rc=1
done
exit "$rc"
