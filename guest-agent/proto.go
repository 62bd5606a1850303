package agent

import (
	"encoding/json"
	"fmt"
	"time"
)

// Version is the agent's protocol and build version, reported by Ping.
const Version = "0.1.0"

// VsockPort is the vsock port the agent listens on for any CID. It is below
// 1024, so binding it takes CAP_NET_BIND_SERVICE in the guest: no guest
// user can take it while the agent restarts and have kvbox present the
// box's token to it. Agents before this one listened on 1024, where kvbox
// no longer dials: it talks to them over their serial ports.
const VsockPort = 1023

// SerialPortPrefix starts the name of every virtio-serial port the agent
// serves (org.kvbox.agent.0 ... org.kvbox.agent.3).
const SerialPortPrefix = "org.kvbox.agent."

// Capabilities says what the guest can do.
type Capabilities struct {
	Exec     bool `json:"exec"`
	TTY      bool `json:"tty"`               // /dev/ptmx works
	Identify bool `json:"identify"`          // netlink and an ethernet link are there
	Clock    bool `json:"clock"`             // may set CLOCK_REALTIME
	Entropy  bool `json:"entropy"`           // may credit entropy to the kernel RNG
	Vsock    bool `json:"vsock"`             // the agent listens on vsock
	Forward  bool `json:"forward,omitempty"` // serves "dial" (TCP streams)
}

// Info is Ping's answer.
type Info struct {
	Version      string        `json:"version"`
	Hostname     string        `json:"hostname"`
	Kernel       string        `json:"kernel"` // uname release
	Uptime       time.Duration `json:"uptime"`
	Capabilities Capabilities  `json:"capabilities"`
	// Features names the optional operations this agent knows (see
	// features.go); an agent older than the list sends none.
	Features []string `json:"features,omitempty"`
	// AfterCloneHooks is how many after-clone hooks the box has (-1: its
	// folder is unreadable); reported with FeatureHookCount.
	AfterCloneHooks int `json:"after_clone_hooks,omitempty"`
	// BootID is the guest kernel's boot_id: a clone whose agent answers
	// with another one than its snapshot's booted again after the restore.
	BootID string `json:"boot_id,omitempty"`
}

// ExecRequest describes a process to run in the guest.
type ExecRequest struct {
	Argv []string `json:"argv"`
	// Env is the whole environment ("K=V"). When empty the agent uses
	// PATH, HOME and (with TTY) TERM defaults.
	Env []string `json:"env,omitempty"`
	// Dir is the working directory; HOME or / when empty.
	Dir string `json:"dir,omitempty"`
	// TTY runs the process on a new pty in a new session; its output then
	// comes back as one stream (stdout).
	TTY  bool   `json:"tty,omitempty"`
	Rows uint16 `json:"rows,omitempty"`
	Cols uint16 `json:"cols,omitempty"`
	// EnvAdd is added to Env (or to the defaults when Env is empty), a
	// variable of the same name replaced. Needs FeatureExecUser.
	EnvAdd []string `json:"env_add,omitempty"`
	// User (a name or a numeric uid) runs the process as that user, with
	// its groups and, in the defaults, its HOME. Needs FeatureExecUser.
	User string `json:"user,omitempty"`
	// Timeout, when positive, is enforced by the host: when it passes,
	// the process group is killed and Exec returns a *TimeoutError.
	Timeout time.Duration `json:"-"`
}

// WinSize is a terminal size.
type WinSize struct {
	Rows uint16 `json:"rows"`
	Cols uint16 `json:"cols"`
}

// Identity is what a box needs to stop looking like the box it was cloned
// from. Empty fields are left alone.
type Identity struct {
	Hostname string   `json:"hostname,omitempty"`
	MAC      string   `json:"mac,omitempty"`     // 52:54:00:12:34:56
	Address  string   `json:"address,omitempty"` // CIDR: 172.30.0.5/24
	Gateway  string   `json:"gateway,omitempty"`
	DNS      []string `json:"dns,omitempty"`
	// MachineID (32 hex digits) is written to /etc/machine-id when that
	// file exists.
	MachineID string `json:"machine_id,omitempty"`
	// Hosts are extra /etc/hosts lines ("10.0.0.1 gw"), after the
	// localhost and hostname lines.
	Hosts []string `json:"hosts,omitempty"`
}

// Method names of requests; the file that serves one registers it
// (registerOp, ops.go).
const (
	methodPing       = "ping"
	methodExec       = "exec"
	methodIdentify   = "identify"
	methodSetClock   = "set-clock"
	methodAddEntropy = "add-entropy"
	methodDial       = "dial" // forward.go
)

type request struct {
	Method string          `json:"method"`
	Params json.RawMessage `json:"params,omitempty"`
}

type response struct {
	Error  string          `json:"error,omitempty"`
	Result json.RawMessage `json:"result,omitempty"`
}

// helloMsg is the guest's HELLO: the echo of the host's nonce, or, with
// Started and no nonce, the first frame of a freshly started agent on a
// port, so that a host still connected from before learns its call is lost.
type helloMsg struct {
	Nonce   []byte `json:"nonce,omitempty"`
	Version string `json:"version"`
	Started bool   `json:"started,omitempty"`
}

type exitStatus struct {
	// Code is the exit code, or 128+signal when a signal ended the process.
	Code int `json:"code"`
	// Error is set when the agent lost the process (aborted).
	Error string `json:"error,omitempty"`
}

type signalMsg struct {
	Signal int `json:"signal"`
}

type clockMsg struct {
	UnixNano int64 `json:"unix_nano"`
}

// RemoteError is an error the agent reported for a call.
type RemoteError struct {
	Method  string
	Message string
}

func (e *RemoteError) Error() string {
	return fmt.Sprintf("guest agent: %s: %s", e.Method, e.Message)
}
