package statedir

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"kvbox.dev/kvbox/base"
)

// Entries is a folder of named entries (images/, snapshots/): one folder an
// entry, complete once its record, a JSON file written last, is in it.
type Entries struct {
	Dir    string // the folder of entries
	Record string // the record's file name in an entry's folder
	What   string // what an entry is called in errors: "image"
	// Missing ends the line for an entry that is not there, after
	// WHAT "NAME": "not found (kvbox images ls lists images)".
	Missing string
}

// Read checks name (base.ValidName) and reads its entry's record into v.
// An entry without a record (none, or one being made) is an error of kind
// NotFound.
func (e Entries) Read(name string, v any) error {
	if err := base.ValidName(name); err != nil {
		return err
	}
	b, err := os.ReadFile(filepath.Join(e.Dir, name, e.Record))
	if errors.Is(err, os.ErrNotExist) {
		return base.Errorf(base.NotFound, "%s %q %s", e.What, name, e.Missing)
	}
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("%s %q: %w", e.What, name, err)
	}
	return nil
}

// List gets every complete entry of the folder dir by its name, in the
// order of their names. A dot folder is work in progress, never an entry
// (no name starts with a dot); an entry get says is not found (being made,
// or left over by a killed kvbox) is left out; a folder not made yet holds
// none.
func List[T any](dir string, get func(name string) (T, error)) ([]T, error) {
	ents, err := os.ReadDir(dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var out []T
	for _, d := range ents {
		if !d.IsDir() || strings.HasPrefix(d.Name(), ".") {
			continue
		}
		x, err := get(d.Name())
		if errors.Is(err, base.ErrNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		out = append(out, x)
	}
	return out, nil
}
