package snapshot

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"maps"
	"os"
	"time"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/qmp"
	"kvbox.dev/kvbox/step"
)

// ramBlockID is the id of the box's RAM block in QEMU's migration stream:
// the memory-backend-file object kvbox adds is named kvbox.ram.
const ramBlockID = domain.RAMBackendID

// mappedRAMHeader is QEMU's MappedRamHeader (migration/ram.c, QEMU >= 9.0),
// written big-endian and packed right after a RAM block's id and length
// when the mapped-ram capability is on. The offsets are absolute in the file.
type mappedRAMHeader struct {
	Version      uint32
	PageSize     uint64
	BitmapOffset uint64
	PagesOffset  uint64
}

const mappedRAMHeaderSize = 4 + 8 + 8 + 8

// prepareMappedRAM readies a state file written with mapped-ram for clones
// to map: it finds kvbox.ram's block, zeroes its page bitmap so that loading
// the state reads no page (the clone maps the pages from the file instead,
// privately, at the returned offset), and returns that offset. A file it
// readied already is left as it is (its bitmap is all zero, which no
// guest's saved RAM has).
func prepareMappedRAM(path string, ramSize int64) (int64, error) {
	f, err := domain.OpenNoFollow(path, os.O_RDWR) // QEMU wrote it: a plain file of its own, never a link
	if err != nil {
		return 0, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return 0, err
	}
	h, err := findRAMBlock(f, ramSize, fi.Size())
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	pages := (uint64(ramSize) + h.PageSize - 1) / h.PageSize
	bitmapBytes := (pages + 63) / 64 * 8 // BITS_TO_LONGS(pages) * sizeof(long)
	if h.BitmapOffset+bitmapBytes > h.PagesOffset {
		return 0, fmt.Errorf("%s: mapped-ram bitmap overlaps the pages", path)
	}
	bitmap := make([]byte, bitmapBytes)
	if _, err := f.ReadAt(bitmap, int64(h.BitmapOffset)); err != nil {
		return 0, fmt.Errorf("%s: read the mapped-ram bitmap: %w", path, err)
	}
	if bytes.Count(bitmap, []byte{0}) == len(bitmap) {
		// Readied already (a resume killed after it): no running guest's
		// RAM is all zeros, and punching now would zero every page.
		return int64(h.PagesOffset), nil
	}
	if err := punchUnsentPages(f, bitmap, pages, h); err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	if _, err := f.WriteAt(make([]byte, bitmapBytes), int64(h.BitmapOffset)); err != nil {
		return 0, err
	}
	return int64(h.PagesOffset), f.Sync()
}

// punchUnsentPages makes every page whose bitmap bit is clear read as
// zeros in the file. A loader reads only the pages whose bit is set and
// leaves the others zero; a clone maps the file instead, so it must see the
// same. A live copy breaks that: a page sent in one pass that is all zero by
// a later one only has its bit cleared (QEMU's save_zero_page with
// mapped-ram), and its old bytes stay in the file. A guest zeroes freed
// pages all the time, so without this a clone of a live snapshot could map
// stale memory. Runs of clear bits become holes.
func punchUnsentPages(f *os.File, bitmap []byte, pages uint64, h mappedRAMHeader) error {
	// Only where the file holds data: a run of clear bits is mostly a
	// hole already (pages never sent), and a punch per run cost ~0.5 s
	// for a 256 MB box here.
	data, _, err := overlay.DataExtents(f)
	if err != nil {
		return err
	}
	punch := func(off, end int64) error {
		for len(data) > 0 && data[0].Off+data[0].Len <= off {
			data = data[1:]
		}
		for _, e := range data {
			if e.Off >= end {
				break
			}
			from, to := max(off, e.Off), min(end, e.Off+e.Len)
			if err := unix.Fallocate(int(f.Fd()), unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, from, to-from); err != nil {
				return err
			}
		}
		return nil
	}
	set := func(i uint64) bool { return bitmap[i/8]&(1<<(i%8)) != 0 } // unsigned longs, little-endian
	for i := uint64(0); i < pages; {
		if set(i) {
			i++
			continue
		}
		j := i
		for j < pages && !set(j) {
			j++
		}
		off, n := int64(h.PagesOffset+i*h.PageSize), int64((j-i)*h.PageSize)
		if err := punch(off, off+n); err != nil {
			return fmt.Errorf("punch the unsent pages %d..%d: %w", i, j, err)
		}
		i = j
	}
	return nil
}

