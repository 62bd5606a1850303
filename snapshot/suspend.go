package snapshot

import (
	"context"
	"errors"
	"fmt"
	"html"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/qmp"
	"kvbox.dev/kvbox/revert"
)

// Suspend and resume use the live-snapshot machinery on the box itself
// instead of libvirt's managed save: managed save writes every page of the
// guest's RAM into one stream and `virsh start` reads all of it back (a
// 4 GiB box: 14.7 s and 6.8 s, DESIGN.md), where a box's RAM already is a
// file. A box booted from an image keeps its RAM in its shared memory
// file: only the device state (~300 KB, x-ignore-shared) is written, and
// resume maps the same file again, so neither depends on the RAM's size.
// A clone's RAM is a private mapping of its snapshot: it is copied live
// into a mapped-ram file in the box's folder (QEMU stops the guest only for
// the last pass), and resume reads its pages into the box's own shared
// memory file, so a resumed clone is like a box booted from an image from
// then on: its next suspend saves only device state. (Mapping the mapped-ram
// file privately, as a clone maps a snapshot of a clone, loads faster, but
// a live mapped-ram save of a box whose RAM is such a mapping gave a state
// whose restore crashes the guest here, QEMU 10.0: the same happens to a
// clone of a snapshot of a grandchild.)
//
// While suspended, the box's persistent definition names a RAM file in a
// folder that does not exist (SUSPENDED-run-kvbox-resume-NAME): an
// operator's `virsh start` fails at once with that path in the error and
// changes nothing, instead of cold-booting over the saved memory or
// restoring a stale state later. kvbox ls shows the box as suspended.

// SuspendResult reports a suspend.
type SuspendResult struct {
	Pause      time.Duration // the guest stopped until its state was saved
	Total      time.Duration // the whole command, QEMU gone
	StateBytes int64         // real bytes of the saved state (and RAM copy)
	Live       bool          // RAM copied live (a clone)
	// Kill is the time QEMU took to go, Sync that of putting the memory
	// file on disk.
	Kill, Sync time.Duration
}

// ResumeResult reports a resume.
type ResumeResult struct {
	Box   domain.Box
	Start time.Duration // libvirt started QEMU, paused
	Load  time.Duration // device state loaded
	Agent time.Duration // the agent answered, clock set
	Total time.Duration
}

// suspendedRAMDir is the folder, never created, that a suspended box's
// persistent definition maps its RAM from: `virsh start` then fails and
// says why.
func suspendedRAMDir(b domain.Box) string {
	return filepath.Join(b.Dir, "SUSPENDED-run-kvbox-resume-"+b.Name)
}

