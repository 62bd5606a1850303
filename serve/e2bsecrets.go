package serve

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"
)

// E2B's Secrets (the SDK's Secret.create, update, getInfo, list, exists,
// destroy: /secrets and /secrets/{id or name}) are values a sandbox's
// network rules name (Secret.fill: ${e2b.secrets.NAME} in a header value)
// and that only kvbox's egress proxy on the host ever reads: serve keeps
// the value in the host's egress secret store (Host.SetSecret), never in
// a box, a box's definition or a response, and keeps its own index of
// them (name, id, version, metadata, times) in its folder.
//
// A secret is its tenant's: serve's tenant is the API key the request
// came with. A secret's name in the host's store is the tenant's scope
// (e2bs-, then 12 hex digits of a hash of the key) and the name, and a
// rule can only name the secrets of its own tenant: serve writes every
// reference itself, from ${e2b.secrets.NAME}, and refuses a header value
// that names the store (${secret:...}) or anything else. The host's own
// secrets (kvbox secrets set, for kvbox new --header) and another key's
// are out of a tenant's reach.

// e2bSecret is serve's index entry of one secret (never its value).
type e2bSecret struct {
	ID       string            `json:"id"`
	Name     string            `json:"name"`
	Tenant   string            `json:"tenant"`
	Version  int64             `json:"version"`
	Metadata map[string]string `json:"metadata"`
	Created  time.Time         `json:"created"`
	Updated  time.Time         `json:"updated"`
}

// secretJSON is E2B's Secret.
type secretJSON struct {
	SecretID       string            `json:"secretID"`
	Name           string            `json:"name"`
	CurrentVersion int64             `json:"currentVersion"`
	Metadata       map[string]string `json:"metadata"`
	CreatedAt      time.Time         `json:"createdAt"`
	UpdatedAt      time.Time         `json:"updatedAt"`
}

func (e e2bSecret) json() secretJSON {
	m := e.Metadata
	if m == nil {
		m = map[string]string{}
	}
	return secretJSON{SecretID: e.ID, Name: e.Name, CurrentVersion: e.Version, Metadata: m, CreatedAt: e.Created, UpdatedAt: e.Updated}
}

// secretIndex is serve's index of its tenants' secrets, in one file.
type secretIndex struct {
	path string
	mu   sync.Mutex
}

func (x *secretIndex) read() ([]e2bSecret, error) {
	data, err := os.ReadFile(x.path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var all []e2bSecret
	if err := json.Unmarshal(data, &all); err != nil {
		return nil, fmt.Errorf("serve: %s: %w", x.path, err)
	}
	return all, nil
}

func (x *secretIndex) write(all []e2bSecret) error {
	data, err := json.Marshal(all)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(x.path), 0o700); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(filepath.Dir(x.path), ".idx-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err = tmp.Write(data); err == nil {
		err = tmp.Sync()
	}
	if cerr := tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp.Name(), x.path)
	}
	return err
}

// Limits of E2B's secrets (its own for metadata; kvbox's for the rest).
const (
	maxSecretValue    = 8 << 10
	maxSecretName     = 46 // the store's 64, less the scope
	maxSecretMetadata = 32
	maxSecretsListed  = 100
)

var e2bSecretName = regexp.MustCompile(`^[a-z0-9][a-z0-9_.-]*$`)

// checkSecretName canonicalizes an E2B secret name (lower case, as E2B
// stores them) and says what is wrong with one kvbox cannot keep.
func checkSecretName(n string) (string, error) {
	c := strings.ToLower(n)
	switch {
	case c == "":
		return "", errorf(http.StatusBadRequest, "secret name: empty")
	case strings.HasPrefix(c, "sec_"):
		return "", errorf(http.StatusBadRequest, "secret name %q: sec_ starts secret ids, not names", n)
	case len(c) > maxSecretName || !e2bSecretName.MatchString(c):
		return "", errorf(http.StatusBadRequest, "secret name %q: kvbox takes 1 to %d of a-z 0-9 _ . - (a letter or digit first)", n, maxSecretName)
	}
	return c, nil
}

// checkSecretValue says what is wrong with a value a header cannot carry
// (never quoting it).
func checkSecretValue(v string) error {
	switch {
	case v == "":
		return errorf(http.StatusBadRequest, "secret value: empty")
	case len(v) > maxSecretValue:
		return errorf(http.StatusBadRequest, "secret value: %d bytes, at most %d", len(v), maxSecretValue)
	case !utf8.ValidString(v) || strings.ContainsAny(v, "\r\n\x00"):
		return errorf(http.StatusBadRequest, "secret value: a header value cannot hold a line break, NUL or bytes that are not UTF-8")
	}
	return nil
}