// findRAMBlock locates kvbox.ram's mapped-ram header in the head of a
// migration stream: the id (length-prefixed), its used length, the header.
// It reads the head in growing windows up to 16 MiB: the header sits in the
// first hundred bytes when kvbox.ram is QEMU's first RAM block, and reading
// all 16 MiB of a state file took ~0.4 s here.
func findRAMBlock(r io.ReaderAt, ramSize, fileSize int64) (mappedRAMHeader, error) {
	key := append([]byte{byte(len(ramBlockID))}, ramBlockID...)
	key = binary.BigEndian.AppendUint64(key, uint64(ramSize))
	for _, n := range []int{64 << 10, 1 << 20, 16 << 20} {
		b := make([]byte, n)
		m, err := r.ReadAt(b, 0)
		if err != nil && err != io.EOF {
			return mappedRAMHeader{}, err
		}
		if h, ok := scanRAMBlock(b[:m], key, fileSize); ok {
			return h, nil
		}
		if m < n {
			break // the whole stream was read
		}
	}
	return mappedRAMHeader{}, fmt.Errorf("no mapped-ram block %q of %d bytes in the migration stream", ramBlockID, ramSize)
}

// scanRAMBlock looks for key (a RAM block's id and length) followed by a
// plausible mapped-ram header in b.
func scanRAMBlock(b, key []byte, fileSize int64) (mappedRAMHeader, bool) {
	for off := 0; ; {
		i := bytes.Index(b[off:], key)
		if i < 0 {
			return mappedRAMHeader{}, false
		}
		p := off + i + len(key)
		off += i + 1
		if p+mappedRAMHeaderSize > len(b) {
			continue
		}
		var h mappedRAMHeader
		binary.Read(bytes.NewReader(b[p:p+mappedRAMHeaderSize]), binary.BigEndian, &h)
		if h.Version == 1 && h.PageSize >= 4096 && h.PageSize&(h.PageSize-1) == 0 &&
			h.BitmapOffset < h.PagesOffset && h.PagesOffset%h.PageSize == 0 &&
			int64(h.PagesOffset) <= fileSize {
			return h, true
		}
	}
}

// writeback keeps a file that QEMU is writing on its way to disk: at most
// every 20 ms it starts the write-out of what is dirty (sync_file_range,
// no wait), so that little is left for the fsync after the copy (every
// 100 ms left a tiny box's snapshot 60-80 ms of it; every 20 ms, 7-22).
// At a live copy's switch-over QEMU flushes the box's disk (block
// inactivation), and that flush waited behind the state file's dirty page
// cache: on the Debian box (1.4 GB copied) the pause was 460-870 ms
// instead of ~110.
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
		// QEMU's close in the pause (38 ms for the 75 MB of a tiny box).
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
// box's vCPUs need for their I/O. Polled every 2 ms throughout, snapshots
// of the 4 GiB Debian clone (1.5 GB, copies of 2-17 s) kept libvirtd, QEMU's
// main loop and kvbox on about half of one of this machine's two cores, and
// the box stopped answering a ping every 5 ms for 85-221 ms at a time while
// its reported pauses were 29-63 ms; at 20 ms, its longest gaps were 30-36 ms
// in the live phase, with the same pauses.
//
// When the copy may end is judged at the fastest pace it has gone yet: a
// copy speeds up at its end, where RAM the guest never touched reads as
// zeros. Judged at the last interval's pace, one snapshot in two of the
// tiny box was seen stopped 10-15 ms late.
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
// zeroed page of page cache (4 GB of it for the 4 GiB Debian clone). The
// box's balloon (templates/box.xml) takes free page hints: while a
// migration runs, the guest's driver takes its free memory and names it
// to QEMU, which clears those pages from the copy's bitmap and never
// reads or stores them. A page the first pass has already reached is read
// all the same, and the pass outruns a guest that answers from its own
// vCPU: of five snapshots of tiny clones (512 MB, half of it free), two
// read the free half regardless. So a copy of RAM mapped from a file
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
// nothing more comes for hintSettle: here the tiny box's guest named its
// 400 MB within 5 ms of the request, the Debian box's 3.8 GB within 40 ms,
// never more than 9 ms apart. A guest that names nothing by hintFirst
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
