package snapshot

import (
	"strings"
	"testing"
)

// A snapshot whose agent speaks another major protocol version is refused
// before libvirt is asked anything.
func TestCompatRefusesAnotherAgentProtocol(t *testing.T) {
	err := Compat{DomainType: "qemu", Agent: "9.0.0"}.Check(nil, "qemu")
	if err == nil || !strings.Contains(err.Error(), "protocol 9.0.0") {
		t.Fatalf("Check of an agent 9.0.0 snapshot: %v", err)
	}
}

func TestMajor(t *testing.T) {
	for v, want := range map[string]string{"0.1.0": "0", "12.3.4": "12", "7": "7", "": ""} {
		if got := major(v); got != want {
			t.Errorf("major(%q) = %q, want %q", v, got, want)
		}
	}
}
