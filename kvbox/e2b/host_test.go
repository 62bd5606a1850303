package e2b

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/serve"
	"kvbox.dev/kvbox/snapshot"
)

// A snapshot another program keeps for itself (kvbox-node's cache marks
// its own) is not serve's: not listed, not cloned, not removed, whatever
// its name; an unmarked one of the same shape of name is serve's as any.
func TestServeLeavesMarkedSnapshotsAlone(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	k, err := kvbox.Open(ctx, kvbox.Config{URI: "test:///default", StateDir: dir, NoSweep: true})
	if err != nil {
		t.Skipf("libvirt's test driver: %v", err)
	}
	defer k.Close()
	write := func(name string) snapshot.Snapshot {
		s := snapshot.Snapshot{Name: name, Created: time.Now().UTC()}
		sd := filepath.Join(dir, "snapshots", name)
		if err := os.MkdirAll(sd, 0o750); err != nil {
			t.Fatal(err)
		}
		b, _ := json.Marshal(s)
		if err := os.WriteFile(filepath.Join(sd, snapshot.MetaFile), b, 0o640); err != nil {
			t.Fatal(err)
		}
		got, err := k.GetSnapshot(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	const marked, plain = "pod-sha256-0123456789abcdef01234567-89abcdef", "pod-sha256-aaaaaaaaaaaaaaaaaaaaaaaa-bbbbbbbb"
	if err := snapshot.SetOwner(write(marked), snapshot.Owner{Owner: snapshot.OwnerKvboxNode, Digest: "sha256:00"}); err != nil {
		t.Fatal(err)
	}
	write(plain)
	h := Host(k)
	snaps, err := h.Snapshots(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range snaps {
		names = append(names, s.Name)
	}
	if len(names) != 1 || names[0] != plain {
		t.Errorf("serve lists %v, want only %s", names, plain)
	}
	if _, err := h.Clone(ctx, serve.CloneRequest{Snapshot: marked, Name: "sbx0000000000000001"}); !errors.Is(err, serve.ErrNotFound) {
		t.Errorf("a clone of the marked snapshot: %v, want not found", err)
	}
	if err := h.RemoveSnapshot(ctx, marked); !errors.Is(err, serve.ErrNotFound) {
		t.Errorf("removing the marked snapshot: %v, want not found", err)
	}
	if _, err := k.GetSnapshot(ctx, marked); err != nil {
		t.Errorf("the marked snapshot is gone: %v", err)
	}
	if err := h.RemoveSnapshot(ctx, plain); err != nil {
		t.Errorf("removing an unmarked snapshot: %v", err)
	}
}
