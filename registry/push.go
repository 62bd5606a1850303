// Package registry pushes snapshots to an OCI registry and pulls them
// back, as artifacts a second host can clone from.
//
// A snapshot artifact is an OCI image manifest whose layers are the files
// of the snapshot folder and of the base image it stands on (disk, kernel,
// initrd, image.json), each encoded as an extent map plus zstd data so
// holes cost nothing (see sparse.go). The manifest's annotations carry the
// source paths (rewritten on pull) and what a restore needs (Compat),
// checked against the pulling host before any blob is fetched.
package registry

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/progress"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/statedir"
)

// Manifest annotations.
const (
	AnnotKind      = "dev.kvbox.kind" // ArtifactType
	AnnotSnapshot  = "dev.kvbox.snapshot"
	AnnotStateDir  = "dev.kvbox.state-dir"
	AnnotImageDir  = "dev.kvbox.image-dir"
	AnnotImageName = "dev.kvbox.image"
	AnnotCompat    = "dev.kvbox.compat"
)

// Options are how to reach the registry.
type Options struct {
	Insecure bool   // plain HTTP
	Username string // with Password, instead of docker's config.json
	Password string
	// Keychain gives the credentials of a repository when Username is
	// empty (nil: docker's config.json and credential helpers, as the CLI
	// uses them; a keychain that resolves to authn.Anonymous sends none).
	Keychain authn.Keychain
	// SecureOnly speaks HTTPS only unless Insecure is set: no request in
	// plain HTTP at all, also for registries go-containerregistry would
	// try in plain HTTP after HTTPS (localhost, loopback and private
	// addresses) and for a token service a registry names by an http URL.
	SecureOnly bool
	// MaxCPUs, MaxMemoryBytes and MaxDiskBytes bound the snapshot a pull
	// takes (0: kvbox's own limits): one that declares more is refused
	// before its memory and disk parts are fetched.
	MaxCPUs        int
	MaxMemoryBytes int64
	MaxDiskBytes   int64
	// Progress gets one log line per part and, as each part's bytes go
	// to or come from the registry, a stage named by the part's title
	// (several may be in flight at once); nil: quiet. A pulled artifact
	// names its parts' titles: whatever shows them makes them printable
	// (the CLI's terminal.Progress does).
	Progress progress.Reporter
	// DomainType is the libvirt domain type kvbox uses on this host, for
	// the compatibility check of a pull.
	DomainType string
	// Emulator is the <emulator> this host gives kvbox's boxes
	// (domain.Host.Emulator; "" for libvirt's default): a pulled
	// snapshot's clones run it, whatever the artifact named.
	Emulator string
}

func (o Options) ref(s string) (name.Reference, error) {
	var opts []name.Option
	if o.Insecure {
		opts = append(opts, name.Insecure)
	}
	r, err := name.ParseReference(s, opts...)
	if err != nil {
		return nil, fmt.Errorf("bad reference %q (want HOST[:PORT]/REPO[:TAG]): %w", s, err)
	}
	return r, nil
}

func (o Options) remote(ctx context.Context, counter *counter) []remote.Option {
	auth := remote.WithAuthFromKeychain(authn.DefaultKeychain)
	switch {
	case o.Username != "":
		auth = remote.WithAuth(&authn.Basic{Username: o.Username, Password: o.Password})
	case o.Keychain != nil:
		auth = remote.WithAuthFromKeychain(o.Keychain)
	}
	var rt http.RoundTripper = remote.DefaultTransport
	if o.SecureOnly && !o.Insecure {
		rt = httpsOnly{rt}
	}
	return []remote.Option{auth, remote.WithContext(ctx), remote.WithTransport(counter.wrap(rt)),
		remote.WithJobs(2)}
}

// httpsOnly refuses every request that is not HTTPS (Options.SecureOnly).
type httpsOnly struct{ rt http.RoundTripper }

func (t httpsOnly) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.URL.Scheme != "https" {
		if r.Body != nil {
			r.Body.Close()
		}
		return nil, fmt.Errorf("%s: plain HTTP to %s refused: only a registry named insecure is spoken to without TLS", r.URL.Scheme, r.URL.Host)
	}
	return t.rt.RoundTrip(r)
}

