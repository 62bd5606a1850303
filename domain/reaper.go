package domain

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/statedir"
)

// A box (or snapshot) with a deadline has a reaper: a small detached kvbox
// process (`kvbox __reap KIND NAME ID`, its own session, no terminal) that
// sleeps until the deadline, reads the deadline again from where it lives
// (the box's libvirt metadata, the snapshot's snapshot.json) and removes the
// box through the normal rm path once it has passed. It wakes at least every
// ReaperRecheck to read the deadline again, so a deadline changed behind its
// back is honoured within that time; `kvbox ttl` restarts it anyway. No kvbox
// daemon and no systemd timer is needed, and nothing runs for a box without
// a deadline. A host reboot ends every reaper: the first kvbox command
// afterwards removes what expired meanwhile and starts the reapers of the
// rest (SweepExpired).
//
// Each reaper holds an flock on reapers/KIND-NAME.lock (its pid inside)
// while it lives: a second reaper of the same thing exits at once, and
// kvbox tells whether one is alive without trusting a pid.

// DueBox is RemoveIf's check for a TTL: the box is the one with uuid (its
// libvirt UUID, which a new box of the same name does not have) and its
// deadline has passed.
func DueBox(uuid string) func(Box) error {
	return func(b Box) error {
		if uuid == "" || b.UUID != uuid {
			return base.Errorf(base.NotDue, "box %q is another box now (UUID %s, not %s)", b.Name, b.UUID, uuid)
		}
		if b.Expires == nil || time.Now().Before(*b.Expires) {
			return base.Errorf(base.NotDue, "box %q has no past deadline any more", b.Name)
		}
		return nil
	}
}

// ReaperRecheck is the longest a reaper sleeps before reading its deadline
// again.
const ReaperRecheck = 30 * time.Second

// Reaper kinds.
const (
	ReapBox      = "box"
	ReapSnapshot = "snapshot"
)

// reaperLockPath is the lock a live reaper of KIND NAME holds.
func (h *Host) reaperLockPath(kind, name string) string { return h.Layout().ReaperLock(kind, name) }

// ReaperLog is where the reaper of a box writes what it did: the box's
// folder, so that it goes with the box. Snapshot reapers write to logs/.
func (h *Host) ReaperLog(kind, name string) string {
	if kind == ReapBox {
		return h.Layout().BoxReaperLog(name)
	}
	return h.Layout().SnapshotReaperLog(name)
}

// ReaperHeld is a reaper's hold on its lock; Release drops it (and removes
// the lock file while it is still this reaper's).
type ReaperHeld = base.FileLock

// HoldReaper takes the reaper lock of KIND NAME for the calling process and
// records its pid; ok is false when another reaper holds it.
func (h *Host) HoldReaper(kind, name string) (held *ReaperHeld, ok bool, err error) {
	l, err := base.Lock(h.reaperLockPath(kind, name), false)
	if errors.Is(err, base.ErrLocked) {
		return nil, false, nil
	}
	if err != nil {
		return nil, false, err
	}
	l.Note(strconv.Itoa(os.Getpid()) + "\n")
	return l, true, nil
}

// ReaperAlive reports whether a reaper of KIND NAME runs.
func (h *Host) ReaperAlive(kind, name string) bool {
	l, err := base.LockExisting(h.reaperLockPath(kind, name))
	if errors.Is(err, base.ErrLocked) {
		return true
	}
	if err == nil {
		l.Unlock()
	}
	return false
}

// StartReaper starts the reaper of KIND NAME (id tells this box or snapshot
// from a later one of the same name: a box's UUID, a snapshot's creation
// time). It returns at once; the reaper runs detached, in its own session,
// logging to ReaperLog. Without h.ReaperCommand nothing is started.
func (h *Host) StartReaper(kind, name, id string) error {
	if h.ReaperCommand == nil {
		return nil
	}
	cmd := h.ReaperCommand(kind, name, id)
	logPath := h.ReaperLog(kind, name)
	if err := os.MkdirAll(filepath.Dir(logPath), 0o750); err != nil {
		return err
	}
	// A box's folder is writable by QEMU: never follow a link planted
	// there, and never block on a FIFO.
	log, err := os.OpenFile(logPath, os.O_WRONLY|os.O_CREATE|os.O_APPEND|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o600)
	if err != nil {
		return fmt.Errorf("reaper log of %s %q: %w", kind, name, err)
	}
	defer log.Close()
	if fi, err := log.Stat(); err != nil || !fi.Mode().IsRegular() {
		return fmt.Errorf("reaper log %s is not a regular file", logPath)
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = nil, log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start the reaper of %s %q: %w", kind, name, err)
	}
	// Reaped when it ends, so that a long-running caller (kvbox serve,
	// a reaper per sandbox) keeps no zombie; a CLI that exits first
	// leaves it to init.
	go cmd.Wait()
	return nil
}

