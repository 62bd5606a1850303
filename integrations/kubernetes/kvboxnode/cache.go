package kvboxnode

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	corev1 "k8s.io/api/core/v1"

	"kvbox.dev/kvbox/snapshot"
)

// Cache is the node's snapshots of pods' images, keyed by the artifact's
// digest: each digest is pulled once (pods that need it meanwhile wait for
// that pull), kept as a snapshot of a name drawn for it (CacheNamePrefix
// and a random part) that carries kvbox-node's owner mark with the digest
// (Snapshot.Owner), and listed in node.status.images under every reference
// pods named it by, with its size, so that the scheduler prefers nodes
// that hold it. It is collected under a disk budget, least recently used
// first, and never drops a snapshot a box is cloned from or a clone is
// being made from.
//
// The cache's snapshots are those of its index (one small JSON file per
// digest in its folder, root's) whose snapshot carries its mark with that
// digest: a snapshot of a look-alike name, or one put in the place of one
// of its own, is neither cloned nor removed. A snapshot pulled with
// credentials is cloned for another pod only once that pod's own
// credentials resolved the same digest (Acquire); one pulled anonymously
// is for every pod of the node.
type Cache struct {
	lib    Library
	dir    string
	budget int64 // bytes; 0: no limit
	log    *slog.Logger
	now    func() time.Time
	// insecure registries: HOST[:PORT] spoken to in plain HTTP.
	insecure map[string]bool
	caps     PullOptions // MaxCPUs, MaxMemory, MaxDisk

	mu      sync.Mutex
	entries map[string]*cacheEntry // by digest
	pulls   map[string]*pullCall   // by digest
	holds   map[string]int         // by snapshot name
	changed func()
}

// cacheEntry is what the cache knows of one digest (its JSON file).
type cacheEntry struct {
	Digest   string    `json:"digest"`
	Snapshot string    `json:"snapshot"`
	Refs     []string  `json:"refs"` // references pods named it by, the newest last
	Size     int64     `json:"size_bytes"`
	LastUsed time.Time `json:"last_used"`
	CPUs     int       `json:"cpus"`
	Memory   int64     `json:"memory_bytes"`
	Disk     int64     `json:"disk_bytes"`
	// Credentialed: the pull sent credentials, so a later pod must show
	// that its own reach the digest (Acquire).
	Credentialed bool `json:"credentialed"`
}

type pullCall struct {
	done chan struct{}
	err  error
}

// maxRefs bounds the references kept per digest.
const maxRefs = 8

// NewCache is the cache in dir (created if missing) over lib's snapshots.
func NewCache(lib Library, dir string, budget int64, insecure []string, log *slog.Logger) (*Cache, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	c := &Cache{lib: lib, dir: dir, budget: budget, log: log, now: time.Now, insecure: map[string]bool{},
		entries: map[string]*cacheEntry{}, pulls: map[string]*pullCall{}, holds: map[string]int{}, changed: func() {}}
	for _, h := range insecure {
		c.insecure[h] = true
	}
	if c.log == nil {
		c.log = slog.Default()
	}
	return c, nil
}

// SetSnapshotCaps bounds the snapshots the cache pulls: vCPUs, RAM and
// disk bytes (0: kvbox's own limit).
func (c *Cache) SetSnapshotCaps(cpus int, memory, disk int64) {
	c.caps = PullOptions{MaxCPUs: cpus, MaxMemory: memory, MaxDisk: disk}
}

// ours says whether s is the cache's snapshot of digest: marked by
// kvbox-node with that digest.
func ours(s Snapshot, digest string) bool {
	return s.Owner == snapshot.OwnerKvboxNode && s.OwnerDigest == digest && digest != ""
}

// OnChange sets what the cache calls when its list of images changed.
func (c *Cache) OnChange(f func()) { c.changed = f }

