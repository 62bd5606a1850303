package qmp

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestApplyMigrationSettingsRestoresExactly(t *testing.T) {
	caps := map[string]bool{"x-ignore-shared": false, "mapped-ram": true, "multifd": false}
	params := map[string]any{
		"announce-rounds": json.Number("5"),
		"max-bandwidth":   json.Number("18446744073709551615"),
		"tls-creds":       "",
	}
	f := &fakeMonitor{}
	f.reply = func(execute string, args map[string]any) string {
		switch execute {
		case "query-migrate-capabilities":
			var list []string
			for _, k := range sortedKeys(caps) {
				list = append(list, fmt.Sprintf(`{"capability": %q, "state": %v}`, k, caps[k]))
			}
			return `{"return": [` + strings.Join(list, ",") + `]}`
		case "query-migrate-parameters":
			b, _ := json.Marshal(params)
			return `{"return": ` + string(b) + `}`
		case "migrate-set-capabilities":
			for _, cs := range args["capabilities"].([]any) {
				m := cs.(map[string]any)
				caps[m["capability"].(string)] = m["state"].(bool)
			}
		case "migrate-set-parameters":
			for k, v := range args {
				if n, ok := v.(float64); ok && k != "max-bandwidth" {
					v = json.Number(fmt.Sprint(n))
				}
				params[k] = v
			}
		}
		return `{"return": {}}`
	}
	c := New(f)
	ctx := context.Background()
	restore, err := c.ApplyMigrationSettings(ctx,
		map[string]bool{"x-ignore-shared": true, "mapped-ram": true},
		map[string]any{"announce-rounds": 0, "max-bandwidth": 1000})
	if err != nil {
		t.Fatal(err)
	}
	if !caps["x-ignore-shared"] || params["announce-rounds"] != json.Number("0") {
		t.Fatalf("settings not applied: %v %v", caps, params)
	}
	n := len(f.commands())
	if err := restore(ctx); err != nil {
		t.Fatal(err)
	}
	sent := f.commands()[n:]
	if len(sent) != 2 {
		t.Fatalf("restore sent %q", sent)
	}
	// Only what was changed goes back, with the exact old values (a uint64
	// bandwidth must not pass through float64).
	jsonEqual(t, sent[0], `{"execute":"migrate-set-parameters","arguments":{"announce-rounds":5,"max-bandwidth":18446744073709551615}}`)
	if !strings.Contains(sent[0], "18446744073709551615") {
		t.Errorf("max-bandwidth lost precision: %s", sent[0])
	}
	jsonEqual(t, sent[1], `{"execute":"migrate-set-capabilities","arguments":{"capabilities":[
		{"capability":"mapped-ram","state":true},{"capability":"x-ignore-shared","state":false}]}}`)
	if caps["x-ignore-shared"] || caps["multifd"] || !caps["mapped-ram"] {
		t.Errorf("capabilities after restore: %v", caps)
	}
}

func TestApplyMigrationSettingsRefusesWhatCannotBeRestored(t *testing.T) {
	f := &fakeMonitor{reply: func(execute string, _ map[string]any) string {
		switch execute {
		case "query-migrate-capabilities":
			return `{"return": [{"capability": "x-ignore-shared", "state": false}]}`
		case "query-migrate-parameters":
			return `{"return": {"announce-rounds": 5}}`
		}
		return `{"return": {}}`
	}}
	c := New(f)
	ctx := context.Background()
	if _, err := c.ApplyMigrationSettings(ctx, map[string]bool{"no-such-cap": true}, nil); err == nil {
		t.Error("unknown capability accepted")
	}
	if _, err := c.ApplyMigrationSettings(ctx, nil, map[string]any{"tls-hostname": "x"}); err == nil {
		t.Error("unreported parameter accepted")
	}
	for _, cmd := range f.commands() {
		if strings.Contains(cmd, "migrate-set-") {
			t.Errorf("changed something before refusing: %s", cmd)
		}
	}
}

func TestApplyMigrationSettingsRollsBackOnFailure(t *testing.T) {
	f := &fakeMonitor{reply: func(execute string, _ map[string]any) string {
		switch execute {
		case "query-migrate-capabilities":
			return `{"return": [{"capability": "x-ignore-shared", "state": false}]}`
		case "query-migrate-parameters":
			return `{"return": {"announce-rounds": 5}}`
		case "migrate-set-parameters":
			return `{"error": {"class": "GenericError", "desc": "bad value"}}`
		}
		return `{"return": {}}`
	}}
	c := New(f)
	_, err := c.ApplyMigrationSettings(context.Background(),
		map[string]bool{"x-ignore-shared": true}, map[string]any{"announce-rounds": -1})
	if err == nil || !strings.Contains(err.Error(), "bad value") {
		t.Fatalf("got %v", err)
	}
	sent := f.commands()
	last := sent[len(sent)-1]
	jsonEqual(t, last, `{"execute":"migrate-set-capabilities","arguments":{"capabilities":[{"capability":"x-ignore-shared","state":false}]}}`)
}