// Suspend saves a running box's memory and device state to disk and ends
// its QEMU: RAM and CPU are given back. On a failure before QEMU is gone,
// the box runs on as it was.
func Suspend(ctx context.Context, h *domain.Host, name string) (SuspendResult, error) {
	t0 := time.Now()
	box, dom, release, err := h.LockedLookup(name)
	if err != nil {
		return SuspendResult{}, err
	}
	defer release()
	if box.State != "running" {
		return SuspendResult{}, fmt.Errorf("box %q is %s; kvbox suspends a running box: %w", name, box.State, domain.ErrBusy)
	}
	live, err := dom.GetXMLDesc(libvirt.DOMAIN_XML_MIGRATABLE)
	if err != nil {
		return SuspendResult{}, fmt.Errorf("read the domain XML of %q: %s", name, domain.LibvirtMessage(err))
	}
	boot, err := dom.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE)
	if err != nil {
		return SuspendResult{}, fmt.Errorf("read the domain XML of %q: %s", name, domain.LibvirtMessage(err))
	}
	shared := domain.SharedRAMArgs(box.MemoryBytes, domain.MemoryFile(box.Dir))[1]
	mapped := !strings.Contains(live, html.EscapeString(shared)) && !strings.Contains(live, shared)
	suspendedDef, err := suspendedXML(boot, box)
	if err != nil {
		return SuspendResult{}, err
	}

	r := revert.New()
	defer r.Fail()
	if err := os.MkdirAll(filepath.Dir(h.SuspendFile(name, "live")), 0o700); err != nil {
		return SuspendResult{}, err
	}
	r.Add(func() { h.RemoveSuspendFiles(name) })
	for k, x := range map[string]string{"live": live, "boot": boot} {
		if err := overlay.WriteFileAtomic(h.SuspendFile(name, k), []byte(x), 0o600); err != nil {
			return SuspendResult{}, err
		}
	}
	stateName := fmt.Sprintf("suspend-%d.state", time.Now().UnixNano())
	statePath := filepath.Join(box.Dir, stateName)
	r.Add(func() { os.Remove(statePath) })

	q := h.QMP(dom, name)
	bg := context.WithoutCancel(ctx)
	running := true
	r.Add(func() {
		// A save cut short: no migration left running, the guest runs on.
		if s, err := q.QueryMigrate(bg); err == nil && qmp.MigrationRunning(s.Status) {
			q.MigrateCancel(bg)
			q.WaitMigration(bg, 5*time.Millisecond)
		}
		if !running || mapped {
			q.BlockdevSetActive(bg, "", true)
			dom.Resume()
		}
	})
	var stopped time.Time
	if mapped {
		restore, err := q.ApplyMigrationSettings(ctx, map[string]bool{qmp.CapIgnoreShared: false, qmp.CapMappedRAM: true, qmp.CapPauseBeforeSwitchover: false}, liveParams)
		if err != nil {
			return SuspendResult{}, err
		}
		r.Add(func() { restore(bg) })
		if err := q.Migrate(ctx, "file:"+statePath); err != nil {
			return SuspendResult{}, err
		}
		if stopped, err = q.WaitMigrationStop(ctx, 2*time.Millisecond, nil); err != nil {
			return SuspendResult{}, fmt.Errorf("save the state of box %q: %w", name, err)
		}
	} else {
		// Capabilities first: they do not touch the running guest, and
		// every QMP round trip inside the pause lengthens it.
		restore, err := q.ApplyMigrationSettings(ctx, map[string]bool{qmp.CapIgnoreShared: true}, nil)
		if err != nil {
			return SuspendResult{}, err
		}
		r.Add(func() { restore(bg) })
		stopped = time.Now()
		if err := dom.Suspend(); err != nil {
			return SuspendResult{}, fmt.Errorf("pause box %q: %s", name, domain.LibvirtMessage(err))
		}
		running = false
		if err := q.Migrate(ctx, "file:"+statePath); err != nil {
			return SuspendResult{}, err
		}
		if err := q.WaitMigration(ctx, 2*time.Millisecond); err != nil {
			return SuspendResult{}, fmt.Errorf("save the state of box %q: %w", name, err)
		}
	}
	pause := time.Since(stopped)
	domain.Testpoint("suspend-saved")
	susp := domain.Suspended{At: time.Now().UTC().Truncate(time.Second), State: stateName, MappedRAM: mapped, PauseMillis: pause.Milliseconds()}
	if err := syncFile(statePath); err != nil {
		return SuspendResult{}, err
	}

	// The definition that makes virsh start fail, before QEMU goes: from
	// the moment QEMU is gone no start may boot over the saved memory.
	d2, err := h.Conn.DomainDefineXML(suspendedDef)
	if err != nil {
		return SuspendResult{}, fmt.Errorf("define suspended box %q: %s", name, domain.LibvirtMessage(err))
	}
	d2.Free()
	r.Add(func() {
		if d, err := h.Conn.DomainDefineXML(boot); err == nil {
			d.Free()
		}
		domain.WriteMeta(dom, box.Meta, true)
	})
	meta := box.Meta
	meta.Suspended = &susp
	if err := domain.WriteMeta(dom, meta, false); err != nil {
		return SuspendResult{}, fmt.Errorf("mark box %q suspended: %w", name, err)
	}
	domain.Testpoint("suspend-defined")
	tk := time.Now()
	if err := domain.PullPlug(dom, name); err != nil {
		return SuspendResult{}, err
	}
	kill := time.Since(tk)
	r.Success()
	ts := time.Now()
	// The RAM of a box booted from an image is its memory file: on disk
	// before kvbox says it is saved (a host crash keeps the box).
	if !mapped {
		if err := syncFile(domain.MemoryFile(box.Dir)); err != nil {
			return SuspendResult{}, fmt.Errorf("box %q is suspended, but its memory file could not be synced: %w", name, err)
		}
	}
	sync := time.Since(ts)
	removeOldStates(box.Dir, stateName)
	size, _ := overlay.Du(statePath)
	return SuspendResult{Pause: pause, Total: time.Since(t0), StateBytes: size, Live: mapped, Kill: kill, Sync: sync}, nil
}

