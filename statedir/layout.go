// Package statedir is the layout of kvbox's state directory: the one place
// that knows where each thing kvbox keeps is, so that no package spells a
// path of it out again.
package statedir

import "path/filepath"

// Default is the state directory kvbox uses unless told otherwise.
const Default = "/var/lib/kvbox"

// Modes of what kvbox keeps under its state dir. Nothing has world bits:
// the state dir is root:QEMU-group 0710, so a local user who is neither
// root nor QEMU cannot even traverse it.
const (
	RootMode       = 0o710 // root:QEMU group: QEMU traverses, nobody lists
	SharedDirMode  = 0o750 // root:QEMU group: boxes/, snapshots/, images/ and their sealed folders
	SharedFileMode = 0o440 // root:QEMU group: sealed snapshot files and base images, read-only to QEMU
	PrivateDirMode = 0o700 // root's alone: locks/, logs/, registry-cache/, publish/, ...
)

// Layout is a state directory.
type Layout struct{ Root string }

func (l Layout) join(p ...string) string { return filepath.Join(append([]string{l.Root}, p...)...) }

// Boxes holds one folder per box: disk overlay, agent sockets, console
// log, a suspended box's saved state. QEMU's user writes these folders.
func (l Layout) Boxes() string { return l.join("boxes") }

// Box is the folder of box name.
func (l Layout) Box(name string) string { return l.join("boxes", name) }

// Snapshots holds one sealed folder per snapshot.
func (l Layout) Snapshots() string { return l.join("snapshots") }

// Images holds one folder per base image (with its versions).
func (l Layout) Images() string { return l.join("images") }

// Shared are the folders QEMU reads through its group.
func (l Layout) Shared() []string { return []string{l.Boxes(), l.Snapshots(), l.Images()} }

// Private are the folders that are root's alone.
func (l Layout) Private() []string {
	return []string{l.join("locks"), l.Logs(), l.RegistryCache(), l.join("publish"),
		l.join("reapers"), l.join("suspend"), l.join("ssh")}
}

// HostLock is the host-wide lock: it serializes every change of which
// boxes exist and which addresses they hold.
func (l Layout) HostLock() string { return l.join("lock") }

// BoxLock is the lock of box name, held by commands that change it.
func (l Layout) BoxLock(name string) string { return l.join("locks", name+".lock") }

// PullLock is held while a snapshot is pulled under name.
func (l Layout) PullLock(name string) string { return l.join("locks", "pull-"+name+".lock") }

// ReaperLock is held by the live reaper of KIND NAME, its pid inside.
func (l Layout) ReaperLock(kind, name string) string {
	return l.join("reapers", kind+"-"+name+".lock")
}

// Logs holds what outlives a box or a command: failed boxes' console logs,
// QMP transcripts, snapshot reapers' logs.
func (l Layout) Logs() string { return l.join("logs") }

// FailedConsoleLog is where the console log of a box whose creation failed
// is kept after its folder is removed: the next failure of that name
// replaces it.
func (l Layout) FailedConsoleLog(name string) string { return l.join("logs", name+".console.log") }

// QMPLog is the transcript of the QMP commands kvbox sent to box name's
// QEMU and QEMU's replies.
func (l Layout) QMPLog(name string) string { return l.join("logs", name+".qmp.log") }

// SnapshotReaperLog is where the reaper of snapshot name writes what it did.
func (l Layout) SnapshotReaperLog(name string) string {
	return l.join("logs", name+".snapshot-reaper.log")
}

// BoxReaperLog is where the reaper of box name writes what it did: beside
// the other logs, not in the box's folder, which a reaper started for a
// box being removed would otherwise make again (and whose removal would
// take what the reaper said it did).
func (l Layout) BoxReaperLog(name string) string { return l.join("logs", name+".reaper.log") }

// The files kvbox keeps, root's alone, for a suspended box (SuspendFile):
// its live domain XML at the suspend (what resume starts it from), its
// persistent one (what it gets back), and while QEMU still runs, what the
// suspend's save changed in it (a vmstate.Record). Not in the box's
// folder, which QEMU can write.
const (
	SuspendLive   = "live.xml"
	SuspendBoot   = "boot.xml"
	SuspendSaving = "saving.json"
)

// SuspendFile is the file of kind (SuspendLive, SuspendBoot,
// SuspendSaving) kvbox keeps for the suspended box name.
func (l Layout) SuspendFile(name, kind string) string {
	return l.join("suspend", name+"."+kind)
}

// SuspendFiles matches the SuspendBoot files of every box.
func (l Layout) SuspendFiles() string { return l.join("suspend", "*."+SuspendBoot) }

// Publish is box name's publish record (ext ".json") or its port holder's
// log (".log").
func (l Layout) Publish(name, ext string) string { return l.join("publish", name+ext) }

// Serve is kvbox serve's folder: its API key, its lock, the sandboxes'
// secrets. Root's alone (serve makes it).
func (l Layout) Serve() string { return l.join("serve") }

// RegistryCache holds what push and pull keep between runs.
func (l Layout) RegistryCache() string { return l.join("registry-cache") }

// SSHKey is kvbox's SSH private key (".pub" beside it).
func (l Layout) SSHKey() string { return l.join("ssh", "id_ed25519") }

// Emulator is where kvbox keeps its QEMU wrapper.
func (l Layout) Emulator() string { return l.join("libexec", "qemu-system-x86_64") }