func checkSecretMetadata(m map[string]string) error {
	if len(m) > maxSecretMetadata {
		return errorf(http.StatusBadRequest, "secret metadata: %d entries, at most %d", len(m), maxSecretMetadata)
	}
	total := 0
	for k, v := range m {
		if len(k) > 128 || len(v) > 1024 {
			return errorf(http.StatusBadRequest, "secret metadata %q: keys up to 128 bytes, values up to 1024", k)
		}
		if err := errors.Join(checkText("secret metadata key", k, true), checkText("secret metadata value", v, false)); err != nil {
			return err
		}
		total += len(k) + len(v)
	}
	if total > 8192 {
		return errorf(http.StatusBadRequest, "secret metadata: %d bytes, at most 8192", total)
	}
	return nil
}

// tenant is the scope of the request's API key (the control plane has
// checked it).
func tenantOf(r *http.Request) string { return tenantOfKey(r.Header.Get(hdrAPIKey)) }

func tenantOfKey(key string) string {
	sum := sha256.Sum256([]byte("kvbox serve tenant\x00" + key))
	return hex.EncodeToString(sum[:6])
}

// storeName is the host store's name of tenant's secret name.
func storeName(tenant, name string) string { return "e2bs-" + tenant + "." + name }

// secretsCall serves /secrets and /secrets/{id or name}.
func (s *Server) secretsCall(w http.ResponseWriter, r *http.Request, parts []string, method func(...string) bool) {
	var err error
	switch {
	case len(parts) == 1:
		if !method(http.MethodGet, http.MethodPost) {
			return
		}
		if r.Method == http.MethodPost {
			err = s.createSecret(w, r)
		} else {
			err = s.listSecrets(w, r)
		}
	default:
		if !method(http.MethodGet, http.MethodPost, http.MethodDelete) {
			return
		}
		switch r.Method {
		case http.MethodGet:
			err = s.getSecret(w, r, parts[1])
		case http.MethodPost:
			err = s.updateSecret(w, r, parts[1])
		default:
			err = s.deleteSecret(w, r, parts[1])
		}
	}
	if err != nil {
		s.fail(w, r, err)
	}
}

type newSecretJSON struct {
	Name     string            `json:"name"`
	Value    *string           `json:"value"`
	Metadata map[string]string `json:"metadata"`
}

// decodeSecret reads a secret's creation or update (what names it in
// errors) and checks its value and metadata.
func decodeSecret(w http.ResponseWriter, r *http.Request, what func(newSecretJSON) (string, error)) (newSecretJSON, string, error) {
	var req newSecretJSON
	if e := decodeBody(w, r, &req, false); e != nil {
		return req, "", e
	}
	name, err := what(req)
	if err != nil {
		return req, "", err
	}
	if req.Value == nil {
		return req, "", errorf(http.StatusBadRequest, "secret %s: no value", name)
	}
	return req, name, errors.Join(checkSecretValue(*req.Value), checkSecretMetadata(req.Metadata))
}

func (s *Server) createSecret(w http.ResponseWriter, r *http.Request) error {
	req, name, err := decodeSecret(w, r, func(req newSecretJSON) (string, error) { return checkSecretName(req.Name) })
	if err != nil {
		return err
	}
	t := tenantOf(r)
	s.index.mu.Lock()
	defer s.index.mu.Unlock()
	all, err := s.index.read()
	if err != nil {
		return err
	}
	if slices.ContainsFunc(all, func(e e2bSecret) bool { return e.Tenant == t && e.Name == name }) {
		return errorf(http.StatusConflict, "secret %s exists: update it (Secret.update)", name)
	}
	if err := s.host.SetSecret(storeName(t, name), []byte(*req.Value)); err != nil {
		return fmt.Errorf("secret %s: %w", name, err)
	}
	now := time.Now().UTC().Truncate(time.Millisecond)
	e := e2bSecret{ID: "sec_" + newToken()[:24], Name: name, Tenant: t, Version: 1, Metadata: req.Metadata, Created: now, Updated: now}
	if err := s.index.write(append(all, e)); err != nil {
		s.host.RemoveSecret(storeName(t, name))
		return fmt.Errorf("secret %s: %w", name, err)
	}
	s.logf("secret %s made (version 1)", name)
	writeJSON(w, http.StatusCreated, e.json())
	return nil
}

// find is the index entry of tenant's secret id or name.
func findSecret(all []e2bSecret, tenant, idOrName string) int {
	n := strings.ToLower(idOrName)
	return slices.IndexFunc(all, func(e e2bSecret) bool { return e.Tenant == tenant && (e.ID == idOrName || e.Name == n) })
}