// scripted answers successive calls of one command from a list, repeating
// the last answer.
func scripted(answers map[string][]string) func(string, map[string]any) string {
	return func(execute string, _ map[string]any) string {
		list, ok := answers[execute]
		if !ok || len(list) == 0 {
			return `{"return": {}}`
		}
		a := list[0]
		if len(list) > 1 {
			answers[execute] = list[1:]
		}
		return a
	}
}

func TestWaitMigration(t *testing.T) {
	tests := []struct {
		name    string
		replies []string
		wantErr string
	}{
		{"completed", []string{
			`{"return": {}}`,
			`{"return": {"status": "setup"}}`,
			`{"return": {"status": "active"}}`,
			`{"return": {"status": "completed", "total-time": 12}}`,
		}, ""},
		{"failed", []string{
			`{"return": {"status": "active"}}`,
			`{"return": {"status": "failed", "error-desc": "Error in migration completion: Bad address"}}`,
		}, "Bad address"},
		{"cancelled", []string{`{"return": {"status": "cancelled"}}`}, "cancelled"},
		{"query error", []string{`{"error": {"class": "GenericError", "desc": "gone"}}`}, "gone"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := New(&fakeMonitor{reply: scripted(map[string][]string{"query-migrate": tt.replies})})
			err := c.WaitMigration(context.Background(), time.Millisecond)
			if tt.wantErr == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("got %v, want %q", err, tt.wantErr)
			}
			if tt.name != "query error" && !errors.Is(err, ErrMigrationFailed) {
				t.Errorf("%v does not wrap ErrMigrationFailed", err)
			}
		})
	}
}

func TestWaitMigrationTimeout(t *testing.T) {
	c := New(&fakeMonitor{reply: scripted(map[string][]string{"query-migrate": {`{"return": {"status": "active"}}`}})})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	err := c.WaitMigration(ctx, time.Millisecond)
	if !errors.Is(err, context.DeadlineExceeded) || !strings.Contains(err.Error(), "active") {
		t.Fatalf("got %v", err)
	}
}

func TestWaitJob(t *testing.T) {
	tests := []struct {
		name     string
		replies  []string
		wantErr  error
		wantSent []string // commands other than query-jobs, in order
	}{
		{"concluded", []string{
			`{"return": [{"id": "j", "type": "backup", "status": "running", "current-progress": 1, "total-progress": 9}]}`,
			`{"return": [{"id": "j", "type": "backup", "status": "concluded", "current-progress": 9, "total-progress": 9}]}`,
		}, nil, []string{`{"execute":"job-dismiss","arguments":{"id":"j"}}`}},
		{"failed", []string{
			`{"return": [{"id": "j", "type": "backup", "status": "concluded", "error": "No space left on device"}]}`,
		}, ErrJobFailed, []string{`{"execute":"job-dismiss","arguments":{"id":"j"}}`}},
		{"pending is finalized", []string{
			`{"return": [{"id": "j", "type": "backup", "status": "pending"}]}`,
			`{"return": [{"id": "j", "type": "backup", "status": "concluded"}]}`,
		}, nil, []string{`{"execute":"job-finalize","arguments":{"id":"j"}}`, `{"execute":"job-dismiss","arguments":{"id":"j"}}`}},
		{"unknown", []string{`{"return": [{"id": "other", "status": "running"}]}`}, ErrNotFound, nil},
		{"vanished", []string{
			`{"return": [{"id": "j", "status": "running"}]}`,
			`{"return": []}`,
		}, ErrJobVanished, nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			f := &fakeMonitor{reply: scripted(map[string][]string{"query-jobs": tt.replies})}
			_, err := New(f).WaitJob(context.Background(), "j", time.Millisecond)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("got %v, want %v", err, tt.wantErr)
			}
			var other []string
			for _, cmd := range f.commands() {
				if !strings.Contains(cmd, "query-jobs") {
					other = append(other, cmd)
				}
			}
			if len(other) != len(tt.wantSent) {
				t.Fatalf("sent %q, want %q", other, tt.wantSent)
			}
			for i := range other {
				jsonEqual(t, other[i], tt.wantSent[i])
			}
		})
	}
}

func TestWaitJobTimeout(t *testing.T) {
	f := &fakeMonitor{reply: scripted(map[string][]string{"query-jobs": {`{"return": [{"id": "j", "status": "running"}]}`}})}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Millisecond)
	defer cancel()
	if _, err := New(f).WaitJob(ctx, "j", time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("got %v", err)
	}
}
