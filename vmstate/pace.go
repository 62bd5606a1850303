package vmstate

import (
	"context"
	"fmt"
	"maps"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/qmp"
	"kvbox.dev/kvbox/step"
)

// writeback keeps a file that QEMU is writing on its way to disk: at most
// every 20 ms it starts the write-out of what is dirty (sync_file_range,
// no wait), so that little is left for the fsync after the copy. At a
// live copy's switch-over QEMU flushes the box's disk (block
// inactivation), and that flush waits behind the state file's dirty page
// cache, in the pause (docs/design.md#live-copy-of-ram).
type writeback struct {
	path string
	f    *os.File
	last time.Time
}

func (w *writeback) kick() {
	if time.Since(w.last) < 20*time.Millisecond {
		return
	}
	w.last = time.Now()
	if w.f == nil {
		f, err := os.OpenFile(w.path, os.O_RDONLY|unix.O_NOFOLLOW, 0)
		if err != nil {
			return // not made yet
		}
		w.f = f
		// QEMU opened the file with O_TRUNC, and ext4 (auto_da_alloc)
		// then flushes it at the next close of any of its open files:
		// made here, while little is written, instead of by kvbox's or
		// QEMU's close in the pause.
		if g, err := os.Open(w.path); err == nil {
			g.Close()
		}
	}
	unix.SyncFileRange(int(w.f.Fd()), 0, 0, unix.SYNC_FILE_RANGE_WRITE)
}

func (w *writeback) close() {
	if w.f != nil {
		w.f.Close()
	}
}

// liveDowntimes are the downtime-limits (ms) a live copy goes through: a
// guest that dirties its memory faster than the copy runs never fits the
// first, so after every liveRoundsPerStep dirty-bitmap rounds QEMU may
// stop it for longer, until the copy ends. Better a longer pause than a
// copy that never ends.
var liveDowntimes = []int64{50, 300, 2000}

const liveRoundsPerStep = 8

// A live copy is polled every pollSlow, and every pollFast where a poll's
// timing counts: while the hint gate holds the copy (it opens at a poll),
// and once the copy may end within pollAhead. QEMU stops the box for the
// last pass by itself and leaves it stopped until kvbox sees that, so a
// late poll is a longer pause. Each poll costs the host: query-migrate goes
// through libvirtd to QEMU's main loop and takes QEMU's big lock, which the
// box's vCPUs need for their I/O: polled fast throughout, a long copy
// kept a core half busy and stalled the box for far longer than its
// reported pause (docs/design.md#live-copy-of-ram).
//
// When the copy may end is judged at the fastest pace it has gone yet: a
// copy speeds up at its end, where RAM the guest never touched reads as
// zeros, and judged at the last interval's pace the box was often seen
// stopped late.
const (
	pollFast  = 2 * time.Millisecond
	pollSlow  = 20 * time.Millisecond
	pollAhead = 3 * pollSlow
	pollNear  = 32 << 20 // RAM left under which the copy is polled fast at any pace
)

// pacer picks the wait before the next poll of a live copy from how fast
// its RAM left to copy goes down.
type pacer struct {
	at   time.Time // the last poll
	left int64     // RAM left to copy at it
	pace float64   // the fastest it went down yet, bytes per second
}

func (p *pacer) next(now time.Time, s qmp.MigrateStatus, held bool) time.Duration {
	if held || s.Status != qmp.MigrationActive || s.RAM == nil {
		p.at = time.Time{} // a held copy's pace says nothing
		return pollFast
	}
	left, _ := s.RAM.Remaining.Int64()
	at, before := p.at, p.left
	p.at, p.left = now, left
	if !at.IsZero() && left < before {
		p.pace = max(p.pace, float64(before-left)/now.Sub(at).Seconds())
	}
	// A new pass (of the pages dirtied meanwhile) may be short enough to
	// end the copy at once.
	if left <= pollNear || left > before || float64(left) <= p.pace*pollAhead.Seconds() {
		return pollFast
	}
	return pollSlow
}

// liveWatch is what kvbox does at each poll of a live copy.
type liveWatch struct {
	q     *qmp.Client
	wb    writeback
	pace  pacer
	stage int
	gate  *hintGate // nil: the copy runs from its start
	err   error     // why the watch ended the copy (cancel)
	stop  context.CancelFunc
}

func (w *liveWatch) poll(ctx context.Context, s qmp.MigrateStatus) {
	w.wb.kick()
	if w.gate != nil && s.RAM != nil && !w.gate.hold(time.Now(), *s.RAM) {
		w.gate = nil
		if err := w.q.MigrateSetParameters(ctx, openParams()); err != nil {
			w.err = fmt.Errorf("let the memory copy run: %w", err)
			w.stop()
			return
		}
		step.KillPoint("live-opened")
	}
	if s.RAM == nil || w.stage+1 >= len(liveDowntimes) {
		return
	}
	if n, _ := s.RAM.DirtySyncCount.Int64(); n > int64(liveRoundsPerStep*(w.stage+1)) {
		w.stage++
		w.q.MigrateSetParameters(ctx, map[string]any{qmp.ParamDowntimeLimit: liveDowntimes[w.stage]})
	}
}

