package registry

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	v1 "github.com/google/go-containerregistry/pkg/v1"
)

// memo remembers the part each file a push encoded became. A sealed
// snapshot's files and an image's files never change, so a second push of
// the same snapshot, or of one on the same base image, need not encode them
// again: the manifest takes the remembered digests, and remote.Write asks
// the registry for each blob before it reads any, so a blob the registry
// has is never encoded at all. One it lacks is encoded then, and must hash
// as remembered (the encoder is deterministic: one goroutine, fixed level).
type memo struct {
	path string
	mu   sync.Mutex
	m    map[string]memoEntry
}

type memoEntry struct {
	Digest   string `json:"digest"`
	Blob     int64  `json:"blob_bytes"`
	Apparent int64  `json:"apparent_bytes"`
	Data     int64  `json:"data_bytes"`
}

const memoFile = "parts.json"

// loadMemo reads the cache's memo; a missing or unreadable one is empty.
func loadMemo(c cache) *memo {
	m := &memo{path: filepath.Join(c.dir, memoFile), m: map[string]memoEntry{}}
	if b, err := os.ReadFile(m.path); err == nil {
		json.Unmarshal(b, &m.m)
	}
	return m
}

// key names a file's content: its path and what any change to it changes
// (size, modification and change times, inode).
func memoKey(path string, fi os.FileInfo) string {
	st, _ := fi.Sys().(*syscall.Stat_t)
	if st == nil {
		return ""
	}
	return fmt.Sprintf("%s|%d|%d|%d|%d.%d", path, fi.Size(), st.Ino, fi.ModTime().UnixNano(), st.Ctim.Sec, st.Ctim.Nsec)
}

func (m *memo) get(key string) (memoEntry, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e, ok := m.m[key]
	return e, ok && key != ""
}

func (m *memo) put(key string, e memoEntry) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if key != "" {
		m.m[key] = e
	}
}

func (m *memo) forget(key string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	delete(m.m, key)
}

// save writes the memo, keeping only entries whose files still exist.
func (m *memo) save() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	for k := range m.m {
		path, _, _ := strings.Cut(k, "|")
		if _, err := os.Stat(path); err != nil {
			delete(m.m, k) // its snapshot or image is gone
		}
	}
	b, err := json.Marshal(m.m)
	if err != nil {
		return err
	}
	tmp := m.path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, m.path)
}

// ensureBlob makes sure the cache holds the blob of path that the memo
// said hashes to dig, encoding path again if it was pruned.
func (c cache) ensureBlob(m *memo, key, path string, dig v1.Hash, size int64) error {
	if fi, err := os.Stat(c.blob(dig)); err == nil && fi.Size() == size {
		return nil
	}
	got, n, err := c.put(func(w io.Writer) error {
		_, _, err := encodeSparse(path, w)
		return err
	})
	if err != nil {
		return err
	}
	if got != dig || n != size {
		m.forget(key)
		m.save()
		os.Remove(c.blob(got))
		return fmt.Errorf("%s encodes to %s now, not the %s remembered: push again", path, got, dig)
	}
	return nil
}
