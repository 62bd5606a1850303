// Package qmp owns kvbox's conversation with a running QEMU through the QEMU
// Machine Protocol: one Client with a timeout per command, QMP errors kept as
// typed values, and typed wrappers for exactly the commands the snapshot and
// clone code use. Commands reach QEMU through libvirt
// (virDomainQemuMonitorCommand, see NewDomainMonitor), never a second monitor
// socket; any go-qemu qmp.Monitor works, which is what the tests use.
package qmp

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	gqmp "github.com/digitalocean/go-qemu/qmp"
)

// DefaultTimeout bounds a single command when the Client has no Timeout set.
const DefaultTimeout = 30 * time.Second

// QMP error classes as QEMU reports them in {"error": {"class": ...}}.
const (
	ClassGenericError    = "GenericError"
	ClassCommandNotFound = "CommandNotFound"
	ClassDeviceNotActive = "DeviceNotActive"
	ClassDeviceNotFound  = "DeviceNotFound"
	ClassKVMMissingCap   = "KVMMissingCap"
)

// Sentinels matched by errors.Is against an *Error of the same class.
var (
	ErrCommandNotFound = errors.New("qmp: command not found")
	ErrDeviceNotFound  = errors.New("qmp: device not found")
	ErrDeviceNotActive = errors.New("qmp: device not active")
	ErrGeneric         = errors.New("qmp: generic error")
)

// Error is a QMP error reply. Class and Desc are QEMU's, unchanged.
type Error struct {
	Command string
	Class   string
	Desc    string
}

func (e *Error) Error() string {
	return fmt.Sprintf("qmp %s: %s (%s)", e.Command, e.Desc, e.Class)
}

// Is lets errors.Is(err, ErrDeviceNotFound) and friends test the class.
func (e *Error) Is(target error) bool {
	switch target {
	case ErrCommandNotFound:
		return e.Class == ClassCommandNotFound
	case ErrDeviceNotFound:
		return e.Class == ClassDeviceNotFound
	case ErrDeviceNotActive:
		return e.Class == ClassDeviceNotActive
	case ErrGeneric:
		return e.Class == ClassGenericError
	}
	return false
}

// Client sends QMP commands over a go-qemu Monitor. It is safe for concurrent
// use as far as the Monitor is (libvirt serialises monitor commands itself).
type Client struct {
	mon gqmp.Monitor
	// Timeout bounds each command; the context's own deadline still applies
	// when it is earlier. Zero means DefaultTimeout.
	Timeout time.Duration
	// Transcript, if set, records every command and its reply.
	Transcript *Transcript
}

// New wraps a connected Monitor.
func New(mon gqmp.Monitor) *Client {
	return &Client{mon: mon}
}

// Monitor returns the Monitor the Client talks through.
func (c *Client) Monitor() gqmp.Monitor { return c.mon }

type request struct {
	Execute   string `json:"execute"`
	Arguments any    `json:"arguments,omitempty"`
}

type reply struct {
	Return json.RawMessage `json:"return"`
	Error  *struct {
		Class string `json:"class"`
		Desc  string `json:"desc"`
	} `json:"error"`
}

// Execute runs one QMP command with args (nil for none, else anything that
// marshals to a JSON object) and decodes the "return" value into out when out
// is non-nil. A QMP error reply comes back as *Error; a command that outlives
// its timeout returns an error wrapping context.DeadlineExceeded (the
// underlying call cannot be interrupted and finishes in the background).
func (c *Client) Execute(ctx context.Context, command string, args, out any) error {
	raw, err := json.Marshal(request{Execute: command, Arguments: args})
	if err != nil {
		return fmt.Errorf("qmp %s: encode arguments: %w", command, err)
	}
	timeout := c.Timeout
	if timeout <= 0 {
		timeout = DefaultTimeout
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()

	type result struct {
		out []byte
		err error
	}
	done := make(chan result, 1)
	start := time.Now()
	go func() {
		out, err := c.mon.Run(raw)
		done <- result{out, err}
	}()
	var res result
	select {
	case res = <-done:
	case <-ctx.Done():
		if c.Transcript != nil {
			c.Transcript.record(command, raw, nil, ctx.Err(), time.Since(start))
		}
		return fmt.Errorf("qmp %s: %w", command, ctx.Err())
	}
	if c.Transcript != nil {
		c.Transcript.record(command, raw, res.out, res.err, time.Since(start))
	}
	if res.err != nil {
		return fmt.Errorf("qmp %s: %w", command, res.err)
	}
	var rep reply
	if err := json.Unmarshal(res.out, &rep); err != nil {
		return fmt.Errorf("qmp %s: decode reply %q: %w", command, truncate(res.out), err)
	}
	if rep.Error != nil {
		return &Error{Command: command, Class: rep.Error.Class, Desc: rep.Error.Desc}
	}
	if out == nil {
		return nil
	}
	if len(rep.Return) == 0 {
		return fmt.Errorf("qmp %s: reply has no return value: %q", command, truncate(res.out))
	}
	dec := json.NewDecoder(bytes.NewReader(rep.Return))
	// Numbers stay json.Number so that values read back (migration
	// parameters, byte counts) are written back exactly.
	dec.UseNumber()
	if err := dec.Decode(out); err != nil {
		return fmt.Errorf("qmp %s: decode return value: %w", command, err)
	}
	return nil
}

func truncate(b []byte) string {
	const max = 200
	if len(b) > max {
		return string(b[:max]) + "..."
	}
	return string(b)
}

// Stop pauses the guest's vCPUs.
func (c *Client) Stop(ctx context.Context) error { return c.Execute(ctx, "stop", nil, nil) }

// Cont resumes the guest's vCPUs.
func (c *Client) Cont(ctx context.Context) error { return c.Execute(ctx, "cont", nil, nil) }

// Status is the answer of query-status. Status is QEMU's RunState
// ("running", "paused", "postmigrate", "inmigrate", "finish-migrate", ...).
type Status struct {
	Running bool   `json:"running"`
	Status  string `json:"status"`
}

// QueryStatus reports whether the guest runs and QEMU's run state.
func (c *Client) QueryStatus(ctx context.Context) (Status, error) {
	var s Status
	err := c.Execute(ctx, "query-status", nil, &s)
	return s, err
}

// SetLink sets a NIC's link state; name is the netdev or device id
// (libvirt names them "net0"/"hostnet0").
func (c *Client) SetLink(ctx context.Context, name string, up bool) error {
	return c.Execute(ctx, "set_link", map[string]any{"name": name, "up": up}, nil)
}

// AnnounceArgs are the arguments of announce-self (milliseconds for the
// delays). A clone uses it to re-announce its new MAC once its link is open.
type AnnounceArgs struct {
	Initial    int      `json:"initial"`
	Max        int      `json:"max"`
	Rounds     int      `json:"rounds"`
	Step       int      `json:"step"`
	Interfaces []string `json:"interfaces,omitempty"`
	ID         string   `json:"id,omitempty"`
}

// AnnounceSelf makes QEMU send RARP announces for the guest's NICs.
func (c *Client) AnnounceSelf(ctx context.Context, a AnnounceArgs) error {
	return c.Execute(ctx, "announce-self", a, nil)
}