// suspendedXML is the box's persistent definition while it is suspended:
// its own, with the RAM backend's file in a folder that does not exist.
func suspendedXML(boot string, b domain.Box) (string, error) {
	old := domain.SharedRAMArgs(b.MemoryBytes, domain.MemoryFile(b.Dir))[1]
	repl := domain.SharedRAMArgs(b.MemoryBytes, filepath.Join(suspendedRAMDir(b), "memory"))[1]
	for _, o := range []string{html.EscapeString(old), old} {
		if strings.Count(boot, o) == 1 {
			return strings.Replace(boot, o, html.EscapeString(repl), 1), nil
		}
	}
	return "", fmt.Errorf("the definition of box %q lacks kvbox's RAM backend (%s); it cannot be suspended", b.Name, old)
}

// Resume starts a suspended box from its saved state, with its own name,
// MAC and address (no re-identification; the clock is set): every process
// runs on where it stopped, and its disk is as it was. On failure the box
// stays suspended.
func Resume(ctx context.Context, h *domain.Host, name string, agentTimeout time.Duration) (ResumeResult, error) {
	var res ResumeResult
	t0 := time.Now()
	box, dom, release, err := h.LockedLookup(name)
	if err != nil {
		return res, err
	}
	defer release()
	if box.State != "suspended" {
		return res, fmt.Errorf("box %q is %s, not suspended: %w", name, box.State, domain.ErrBusy)
	}
	s := *box.Suspended
	if s.State == "" || strings.ContainsAny(s.State, "/\x00") || s.State == ".." {
		return res, fmt.Errorf("box %q: its metadata names no saved state file (%q)", name, s.State)
	}
	statePath := filepath.Join(box.Dir, s.State)
	if _, err := os.Stat(statePath); err != nil {
		return res, fmt.Errorf("box %q: its saved state: %w", name, err)
	}
	live, err := os.ReadFile(h.SuspendFile(name, "live"))
	if err != nil {
		return res, fmt.Errorf("box %q: its saved domain XML: %w", name, err)
	}
	boot, err := os.ReadFile(h.SuspendFile(name, "boot"))
	if err != nil {
		return res, fmt.Errorf("box %q: its saved domain XML: %w", name, err)
	}
	suspendedDef, err := dom.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE)
	if err != nil {
		return res, fmt.Errorf("read box %q: %s", name, domain.LibvirtMessage(err))
	}
	if err := h.Net.Ensure(); err != nil {
		return res, err
	}
	// The resume definition keeps the mark until the end: a kvbox killed
	// half-way leaves a box kvbox still knows to be suspended (never one
	// that kvbox start would boot afresh over its saved memory).
	meta := box.Meta
	// Either way the resumed box's RAM is its own shared memory file, as
	// for a box booted from an image: the next suspend (and a snapshot)
	// saves only its device state.
	spec := CloneXMLSpec{Name: name, Meta: meta, Disk: filepath.Join(box.Dir, CloneDisk), UUID: box.UUID, MemBytes: box.MemoryBytes,
		MemPath: statePath, BootRAM: domain.MemoryFile(box.Dir), Incoming: true}
	if s.MappedRAM {
		// The stream holds the RAM: its pages are read into a fresh
		// (sparse, all zero) memory file, the pages it lacks being zero.
		if err := os.Truncate(domain.MemoryFile(box.Dir), 0); err != nil && !errors.Is(err, os.ErrNotExist) {
			return res, err
		}
	}
	rx, err := CloneXML(string(live), spec)
	if err != nil {
		return res, err
	}

	r := revert.New()
	defer r.Fail()
	d, err := h.Conn.DomainDefineXML(rx)
	if err != nil {
		return res, fmt.Errorf("define box %q to resume it: %s", name, domain.LibvirtMessage(err))
	}
	d.Free()
	r.Add(func() {
		if d, err := h.Conn.DomainDefineXML(suspendedDef); err == nil {
			d.Free()
		}
	})
	if err := dom.CreateWithFlags(libvirt.DOMAIN_START_PAUSED); err != nil {
		return res, fmt.Errorf("start box %q: %s", name, domain.LibvirtMessage(err))
	}
	r.Add(func() { domain.PullPlug(dom, name) })
	res.Start = time.Since(t0)
	domain.Testpoint("resume-started")
	if err := loadStateFile(ctx, h.QMP(dom, name), statePath, s.MappedRAM); err != nil {
		return res, fmt.Errorf("load the saved state of box %q: %w", name, err)
	}
	if err := dom.Resume(); err != nil {
		return res, fmt.Errorf("resume box %q: %s", name, domain.LibvirtMessage(err))
	}
	res.Load = time.Since(t0) - res.Start
	domain.Testpoint("resume-running")

	if agentTimeout <= 0 {
		agentTimeout = 60 * time.Second
	}
	actx, cancel := context.WithTimeout(ctx, agentTimeout)
	defer cancel()
	b := box
	b.State, b.Suspended = "running", nil
	c, err := h.WaitAgent(actx, dom, b)
	if err != nil {
		return res, fmt.Errorf("resumed box %q: %w", name, err)
	}
	err = c.SetClock(actx, time.Now())
	c.Close()
	if err != nil && !errors.Is(err, errors.ErrUnsupported) {
		return res, fmt.Errorf("set the clock of box %q: %w", name, err)
	}
	res.Agent = time.Since(t0) - res.Start - res.Load

	// Its own definition back, for the next cold boot, with the metadata
	// as it is now (kvbox ttl may have changed it while it slept).
	d, err = h.Conn.DomainDefineXML(string(boot))
	if err != nil {
		return res, fmt.Errorf("define box %q for its next boot: %s", name, domain.LibvirtMessage(err))
	}
	d.Free()
	meta.Suspended = nil
	if err := domain.WriteMeta(dom, meta, true); err != nil {
		return res, fmt.Errorf("box %q: %w", name, err)
	}
	r.Success()
	h.RemoveSuspendFiles(name)
	os.Remove(statePath)
	res.Total = time.Since(t0)
	res.Box, err = h.Get(name)
	return res, err
}

