package domain

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

// TestEmulatorWrapper runs the wrapper with a stand-in QEMU that prints its
// arguments one per line: libvirt's pc.ram object goes when kvbox's backend
// is there, and every other argument (spaces, quotes, globs, a trailing
// -object) goes through as it was.
func TestEmulatorWrapper(t *testing.T) {
	dir := t.TempDir()
	qemu := filepath.Join(dir, "it's qemu")
	if err := os.WriteFile(qemu, []byte("#!/bin/sh\nfor a do printf '%s\\n' \"$a\"; done\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	wrapper := filepath.Join(dir, "wrapper")
	if err := os.WriteFile(wrapper, emulatorWrapper(qemu), 0o755); err != nil {
		t.Fatal(err)
	}
	pcRAM := `{"qom-type":"memory-backend-ram","id":"pc.ram","size":4294967296}`
	secret := `{"qom-type":"secret","id":"masterKey0","format":"raw","file":"/a b/*"}`
	kvboxRAM := "memory-backend-file,id=kvbox.ram,size=4294967296,mem-path=/var/lib/kvbox/boxes/a,,b/memory,share=on"
	for _, c := range []struct {
		name     string
		in, want []string
	}{
		{"a box", []string{"-name", "guest=x y", "-object", secret, "-object", pcRAM, "-m", "size=4194304k", "-object", kvboxRAM, "-machine", "memory-backend=kvbox.ram", "*"},
			[]string{"-name", "guest=x y", "-object", secret, "-m", "size=4194304k", "-object", kvboxRAM, "-machine", "memory-backend=kvbox.ram", "*"}},
		{"libvirt's probe", []string{"-S", "-machine", "none,accel=kvm:tcg", "-object", pcRAM},
			[]string{"-S", "-machine", "none,accel=kvm:tcg", "-object", pcRAM}},
		{"a trailing -object", []string{"-machine", "memory-backend=kvbox.ram", "-object"},
			[]string{"-machine", "memory-backend=kvbox.ram", "-object"}},
		{"no arguments", nil, nil},
	} {
		out, err := exec.Command(wrapper, c.in...).Output()
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		var got []string
		if s := strings.TrimSuffix(string(out), "\n"); s != "" {
			got = strings.Split(s, "\n")
		}
		if !reflect.DeepEqual(got, c.want) {
			t.Errorf("%s: QEMU got\n%q\nwant\n%q", c.name, got, c.want)
		}
	}
}

func TestEmulatorFacts(t *testing.T) {
	caps := `<capabilities><host><secmodel>
      <model>none</model>
      <doi>0</doi>
    </secmodel><secmodel>
      <model>dac</model></secmodel></host>
  <guest><os_type>hvm</os_type><arch name='i686'><emulator>/usr/bin/qemu-system-i386</emulator></arch></guest>
  <guest><os_type>hvm</os_type><arch name='x86_64'><wordsize>64</wordsize><emulator>/usr/bin/qemu-system-x86_64</emulator></arch></guest></capabilities>`
	if m := qemuEmulatorRE.FindStringSubmatch(caps); m == nil || m[1] != "/usr/bin/qemu-system-x86_64" {
		t.Errorf("emulator: %q", m)
	}
	if macModelRE.MatchString(caps) {
		t.Error("none and dac taken for a MAC security driver")
	}
	if !macModelRE.MatchString(strings.Replace(caps, "<model>none</model>", "<model>apparmor</model>", 1)) {
		t.Error("apparmor not seen")
	}
}
