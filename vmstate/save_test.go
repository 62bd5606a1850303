package vmstate

import (
	"context"
	"encoding/json"
	"errors"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	gqmp "github.com/digitalocean/go-qemu/qmp"
	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/qmp"
)

// fakeQEMU answers QMP commands as a QEMU whose migration settings are
// set (and read back), and whose migration completes at once; it records
// every command with its arguments.
type fakeQEMU struct {
	mu     sync.Mutex
	sent   []string // "execute {args}"
	caps   map[string]bool
	params map[string]any
	fail   string // a command that fails
	// migrating, when set, is the status query-migrate reports for good
	// (a copy that never ends, a cancel QEMU never finishes).
	migrating string
}

func newFakeQEMU() *fakeQEMU {
	return &fakeQEMU{
		// Not QEMU's defaults: what an operator or another tool set.
		caps:   map[string]bool{qmp.CapIgnoreShared: true, qmp.CapMappedRAM: false, qmp.CapMultifd: false, qmp.CapPauseBeforeSwitchover: false, "events": true},
		params: map[string]any{qmp.ParamMaxBandwidth: 12345, qmp.ParamDowntimeLimit: 77, qmp.ParamZeroPageDetect: "none", qmp.ParamAnnounceRounds: 5},
	}
}

func (f *fakeQEMU) Connect() error    { return nil }
func (f *fakeQEMU) Disconnect() error { return nil }
func (f *fakeQEMU) Events(context.Context) (<-chan gqmp.Event, error) {
	return nil, gqmp.ErrEventsNotSupported
}

func (f *fakeQEMU) Run(cmd []byte) ([]byte, error) {
	var req struct {
		Execute   string          `json:"execute"`
		Arguments json.RawMessage `json:"arguments"`
	}
	if err := json.Unmarshal(cmd, &req); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.sent = append(f.sent, strings.TrimSpace(req.Execute+" "+string(req.Arguments)))
	if req.Execute == f.fail {
		return []byte(`{"error": {"class": "GenericError", "desc": "it broke"}}`), nil
	}
	ret := any(map[string]any{})
	switch req.Execute {
	case "query-migrate-capabilities":
		var l []map[string]any
		for k, v := range f.caps {
			l = append(l, map[string]any{"capability": k, "state": v})
		}
		ret = l
	case "query-migrate-parameters":
		ret = f.params
	case "migrate-set-capabilities":
		var a struct{ Capabilities []capabilityArg }
		json.Unmarshal(req.Arguments, &a)
		for _, c := range a.Capabilities {
			f.caps[c.Capability] = c.State
		}
	case "migrate-set-parameters":
		var a map[string]any
		json.Unmarshal(req.Arguments, &a)
		for k, v := range a {
			f.params[k] = v
		}
	case "query-migrate":
		ret = map[string]any{"status": "completed", "downtime": 3}
		if f.migrating != "" {
			ret = map[string]any{"status": f.migrating}
		}
	}
	b, _ := json.Marshal(map[string]any{"return": ret})
	return b, nil
}

type capabilityArg struct {
	Capability string `json:"capability"`
	State      bool   `json:"state"`
}

func (f *fakeQEMU) commands(prefix string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, c := range f.sent {
		if strings.HasPrefix(c, prefix) {
			out = append(out, c)
		}
	}
	return out
}

// fakeGuest is a libvirt domain's run state as Suspend and Resume change
// it.
type fakeGuest struct {
	state          libvirt.DomainState
	resumes        int
	failResumeOnce bool
}

func (g *fakeGuest) Suspend() error { g.state = libvirt.DOMAIN_PAUSED; return nil }
func (g *fakeGuest) Resume() error {
	if g.failResumeOnce {
		g.failResumeOnce = false
		return errors.New("libvirt did not answer")
	}
	g.resumes++
	g.state = libvirt.DOMAIN_RUNNING
	return nil
}
func (g *fakeGuest) GetState() (libvirt.DomainState, int, error) { return g.state, 0, nil }

func newSave(t *testing.T, mode Mode) (*Save, *fakeQEMU, *fakeGuest) {
	f, g := newFakeQEMU(), &fakeGuest{state: libvirt.DOMAIN_RUNNING}
	return &Save{QMP: qmp.New(f), Dom: g, Box: "b", Path: filepath.Join(t.TempDir(), "state"), Mode: mode}, f, g
}

// settingsAsBefore fails unless QEMU's migration settings are again those
// newFakeQEMU started with.
func settingsAsBefore(t *testing.T, f *fakeQEMU) {
	t.Helper()
	want := newFakeQEMU()
	for k, v := range want.caps {
		if f.caps[k] != v {
			t.Errorf("capability %s is %v, was %v", k, f.caps[k], v)
		}
	}
	for k, v := range want.params {
		if got, _ := json.Marshal(f.params[k]); string(got) != mustJSON(v) {
			t.Errorf("parameter %s is %s, was %s", k, got, mustJSON(v))
		}
	}
}

func mustJSON(v any) string { b, _ := json.Marshal(v); return string(b) }