func (o Options) logf(format string, a ...any) {
	if o.Progress != nil {
		o.Progress.Log(fmt.Sprintf(format, a...))
	}
}

// counter counts the bytes sent in request bodies and received in
// response bodies.
type counter struct{ sent, recv atomic.Int64 }

type countRT struct {
	c  *counter
	rt http.RoundTripper
}

func (c *counter) wrap(rt http.RoundTripper) http.RoundTripper { return countRT{c, rt} }

func (t countRT) RoundTrip(r *http.Request) (*http.Response, error) {
	if r.Body != nil {
		r.Body = &countReader{ReadCloser: r.Body, n: &t.c.sent}
	}
	resp, err := t.rt.RoundTrip(r)
	if resp != nil && resp.Body != nil {
		resp.Body = &countReader{ReadCloser: resp.Body, n: &t.c.recv}
	}
	return resp, err
}

type countReader struct {
	io.ReadCloser
	n *atomic.Int64
}

func (c *countReader) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	c.n.Add(int64(n))
	return n, err
}

// Part is one file of the artifact.
type Part struct {
	Title     string `json:"title"` // snapshot/FILE or image/FILE
	Digest    string `json:"digest"`
	Blob      int64  `json:"blob_bytes"`     // what the registry stores
	Apparent  int64  `json:"apparent_bytes"` // the file's size with holes
	DataBytes int64  `json:"data_bytes"`     // bytes outside holes
}

// PushResult is what a push did.
type PushResult struct {
	Ref      string        `json:"ref"`
	Digest   string        `json:"digest"`
	Parts    []Part        `json:"parts"`
	Known    int           `json:"known_parts"` // parts an earlier push had encoded: not encoded again
	Sent     int64         `json:"sent_bytes"`  // request bodies, blobs and manifest
	OnDisk   int64         `json:"on_disk_bytes"`
	Encode   time.Duration `json:"encode_ns"`
	Transfer time.Duration `json:"transfer_ns"`
}

// imageDir is the base image version folder of a snapshot (its disk's folder).
func imageDir(s snapshot.Snapshot) string { return filepath.Dir(s.BaseDisk) }

func regularFiles(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if e.Type().IsRegular() && e.Name()[0] != '.' {
			out = append(out, e.Name())
		}
	}
	sort.Strings(out)
	return out, nil
}

// Push sends snapshot s, and the base image under it, to ref.
func Push(ctx context.Context, stateDir string, s snapshot.Snapshot, refStr string, o Options) (PushResult, error) {
	ref, err := o.ref(refStr)
	if err != nil {
		return PushResult{}, err
	}
	compat, err := snapshot.LoadCompat(s.Dir)
	if err != nil {
		return PushResult{}, err
	}
	c := cache{statedir.Layout{Root: stateDir}.RegistryCache()}
	p := &pusher{c: c, memo: loadMemo(c), o: o, res: PushResult{Ref: ref.String()}}
	t0 := time.Now()
	idir := imageDir(s)
	if err := p.addAll(ctx, s, idir); err != nil {
		return p.res, err
	}
	p.res.Encode = time.Since(t0)
	sd, _ := overlay.Du(s.Dir)
	id, _ := overlay.Du(idir)
	p.res.OnDisk = sd + id
	defer pruneCache(c, p.res.Parts)

	cj, _ := json.Marshal(compat)
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, ConfigType)
	img, err = mutate.Append(img, p.adds...)
	if err != nil {
		return p.res, err
	}
	img = mutate.Annotations(img, map[string]string{
		AnnotKind: ArtifactType, AnnotSnapshot: s.Name, AnnotStateDir: stateDir, AnnotImageDir: idir,
		AnnotImageName: s.Image, AnnotCompat: string(cj),
	}).(v1.Image)
	var cnt counter
	t1 := time.Now()
	if err := remote.Write(ref, img, o.remote(ctx, &cnt)...); err != nil {
		return p.res, fmt.Errorf("push %s: %w", ref, err)
	}
	p.res.Transfer = time.Since(t1)
	p.res.Sent = cnt.sent.Load()
	p.memo.save()
	d, err := img.Digest()
	if err != nil {
		return p.res, err
	}
	p.res.Digest = d.String()
	return p.res, nil
}

