package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"
)

// Migration capabilities and parameters kvbox changes (qapi/migration.json).
const (
	CapIgnoreShared = "x-ignore-shared"
	CapMappedRAM    = "mapped-ram"
	CapMultifd      = "multifd"

	ParamAnnounceInitial = "announce-initial"
	ParamAnnounceMax     = "announce-max"
	ParamAnnounceRounds  = "announce-rounds"
	ParamAnnounceStep    = "announce-step"
	ParamMultifdChannels = "multifd-channels"
	ParamMaxBandwidth    = "max-bandwidth"
	ParamDowntimeLimit   = "downtime-limit"
	ParamZeroPageDetect  = "zero-page-detection"
)

type capabilityState struct {
	Capability string `json:"capability"`
	State      bool   `json:"state"`
}

// MigrateSetCapabilities sets the given migration capabilities; the others
// keep their value. QEMU refuses while a migration runs.
func (c *Client) MigrateSetCapabilities(ctx context.Context, caps map[string]bool) error {
	list := make([]capabilityState, 0, len(caps))
	for _, name := range sortedKeys(caps) {
		list = append(list, capabilityState{name, caps[name]})
	}
	return c.Execute(ctx, "migrate-set-capabilities", map[string]any{"capabilities": list}, nil)
}

// QueryMigrateCapabilities returns every migration capability QEMU knows
// with its current state.
func (c *Client) QueryMigrateCapabilities(ctx context.Context) (map[string]bool, error) {
	var list []capabilityState
	if err := c.Execute(ctx, "query-migrate-capabilities", nil, &list); err != nil {
		return nil, err
	}
	caps := make(map[string]bool, len(list))
	for _, cs := range list {
		caps[cs.Capability] = cs.State
	}
	return caps, nil
}

// MigrateSetParameters sets migration parameters; QEMU takes them as one flat
// object ({"announce-rounds": 0, ...}).
func (c *Client) MigrateSetParameters(ctx context.Context, params map[string]any) error {
	return c.Execute(ctx, "migrate-set-parameters", params, nil)
}

// QueryMigrateParameters returns the current migration parameters. Numbers
// are json.Number so they can be set back without loss.
func (c *Client) QueryMigrateParameters(ctx context.Context) (map[string]any, error) {
	params := map[string]any{}
	if err := c.Execute(ctx, "query-migrate-parameters", nil, &params); err != nil {
		return nil, err
	}
	return params, nil
}

// ApplyMigrationSettings records the current value of every capability and
// parameter named in caps and params, sets the new values, and returns a
// restore func that sets each recorded value back. Callers must run restore
// after the snapshot or clone step: a capability such as x-ignore-shared left
// on makes a later `virsh save` write an image without RAM that `virsh
// restore` cannot load (docs/design.md#traps-found).
//
// A parameter QEMU does not report cannot be put back, so it is refused before
// anything changes. If setting the new values fails, what was already changed
// is restored before returning the error.
func (c *Client) ApplyMigrationSettings(ctx context.Context, caps map[string]bool, params map[string]any) (restore func(context.Context) error, err error) {
	oldCaps := map[string]bool{}
	oldParams := map[string]any{}
	if len(caps) > 0 {
		cur, err := c.QueryMigrateCapabilities(ctx)
		if err != nil {
			return nil, err
		}
		for name := range caps {
			v, ok := cur[name]
			if !ok {
				return nil, fmt.Errorf("qmp: migration capability %q is unknown to this QEMU", name)
			}
			oldCaps[name] = v
		}
	}
	if len(params) > 0 {
		cur, err := c.QueryMigrateParameters(ctx)
		if err != nil {
			return nil, err
		}
		for name := range params {
			v, ok := cur[name]
			if !ok {
				return nil, fmt.Errorf("qmp: migration parameter %q is not reported by query-migrate-parameters, it could not be restored", name)
			}
			oldParams[name] = v
		}
	}

	capsSet, paramsSet := false, false
	restore = func(ctx context.Context) error {
		var errs []error
		if paramsSet && len(oldParams) > 0 {
			if err := c.MigrateSetParameters(ctx, oldParams); err != nil {
				errs = append(errs, fmt.Errorf("restore migration parameters: %w", err))
			}
		}
		if capsSet && len(oldCaps) > 0 {
			if err := c.MigrateSetCapabilities(ctx, oldCaps); err != nil {
				errs = append(errs, fmt.Errorf("restore migration capabilities: %w", err))
			}
		}
		return errors.Join(errs...)
	}

	if len(caps) > 0 {
		capsSet = true
		if err := c.MigrateSetCapabilities(ctx, caps); err != nil {
			capsSet = false
			return nil, err
		}
	}
	if len(params) > 0 {
		paramsSet = true
		if err := c.MigrateSetParameters(ctx, params); err != nil {
			paramsSet = false
			return nil, errors.Join(err, restore(ctx))
		}
	}
	return restore, nil
}

