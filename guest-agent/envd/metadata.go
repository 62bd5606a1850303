package envd

import (
	"errors"
	"fmt"
	"net/http"
	"os"
	"strings"
	"syscall"
	"unicode/utf8"

	"golang.org/x/sys/unix"
)

// File metadata (envd 0.6.2): a file's user-defined key/value pairs, kept
// as its extended attributes user.e2b.KEY. An upload sets them from its
// X-Metadata-KEY headers (keys lowercased, as HTTP header names are
// case-insensitive), replacing whatever the file had; every EntryInfo and
// the upload's answer carry them back.

// metadataHeaderPrefix starts the upload headers that carry metadata.
const metadataHeaderPrefix = "X-Metadata-"

// metadataXattrPrefix is the extended attributes' namespace: user. is the
// one an unprivileged file owner may write; e2b. keeps clear of other
// tools' attributes.
const metadataXattrPrefix = "user.e2b."

// maxMetadataKey bounds a key: the kernel limits an attribute's name to
// 255 bytes, prefix included.
const maxMetadataKey = 255 - len(metadataXattrPrefix)

// maxMetadataTotal bounds a file's metadata, names and values: ext4 keeps
// a file's attributes in one block.
const maxMetadataTotal = 4096

// metadataHeaders is the metadata an upload's headers carry (nil: none),
// checked.
func metadataHeaders(h http.Header) (map[string]string, error) {
	var m map[string]string
	for name, vs := range h {
		if len(vs) == 0 || len(name) <= len(metadataHeaderPrefix) || !strings.EqualFold(name[:len(metadataHeaderPrefix)], metadataHeaderPrefix) {
			continue
		}
		if m == nil {
			m = map[string]string{}
		}
		m[strings.ToLower(name[len(metadataHeaderPrefix):])] = vs[0]
	}
	return m, checkMetadata(m)
}

// checkMetadata refuses what cannot be kept as given: an empty or long key,
// anything but printable ASCII, more than a block in all.
func checkMetadata(m map[string]string) error {
	total := 0
	for k, v := range m {
		if k == "" {
			return errors.New("a metadata key is empty")
		}
		if len(k) > maxMetadataKey {
			return fmt.Errorf("metadata key %q is longer than %d bytes", k, maxMetadataKey)
		}
		for _, s := range []string{k, v} {
			for i := 0; i < len(s); i++ {
				if s[i] < 0x20 || s[i] > 0x7e {
					return fmt.Errorf("metadata %q: byte 0x%02x is not printable ASCII", k, s[i])
				}
			}
		}
		total += len(metadataXattrPrefix) + len(k) + len(v)
	}
	if total > maxMetadataTotal {
		return fmt.Errorf("the metadata is %d bytes, more than %d", total, maxMetadataTotal)
	}
	return nil
}

// writeMetadata makes m the metadata of the open file f: the keys m lacks
// go (an overwritten file keeps its attributes through the truncation).
// A filesystem without extended attributes (proc, sys) keeps none, and
// says nothing: the answer reads the metadata back.
func writeMetadata(f *os.File, m map[string]string) error {
	fd := int(f.Fd())
	names, err := xattrNames(func(b []byte) (int, error) { return unix.Flistxattr(fd, b) })
	if xattrUnsupported(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, n := range names {
		if k, ok := strings.CutPrefix(n, metadataXattrPrefix); ok {
			if _, keep := m[k]; !keep {
				if err := unix.Fremovexattr(fd, n); err != nil && !errors.Is(err, unix.ENODATA) {
					return err
				}
			}
		}
	}
	for k, v := range m {
		if err := unix.Fsetxattr(fd, metadataXattrPrefix+k, []byte(v), 0); err != nil {
			if xattrUnsupported(err) {
				return nil
			}
			return err
		}
	}
	return nil
}

// readMetadata is the metadata of the file at path (nil: none, or none can
// be read); a symlink has none of its own. Values that are not UTF-8 (set
// in the guest by other means) are left out: EntryInfo's map cannot carry
// them.
func readMetadata(path string) map[string]string {
	names, err := xattrNames(func(b []byte) (int, error) { return unix.Llistxattr(path, b) })
	if err != nil {
		return nil
	}
	var m map[string]string
	for _, n := range names {
		k, ok := strings.CutPrefix(n, metadataXattrPrefix)
		if !ok {
			continue
		}
		v, err := xattrValue(path, n)
		if err != nil || !utf8.ValidString(k) || !utf8.Valid(v) {
			continue
		}
		if m == nil {
			m = map[string]string{}
		}
		m[k] = string(v)
	}
	return m
}

// xattrNames lists attribute names with list (a listxattr call), growing
// its buffer while the list grows under it.
func xattrNames(list func([]byte) (int, error)) ([]string, error) {
	for range 8 {
		n, err := list(nil)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return nil, nil
		}
		buf := make([]byte, n)
		n, err = list(buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		var out []string
		for _, s := range strings.Split(string(buf[:n]), "\x00") {
			if s != "" {
				out = append(out, s)
			}
		}
		return out, nil
	}
	return nil, unix.ERANGE
}

func xattrValue(path, name string) ([]byte, error) {
	for range 8 {
		n, err := unix.Lgetxattr(path, name, nil)
		if err != nil {
			return nil, err
		}
		buf := make([]byte, n)
		n, err = unix.Lgetxattr(path, name, buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
	return nil, unix.ERANGE
}

func xattrUnsupported(err error) bool {
	return errors.Is(err, syscall.ENOTSUP) || errors.Is(err, syscall.EOPNOTSUPP)
}
