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
