package libadapter

import (
	"context"
	"encoding/base64"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"kvbox.dev/kvbox/registry"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
)

// A pod's pull without credentials of its own sends none, though the
// node's docker config (HOME and DOCKER_CONFIG, in a folder of the
// test's) holds some for the registry: a registry on loopback that asks
// for Basic credentials gets no Authorization header. The options speak
// HTTPS only, but to a registry named insecure.
func TestOptionsSendNoNodeCredentials(t *testing.T) {
	home := t.TempDir()
	var mu sync.Mutex
	var auths []string
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		if a := r.Header.Get("Authorization"); a != "" {
			auths = append(auths, a)
		}
		mu.Unlock()
		w.Header().Set("WWW-Authenticate", `Basic realm="test"`)
		http.Error(w, "who are you", http.StatusUnauthorized)
	}))
	defer srv.Close()
	host := strings.TrimPrefix(srv.URL, "http://")
	dir := filepath.Join(home, ".docker")
	os.MkdirAll(dir, 0o700)
	cfg := `{"auths":{"` + host + `":{"auth":"` + base64.StdEncoding.EncodeToString([]byte("node:node-secret")) + `"}}}`
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("HOME", home)
	t.Setenv("DOCKER_CONFIG", dir)

	o := options(kvboxnode.PullOptions{Insecure: true})
	if _, _, err := registry.Inspect(context.Background(), host+"/team/web:v1", o); err == nil {
		t.Fatal("a registry answering 401 to everything: no error")
	}
	mu.Lock()
	defer mu.Unlock()
	if len(auths) > 0 {
		t.Errorf("a pull without the pod's credentials sent %v: the node's", auths)
	}
	if !options(kvboxnode.PullOptions{}).SecureOnly {
		t.Error("a pod's pull may speak plain HTTP to a registry not named insecure")
	}
}
