package statedir

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"kvbox.dev/kvbox/base"
)

type rec struct{ Name string }

// An entry is read by its record; one without a record is not found, with
// the store's line; a bad name or record is an error of its own.
func TestEntriesRead(t *testing.T) {
	dir := t.TempDir()
	e := Entries{Dir: dir, Record: "rec.json", What: "thing", Missing: "not found (list them)"}
	os.MkdirAll(filepath.Join(dir, "a"), 0o700)
	os.WriteFile(filepath.Join(dir, "a", "rec.json"), []byte(`{"Name":"a"}`), 0o600)
	os.MkdirAll(filepath.Join(dir, "half"), 0o700)
	os.MkdirAll(filepath.Join(dir, "bad"), 0o700)
	os.WriteFile(filepath.Join(dir, "bad", "rec.json"), []byte(`{`), 0o600)

	var r rec
	if err := e.Read("a", &r); err != nil || r.Name != "a" {
		t.Errorf("a: %+v, %v", r, err)
	}
	err := e.Read("half", &r)
	if !errors.Is(err, base.ErrNotFound) || err.Error() != `thing "half" not found (list them)` {
		t.Errorf("half: %v", err)
	}
	if err := e.Read("bad", &r); err == nil || errors.Is(err, base.ErrNotFound) || !strings.HasPrefix(err.Error(), `thing "bad": `) {
		t.Errorf("bad: %v", err)
	}
	if err := e.Read("../a", &r); err == nil || errors.Is(err, base.ErrNotFound) {
		t.Errorf("../a: %v", err)
	}
}

// List leaves out dot folders, files and entries not found, in the order
// of their names; a folder not made yet lists nothing; any other error is
// the listing's.
func TestList(t *testing.T) {
	dir := t.TempDir()
	for _, d := range []string{"b", "a", ".work", "half"} {
		os.MkdirAll(filepath.Join(dir, d), 0o700)
	}
	os.WriteFile(filepath.Join(dir, "file"), nil, 0o600)
	get := func(name string) (string, error) {
		switch name {
		case "half":
			return "", base.Errorf(base.NotFound, "half")
		case ".work", "file":
			t.Errorf("get(%q)", name)
		}
		return name, nil
	}
	got, err := List(dir, get)
	if err != nil || strings.Join(got, ",") != "a,b" {
		t.Errorf("List = %q, %v", got, err)
	}
	if got, err := List(filepath.Join(dir, "none"), get); err != nil || got != nil {
		t.Errorf("List of a missing folder = %q, %v", got, err)
	}
	boom := errors.New("boom")
	if _, err := List(dir, func(string) (string, error) { return "", boom }); !errors.Is(err, boom) {
		t.Errorf("List with a failing get: %v", err)
	}
}
