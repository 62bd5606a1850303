package snapshot

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	agent "kvbox.dev/kvbox/guest-agent"
)

// A snapshot whose agent speaks another major protocol version is refused
// before libvirt is asked anything.
func TestCompatRefusesAnotherAgentProtocol(t *testing.T) {
	err := Compat{DomainType: "qemu", Agent: "9.0.0"}.Check(nil, "qemu")
	if err == nil || !strings.Contains(err.Error(), "protocol 9.0.0") {
		t.Fatalf("Check of an agent 9.0.0 snapshot: %v", err)
	}
	// A front tells the refusal apart (kvbox-node: the pod fails,
	// waiting does not help), wrapped or not, and the text is one line.
	if !errors.Is(fmt.Errorf("snapshot %q: %w", "warm", err), ErrIncompatible) {
		t.Errorf("%v is not ErrIncompatible", err)
	}
	if !strings.HasPrefix(err.Error(), "incompatible host: ") || strings.Contains(err.Error(), "\n") {
		t.Errorf("refusal %q", err)
	}
	kvm := Compat{DomainType: "kvm", Agent: agent.Version}.Check(nil, "qemu")
	if !errors.Is(kvm, ErrIncompatible) {
		t.Errorf("a kvm snapshot on a TCG host: %v, want ErrIncompatible", kvm)
	}
}

func TestMajor(t *testing.T) {
	for v, want := range map[string]string{"0.1.0": "0", "12.3.4": "12", "7": "7", "": ""} {
		if got := major(v); got != want {
			t.Errorf("major(%q) = %q, want %q", v, got, want)
		}
	}
}

// A host's restore class is read from its capabilities: its own
// architecture only, machine types by name and canonical name, each once.
func TestHostCompatFromCaps(t *testing.T) {
	caps := `<capabilities>
  <host><cpu><arch>x86_64</arch><model>qemu64</model></cpu></host>
  <guest><os_type>hvm</os_type>
    <arch name='i686'><machine>pc-i440fx-9.2</machine><domain type='qemu'/></arch>
  </guest>
  <guest><os_type>hvm</os_type>
    <arch name='x86_64'>
      <machine maxCpus='255'>pc-i440fx-10.0</machine>
      <machine canonical='pc-i440fx-10.0' maxCpus='255'>pc</machine>
      <machine maxCpus='4096'>pc-q35-10.0</machine>
      <machine canonical='pc-q35-10.0' maxCpus='4096'>q35</machine>
      <domain type='qemu'/>
      <domain type='kvm'/>
    </arch>
  </guest>
</capabilities>`
	h, err := hostCompatFromCaps(caps, "qemu", 10000002, 11003000)
	if err != nil {
		t.Fatal(err)
	}
	want := HostCompat{DomainType: "qemu", Arch: "x86_64", DomainTypes: []string{"kvm", "qemu"},
		Machines: []string{"pc", "pc-i440fx-10.0", "pc-q35-10.0", "q35"}, QEMU: 10000002, Libvirt: 11003000, Agent: agent.Version}
	if !reflect.DeepEqual(h, want) {
		t.Fatalf("hostCompatFromCaps:\n got %+v\nwant %+v", h, want)
	}
	if _, err := hostCompatFromCaps(`<capabilities><host></host></capabilities>`, "qemu", 1, 1); err == nil {
		t.Fatal("capabilities without a host CPU: no error")
	}
}

// A snapshot's Compat is its compat.json; a folder without one (with its
// domain XML) is an error that names the file, not a guess from this host.
func TestLoadCompat(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, DomainXMLFile), []byte("<domain type='qemu'><name>x</name></domain>"), 0o640)
	if _, err := LoadCompat(dir); err == nil || !strings.Contains(err.Error(), CompatFile) {
		t.Errorf("a snapshot without %s: %v", CompatFile, err)
	}
	want := Compat{DomainType: "qemu", Arch: "x86_64", Machine: "pc-q35-10.0", QEMU: 10000000, Agent: agent.Version}
	if err := writeCompat(dir, want); err != nil {
		t.Fatal(err)
	}
	if got, err := LoadCompat(dir); err != nil || !reflect.DeepEqual(got, want) {
		t.Errorf("LoadCompat = %+v, %v; want %+v", got, err, want)
	}
}
