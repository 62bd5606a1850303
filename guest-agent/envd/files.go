package envd

import (
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"mime"
	"mime/multipart"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/klauspost/compress/gzip"

	"kvbox.dev/kvbox/guest-agent/guestexec"
)

// Signature is the signature of a /files URL the SDKs make
// (downloadUrl, uploadUrl) for a sandbox whose token is token: "v1_" and
// the unpadded base64 of the SHA-256 of "path:operation:user:token", with
// ":expiration" (Unix seconds) when the URL expires. operation is "read"
// or "write"; user is the URL's username, "" when it names none.
func Signature(path, operation, user, token string, expiration int64) string {
	raw := path + ":" + operation + ":" + user + ":" + token
	if expiration != 0 {
		raw += ":" + strconv.FormatInt(expiration, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// filesAuthorized reports whether a /files request may be served: it is
// the host's, or it carries the local token, or a valid, unexpired
// signature of its path, operation and user made with that token.
func (s *Server) filesAuthorized(r *http.Request, operation string) (bool, string) {
	if s.tokenOK(r.Context(), r.Header) {
		return true, ""
	}
	tok := s.LocalToken()
	if tok == "" {
		return false, errToken.Error()
	}
	q := r.URL.Query()
	sig := q.Get("signature")
	if sig == "" {
		return false, errToken.Error() + " or signature"
	}
	var exp int64
	if e := q.Get("signature_expiration"); e != "" {
		var err error
		if exp, err = strconv.ParseInt(e, 10, 64); err != nil {
			return false, "signature_expiration is not a Unix time"
		}
		if time.Now().Unix() > exp {
			return false, "the signature has expired"
		}
	}
	want := Signature(q.Get("path"), operation, q.Get("username"), tok, exp)
	if subtle.ConstantTimeCompare([]byte(sig), []byte(want)) != 1 {
		return false, "the signature does not match"
	}
	return true, ""
}

// filesCaller is the user a /files request for operation runs as, once
// it is authorized; otherwise it answers the request and returns false.
func (s *Server) filesCaller(w http.ResponseWriter, r *http.Request, operation string) (*guestexec.User, bool) {
	if ok, why := s.filesAuthorized(r, operation); !ok {
		httpError(w, http.StatusUnauthorized, why)
		return nil, false
	}
	u, err := s.filesUser(r)
	if err != nil {
		httpError(w, http.StatusBadRequest, err.Error())
		return nil, false
	}
	return u, true
}

// filesUser is the user a /files request runs as: its username parameter,
// else its Basic authorization, else the default user.
func (s *Server) filesUser(r *http.Request) (*guestexec.User, error) {
	if name := r.URL.Query().Get("username"); name != "" {
		return s.lookupUser(name)
	}
	return s.userFromHeader(r.Header)
}

// fileStatus is the HTTP status of a file error.
func fileStatus(err error) int {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return http.StatusNotFound
	case errors.Is(err, fs.ErrPermission):
		return http.StatusForbidden
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return http.StatusInsufficientStorage
	case errors.Is(err, syscall.EISDIR), errors.Is(err, syscall.ENOTDIR):
		return http.StatusBadRequest
	}
	return http.StatusInternalServerError
}

// getFile answers GET /files?path=: the file's bytes, gzip-compressed
// when the client accepts it (a Range request is answered uncompressed).
func (s *Server) getFile(w http.ResponseWriter, r *http.Request) {
	u, ok := s.filesCaller(w, r, "read")
	if !ok {
		return
	}
	path, err := resolvePath(r.URL.Query().Get("path"), u)
	if err != nil {
		httpError(w, http.StatusBadRequest, "path: "+err.Error())
		return
	}
	f, err := os.Open(path)
	if err != nil {
		httpError(w, fileStatus(err), err.Error())
		return
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		httpError(w, fileStatus(err), err.Error())
		return
	}
	if !st.Mode().IsRegular() {
		httpError(w, http.StatusBadRequest, fmt.Sprintf("%s is not a file", path))
		return
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	w.Header().Set("Content-Disposition", mime.FormatMediaType("inline", map[string]string{"filename": filepath.Base(path)}))
	if r.Header.Get("Range") == "" && acceptsGzip(r.Header.Get("Accept-Encoding")) && st.Size() > 0 {
		w.Header().Set("Content-Encoding", "gzip")
		w.Header().Add("Vary", "Accept-Encoding")
		zw, _ := gzip.NewWriterLevel(w, gzip.BestSpeed)
		if _, err := io.Copy(zw, f); err != nil {
			s.logf("GET /files %s: %v", path, err)
			return
		}
		zw.Close()
		return
	}
	http.ServeContent(w, r, "", st.ModTime(), f)
}

// acceptsGzip reports whether an Accept-Encoding value allows gzip.
func acceptsGzip(v string) bool {
	for _, part := range strings.Split(v, ",") {
		enc, params, _ := strings.Cut(strings.TrimSpace(part), ";")
		if !strings.EqualFold(strings.TrimSpace(enc), "gzip") {
			continue
		}
		if q, ok := strings.CutPrefix(strings.ReplaceAll(params, " ", ""), "q="); ok {
			if f, err := strconv.ParseFloat(q, 64); err == nil && f == 0 {
				return false
			}
		}
		return true
	}
	return false
}

// writtenEntry is one element of POST /files's answer; Metadata is the
// file's metadata as read back from it (none: left out).
type writtenEntry struct {
	Path     string            `json:"path"`
	Name     string            `json:"name"`
	Type     string            `json:"type"`
	Metadata map[string]string `json:"metadata,omitempty"`
}

// postFiles answers POST /files: multipart/form-data with one part per
// file (field "file", to ?path=, else to its filename), or the
// bytes of one file (application/octet-stream, maybe gzip-encoded) to
// ?path=. Each file is written in place, as E2B's envd writes it: an
// existing file keeps its inode and mode (a watcher sees it written, a
// process that has it open reads the new bytes), and its metadata
// becomes the request's X-Metadata-* headers (file metadata: xattrs).
func (s *Server) postFiles(w http.ResponseWriter, r *http.Request) {
	u, ok := s.filesCaller(w, r, "write")
	if !ok {
		return
	}
	meta, err := metadataHeaders(r.Header)
	if err != nil {
		httpError(w, http.StatusBadRequest, "invalid metadata: "+err.Error())
		return
	}
	qpath := r.URL.Query().Get("path")
	mt, params, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	var written []writtenEntry
	var status int
	switch {
	case mt == "multipart/form-data":
		written, status, err = s.writeParts(multipart.NewReader(r.Body, params["boundary"]), qpath, u, meta)
	case mt == "application/octet-stream" || mt == "":
		written, status, err = s.writeBody(r, qpath, u, meta)
	default:
		status, err = http.StatusBadRequest, fmt.Errorf("content type %q: send multipart/form-data or application/octet-stream", mt)
	}
	if err != nil {
		httpError(w, status, err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(written)
}

// writeParts writes each part named "file" of a multipart body (gzip-
// encoded or not) to qpath, else to the part's filename.
func (s *Server) writeParts(mr *multipart.Reader, qpath string, u *guestexec.User, meta map[string]string) ([]writtenEntry, int, error) {
	var written []writtenEntry
	for {
		part, err := mr.NextRawPart()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return nil, http.StatusBadRequest, fmt.Errorf("multipart body: %w", err)
		}
		// The part's filename is the whole target path: Part.FileName
		// would keep only its last element.
		_, dp, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
		if dp["name"] != "file" {
			part.Close()
			continue
		}
		// ?path= names the target of a one-file write (SDKs before
		// 2.15 send the part without a usable filename then); the
		// filename names each file of a write of several.
		target := qpath
		if target == "" {
			target = dp["filename"]
		}
		var body io.Reader = part
		if strings.EqualFold(part.Header.Get("Content-Encoding"), "gzip") {
			zr, err := gzip.NewReader(part)
			if err != nil {
				return nil, http.StatusBadRequest, fmt.Errorf("gzip part: %w", err)
			}
			body = zr
		}
		e, status, err := s.writeFile(target, body, u, meta)
		part.Close()
		if err != nil {
			return nil, status, err
		}
		written = append(written, e)
	}
	if len(written) == 0 {
		return nil, http.StatusBadRequest, errors.New(`multipart body: no part named "file"`)
	}
	return written, 0, nil
}

// writeBody writes the request's body (gzip-encoded or not) to qpath.
func (s *Server) writeBody(r *http.Request, qpath string, u *guestexec.User, meta map[string]string) ([]writtenEntry, int, error) {
	if qpath == "" {
		return nil, http.StatusBadRequest, errors.New("an octet-stream upload needs ?path=")
	}
	var body io.Reader = r.Body
	if strings.EqualFold(r.Header.Get("Content-Encoding"), "gzip") {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			return nil, http.StatusBadRequest, fmt.Errorf("gzip body: %w", err)
		}
		body = zr
	}
	e, status, err := s.writeFile(qpath, body, u, meta)
	if err != nil {
		return nil, status, err
	}
	return []writtenEntry{e}, 0, nil
}

// writeFile writes body to target (relative to u's home) as u, making the
// missing directories: in place, truncated first, as E2B's envd does (a
// watcher sees the file written, not a temporary renamed over it), so an
// upload cut short leaves the file with what arrived. The file is u's and
// its metadata is meta, whatever it had before.
func (s *Server) writeFile(target string, body io.Reader, u *guestexec.User, meta map[string]string) (writtenEntry, int, error) {
	path, err := resolvePath(target, u)
	if err != nil {
		return writtenEntry{}, http.StatusBadRequest, fmt.Errorf("path: %w", err)
	}
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return writtenEntry{}, http.StatusBadRequest, fmt.Errorf("%s is a directory", path)
	}
	if err := mkdirAllAs(filepath.Dir(path), u); err != nil {
		return writtenEntry{}, fileStatus(err), err
	}
	// O_NONBLOCK: a FIFO at path is not waited on (it is refused below).
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_TRUNC|syscall.O_NONBLOCK, 0o644)
	if err != nil {
		return writtenEntry{}, fileStatus(err), err
	}
	defer f.Close()
	if st, err := f.Stat(); err != nil || !st.Mode().IsRegular() {
		return writtenEntry{}, http.StatusBadRequest, fmt.Errorf("%s is not a plain file", path)
	}
	if os.Geteuid() == 0 {
		if err := f.Chown(int(u.UID), int(u.GID)); err != nil {
			return writtenEntry{}, fileStatus(err), err
		}
	}
	if _, err := io.Copy(f, body); err != nil {
		return writtenEntry{}, fileStatus(err), fmt.Errorf("write %s: %w", path, err)
	}
	if err := writeMetadata(f, meta); err != nil {
		return writtenEntry{}, fileStatus(err), fmt.Errorf("metadata of %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return writtenEntry{}, fileStatus(err), fmt.Errorf("write %s: %w", path, err)
	}
	return writtenEntry{Path: path, Name: filepath.Base(path), Type: "file", Metadata: readMetadata(path)}, 0, nil
}
