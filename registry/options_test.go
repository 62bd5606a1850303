package registry

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// SecureOnly sends nothing in plain HTTP unless the registry is named
// insecure: go-containerregistry on its own falls back to plain HTTP for a
// loopback or private host (here a plain HTTP server on 127.0.0.1).
func TestSecureOnlyRefusesPlainHTTP(t *testing.T) {
	var got atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got.Add(1)
		http.Error(w, "a service of this host that is no registry", http.StatusNotFound)
	}))
	defer srv.Close()
	ref := strings.TrimPrefix(srv.URL, "http://") + "/team/web:v1"
	inspect := func(o Options) (int32, error) {
		got.Store(0)
		_, _, err := Inspect(context.Background(), ref, o)
		return got.Load(), err
	}
	if n, _ := inspect(Options{}); n == 0 {
		t.Fatalf("without SecureOnly no plain HTTP request reached %s: the fallback this test guards against is gone", srv.URL)
	}
	n, err := inspect(Options{SecureOnly: true})
	if n != 0 || err == nil {
		t.Errorf("SecureOnly: %d plain HTTP requests reached the server (err %v); want none", n, err)
	}
	if n, _ := inspect(Options{SecureOnly: true, Insecure: true}); n == 0 {
		t.Errorf("SecureOnly with the registry named insecure: no request reached it")
	}
}