// Migrate starts an outgoing migration to uri (kvbox uses "file:PATH").
// It returns once the migration started; see WaitMigration.
func (c *Client) Migrate(ctx context.Context, uri string) error {
	return c.Execute(ctx, "migrate", map[string]any{"uri": uri}, nil)
}

// MigrateIncoming starts loading state into a QEMU started with
// `-incoming defer`.
func (c *Client) MigrateIncoming(ctx context.Context, uri string) error {
	return c.Execute(ctx, "migrate-incoming", map[string]any{"uri": uri}, nil)
}

// MigrateCancel cancels the running outgoing migration.
func (c *Client) MigrateCancel(ctx context.Context) error {
	return c.Execute(ctx, "migrate_cancel", nil, nil)
}

// Migration states from qapi/migration.json MigrationStatus.
const (
	MigrationNone      = "none"
	MigrationSetup     = "setup"
	MigrationActive    = "active"
	MigrationCompleted = "completed"
	MigrationFailed    = "failed"
	MigrationCancelled = "cancelled"
)

// MigrateStatus is the part of query-migrate kvbox reads. Status is empty
// when QEMU has seen no migration yet (it then omits the field).
type MigrateStatus struct {
	Status    string       `json:"status"`
	ErrorDesc string       `json:"error-desc,omitempty"`
	TotalTime *json.Number `json:"total-time,omitempty"` // ms
	Downtime  *json.Number `json:"downtime,omitempty"`   // ms
	RAM       *MigrateRAM  `json:"ram,omitempty"`
}

// MigrateRAM holds the RAM counters of query-migrate.
type MigrateRAM struct {
	Transferred    json.Number `json:"transferred"`
	Remaining      json.Number `json:"remaining"`
	Total          json.Number `json:"total"`
	Duplicate      json.Number `json:"duplicate"`
	Normal         json.Number `json:"normal"`
	DirtySyncCount json.Number `json:"dirty-sync-count"`
}

// QueryMigrate returns the state of the current or last migration, outgoing
// or incoming.
func (c *Client) QueryMigrate(ctx context.Context) (MigrateStatus, error) {
	var s MigrateStatus
	err := c.Execute(ctx, "query-migrate", nil, &s)
	return s, err
}

// ErrMigrationFailed is wrapped by WaitMigration's error when QEMU reports
// the migration failed or cancelled.
var ErrMigrationFailed = errors.New("migration failed")

