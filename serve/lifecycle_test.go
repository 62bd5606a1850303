package serve

import (
	"context"
	"encoding/json"
	"errors"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// A pause with memory false shuts the sandbox's box down with its disk
// kept: it is paused (listed so, 409 on its data plane, its health a 502,
// never resumed by traffic), and connect boots it from its disk with the
// same id, its deadline then; a boot or a shutdown that fails leaves it
// as it was.
func TestPauseWithoutMemory(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm","timeout":600}`)
	envs := func() (int, string) {
		s, b, _ := call(t, ts, "GET", "/envs", "", "E2b-Sandbox-Id: "+a.ID, "X-Access-Token: "+a.Token)
		return s, b
	}
	if s, b, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{"memory":false}`); s != 204 {
		t.Fatalf("pause without memory: %d %s", s, b)
	}
	b, _ := h.Box(context.Background(), a.ID)
	if b.State != Stopped || b.Labels[labelPaused] != pausedFilesystem || b.Expires != nil {
		t.Fatalf("the box after the pause: %+v", b)
	}
	for _, c := range h.calls {
		if strings.HasPrefix(c, "suspend ") {
			t.Errorf("a pause without memory saved the memory: %v", h.calls)
		}
	}
	if s, body, _ := call(t, ts, "GET", "/sandboxes/"+a.ID, ""); s != 200 || !strings.Contains(body, `"state":"paused"`) {
		t.Errorf("detail: %d %s", s, body)
	}
	if s, body, _ := call(t, ts, "GET", "/v2/sandboxes?state=paused", ""); s != 200 || !strings.Contains(body, a.ID) {
		t.Errorf("list of the paused: %d %s", s, body)
	}
	s, body := envs()
	errorShape(t, "envd of a sandbox paused without memory", s, body, 409)
	if s, _, _ := call(t, ts, "GET", "/health", "", "E2b-Sandbox-Id: "+a.ID); s != 502 {
		t.Errorf("its health: %d, want 502 (isRunning false)", s)
	}
	if s, _, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{"memory":false}`); s != 409 {
		t.Errorf("pausing it again: %d, want 409", s)
	}
	if s, _, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/timeout", `{"timeout":30}`); s != 409 {
		t.Errorf("a timeout while paused: %d, want 409", s)
	}
	// A boot that fails leaves it paused; the next connect boots it.
	h.mu.Lock()
	h.failBoot = errors.New("the agent did not answer")
	h.mu.Unlock()
	if s, body, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/connect", `{"timeout":30}`); s != 500 || !strings.Contains(body, "stays paused") {
		t.Errorf("a connect whose boot fails: %d %s", s, body)
	}
	if b, _ := h.Box(context.Background(), a.ID); b.State != Stopped || b.Labels[labelPaused] != pausedFilesystem {
		t.Errorf("after a failed boot: %+v, want stopped and paused again", b)
	}
	s, body, _ = call(t, ts, "POST", "/sandboxes/"+a.ID+"/connect", `{"timeout":1800}`)
	if s != 201 || !strings.Contains(body, `"sandboxID":"`+a.ID+`"`) {
		t.Fatalf("connect: %d %s, want 201 with the same id", s, body)
	}
	b, _ = h.Box(context.Background(), a.ID)
	if b.State != Running || b.Labels[labelPaused] != "" || b.Labels[labelTemplate] != "warm" {
		t.Errorf("after connect: %+v", b)
	}
	if d := deadline(t, h, a.ID); d != 30*time.Minute {
		t.Errorf("deadline after connect: %s, want 30m", d)
	}
	h.mu.Lock()
	boots := h.boxes[a.ID].boots
	h.mu.Unlock()
	if boots != 2 {
		t.Errorf("%d boots, want 2 (one failed)", boots)
	}
	if s, body := envs(); s != 200 {
		t.Errorf("envd after the boot: %d %s", s, body)
	}

	// A shutdown that fails puts the deadline and the labels back.
	before, _ := h.Box(context.Background(), a.ID)
	h.mu.Lock()
	h.failStop = errors.New("libvirt said no")
	h.mu.Unlock()
	if s, body, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{"memory":false}`); s != 500 {
		t.Errorf("a pause whose shutdown fails: %d %s", s, body)
	}
	b, _ = h.Box(context.Background(), a.ID)
	if b.State != Running || b.Labels[labelPaused] != "" || b.Expires == nil || !b.Expires.Equal(*before.Expires) {
		t.Errorf("after a failed pause: %+v, want it running as before (deadline %v)", b, before.Expires)
	}

	// Traffic never boots one, even made with autoResume.
	ar := create(t, ts, `{"templateID":"warm","autoPause":true,"autoResume":{"enabled":true}}`)
	if s, body, _ := call(t, ts, "POST", "/sandboxes/"+ar.ID+"/pause", `{"memory":false}`); s != 204 {
		t.Fatalf("pause: %d %s", s, body)
	}
	s, body, _ = call(t, ts, "GET", "/envs", "", "E2b-Sandbox-Id: "+ar.ID, "X-Access-Token: "+ar.Token)
	errorShape(t, "traffic to an auto-resume sandbox paused without memory", s, body, 409)
	if b, _ := h.Box(context.Background(), ar.ID); b.State != Stopped {
		t.Errorf("traffic booted it: %+v", b)
	}
	// The deprecated resume boots it too; kill removes one that is paused.
	if s, body, _ := call(t, ts, "POST", "/sandboxes/"+ar.ID+"/resume", `{"timeout":30}`); s != 201 {
		t.Errorf("resume: %d %s", s, body)
	}
	if s, _, _ := call(t, ts, "POST", "/sandboxes/"+ar.ID+"/pause", `{"memory":false}`); s != 204 {
		t.Fatal("pause again")
	}
	if s, body, _ := call(t, ts, "DELETE", "/sandboxes/"+ar.ID, ""); s != 204 {
		t.Errorf("kill of a paused one: %d %s", s, body)
	}
	if _, err := h.Box(context.Background(), ar.ID); !errors.Is(err, ErrNotFound) {
		t.Errorf("killed, it is still there: %v", err)
	}
}

// What asks for a cold boot or a snapshot without memory that kvbox does
// not do is refused in one line, never done otherwise quietly: connect
// with memory false to a sandbox paused with its memory, a timeout's pause
// without memory, a snapshot without memory. A connect with memory false
// to a running sandbox is the no-op E2B's is.
func TestMemoryFalseRefusals(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	if s, body, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/connect", `{"timeout":30,"memory":false}`); s != 200 {
		t.Errorf("connect memory false to a running sandbox: %d %s", s, body)
	}
	s, body, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/snapshots", `{"memory":false}`)
	errorShape(t, "a snapshot without memory", s, body, 400)
	if s, _, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/pause", `{}`); s != 204 {
		t.Fatal("pause")
	}
	s, body, _ = call(t, ts, "POST", "/sandboxes/"+a.ID+"/connect", `{"timeout":30,"memory":false}`)
	errorShape(t, "a cold boot of a sandbox paused with its memory", s, body, 400)
	if b, _ := h.Box(context.Background(), a.ID); b.State != Suspended {
		t.Errorf("the refused connect changed the sandbox: %+v", b)
	}
	s, body, _ = call(t, ts, "POST", "/v2/sandboxes", `{"templateID":"warm","autoPause":true,"autoPauseMemory":false}`)
	errorShape(t, "a timeout's pause without memory", s, body, 400)
	if s, body, _ := call(t, ts, "POST", "/v2/sandboxes", `{"templateID":"warm","autoPause":true,"autoPauseMemory":true}`); s != 201 {
		t.Errorf("autoPauseMemory true: %d %s", s, body)
	}
}

// A serve that died in a pause without memory before the box went down
// (or in its boot, after it came up) finds a running box with the paused
// label: it takes the label away and gives it its timeout.
func TestRestartMendsAPausedLabel(t *testing.T) {
	h := newFakeHost()
	dir := t.TempDir()
	_, ts := newTestServer(t, h, dir)
	a := create(t, ts, `{"templateID":"warm","timeout":90}`)
	b, _ := h.Box(context.Background(), a.ID)
	h.SetLabels(context.Background(), a.ID, withLabel(b.Labels, labelPaused, pausedFilesystem))
	h.SetExpires(context.Background(), a.ID, nil)
	newTestServer(t, h, dir)
	b, _ = h.Box(context.Background(), a.ID)
	if b.Labels[labelPaused] != "" || b.Expires == nil {
		t.Errorf("after a restart: %+v, want no paused label and a deadline", b)
	}
}

// lockWaiters is how many calls hold or wait for sandbox id's lock.
func lockWaiters(s *Server, id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if l := s.locks[id]; l != nil {
		return l.n
	}
	return 0
}

// Two kills at once: one removes the sandbox (204), the other finds it
// gone (404, which the SDKs read as false); the box is removed once, and
// nothing of it is left: no secrets, no streams.
func TestKillsAtOnce(t *testing.T) {
	h := newFakeHost()
	dir := t.TempDir()
	_, ts := newTestServer(t, h, dir)
	a := create(t, ts, `{"templateID":"warm"}`)
	if s, _, _ := call(t, ts, "GET", "/envs", "", "E2b-Sandbox-Id: "+a.ID, "X-Access-Token: "+a.Token); s != 200 {
		t.Fatal("envd")
	}
	const n = 8
	statuses := make(chan int, n)
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, _, _ := call(t, ts, "DELETE", "/sandboxes/"+a.ID, "")
			statuses <- s
		}()
	}
	wg.Wait()
	close(statuses)
	got := map[int]int{}
	for s := range statuses {
		got[s]++
	}
	if got[204] != 1 || got[404] != n-1 {
		t.Errorf("%d kills at once answered %v, want one 204 and %d 404", n, got, n-1)
	}
	noTrace(t, h, dir, a.ID)
}

// noTrace checks sandbox id left nothing: no box, one removal, no secrets
// file, no stream open, no lock.
func noTrace(t *testing.T, h *fakeHost, dir, id string) {
	t.Helper()
	if _, err := h.Box(context.Background(), id); !errors.Is(err, ErrNotFound) {
		t.Errorf("sandbox %s's box is still there: %v", id, err)
	}
	h.mu.Lock()
	removes := h.removes[id]
	h.mu.Unlock()
	if removes != 1 {
		t.Errorf("sandbox %s's box removed %d times", id, removes)
	}
	if _, err := os.Stat(filepath.Join(dir, id+".json")); !os.IsNotExist(err) {
		t.Errorf("sandbox %s's secrets are left: %v", id, err)
	}
	eventually(t, "no stream left open", func() bool { return h.openStreams() == 0 })
}

// A kill while a create, a pause, a connect's resume or boot, or a fork's
// clone of the same sandbox is in flight waits for it, then removes the
// sandbox: both answer as the SDKs expect (the other call its success, the
// kill 204), and nothing is left.
func TestKillWhileInFlight(t *testing.T) {
	for _, c := range []struct {
		name, gate string
		setup      func(t *testing.T, ts *httpTestServer) string                   // the sandbox, if made first
		call       func(t *testing.T, ts *httpTestServer, id string) (int, string) // the call in flight
		want       int
	}{
		{"create", "clone", nil, func(t *testing.T, ts *httpTestServer, _ string) (int, string) {
			s, b, _ := call(t, ts.Server, "POST", "/v2/sandboxes", `{"templateID":"warm"}`)
			return s, b
		}, 201},
		{"pause", "suspend", created1, func(t *testing.T, ts *httpTestServer, id string) (int, string) {
			s, b, _ := call(t, ts.Server, "POST", "/sandboxes/"+id+"/pause", `{}`)
			return s, b
		}, 204},
		{"pause without memory", "stop", created1, func(t *testing.T, ts *httpTestServer, id string) (int, string) {
			s, b, _ := call(t, ts.Server, "POST", "/sandboxes/"+id+"/pause", `{"memory":false}`)
			return s, b
		}, 204},
		{"connect resuming", "resume", pausedWith(`{}`), func(t *testing.T, ts *httpTestServer, id string) (int, string) {
			s, b, _ := call(t, ts.Server, "POST", "/sandboxes/"+id+"/connect", `{"timeout":30}`)
			return s, b
		}, 201},
		{"connect booting", "boot", pausedWith(`{"memory":false}`), func(t *testing.T, ts *httpTestServer, id string) (int, string) {
			s, b, _ := call(t, ts.Server, "POST", "/sandboxes/"+id+"/connect", `{"timeout":30}`)
			return s, b
		}, 201},
	} {
		t.Run(c.name, func(t *testing.T) {
			h := newFakeHost()
			dir := t.TempDir()
			s, hts := newTestServer(t, h, dir)
			ts := &httpTestServer{hts}
			id := ""
			if c.setup != nil {
				id = c.setup(t, ts)
			}
			g := h.gate(c.gate)
			type answer struct {
				status int
				body   string
			}
			inFlight := make(chan answer, 1)
			go func() {
				st, b := c.call(t, ts, id)
				inFlight <- answer{st, b}
			}()
			got := <-g.entered
			if id == "" {
				id = got
			}
			killed := make(chan int, 1)
			go func() {
				st, _, _ := call(t, hts, "DELETE", "/sandboxes/"+id, "")
				killed <- st
			}()
			eventually(t, "the kill waiting for the call in flight", func() bool { return lockWaiters(s, id) == 2 })
			close(g.release)
			if a := <-inFlight; a.status != c.want {
				t.Errorf("the %s: %d %s, want %d", c.name, a.status, a.body, c.want)
			}
			if st := <-killed; st != 204 {
				t.Errorf("the kill: %d, want 204", st)
			}
			noTrace(t, h, dir, id)
			if st, _, _ := call(t, hts, "DELETE", "/sandboxes/"+id, ""); st != 404 {
				t.Errorf("a kill after: %d, want 404", st)
			}
		})
	}
}

// httpTestServer names the listener the cases share.
type httpTestServer struct{ Server *httptest.Server }

func created1(t *testing.T, ts *httpTestServer) string {
	return create(t, ts.Server, `{"templateID":"warm"}`).ID
}

func pausedWith(body string) func(*testing.T, *httpTestServer) string {
	return func(t *testing.T, ts *httpTestServer) string {
		id := create(t, ts.Server, `{"templateID":"warm"}`).ID
		if s, b, _ := call(t, ts.Server, "POST", "/sandboxes/"+id+"/pause", body); s != 204 {
			t.Fatalf("pause %s: %d %s", body, s, b)
		}
		return id
	}
}

// A fork's snapshot is due as soon as its forks are made, so the last of
// them to go takes it (the library removes a due snapshot with its last
// clone); a fork of which none was made removes it at once.
func TestForkSnapshotGoesWithItsForks(t *testing.T) {
	h := newFakeHost()
	_, ts := newTestServer(t, h, "")
	a := create(t, ts, `{"templateID":"warm"}`)
	t0 := time.Now()
	s, body, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/fork", `{"count":2}`)
	if s != 201 {
		t.Fatalf("fork: %d %s", s, body)
	}
	var res []forkResultJSON
	json.Unmarshal([]byte(body), &res)
	fb, _ := h.Box(context.Background(), res[0].Sandbox.SandboxID)
	h.mu.Lock()
	sn, ok := h.snaps[fb.Snapshot]
	h.mu.Unlock()
	if !ok || sn.Expires == nil || sn.Expires.After(time.Now()) || sn.Expires.Before(t0) {
		t.Errorf("the fork snapshot %s after its forks were made: %+v, want due now", fb.Snapshot, sn)
	}
	h.mu.Lock()
	h.failClone = map[string]error{}
	for name := range h.snaps {
		if strings.HasPrefix(name, forkPrefix) {
			delete(h.snaps, name)
		}
	}
	h.failNth = h.clones + 1
	h.mu.Unlock()
	if s, body, _ := call(t, ts, "POST", "/sandboxes/"+a.ID+"/fork", `{"count":1}`); s != 201 || !strings.Contains(body, `"error"`) {
		t.Fatalf("a fork that fails: %d %s", s, body)
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	for name := range h.snaps {
		if strings.HasPrefix(name, forkPrefix) {
			t.Errorf("the snapshot of a fork of which none was made is left: %s", name)
		}
	}
}