// removeOldStates deletes a box's saved states but keep (debris of an
// interrupted suspend).
func removeOldStates(dir, keep string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		if n := e.Name(); n != keep && strings.HasPrefix(n, "suspend-") && strings.HasSuffix(n, ".state") {
			os.Remove(filepath.Join(dir, n))
		}
	}
}

func syncFile(path string) error {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// RecoverSuspends finishes or undoes a suspend or resume whose kvbox was
// killed (every kvbox command runs it): boxes with suspend files whose lock
// nobody holds are put in a consistent state. What the guest may already
// have written to its disk decides the direction: a guest that never ran
// again from its saved state goes back to it; one that did runs on.
//   - shut off: suspended (nothing to do), or the files are debris;
//   - suspend killed before its definition: the guest runs on as it was;
//   - suspend killed after it (the state is complete): QEMU is ended;
//   - resume killed with QEMU still paused: QEMU ended, suspended again;
//   - resume killed after the guest ran: it keeps running, its own
//     definition back.
func RecoverSuspends(ctx context.Context, h *domain.Host) error {
	var errs []error
	for _, name := range h.SuspendedBoxes() {
		if err := recoverSuspend(ctx, h, name); err != nil {
			errs = append(errs, fmt.Errorf("box %q: %w", name, err))
		}
	}
	return errors.Join(errs...)
}

func recoverSuspend(ctx context.Context, h *domain.Host, name string) error {
	l, err := h.TryLockBox(name)
	if err != nil {
		return nil // a live kvbox is at it
	}
	defer l.Unlock()
	box, dom, err := h.Lookup(name)
	if errors.Is(err, domain.ErrNotFound) {
		h.RemoveSuspendFiles(name)
		return nil
	}
	if err != nil {
		return err
	}
	defer dom.Free()
	inactive, err := dom.GetXMLDesc(libvirt.DOMAIN_XML_INACTIVE)
	if err != nil {
		return fmt.Errorf("%s", domain.LibvirtMessage(err))
	}
	persistentSuspended := strings.Contains(inactive, "<suspended>") || strings.Contains(inactive, ":suspended>")
	boot, err := os.ReadFile(h.SuspendFile(name, "boot"))
	if err != nil {
		return err
	}
	st, _, err := dom.GetState()
	if err != nil {
		return fmt.Errorf("%s", domain.LibvirtMessage(err))
	}
	bg := context.WithoutCancel(ctx)
	if st == libvirt.DOMAIN_SHUTOFF {
		if !persistentSuspended {
			h.RemoveSuspendFiles(name) // debris: the box is stopped, not suspended
		}
		return nil
	}
	q := h.QMP(dom, name)
	switch {
	case box.Suspended == nil && !persistentSuspended:
		// Suspend killed while saving: the guest runs on.
		if s, err := q.QueryMigrate(bg); err == nil && qmp.MigrationRunning(s.Status) {
			q.MigrateCancel(bg)
			q.WaitMigration(bg, 5*time.Millisecond)
		}
		q.MigrateSetCapabilities(bg, map[string]bool{qmp.CapIgnoreShared: false, qmp.CapMappedRAM: false})
		if st == libvirt.DOMAIN_PAUSED {
			q.BlockdevSetActive(bg, "", true)
			if err := dom.Resume(); err != nil {
				return fmt.Errorf("resume after an interrupted suspend: %s", domain.LibvirtMessage(err))
			}
		}
		h.RemoveSuspendFiles(name)
		removeOldStates(box.Dir, "")
	case box.Suspended == nil:
		// Suspend killed after its definition: the state is saved.
		return domain.PullPlug(dom, name)
	case st == libvirt.DOMAIN_PAUSED:
		// Resume killed before the guest ran: suspended again.
		if err := domain.PullPlug(dom, name); err != nil {
			return err
		}
		sx, err := suspendedXML(string(boot), box)
		if err != nil {
			return err
		}
		d, err := h.Conn.DomainDefineXML(sx)
		if err != nil {
			return fmt.Errorf("define suspended box: %s", domain.LibvirtMessage(err))
		}
		d.Free()
		return domain.WriteMeta(dom, box.Meta, false)
	default:
		// Resume killed after the guest ran: it runs on, as itself.
		d, err := h.Conn.DomainDefineXML(string(boot))
		if err != nil {
			return fmt.Errorf("define box for its next boot: %s", domain.LibvirtMessage(err))
		}
		d.Free()
		meta := box.Meta
		state := meta.Suspended.State
		meta.Suspended = nil
		if err := domain.WriteMeta(dom, meta, true); err != nil {
			return err
		}
		h.RemoveSuspendFiles(name)
		if state != "" && !strings.ContainsAny(state, "/") {
			os.Remove(filepath.Join(box.Dir, state))
		}
	}
	return nil
}
