package registry

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sync"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/types"

	"kvbox.dev/kvbox/progress"
)

// Media types of a kvbox snapshot artifact.
const (
	ArtifactType   = "application/vnd.kvbox.snapshot.v1"
	ConfigType     = "application/vnd.kvbox.snapshot.config.v1+json"
	PartType       = "application/vnd.kvbox.snapshot.part.v1.sparse+zstd" // a snapshot file
	ImagePartType  = "application/vnd.kvbox.image.part.v1.sparse+zstd"    // a base image file
	AnnotTitle     = "org.opencontainers.image.title"
	AnnotApparent  = "dev.kvbox.apparent-size"
	AnnotDataBytes = "dev.kvbox.data-bytes"
)

// fileLayer is an encoded part kept in the blob cache: its bytes are what
// the registry stores, so compressed and uncompressed are the same blob.
type fileLayer struct {
	path     string
	dig      v1.Hash
	size     int64
	mt       types.MediaType
	title    string
	progress progress.Reporter // nil: none
	// ensure, if set, puts the blob at path first (it may have been
	// pruned since an earlier push encoded it).
	ensure func() error
}

func (l *fileLayer) Digest() (v1.Hash, error)            { return l.dig, nil }
func (l *fileLayer) DiffID() (v1.Hash, error)            { return l.dig, nil }
func (l *fileLayer) Size() (int64, error)                { return l.size, nil }
func (l *fileLayer) MediaType() (types.MediaType, error) { return l.mt, nil }
func (l *fileLayer) Compressed() (io.ReadCloser, error) {
	if l.ensure != nil {
		if err := l.ensure(); err != nil {
			return nil, err
		}
	}
	f, err := os.Open(l.path)
	if err != nil {
		return nil, err
	}
	return progressReader(f, l.title, l.size, l.progress), nil
}

// progressReader reports the reads of rc to a stage of rep named title,
// as bytes done of total, and ends the stage once all are read or rc is
// closed (rc itself when rep is nil). A blob read again (a retried
// upload) is a stage again, from 0.
func progressReader(rc io.ReadCloser, title string, total int64, rep progress.Reporter) io.ReadCloser {
	if rep == nil {
		return rc
	}
	st := rep.Stage(title)
	st.Bytes(0, total)
	return &progressRC{ReadCloser: rc, st: st, total: total}
}

type progressRC struct {
	io.ReadCloser
	st          progress.Stage
	done, total int64
	ended       sync.Once // Close may come from another goroutine than Read
}

func (p *progressRC) Read(b []byte) (int, error) {
	n, err := p.ReadCloser.Read(b)
	p.done += int64(n)
	p.st.Bytes(p.done, p.total)
	if p.done >= p.total {
		p.end()
	}
	return n, err
}

func (p *progressRC) Close() error {
	p.end()
	return p.ReadCloser.Close()
}

func (p *progressRC) end() { p.ended.Do(p.st.End) }

func (l *fileLayer) Uncompressed() (io.ReadCloser, error) { return os.Open(l.path) }

// cache is a folder of blobs named by digest (the state dir's
// registry-cache/): encoded parts waiting to be pushed and pulled blobs,
// so an interrupted transfer does not start over.
type cache struct{ dir string }

func (c cache) blob(h v1.Hash) string { return filepath.Join(c.dir, h.Algorithm+"-"+h.Hex) }

// put writes what fill writes into the cache and returns its digest.
func (c cache) put(fill func(w io.Writer) error) (v1.Hash, int64, error) {
	if err := os.MkdirAll(c.dir, 0o700); err != nil {
		return v1.Hash{}, 0, err
	}
	f, err := os.CreateTemp(c.dir, ".part-*")
	if err != nil {
		return v1.Hash{}, 0, err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	h := sha256.New()
	cw := &countWriter{w: io.MultiWriter(f, h)}
	if err := fill(cw); err != nil {
		return v1.Hash{}, 0, err
	}
	if err := f.Sync(); err != nil {
		return v1.Hash{}, 0, err
	}
	dig := v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(h.Sum(nil))}
	if err := os.Rename(f.Name(), c.blob(dig)); err != nil {
		return v1.Hash{}, 0, err
	}
	return dig, cw.n, nil
}

// verify says whether the cached blob is there with the right digest.
func (c cache) verify(h v1.Hash, size int64) bool {
	f, err := os.Open(c.blob(h))
	if err != nil {
		return false
	}
	defer f.Close()
	hs := sha256.New()
	n, err := io.Copy(hs, f)
	if err != nil || n != size || hex.EncodeToString(hs.Sum(nil)) != h.Hex {
		os.Remove(c.blob(h))
		return false
	}
	return true
}

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

func hashErr(want v1.Hash, got string) error {
	return fmt.Errorf("blob %s refused: its content hashes to sha256:%s (tampered or corrupt in the registry)", want, got)
}