// Load reads the cache's index and keeps the entries whose snapshot is
// there with kvbox-node's mark of their digest; a snapshot marked so
// without an entry (kvbox-node was killed between the pull and its entry)
// is taken back in. A snapshot of the cache's name form without the mark
// is none of the cache's: it is left alone.
func (c *Cache) Load(ctx context.Context) error {
	snaps, err := c.lib.Snapshots(ctx)
	if err != nil {
		return err
	}
	have := map[string]Snapshot{}
	for _, s := range snaps {
		have[s.Name] = s
	}
	ents, err := os.ReadDir(c.dir)
	if err != nil {
		return err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	indexed := map[string]bool{}
	for _, e := range ents {
		if !strings.HasSuffix(e.Name(), ".json") {
			continue
		}
		p := filepath.Join(c.dir, e.Name())
		b, err := os.ReadFile(p)
		var ce cacheEntry
		if err == nil {
			err = json.Unmarshal(b, &ce)
		}
		s, ok := have[ce.Snapshot]
		if err != nil || !ok || !ours(s, ce.Digest) || c.entries[ce.Digest] != nil {
			os.Remove(p) // its snapshot is gone, or not the cache's
			continue
		}
		ce.Size = s.SizeBytes
		c.entries[ce.Digest] = &ce
		indexed[s.Name] = true
	}
	for _, s := range snaps {
		switch {
		case indexed[s.Name]:
		case s.Owner == snapshot.OwnerKvboxNode && s.OwnerDigest != "" && c.entries[s.OwnerDigest] == nil:
			// Pulled with credentials or not: not known, so as with them.
			e := &cacheEntry{Digest: s.OwnerDigest, Snapshot: s.Name, Size: s.SizeBytes, LastUsed: c.now(),
				CPUs: s.CPUs, Memory: s.Memory, Disk: s.Disk, Credentialed: true}
			if err := c.save(e); err != nil {
				return fmt.Errorf("cache: %w", err)
			}
			c.entries[e.Digest] = e
		case strings.HasPrefix(s.Name, cacheNameStart) && s.Owner == "":
			c.log.Warn("cache: a snapshot of the cache's name form without kvbox-node's mark is left alone", "snapshot", s.Name)
		}
	}
	return nil
}

// entryFile is the index file of digest.
func (c *Cache) entryFile(digest string) string {
	return filepath.Join(c.dir, strings.ReplaceAll(digest, ":", "-")+".json")
}

func (c *Cache) save(e *cacheEntry) error {
	b, err := json.Marshal(e)
	if err != nil {
		return err
	}
	p := c.entryFile(e.Digest)
	tmp := p + ".new"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

// Options are how to reach ref's registry: plain HTTP when it is one of
// the insecure registries (and never else), the credentials of kc, the
// cache's caps on a snapshot's size.
func (c *Cache) Options(ref string, kc authn.Keychain) PullOptions {
	o := c.caps
	o.Keychain = kc
	if r, err := name.ParseReference(ref, name.WeakValidation); err == nil && c.insecure[r.Context().RegistryStr()] {
		o.Insecure = true
	}
	return o
}

// Cached is the digest the cache holds for ref, if it holds one.
func (c *Cache) Cached(ref string) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var best *cacheEntry
	for _, e := range c.entries {
		if slices.Contains(e.Refs, ref) && (best == nil || e.LastUsed.After(best.LastUsed)) {
			best = e
		}
	}
	if best == nil {
		return "", false
	}
	return best.Digest, true
}

// DigestRef is ref pinned to digest (REPO@DIGEST).
func DigestRef(ref, digest string) (string, error) {
	r, err := name.ParseReference(ref, name.WeakValidation)
	if err != nil {
		return "", fmt.Errorf("image %q is not a registry reference (HOST[:PORT]/REPO[:TAG]): %w", ref, err)
	}
	return r.Context().Digest(digest).String(), nil
}

// Acquire makes sure the snapshot of digest is on this host (pulled from
// ref pinned to digest, once however many pods ask at the same time) and
// holds it: the collector leaves it until release is called (once the
// clone maps it). ref is remembered as one of its names. A snapshot that
// an earlier pull fetched with credentials is given only once o's resolve
// ref pinned to digest to that digest (a manifest request with them),
// unless resolved says the caller's own resolve of ref with o gave digest.
func (c *Cache) Acquire(ctx context.Context, ref, digest string, o PullOptions, resolved bool) (s Snapshot, release func(), err error) {
	pulled := false
	for {
		c.mu.Lock()
		if e := c.entries[digest]; e != nil {
			c.holds[e.Snapshot]++
			c.mu.Unlock()
			var once sync.Once
			release := func() { once.Do(func() { c.release(e.Snapshot) }) }
			snap, err := c.check(ctx, e)
			if errors.Is(err, ErrNotFound) {
				release()
				continue // not the cache's any more: pulled again
			}
			if err == nil && e.Credentialed && !pulled && !resolved {
				err = c.verify(ctx, ref, digest, o)
			}
			if err != nil {
				release()
				return Snapshot{}, nil, err
			}
			c.used(e, ref)
			return snap, release, nil
		}
		call := c.pulls[digest]
		if call == nil {
			call = &pullCall{done: make(chan struct{})}
			c.pulls[digest] = call
			c.mu.Unlock()
			call.err = c.pull(ctx, ref, digest, o)
			c.mu.Lock()
			delete(c.pulls, digest)
			close(call.done)
			c.mu.Unlock()
			if call.err != nil {
				return Snapshot{}, nil, call.err
			}
			pulled = true
			c.changed()
			continue
		}
		c.mu.Unlock()
		select {
		case <-ctx.Done():
			return Snapshot{}, nil, ctx.Err()
		case <-call.done:
		}
		if call.err != nil && !errors.Is(call.err, context.Canceled) {
			return Snapshot{}, nil, call.err
		}
		// It worked (the entry is there now), or the pod that pulled was
		// deleted meanwhile: look again, and pull if nobody does.
	}
}

// check is e's snapshot if it is still the cache's: there, with the
// mark of e's digest. One that is not (gone, or another snapshot in its
// place) leaves the index, and check is ErrNotFound; the snapshot, if
// any, is left alone.
func (c *Cache) check(ctx context.Context, e *cacheEntry) (Snapshot, error) {
	s, err := c.lib.Snapshot(ctx, e.Snapshot)
	if err != nil && !errors.Is(err, ErrNotFound) {
		return Snapshot{}, err
	}
	if err == nil && ours(s, e.Digest) {
		return s, nil
	}
	c.log.Warn("cache: its snapshot is gone or not kvbox-node's any more: it leaves the cache (and is left alone)", "snapshot", e.Snapshot, "digest", e.Digest)
	c.mu.Lock()
	if c.entries[e.Digest] == e {
		delete(c.entries, e.Digest)
		os.Remove(c.entryFile(e.Digest))
	}
	c.mu.Unlock()
	c.changed()
	return Snapshot{}, fmt.Errorf("snapshot %s: %w", e.Snapshot, ErrNotFound)
}

// verify: o's credentials reach ref pinned to digest, and it is that
// digest (the kubelet's "ensure secret pulled images", with a registry
// round trip for every pod).
func (c *Cache) verify(ctx context.Context, ref, digest string, o PullOptions) error {
	dref, err := DigestRef(ref, digest)
	if err != nil {
		return err
	}
	got, err := c.lib.Resolve(ctx, dref, o)
	if err != nil {
		return fmt.Errorf("this node holds %s from a pull with credentials, and this pod's own credentials do not reach it: %w", dref, err)
	}
	if got != digest {
		return fmt.Errorf("%s resolves to %s with this pod's credentials", dref, got)
	}
	return nil
}

// used records a use of e by ref.
func (c *Cache) used(e *cacheEntry, ref string) {
	c.mu.Lock()
	e.LastUsed = c.now()
	newRef := !slices.Contains(e.Refs, ref)
	if newRef {
		e.Refs = append(e.Refs, ref)
		if len(e.Refs) > maxRefs {
			e.Refs = e.Refs[len(e.Refs)-maxRefs:]
		}
	}
	ec := *e
	c.mu.Unlock()
	if err := c.save(&ec); err != nil {
		c.log.Warn("cache: cannot record a use", "digest", e.Digest, "err", err)
	}
	if newRef {
		c.changed()
	}
}

// pull fetches digest as a snapshot of a name drawn for it (a name taken
// already is an error: the next try draws another), which must come back
// with kvbox-node's mark of digest.
func (c *Cache) pull(ctx context.Context, ref, digest string, o PullOptions) error {
	dref, err := DigestRef(ref, digest)
	if err != nil {
		return err
	}
	sname, err := newCacheName(digest)
	if err != nil {
		return err
	}
	t0 := c.now()
	s, err := c.lib.Pull(ctx, dref, sname, o)
	if err != nil {
		return err
	}
	if !ours(s, digest) {
		return fmt.Errorf("snapshot %s came without kvbox-node's mark of %s", sname, digest)
	}
	e := &cacheEntry{Digest: digest, Snapshot: s.Name, Refs: []string{ref}, Size: s.SizeBytes, LastUsed: c.now(),
		CPUs: s.CPUs, Memory: s.Memory, Disk: s.Disk, Credentialed: Credentialed(o, dref)}
	if err := c.save(e); err != nil {
		return fmt.Errorf("cache: %w", err)
	}
	c.mu.Lock()
	c.entries[digest] = e
	c.mu.Unlock()
	c.log.Info("pulled", "ref", ref, "digest", digest, "snapshot", s.Name, "bytes", s.SizeBytes, "credentialed", e.Credentialed,
		"seconds", c.now().Sub(t0).Seconds())
	return nil
}

func (c *Cache) release(sname string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.holds[sname]--; c.holds[sname] <= 0 {
		delete(c.holds, sname)
	}
}

// Images is the cache as node.status.images: each snapshot under its
// references and REPO@DIGEST, the most recently used first.
func (c *Cache) Images() []corev1.ContainerImage {
	c.mu.Lock()
	defer c.mu.Unlock()
	es := make([]*cacheEntry, 0, len(c.entries))
	for _, e := range c.entries {
		es = append(es, e)
	}
	sort.Slice(es, func(i, j int) bool { return es[i].LastUsed.After(es[j].LastUsed) })
	var out []corev1.ContainerImage
	for _, e := range es {
		names := slices.Clone(e.Refs)
		if len(names) > 0 {
			if d, err := DigestRef(names[len(names)-1], e.Digest); err == nil && !slices.Contains(names, d) {
				names = append(names, d)
			}
		}
		if len(names) == 0 {
			continue
		}
		out = append(out, corev1.ContainerImage{Names: names, SizeBytes: e.Size})
	}
	return out
}

// Collect removes snapshots of the cache, least recently used first, until
// what it holds fits the budget. One a box is cloned from, or held, stays.
func (c *Cache) Collect(ctx context.Context) error {
	if c.budget <= 0 {
		return nil
	}
	boxes, err := c.lib.Boxes(ctx)
	if err != nil {
		return err
	}
	used := map[string]bool{}
	for _, b := range boxes {
		used[b.Snapshot] = true
	}
	c.mu.Lock()
	var total int64
	var victims []*cacheEntry
	for _, e := range c.entries {
		total += e.Size
		if !used[e.Snapshot] {
			victims = append(victims, e)
		}
	}
	sort.Slice(victims, func(i, j int) bool { return victims[i].LastUsed.Before(victims[j].LastUsed) })
	c.mu.Unlock()
	removed := false
	for _, e := range victims {
		if total <= c.budget {
			break
		}
		c.mu.Lock()
		held := c.holds[e.Snapshot] > 0 || c.pulls[e.Digest] != nil
		if !held {
			// Out of the index first: a pod asking for it now pulls again.
			delete(c.entries, e.Digest)
		}
		c.mu.Unlock()
		if held {
			continue
		}
		s, err := c.lib.Snapshot(ctx, e.Snapshot)
		if err != nil && !errors.Is(err, ErrNotFound) {
			c.mu.Lock()
			c.entries[e.Digest] = e
			c.mu.Unlock()
			continue
		}
		if err != nil || !ours(s, e.Digest) {
			// Gone, or another snapshot in its place: out of the index,
			// and the snapshot (none of the cache's) left alone.
			os.Remove(c.entryFile(e.Digest))
			total -= e.Size
			removed = true
			c.log.Warn("cache: its snapshot is gone or not kvbox-node's any more: it leaves the cache (and is left alone)", "snapshot", e.Snapshot, "digest", e.Digest)
			continue
		}
		err = c.lib.RemoveSnapshot(ctx, e.Snapshot)
		if err != nil && !errors.Is(err, ErrNotFound) {
			c.mu.Lock()
			c.entries[e.Digest] = e
			c.mu.Unlock()
			c.log.Warn("cache: a snapshot stays", "snapshot", e.Snapshot, "err", err)
			continue
		}
		os.Remove(c.entryFile(e.Digest))
		total -= e.Size
		removed = true
		c.log.Info("cache: removed", "snapshot", e.Snapshot, "digest", e.Digest, "bytes", e.Size, "refs", strings.Join(e.Refs, ","))
	}
	if removed {
		c.changed()
	}
	return nil
}
