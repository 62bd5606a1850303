package kvboxnode

import (
	"context"
	"errors"
	"io"
	"net"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"

	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/snapshot"
)

// Library is what kvbox-node asks of kvbox on this host: the calls of the
// kvbox library (package kvbox; libadapter wires it) the provider uses,
// and nothing of the CLI. Run opens one once the node's subnet is known; the unit tests
// drive the provider with a fake. Every method is safe for concurrent use.
type Library interface {
	// Facts is what the node says about the host: its restore class,
	// CPUs and memory.
	Facts(ctx context.Context) (HostFacts, error)
	// Healthy says why the host cannot run boxes now (libvirt does not
	// answer), or nil.
	Healthy(ctx context.Context) error

	// Clone starts a warm clone of a snapshot on this host: identified
	// (hostname, MAC, address), its agent up, its port open. A failed
	// clone leaves nothing behind.
	Clone(ctx context.Context, r CloneRequest) (Box, error)
	// Remove does everything `kvbox rm --force` does; a box that does not
	// exist is ErrNotFound.
	Remove(ctx context.Context, name string) error
	// Boxes lists this host's boxes (its state dir's), with their labels.
	Boxes(ctx context.Context) ([]Box, error)
	// Start boots a stopped box again (its disk as it was), waiting for
	// its agent.
	Start(ctx context.Context, name string) (Box, error)

	// Ping reaches a box's agent.
	Ping(ctx context.Context, name string) error
	// Exec runs a process in a box through its agent and returns its exit
	// code; resize carries a terminal's new sizes (TTY).
	Exec(ctx context.Context, name string, r agent.ExecRequest, stdin io.Reader, stdout, stderr io.Writer, resize <-chan agent.WinSize) (int, error)
	// Dial opens a stream to target ("127.0.0.1:PORT") inside a box,
	// through its agent (no route to the box needed).
	Dial(ctx context.Context, name, target string) (net.Conn, error)
	// ConsoleLog is what the box's serial console printed.
	ConsoleLog(name string) (io.ReadCloser, error)
	// Stats is a box's CPU time and memory now.
	Stats(ctx context.Context, name string) (BoxStats, error)

	// Snapshots lists this host's snapshots.
	Snapshots(ctx context.Context) ([]Snapshot, error)
	// Snapshot is one snapshot of this host; one that does not exist is
	// ErrNotFound.
	Snapshot(ctx context.Context, name string) (Snapshot, error)
	// RemoveSnapshot deletes a snapshot; one a box is cloned from is
	// ErrBusy and stays.
	RemoveSnapshot(ctx context.Context, name string) error
	// Resolve is the digest of the snapshot artifact a reference names
	// now (one registry round trip).
	Resolve(ctx context.Context, ref string, o PullOptions) (digest string, err error)
	// Pull fetches the snapshot artifact at ref (a REPO@DIGEST reference
	// from Resolve) as snapshot name, after checking this host can
	// restore it: a snapshot it cannot is ErrIncompatible, in one line.
	// The snapshot is kvbox-node's, marked with its digest (Snapshot.Owner
	// and OwnerDigest); a name a snapshot has already is ErrExists.
	Pull(ctx context.Context, ref, name string, o PullOptions) (Snapshot, error)

	Close() error
}

// Errors a Library's methods wrap, for the provider to tell what to do.
var (
	ErrNotFound = errors.New("not found")
	ErrExists   = errors.New("already exists")
	ErrBusy     = errors.New("busy")
	// ErrIncompatible: this host cannot restore the snapshot (domain type,
	// machine type, QEMU, CPU, agent protocol). Waiting does not help.
	ErrIncompatible = errors.New("incompatible host")
)

// OpenFunc opens the library for this host's state dir with the network
// its boxes go on.
type OpenFunc func(ctx context.Context, n network.Config) (Library, error)

// HostFacts is what the library knows about the host.
type HostFacts struct {
	Compat snapshot.HostCompat
	CPUs   int
	Memory int64 // bytes
}

// CloneRequest is one warm clone.
type CloneRequest struct {
	Snapshot string
	Name     string
	// Hostname is the guest's hostname ("" for Name).
	Hostname string
	// Labels go in the box's metadata, listed with it (Box.Labels).
	Labels map[string]string
}

// Box is one box of this host.
type Box struct {
	Name     string
	State    string // running, paused, stopped, crashed, suspended, ...
	IP       string
	Snapshot string // the snapshot it was cloned from
	Labels   map[string]string
	Created  time.Time
	CPUs     int
	Memory   int64 // bytes
	Disk     int64 // bytes
}

// Running says the box's machine runs (or is paused by libvirt).
func (b Box) Running() bool {
	return b.State == "running" || b.State == "paused" || b.State == "blocked"
}

// Snapshot is one snapshot of this host.
type Snapshot struct {
	Name      string
	SizeBytes int64 // on disk
	CPUs      int
	Memory    int64 // bytes of guest RAM
	Disk      int64 // bytes of disk
	// Owner and OwnerDigest are the snapshot's owner mark
	// (snapshot.OwnerOf): "kvbox-node" and the artifact's digest for one
	// kvbox-node pulled, "" for any other.
	Owner, OwnerDigest string
}

// PullOptions say how to reach a registry and what a pull may bring.
type PullOptions struct {
	Insecure bool // plain HTTP: the registry is one the operator named insecure
	// Keychain is the credentials for the image's repository: the pod's
	// imagePullSecrets', else the node's for the registries named for
	// them (PullKeychain); nil sends none.
	Keychain authn.Keychain
	// MaxCPUs, MaxMemory and MaxDisk cap a pulled snapshot's vCPUs, RAM
	// and disk (bytes); 0 is kvbox's own limit.
	MaxCPUs            int
	MaxMemory, MaxDisk int64
}

// BoxStats is one reading of a box's use.
type BoxStats struct {
	At      time.Time
	CPUTime time.Duration // cumulative, all vCPUs and QEMU's own threads
	// Private is memory only this box holds (what it costs the host);
	// Shared is the snapshot's pages it maps, which its siblings share.
	Private, Shared int64
}