func (w *liveWatch) close() { w.wb.close() }

// waitLiveCopy follows the live copy QEMU is writing into path (liveWatch
// at every poll, and onStatus if set) until it completes, and returns when
// QEMU stopped the guest for its last pass. gated says the copy started
// with gateParams: it is let run once the guest's free page hints are in.
func waitLiveCopy(ctx context.Context, q *qmp.Client, path string, gated bool, onStatus func(qmp.MigrateStatus)) (time.Time, error) {
	ctx, stop := context.WithCancel(ctx)
	defer stop()
	w := &liveWatch{q: q, wb: writeback{path: path}, stop: stop}
	if gated {
		w.gate = &hintGate{start: time.Now()}
	}
	defer w.close()
	t, err := q.WaitMigrationStop(ctx, func(s qmp.MigrateStatus) time.Duration {
		if onStatus != nil {
			onStatus(s)
		}
		w.poll(ctx, s)
		return w.pace.next(time.Now(), s, w.gate != nil)
	})
	if w.err != nil {
		return time.Time{}, w.err
	}
	return t, err
}

// A live copy's first pass goes through the whole RAM, and reads every
// page it sends or finds zero: on a clone, a page the guest never touched
// is a hole of the snapshot's state file, which the read fills with a
// zeroed page of page cache (as much as the clone's untouched RAM). The
// box's balloon (templates/box.xml) takes free page hints: while a
// migration runs, the guest's driver takes its free memory and names it
// to QEMU, which clears those pages from the copy's bitmap and never
// reads or stores them. A page the first pass has already reached is read
// all the same, and the pass outruns a guest that answers from its own
// vCPU, and reads the free memory regardless
// (docs/design.md#live-copy-of-ram). So a copy of RAM mapped from a file
// whose guest takes hints starts held back (gateParams), and runs at full
// speed (openParams) once the hints are in (hintGate). Anonymous RAM is
// not held back (anonRAM): the hints still come, and what they clear
// before the first pass gets there is not read.
//
// gateParams hold a copy back: about a page per 100 ms (max-bandwidth is
// bytes per second, applied per 100 ms window; below 10 it means no
// limit; a new limit does not wake the copy, which runs on only when its
// window ends), and no zero-page check, since a mapped-ram copy skips a zero page
// without counting it against the limit and would run through the holes.
var gateParams = map[string]any{qmp.ParamMaxBandwidth: int64(10), qmp.ParamZeroPageDetect: "none"}

// openParams let a held copy run: liveParams' bandwidth and zero-page check.
func openParams() map[string]any {
	return map[string]any{qmp.ParamMaxBandwidth: liveParams[qmp.ParamMaxBandwidth], qmp.ParamZeroPageDetect: liveParams[qmp.ParamZeroPageDetect]}
}

// startParams are what a live copy starts with: liveParams, held back by
// gateParams where gated.
func startParams(gated bool) map[string]any {
	p := maps.Clone(liveParams)
	if gated {
		maps.Copy(p, gateParams)
	}
	return p
}

// The hint gate's times. The guest names 4 MiB at a time, and is done when
// nothing more comes for hintSettle, well above the gaps seen between its
// names (docs/design.md#live-copy-of-ram). A guest that names nothing by hintFirst
// (busy, or with no 4 MiB free in one piece) is not waited for, nor one
// still naming pages at hintMax. Opened too early, the copy only reads
// what came late.
const (
	hintSettle = 20 * time.Millisecond
	hintFirst  = 200 * time.Millisecond
	hintMax    = 2 * time.Second
	hintBlock  = 1 << 20 // less than this off the remaining RAM is the held copy's own pages
)

// hintGate decides when a held copy runs.
type hintGate struct {
	start, moved time.Time
	hinted       bool
	last         int64 // the RAM left to copy when a hint was last seen
}

// hold reports whether the copy stays held at a poll that saw ram.
func (g *hintGate) hold(now time.Time, ram qmp.MigrateRAM) bool {
	left, _ := ram.Remaining.Int64()
	if g.last == 0 {
		g.last, _ = ram.Total.Int64()
		g.moved = g.start
	}
	if g.last-left >= hintBlock {
		g.last, g.moved, g.hinted = left, now, true
	}
	if !g.hinted {
		return now.Sub(g.start) < hintFirst
	}
	return now.Sub(g.moved) < hintSettle && now.Sub(g.start) < hintMax
}