// A save that stopped the guest (a completed copy leaves it stopped) and
// failed afterwards is undone once: the guest runs again, the settings
// are those it found, not QEMU's defaults; a second Undo does nothing.
func TestSaveUndoesOnceToWhatItFound(t *testing.T) {
	ctx := context.Background()
	s, f, g := newSave(t, Mode{Paused: true})
	if _, err := s.Prepare(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Wait(ctx); err != nil {
		t.Fatal(err)
	}
	if g.state != libvirt.DOMAIN_PAUSED || f.caps[qmp.CapMappedRAM] != true {
		t.Fatalf("the save did not pause the guest (%v) or set mapped-ram (%v)", g.state, f.caps[qmp.CapMappedRAM])
	}
	if err := s.Undo(); err != nil {
		t.Fatal(err)
	}
	if g.state != libvirt.DOMAIN_RUNNING || g.resumes != 1 {
		t.Errorf("undone, the guest is %v after %d resumes", g.state, g.resumes)
	}
	settingsAsBefore(t, f)
	if n := len(f.commands("blockdev-set-active")); n != 1 {
		t.Errorf("the block nodes were activated %d times before the guest ran again, want once", n)
	}
	sent := len(f.commands(""))
	if err := s.Undo(); err != nil || len(f.commands("")) != sent || g.resumes != 1 {
		t.Errorf("a second Undo (%v) sent %d commands, resumed %d times", err, len(f.commands(""))-sent, g.resumes)
	}
}

// Recover, from the record a killed kvbox left, does what Undo does.
func TestRecoverFromTheRecord(t *testing.T) {
	ctx := context.Background()
	s, f, g := newSave(t, Mode{})
	rec, err := s.Prepare(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	g.state = libvirt.DOMAIN_PAUSED // QEMU stopped it for the switch-over
	// What a killed kvbox left on disk, read back by another.
	b, _ := json.Marshal(rec)
	var back Record
	if err := json.Unmarshal(b, &back); err != nil {
		t.Fatal(err)
	}
	if err := Recover(ctx, s.QMP, g, "b", back); err != nil {
		t.Fatal(err)
	}
	if g.state != libvirt.DOMAIN_RUNNING {
		t.Errorf("recovered, the guest is %v", g.state)
	}
	settingsAsBefore(t, f)
	// A guest that did not run before the save stays as it is.
	g.state = libvirt.DOMAIN_PAUSED
	back.Ran = false
	if err := Recover(ctx, s.QMP, g, "b", back); err != nil || g.state != libvirt.DOMAIN_PAUSED {
		t.Errorf("a guest paused before the save was run (%v, %v)", err, g.state)
	}
}

// An undo that could not run the guest again says so, and Undo answers
// the same afterwards: the caller keeps the record for Recover.
func TestUndoThatFailedSaysSo(t *testing.T) {
	ctx := context.Background()
	s, _, g := newSave(t, Mode{Paused: true})
	s.Prepare(ctx)
	s.Start(ctx)
	g.failResumeOnce = true
	err := s.Undo()
	if err == nil || s.Undo() == nil {
		t.Fatalf("Undo = %v, then %v: want the failure both times", err, s.Undo())
	}
}

// Start and Wait that fail have undone the save.
func TestFailedStartUndoesItself(t *testing.T) {
	ctx := context.Background()
	s, f, g := newSave(t, Mode{Paused: true})
	s.Prepare(ctx)
	f.fail = "migrate"
	if err := s.Start(ctx); err == nil {
		t.Fatal("Start did not fail")
	}
	if g.state != libvirt.DOMAIN_RUNNING {
		t.Errorf("after a failed Start the guest is %v", g.state)
	}
	settingsAsBefore(t, f)
}

// A save that activated the disks itself (a snapshot's block job) runs
// the guest with no second activation.
func TestContinueAfterActivateDisks(t *testing.T) {
	ctx := context.Background()
	s, f, g := newSave(t, Mode{})
	s.Prepare(ctx)
	s.Start(ctx)
	g.state = libvirt.DOMAIN_PAUSED
	if err := s.ActivateDisks(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Continue(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(f.commands("blockdev-set-active")); n != 1 || g.state != libvirt.DOMAIN_RUNNING {
		t.Errorf("%d activations, guest %v", n, g.state)
	}
	// Undone after it ran on, the guest is not resumed again.
	if err := s.Undo(); err != nil || g.resumes != 1 {
		t.Errorf("Undo = %v after %d resumes", err, g.resumes)
	}
	if !slices.Contains(f.commands("migrate-set-parameters"), "migrate-set-parameters "+mustJSON(map[string]any{qmp.ParamDowntimeLimit: 77, qmp.ParamMaxBandwidth: 12345, qmp.ParamZeroPageDetect: "none"})) {
		t.Errorf("the parameters were not set back: %q", f.commands("migrate-set-parameters"))
	}
}

// An undo whose cancel QEMU never finishes ends at the save's UndoLimit
// with an error, instead of holding its kvbox (and the box's lock) for
// good; the guest is run again all the same.
func TestSaveUndoIsBounded(t *testing.T) {
	ctx := context.Background()
	s, f, g := newSave(t, Mode{Paused: true})
	s.UndoLimit = 300 * time.Millisecond
	if _, err := s.Prepare(ctx); err != nil {
		t.Fatal(err)
	}
	if err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	f.migrating = "cancelling"
	f.mu.Unlock()
	done := make(chan error, 1)
	go func() { done <- s.Undo() }()
	select {
	case err := <-done:
		if err == nil {
			t.Error("an undo that could not set the settings back (a copy still cancelling) says nothing")
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Undo of a save whose copy never stops cancelling did not return")
	}
	if g.state != libvirt.DOMAIN_RUNNING {
		t.Errorf("the guest is %v after the undo", g.state)
	}
}
