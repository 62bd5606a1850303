package vmstate

import (
	"encoding/json"
	"strconv"
	"testing"
	"time"

	"kvbox.dev/kvbox/qmp"
)

func TestHintGate(t *testing.T) {
	const total = 512 << 20
	ram := func(left int64) qmp.MigrateRAM {
		return qmp.MigrateRAM{Total: json.Number(strconv.Itoa(total)), Remaining: json.Number(strconv.FormatInt(left, 10))}
	}
	t0 := time.Unix(1000, 0)
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }

	settle, first := int(hintSettle/time.Millisecond), int(hintFirst/time.Millisecond)
	g := &hintGate{start: t0}
	for _, p := range []struct {
		ms   int
		left int64
		hold bool
	}{
		{2, total - 4096, true},                                 // one page of its own: no hint
		{first - 10, total - 8192, true},                        // still none
		{first - 5, total - 100<<20, true},                      // 100 MB hinted
		{first + 10, total - 200<<20, true},                     // more
		{first + 10 + settle - 1, total - 200<<20 - 4096, true}, // its own page
		{first + 10 + settle, total - 200<<20 - 4096, false},
	} {
		if got := g.hold(at(p.ms), ram(p.left)); got != p.hold {
			t.Fatalf("at %d ms with %d left: hold %v, want %v", p.ms, p.left, got, p.hold)
		}
	}

	g = &hintGate{start: t0}
	if !g.hold(at(first-1), ram(total-8192)) || g.hold(at(first), ram(total-8192)) {
		t.Errorf("a guest that names nothing is waited for until hintFirst, and no longer")
	}

	g = &hintGate{start: t0}
	left := int64(total)
	for ms := 10; ms < 2000; ms += settle / 2 {
		left -= 2 << 20
		if !g.hold(at(ms), ram(left)) {
			t.Fatalf("a guest still naming pages was let go at %d ms", ms)
		}
	}
	if g.hold(at(2000), ram(left-2<<20)) {
		t.Errorf("held past hintMax")
	}
}

// TestPacer: a live copy is polled slowly while much is left at the fastest
// pace it went yet, and fast while held, when its pace is not known yet, at
// a new pass, near its end, and outside precopy.
func TestPacer(t *testing.T) {
	t0 := time.Unix(1000, 0)
	active := func(left int64) qmp.MigrateStatus {
		return qmp.MigrateStatus{Status: qmp.MigrationActive, RAM: &qmp.MigrateRAM{Remaining: json.Number(strconv.FormatInt(left, 10))}}
	}
	const mb = 1 << 20
	var p pacer
	for i, c := range []struct {
		ms   int
		s    qmp.MigrateStatus
		held bool
		want time.Duration
	}{
		{0, qmp.MigrateStatus{Status: qmp.MigrationSetup}, false, pollFast},
		{2, active(4096 * mb), true, pollFast},   // held at the gate
		{4, active(4096 * mb), false, pollFast},  // let go: no pace yet
		{6, active(4094 * mb), false, pollSlow},  // 1 MB/ms: 4 s left
		{26, active(4094 * mb), false, pollSlow}, // not moving
		{46, active(3094 * mb), false, pollSlow}, // 50 MB/ms: 62 ms left
		{66, active(3074 * mb), false, pollSlow}, // 1 MB/ms; at 50, 61 ms left
		{86, active(2954 * mb), false, pollFast}, // 6 MB/ms; at 50, 59 ms left
		{88, active(2955 * mb), false, pollFast}, // a new pass
		{108, active(31 * mb), false, pollFast},  // under pollNear
		{110, qmp.MigrateStatus{Status: "device"}, false, pollFast},
	} {
		if got := p.next(t0.Add(time.Duration(c.ms)*time.Millisecond), c.s, c.held); got != c.want {
			t.Errorf("poll %d at %d ms: next in %v, want %v", i, c.ms, got, c.want)
		}
	}
}