// StopReaper ends the reaper of KIND NAME, if one runs (and is not the
// calling process), and waits until it is gone.
func (h *Host) StopReaper(kind, name string) {
	path := h.reaperLockPath(kind, name)
	for range 100 {
		if !h.ReaperAlive(kind, name) {
			if l, err := base.LockExisting(path); err == nil {
				l.RemoveAndUnlock() // a dead reaper's file
			}
			return
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 1 {
			time.Sleep(10 * time.Millisecond) // it is writing its pid
			continue
		}
		if pid == os.Getpid() {
			return // the reaper itself is removing its box
		}
		if isReaper(pid, kind, name) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// ReaperArg is the hidden subcommand a reaper runs.
const ReaperArg = "__reap"

// isReaper checks that pid is a kvbox reaper of KIND NAME, so a stale or
// rewritten pid never gets a signal meant for a reaper.
func isReaper(pid int, kind, name string) bool {
	cmd, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	args := bytes.Split(bytes.TrimRight(cmd, "\x00"), []byte{0})
	for i := range args {
		if string(args[i]) == ReaperArg && i+2 < len(args) && string(args[i+1]) == kind && string(args[i+2]) == name {
			return true
		}
	}
	return false
}

// SetExpires writes the box's deadline (nil: none) into its libvirt
// metadata, live and persistent, and restarts its reaper: `virsh dumpxml`
// shows <expires>. It returns the box as it is now.
func (h *Host) SetExpires(name string, at *time.Time) (Box, error) {
	b, dom, release, err := h.LockedLookup(name)
	if err != nil {
		return Box{}, err
	}
	defer release()
	if at != nil {
		t := at.UTC().Truncate(time.Second)
		at = &t
	}
	b.Expires = at
	if err := writeMeta(dom, b.Meta); err != nil {
		return Box{}, fmt.Errorf("set the deadline of box %q: %w", name, err)
	}
	h.StopReaper(ReapBox, name)
	if at != nil {
		if err := h.StartReaper(ReapBox, name, b.UUID); err != nil {
			return Box{}, err
		}
	}
	return b, nil
}

// writeMeta replaces a domain's kvbox metadata, in its live definition when
// it runs and in its persistent one.
func writeMeta(dom *libvirt.Domain, m Meta) error { return WriteMeta(dom, m, true) }

// WriteMeta replaces a domain's kvbox metadata in its persistent
// definition, and with live also in the running one.
func WriteMeta(dom *libvirt.Domain, m Meta, live bool) error {
	md, err := MarshalMeta(m)
	if err != nil {
		return err
	}
	flags := libvirt.DOMAIN_AFFECT_CONFIG
	if active, err := dom.IsActive(); err == nil && active && live {
		flags |= libvirt.DOMAIN_AFFECT_LIVE
	}
	if err := dom.SetMetadata(libvirt.DOMAIN_METADATA_ELEMENT, strings.TrimSpace(md), "kvbox", MetadataNS, flags); err != nil {
		return fmt.Errorf("%s", LibvirtMessage(err))
	}
	return nil
}

// The files kvbox keeps for a suspended box (statedir.SuspendLive, ...).
const (
	SuspendLive   = statedir.SuspendLive
	SuspendBoot   = statedir.SuspendBoot
	SuspendSaving = statedir.SuspendSaving
)

// SuspendFile is the file of kind kvbox keeps for the suspended box name.
func (h *Host) SuspendFile(name, kind string) string {
	return h.Layout().SuspendFile(name, kind)
}

// RemoveSuspendFiles deletes what kvbox keeps for a suspended box.
func (h *Host) RemoveSuspendFiles(name string) {
	for _, k := range []string{SuspendLive, SuspendBoot, SuspendSaving} {
		os.Remove(h.SuspendFile(name, k))
	}
}

// PullPlug ends a box's QEMU at once (SIGKILL, then libvirt's destroy): for
// a box whose state is saved or that is being removed.
func PullPlug(dom *libvirt.Domain, name string) error {
	killQEMU(name)
	return powerOff(dom, name)
}

// SuspendedBoxes are the names of boxes with suspend files (suspended, or
// being suspended or resumed).
func (h *Host) SuspendedBoxes() []string {
	m, _ := filepath.Glob(h.Layout().SuspendFiles())
	var out []string
	for _, p := range m {
		out = append(out, strings.TrimSuffix(filepath.Base(p), "."+SuspendBoot))
	}
	return out
}
