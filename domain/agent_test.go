package domain

import (
	"os"
	"strings"
	"testing"
)

func TestNameservers(t *testing.T) {
	f := t.TempDir() + "/resolv.conf"
	os.WriteFile(f, []byte("# generated\nnameserver 127.0.0.53\nnameserver 192.0.2.53\nnameserver ::1\nnameserver 2001:db8::53\noptions edns0\n"), 0o644)
	if got := nameservers(f); strings.Join(got, " ") != "192.0.2.53 2001:db8::53" {
		t.Errorf("nameservers = %v", got)
	}
}

// A box whose metadata names a hostname gets it in its identity (each
// start's too); any other box is called by its name.
func TestIdentityHostname(t *testing.T) {
	h := &Host{}
	if got := h.Identity(Box{Name: "default-web-0-1a2b", Meta: Meta{Hostname: "web-0"}}).Hostname; got != "web-0" {
		t.Errorf("hostname %q, want web-0", got)
	}
	if got := h.Identity(Box{Name: "dev"}).Hostname; got != "dev" {
		t.Errorf("hostname %q, want dev", got)
	}
}