// pusher gathers the parts of one push.
type pusher struct {
	c    cache
	memo *memo
	o    Options
	res  PushResult
	adds []mutate.Addendum
}

// addAll adds every file of the snapshot, of its base image's version
// folder, and the image's metadata.
func (p *pusher) addAll(ctx context.Context, s snapshot.Snapshot, idir string) error {
	files, err := regularFiles(s.Dir)
	if err != nil {
		return err
	}
	for _, f := range files {
		if err := p.add(ctx, "snapshot", s.Dir, f, PartType); err != nil {
			return err
		}
	}
	ifiles, err := regularFiles(idir)
	if err != nil {
		return fmt.Errorf("base image of snapshot %q: %w", s.Name, err)
	}
	for _, f := range ifiles {
		if err := p.add(ctx, "image", idir, f, ImagePartType); err != nil {
			return err
		}
	}
	if _, err := os.Stat(filepath.Join(filepath.Dir(idir), "image.json")); err == nil {
		return p.add(ctx, "image-meta", filepath.Dir(idir), "image.json", ImagePartType)
	}
	return nil
}

// add makes one file a part: encoded into the cache, or, when the memo
// knows the file, its remembered digest with the encoding left to the
// moment the registry turns out to lack the blob.
func (p *pusher) add(ctx context.Context, kind, dir, file string, mt types.MediaType) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	path := filepath.Join(dir, file)
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	key := memoKey(path, fi)
	e, known := p.memo.get(key)
	var dig v1.Hash
	if known {
		if dig, err = v1.NewHash(e.Digest); err != nil {
			known = false
		}
	}
	if !known {
		var n, size, data int64
		dig, n, err = p.c.put(func(w io.Writer) error {
			var err error
			size, data, err = encodeSparse(path, w)
			return err
		})
		if err != nil {
			return err
		}
		e = memoEntry{Digest: dig.String(), Blob: n, Apparent: size, Data: data}
		p.memo.put(key, e)
	}
	part := Part{Title: kind + "/" + file, Digest: e.Digest, Blob: e.Blob, Apparent: e.Apparent, DataBytes: e.Data}
	p.res.Parts = append(p.res.Parts, part)
	l := &fileLayer{path: p.c.blob(dig), dig: dig, size: e.Blob, mt: mt, title: part.Title, progress: p.o.Progress}
	if known {
		p.res.Known++
		l.ensure = func() error { return p.c.ensureBlob(p.memo, key, path, dig, e.Blob) }
	}
	p.adds = append(p.adds, mutate.Addendum{
		Layer:     l,
		MediaType: mt,
		Annotations: map[string]string{
			AnnotTitle: part.Title, AnnotApparent: strconv.FormatInt(e.Apparent, 10), AnnotDataBytes: strconv.FormatInt(e.Data, 10),
		},
	})
	how := "encoded"
	if known {
		how = "known from an earlier push, not encoded"
	}
	p.o.logf("  %-24s %s, %s of data in %s apparent, %s blob (%s)", part.Title, short(dig), human(e.Data), human(e.Apparent), human(e.Blob), how)
	return nil
}

// pruneCache removes the encoded parts of a push (they are only needed
// while it runs): keeping them would double the snapshot's disk cost.
func pruneCache(c cache, parts []Part) {
	for _, p := range parts {
		if h, err := v1.NewHash(p.Digest); err == nil {
			os.Remove(c.blob(h))
		}
	}
}

func short(h v1.Hash) string { return h.Algorithm + ":" + h.Hex[:12] }

func human(n int64) string {
	switch {
	case n >= 1<<30:
		return fmt.Sprintf("%.2f GiB", float64(n)/(1<<30))
	case n >= 1<<20:
		return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
	case n >= 1<<10:
		return fmt.Sprintf("%.1f KiB", float64(n)/(1<<10))
	}
	return fmt.Sprintf("%d B", n)
}