func (s *Server) getSecret(w http.ResponseWriter, r *http.Request, id string) error {
	s.index.mu.Lock()
	all, err := s.index.read()
	s.index.mu.Unlock()
	if err != nil {
		return err
	}
	i := findSecret(all, tenantOf(r), id)
	if i < 0 {
		return errorf(http.StatusNotFound, "secret %s not found", id)
	}
	writeJSON(w, http.StatusOK, all[i].json())
	return nil
}

func (s *Server) updateSecret(w http.ResponseWriter, r *http.Request, id string) error {
	req, _, err := decodeSecret(w, r, func(newSecretJSON) (string, error) { return id, nil })
	if err != nil {
		return err
	}
	t := tenantOf(r)
	s.index.mu.Lock()
	defer s.index.mu.Unlock()
	all, err := s.index.read()
	if err != nil {
		return err
	}
	i := findSecret(all, t, id)
	if i < 0 {
		return errorf(http.StatusNotFound, "secret %s not found", id)
	}
	e := &all[i]
	// The proxy reads the store at each request: the new value holds from
	// the sandboxes' next request.
	if err := s.host.SetSecret(storeName(t, e.Name), []byte(*req.Value)); err != nil {
		return fmt.Errorf("secret %s: %w", e.Name, err)
	}
	e.Version++
	e.Updated = time.Now().UTC().Truncate(time.Millisecond)
	if req.Metadata != nil {
		e.Metadata = req.Metadata
	}
	if err := s.index.write(all); err != nil {
		return fmt.Errorf("secret %s: %w", e.Name, err)
	}
	s.logf("secret %s updated (version %d)", e.Name, e.Version)
	writeJSON(w, http.StatusOK, e.json())
	return nil
}

func (s *Server) deleteSecret(w http.ResponseWriter, r *http.Request, id string) error {
	t := tenantOf(r)
	s.index.mu.Lock()
	defer s.index.mu.Unlock()
	all, err := s.index.read()
	if err != nil {
		return err
	}
	i := findSecret(all, t, id)
	if i < 0 {
		return errorf(http.StatusNotFound, "secret %s not found", id)
	}
	e := all[i]
	// Gone from the store first: a rule that names it fails its requests
	// from now on, as E2B's revoked secrets do.
	if err := s.host.RemoveSecret(storeName(t, e.Name)); err != nil && !errors.Is(err, ErrNotFound) {
		return fmt.Errorf("secret %s: %w", e.Name, err)
	}
	if err := s.index.write(slices.Delete(all, i, i+1)); err != nil {
		return fmt.Errorf("secret %s: %w", e.Name, err)
	}
	s.logf("secret %s removed", e.Name)
	w.WriteHeader(http.StatusNoContent)
	return nil
}

// listSecrets serves GET /secrets: the tenant's, by name, in pages
// (limit, nextToken: the last name of the page before).
func (s *Server) listSecrets(w http.ResponseWriter, r *http.Request) error {
	q := r.URL.Query()
	limit := maxSecretsListed
	if v := q.Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > maxSecretsListed {
			return errorf(http.StatusBadRequest, "limit %q: give 1 to %d", v, maxSecretsListed)
		}
		limit = n
	}
	s.index.mu.Lock()
	all, err := s.index.read()
	s.index.mu.Unlock()
	if err != nil {
		return err
	}
	t, after := tenantOf(r), q.Get("nextToken")
	var mine []e2bSecret
	for _, e := range all {
		if e.Tenant == t && e.Name > after {
			mine = append(mine, e)
		}
	}
	slices.SortFunc(mine, func(a, b e2bSecret) int { return strings.Compare(a.Name, b.Name) })
	if len(mine) > limit {
		mine = mine[:limit]
		w.Header().Set("X-Next-Token", mine[limit-1].Name)
	}
	out := make([]secretJSON, 0, len(mine))
	for _, e := range mine {
		out = append(out, e.json())
	}
	writeJSON(w, http.StatusOK, out)
	return nil
}

// hasSecret says whether tenant has secret name.
func (s *Server) hasSecret(tenant, name string) (bool, error) {
	s.index.mu.Lock()
	defer s.index.mu.Unlock()
	all, err := s.index.read()
	if err != nil {
		return false, err
	}
	return slices.ContainsFunc(all, func(e e2bSecret) bool { return e.Tenant == tenant && e.Name == name }), nil
}

// newSuffix is a short random suffix for a sandbox's header secrets.
func newSuffix() string {
	b := make([]byte, 3)
	rand.Read(b)
	return hex.EncodeToString(b)
}
