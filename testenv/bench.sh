#!/usr/bin/env bash
# make bench: testenv/bench's sections (kvbox on this host), then the fleet section
# (integrations/kubernetes/cmd/fleet-bench: kvbox on Kubernetes against kvbox new --from), each
# inside the test namespace.
#
#   testenv/bench.sh [testenv/bench's flags]
#
# -only (or --only, -only=..., --only=...) names sections; fleet is one of them: -only fleet runs
# the fleet section alone, -only clone,fleet both, -only clone testenv/bench's clone alone; no -only
# runs all. The fleet section's own flags come from BENCH_FLEET (fleet-bench -h lists them, e.g.
# BENCH_FLEET='-n 20 -replicas 10').
set -uo pipefail
_log_prefix=bench
. "$(dirname "$0")/lib.sh"

args=() only="" have_only=0
while [ $# -gt 0 ]; do
	case $1 in
	-only | --only)
		[ $# -ge 2 ] || die "$1 needs a list of sections"
		only=$2 have_only=1
		shift 2
		;;
	-only=* | --only=*)
		only=${1#*=} have_only=1
		shift
		;;
	*)
		args+=("$1")
		shift
		;;
	esac
done

run_fleet=1 rest=""
if [ "$have_only" = 1 ]; then
	run_fleet=0
	IFS=, read -ra secs <<<"$only"
	for s in "${secs[@]}"; do
		s=${s// /}
		[ -z "$s" ] && continue
		if [ "$s" = fleet ]; then run_fleet=1; else rest=${rest:+$rest,}$s; fi
	done
fi

cd "$REPO_DIR" || exit 1
if [ "$have_only" = 0 ]; then
	in_ns go run ./testenv/bench "${args[@]}" || exit 1
elif [ -n "$rest" ]; then
	in_ns go run ./testenv/bench -only "$rest" "${args[@]}" || exit 1
fi
[ "$run_fleet" = 1 ] || exit 0

bash testenv/fleet.sh build || die "the control plane could not be built"
# Built in the root namespace (the Go module proxy is there), run inside the test namespace.
bin=$(mktemp -d) || exit 1
trap 'rm -rf "$bin"' EXIT
(cd integrations/kubernetes && nice -n 10 go build -o "$bin/" ./cmd/fleet-bench ./cmd/kvbox-node) || die "building fleet-bench failed"
# shellcheck disable=SC2086 # BENCH_FLEET is a list of flags
in_ns "$bin/fleet-bench" -repo "$REPO_DIR" -kvbox-node "$bin/kvbox-node" ${BENCH_FLEET:-}
