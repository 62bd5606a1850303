//go:build e2e

package testenv

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"kvbox.dev/kvbox/base"
)

// busyBoxStep: a request whose client gives up while kvbox serve waits for
// its sandbox's box, which another kvbox holds (a long snapshot, say),
// ends with its client: once the box is free again, what it asked for is
// not done. The same request with its client still there is.
func busyBoxStep(t *testing.T, p *serveProc, template string) {
	key := strings.TrimSpace(mustKvbox(t, "serve", "key"))
	api := func(ctx context.Context, method, path string, body any) (int, []byte, error) {
		var rd io.Reader
		if body != nil {
			b, _ := json.Marshal(body)
			rd = bytes.NewReader(b)
		}
		req, _ := http.NewRequestWithContext(ctx, method, "http://"+p.addr+path, rd)
		req.Header.Set("X-API-Key", key)
		req.Header.Set("Content-Type", "application/json")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			return 0, nil, err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return resp.StatusCode, b, err
	}
	code, b, err := api(context.Background(), "POST", "/sandboxes", map[string]any{"templateID": template, "timeout": 600})
	if err != nil || code != http.StatusCreated {
		t.Fatalf("create: %d %s %v", code, b, err)
	}
	var sbx struct {
		SandboxID string `json:"sandboxID"`
	}
	json.Unmarshal(b, &sbx)
	t.Cleanup(func() { kvbox(t, "rm", "--force", sbx.SandboxID) })
	endAt := func() time.Time {
		t.Helper()
		code, b, err := api(context.Background(), "GET", "/sandboxes/"+sbx.SandboxID, nil)
		var info struct {
			EndAt time.Time `json:"endAt"`
		}
		if err != nil || code != http.StatusOK || json.Unmarshal(b, &info) != nil {
			t.Fatalf("get %s: %d %s %v", sbx.SandboxID, code, b, err)
		}
		return info.EndAt
	}
	before := endAt()

	held, err := base.Lock(filepath.Join(stateDir, "locks", sbx.SandboxID+".lock"), false)
	if err != nil {
		t.Fatalf("hold the box's lock: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	_, _, err = api(ctx, "POST", "/sandboxes/"+sbx.SandboxID+"/timeout", map[string]any{"timeout": 3600})
	cancel()
	if err == nil {
		held.Unlock()
		t.Fatalf("a timeout change answered while the box's lock was held elsewhere")
	}
	// Serve's wait ended with the request: freed now, the box gets no
	// late change from it.
	time.Sleep(time.Second)
	held.Unlock()
	time.Sleep(3 * time.Second)
	if got := endAt(); !got.Equal(before) {
		t.Errorf("the sandbox's end moved from %s to %s: the request its client gave up was served once the box was free", before.Format(time.RFC3339), got.Format(time.RFC3339))
	}
	// The same with the client waiting: served.
	if code, b, err := api(context.Background(), "POST", "/sandboxes/"+sbx.SandboxID+"/timeout", map[string]any{"timeout": 3600}); err != nil || code != http.StatusNoContent {
		t.Fatalf("timeout change: %d %s %v", code, b, err)
	}
	if got := endAt(); !got.After(before.Add(30 * time.Minute)) {
		t.Errorf("after a timeout of an hour the sandbox ends at %s (was %s)", got.Format(time.RFC3339), before.Format(time.RFC3339))
	}
}
