package serve

import (
	"context"
	"errors"
	"net"
	"time"

	"kvbox.dev/kvbox/egress"
	"kvbox.dev/kvbox/guest-agent/envd"
)

// Host is what serve needs of kvbox: the calls of the kvbox library
// (package kvbox) it uses, and nothing of how they are done. The command
// wires it to the library's Host (kvbox/e2b/host.go); the tests to a
// fake.
//
// Its errors wrap ErrNotFound, ErrExists, ErrBusy or ErrInvalid where the
// caller can tell the client what to do; anything else is the host's fault.
type Host interface {
	// Clone starts a warm clone of a snapshot under the request's name,
	// its envd configured in the same round trip that gives it its
	// identity. It returns once the clone runs and its envd serves.
	Clone(ctx context.Context, req CloneRequest) (Box, error)
	// Remove removes a box whatever its state (kvbox rm --force).
	Remove(ctx context.Context, name string) error
	// Suspend saves a running box's memory and stops its QEMU; Resume
	// wakes it warm, every process running on.
	Suspend(ctx context.Context, name string) error
	Resume(ctx context.Context, name string) error
	// Stop shuts a running box down (its guest first, its QEMU ended
	// after a bound): its disk is kept, nothing of its memory. Boot
	// cold-boots a stopped box from its disk and returns once its agent
	// (and so its envd) answers.
	Stop(ctx context.Context, name string) error
	Boot(ctx context.Context, name string) error
	// SetLabels replaces a box's labels.
	SetLabels(ctx context.Context, name string, labels map[string]string) (Box, error)
	// SetExpires sets the box's deadline (nil: none); a reaper removes
	// the box then, whether or not serve runs.
	SetExpires(ctx context.Context, name string, at *time.Time) (Box, error)
	// Boxes lists the boxes of this host's state dir; Box reads one.
	Boxes(ctx context.Context) ([]Box, error)
	Box(ctx context.Context, name string) (Box, error)
	// Snapshot freezes a running box into a snapshot; the box runs on.
	Snapshot(ctx context.Context, box, name string, expires *time.Time) (Snapshot, error)
	Snapshots(ctx context.Context) ([]Snapshot, error)
	RemoveSnapshot(ctx context.Context, name string) error
	// SetSnapshotExpires sets a snapshot's deadline: it is removed then,
	// or, while boxes are cloned from it, with the last of them.
	SetSnapshotExpires(ctx context.Context, name string, at *time.Time) error
	// SetEgress replaces a box's egress policy while it runs (a zero one:
	// none), for its new connections.
	SetEgress(ctx context.Context, name string, p egress.Policy) error
	// SetSecret keeps value as secret name in the host's egress secret
	// store (a policy's header names it, ${secret:NAME}; only the proxy
	// reads it); RemoveSecret removes it (ErrNotFound: none).
	SetSecret(name string, value []byte) error
	RemoveSecret(name string) error
	// Dial opens a stream to target in the box, through its agent:
	// "envd" (agent.EnvdDialAddress) or "127.0.0.1:PORT". Streams of a
	// box share one agent connection.
	Dial(ctx context.Context, name, target string) (net.Conn, error)
}

// CloneRequest is one clone to start.
type CloneRequest struct {
	Snapshot, Name string
	Expires        *time.Time
	Labels         map[string]string
	Envd           *envd.Config
	NoInternet     bool
	// SuspendAtExpiry: the deadline suspends the box (and takes itself
	// away) instead of removing it.
	SuspendAtExpiry bool
	// Egress is the clone's egress policy (nil: its snapshot's).
	Egress *egress.Policy
}

// State is a box's state as serve tells them apart.
type State string

const (
	Running   State = "running"
	Suspended State = "suspended" // kvbox suspend: memory on disk, no QEMU
	// Stopped is every other state: shut off, crashed, an operator's
	// pause. A sandbox's box in it is dead to the SDK.
	Stopped State = "stopped"
)

// Box is a box as serve sees it.
type Box struct {
	Name, UUID string
	State      State
	// Snapshot is the snapshot the box was cloned from ("": booted from an
	// image).
	Snapshot    string
	Created     time.Time
	Expires     *time.Time
	CPUs        int
	MemoryBytes int64
	DiskBytes   int64
	Labels      map[string]string
	NoInternet  bool
	// SuspendAtExpiry: CloneRequest's.
	SuspendAtExpiry bool
}

// Snapshot is a kvbox snapshot: an E2B template.
type Snapshot struct {
	Name string
	// Box is the box it was taken from.
	Box     string
	Created time.Time
	Expires *time.Time
}

// Error kinds a Host's errors wrap.
var (
	ErrNotFound = errors.New("not found")
	ErrExists   = errors.New("already exists")
	ErrBusy     = errors.New("busy")
	ErrInvalid  = errors.New("invalid")
)
