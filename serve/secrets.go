package serve

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"kvbox.dev/kvbox/egress"
)

// record is what serve keeps of a sandbox beside libvirt: its secrets,
// which never go into the domain XML (libvirt shows that to whoever may
// read domains, read-only connections included). One file per sandbox in
// serve's folder, root's only; a record whose box is gone is pruned.
type record struct {
	ID          string `json:"id"`
	AccessToken string `json:"access_token"`
	// TrafficToken guards the sandbox's other ports when it was created
	// with network.allowPublicTraffic false.
	TrafficToken string            `json:"traffic_token,omitempty"`
	EnvVars      map[string]string `json:"env_vars,omitempty"`
	// Egress is the policy serve gave the sandbox (references to the
	// host's secret store only), HeaderSecrets the values of the
	// sandbox's own header secrets it names (network.go), by store name.
	Egress        *egress.Policy    `json:"egress,omitempty"`
	HeaderSecrets map[string]string `json:"header_secrets,omitempty"`
}

// secrets is the folder of records, and the records read from it.
type secrets struct {
	dir string
	mu  sync.Mutex
	m   map[string]record
}

// maxRecord bounds a record file read back (a sandbox's variables are
// bounded by the control plane's body size).
const maxRecord = 2 * maxBody

// openSecrets makes the folder (root's only) and reads every record in it.
func openSecrets(dir string) (*secrets, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	if !fi.IsDir() {
		return nil, fmt.Errorf("serve: %s is not a folder", dir)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return nil, fmt.Errorf("serve: %w", err)
		}
	}
	s := &secrets{dir: dir, m: map[string]record{}}
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("serve: %w", err)
	}
	for _, e := range ents {
		id, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !validID(id) {
			continue
		}
		rec, err := readRecord(filepath.Join(dir, e.Name()))
		if err != nil || rec.ID != id {
			continue // a half-written or foreign file: the prune takes it
		}
		s.m[id] = rec
	}
	return s, nil
}

// readRecord reads a record without following a link.
func readRecord(path string) (record, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return record{}, err
	}
	defer f.Close()
	if fi, err := f.Stat(); err != nil || !fi.Mode().IsRegular() {
		return record{}, fmt.Errorf("%s is not a plain file", path)
	}
	b, err := io.ReadAll(io.LimitReader(f, maxRecord))
	if err != nil {
		return record{}, err
	}
	var rec record
	err = json.Unmarshal(b, &rec)
	return rec, err
}

func (s *secrets) path(id string) string { return filepath.Join(s.dir, id+".json") }

// put writes a record (atomically, 0600) and keeps it.
func (s *secrets) put(rec record) error {
	b, err := json.Marshal(rec)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(s.dir, ".rec-*")
	if err != nil {
		return fmt.Errorf("serve: keep sandbox %s's secrets: %w", rec.ID, err)
	}
	_, err = tmp.Write(b)
	if err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), s.path(rec.ID))
	}
	if err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("serve: keep sandbox %s's secrets: %w", rec.ID, err)
	}
	s.mu.Lock()
	s.m[rec.ID] = rec
	s.mu.Unlock()
	return nil
}

func (s *secrets) get(id string) (record, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r, ok := s.m[id]
	return r, ok
}

// del forgets a record; one not there is fine.
func (s *secrets) del(id string) {
	s.mu.Lock()
	delete(s.m, id)
	s.mu.Unlock()
	if err := os.Remove(s.path(id)); err != nil && !errors.Is(err, os.ErrNotExist) {
		// Left for the next prune.
		return
	}
}

// all is every record.
func (s *secrets) all() []record {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]record, 0, len(s.m))
	for _, r := range s.m {
		out = append(out, r)
	}
	return out
}

// prune forgets the records whose id keep does not keep, and removes the
// files nothing should hold (half-written temporaries).
func (s *secrets) prune(keep func(id string) bool) (pruned []record) {
	for _, r := range s.all() {
		if !keep(r.ID) {
			s.del(r.ID)
			pruned = append(pruned, r)
		}
	}
	return pruned
}
