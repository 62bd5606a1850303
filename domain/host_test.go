package domain

import (
	"sync"
	"testing"
)

// A connection libvirtd closed (it restarted) is replaced on next use, by
// one goroutine while others ask for it too.
func TestConnReconnects(t *testing.T) {
	c, err := Connect("test:///default")
	if err != nil {
		t.Skipf("libvirt's test driver: %v", err)
	}
	h := &Host{URI: "test:///default"}
	h.SetConn(c)
	defer h.Close()
	if h.Conn() != c {
		t.Fatal("a live connection was replaced")
	}
	c.Close() // as libvirtd going away leaves it: not alive
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := h.Conn().ListAllDomains(0); err != nil {
				t.Errorf("list on the host's connection after it broke: %v", err)
			}
		}()
	}
	wg.Wait()
	if h.Conn() == c {
		t.Error("the broken connection is still the host's")
	}
}
