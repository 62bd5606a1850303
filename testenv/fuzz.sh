#!/usr/bin/env bash
# fuzz.sh FUZZTIME PACKAGE:TARGET...: go test -fuzz ($GO, or go) for FUZZTIME on each
# target, one after the other; fails on the first target that finds
# something.
#
# Go's fuzzing coordinator before Go 1.27 can end a run whose -fuzztime
# ran out while a worker was still busy with "context deadline exceeded"
# and a failure, having found nothing (go.dev/issue/75804; a loaded
# machine makes it likely). Such a run, with no failing input written
# and no panic, is run once more; a second one fails. A real finding
# always writes its input to PACKAGE/testdata/fuzz and fails at once.
set -uo pipefail
fuzztime=$1
shift
for t in "$@"; do
	pkg=${t%%:*} name=${t#*:}
	for attempt in 1 2; do
		out=$(mktemp)
		"${GO:-go}" test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" -fuzzminimizetime 1s "$pkg" 2>&1 | tee "$out"
		rc=${PIPESTATUS[0]}
		if [ "$rc" -eq 0 ]; then
			rm -f "$out"
			break
		fi
		if [ "$attempt" -eq 1 ] && grep -q 'context deadline exceeded' "$out" &&
			! grep -qE 'Failing input written|panic:' "$out"; then
			rm -f "$out"
			echo "fuzz.sh: $name ended with Go's fuzztime race (go.dev/issue/75804), nothing found: once more"
			continue
		fi
		rm -f "$out"
		exit 1
	done
done