// WaitMigration polls query-migrate every poll until the migration is
// completed. A failed or cancelled migration returns an error wrapping
// ErrMigrationFailed with QEMU's error-desc. ctx bounds the whole wait.
func (c *Client) WaitMigration(ctx context.Context, poll time.Duration) error {
	if poll <= 0 {
		poll = 10 * time.Millisecond
	}
	last := ""
	for {
		s, err := c.QueryMigrate(ctx)
		if err != nil {
			if ctx.Err() != nil && last != "" {
				return fmt.Errorf("qmp: waiting for migration (last status %q): %w", last, err)
			}
			return err
		}
		last = s.Status
		switch s.Status {
		case MigrationCompleted:
			return nil
		case MigrationFailed, MigrationCancelled:
			desc := s.ErrorDesc
			if desc == "" {
				desc = "QEMU gave no error-desc"
			}
			return fmt.Errorf("qmp: migration %s: %s: %w", s.Status, desc, ErrMigrationFailed)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("qmp: waiting for migration (last status %q): %w", s.Status, ctx.Err())
		case <-time.After(poll):
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// CapPauseBeforeSwitchover makes a migration wait in pre-switchover for
// migrate-continue; kvbox keeps it off.
const CapPauseBeforeSwitchover = "pause-before-switchover"

// MigrationRunning reports whether status is one of a migration still in
// progress (it has to be cancelled before capabilities change again).
func MigrationRunning(status string) bool {
	switch status {
	case MigrationSetup, MigrationActive, "pre-switchover", "device", "wait-unplug", "cancelling":
		return true
	}
	return false
}

// CancelRunningMigration cancels a migration still in progress, if any,
// and waits for it to end; best effort, for undo and recovery.
func (c *Client) CancelRunningMigration(ctx context.Context) {
	if s, err := c.QueryMigrate(ctx); err == nil && MigrationRunning(s.Status) {
		c.MigrateCancel(ctx)
		c.WaitMigration(ctx, 5*time.Millisecond)
	}
}

// WaitMigrationStop polls query-migrate until the migration completed and
// returns when the guest was stopped for the switch-over: the earlier of the
// first poll that saw it past precopy ("device") and the completion time
// less QEMU's reported downtime. next gets every status seen while the copy
// runs and says how long to wait before the next poll.
func (c *Client) WaitMigrationStop(ctx context.Context, next func(MigrateStatus) time.Duration) (time.Time, error) {
	var stopped time.Time
	for {
		s, err := c.QueryMigrate(ctx)
		if err != nil {
			return time.Time{}, err
		}
		now := time.Now()
		switch s.Status {
		case MigrationCompleted:
			if s.Downtime != nil {
				if ms, err := s.Downtime.Int64(); err == nil {
					if t := now.Add(-time.Duration(ms) * time.Millisecond); stopped.IsZero() || t.Before(stopped) {
						stopped = t
					}
				}
			}
			if stopped.IsZero() {
				stopped = now
			}
			return stopped, nil
		case MigrationFailed, MigrationCancelled:
			desc := s.ErrorDesc
			if desc == "" {
				desc = "QEMU gave no error-desc"
			}
			return time.Time{}, fmt.Errorf("qmp: migration %s: %s: %w", s.Status, desc, ErrMigrationFailed)
		case "device", "pre-switchover":
			if stopped.IsZero() {
				stopped = now
			}
		}
		select {
		case <-ctx.Done():
			return time.Time{}, fmt.Errorf("qmp: waiting for migration (last status %q): %w", s.Status, ctx.Err())
		case <-time.After(next(s)):
		}
	}
}

// HintState is what a box's virtio-balloon device and its guest's driver
// agreed on about free page hinting (VIRTIO_BALLOON_F_FREE_PAGE_HINT).
type HintState struct {
	Offered bool // the device offers it (QEMU's free-page-hint property)
	Taken   bool // the guest's driver accepted it: while a migration runs, it names the pages it has free and QEMU skips them
}

// FreePageHints reads the HintState of the box's balloon with
// x-query-virtio-status, an unstable command (QEMU 7.2 and later): the
// zero HintState, with no error, where QEMU lacks it or the box has no
// balloon.
func (c *Client) FreePageHints(ctx context.Context) (HintState, error) {
	var devs []struct{ Name, Path string }
	if err := c.Execute(ctx, "x-query-virtio", nil, &devs); err != nil {
		if errors.Is(err, ErrCommandNotFound) {
			return HintState{}, nil
		}
		return HintState{}, err
	}
	has := func(fs []string) bool {
		return slices.ContainsFunc(fs, func(f string) bool { return strings.HasPrefix(f, "VIRTIO_BALLOON_F_FREE_PAGE_HINT:") })
	}
	for _, d := range devs {
		if d.Name != "virtio-balloon" {
			continue
		}
		var st struct {
			HostFeatures struct {
				DevFeatures []string `json:"dev-features"`
			} `json:"host-features"`
			GuestFeatures struct {
				DevFeatures []string `json:"dev-features"`
			} `json:"guest-features"`
		}
		if err := c.Execute(ctx, "x-query-virtio-status", map[string]any{"path": d.Path}, &st); err != nil {
			return HintState{}, err
		}
		return HintState{Offered: has(st.HostFeatures.DevFeatures), Taken: has(st.GuestFeatures.DevFeatures)}, nil
	}
	return HintState{}, nil
}
