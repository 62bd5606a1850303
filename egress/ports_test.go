package egress

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

// Two state dirs choose their proxy ports apart: each from a block of its
// own path's, past a block something holds, kept once chosen.
func TestEnsurePorts(t *testing.T) {
	base := t.TempDir()
	a, b := filepath.Join(base, "a"), filepath.Join(base, "b")
	all := func(Ports) bool { return true }
	pa, err := EnsurePorts(a, all)
	if err != nil {
		t.Fatal(err)
	}
	if !pa.valid() {
		t.Fatalf("ports %+v", pa)
	}
	// Another state dir starts elsewhere.
	pb, err := EnsurePorts(b, all)
	if err != nil {
		t.Fatal(err)
	}
	if pb == pa {
		t.Fatalf("two state dirs chose the same ports %+v", pa)
	}
	// Recorded: asked again, the same, even where the block is held now
	// (the proxy holds it).
	if again, err := EnsurePorts(a, func(Ports) bool { return false }); err != nil || again != pa {
		t.Fatalf("again: %+v %v, want %+v", again, err, pa)
	}
	if fi, err := os.Stat(PortsFile(a)); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("the record: %v %v", fi, err)
	}

	// A state dir whose first block is held (another state dir's proxy)
	// takes the next free one.
	c := filepath.Join(base, "c")
	first := blockPorts(firstBlock(c))
	pc, err := EnsurePorts(c, func(p Ports) bool { return p != first })
	if err != nil {
		t.Fatal(err)
	}
	if pc == first || !pc.valid() {
		t.Fatalf("chose %+v past a held %+v", pc, first)
	}
	// Nothing free: one clear error, nothing recorded.
	d := filepath.Join(base, "d")
	if _, err := EnsurePorts(d, func(Ports) bool { return false }); err == nil {
		t.Fatal("ports chosen where none is free")
	}
	if _, err := os.Stat(PortsFile(d)); err == nil {
		t.Fatal("a record where no ports were chosen")
	}
	// A damaged record is refused, not replaced behind the boxes' back.
	os.WriteFile(PortsFile(d), []byte(`{"http":80,"tls":443,"dns":53}`), 0o600)
	if _, err := EnsurePorts(d, all); err == nil {
		t.Fatal("a record outside the range taken")
	}
	// The range stays below the kernel's ephemeral ports and in blocks.
	if blockPorts(portBlocks-1).DNS > PortLast || blockPorts(portBlocks) != blockPorts(0) {
		t.Fatal("blocks leave the range")
	}
	if (portRange{20000, 20001}).overlaps(Ports{HTTP: 20002, TLS: 20003, DNS: 20004}) ||
		!(portRange{20003, 20003}).overlaps(Ports{HTTP: 20002, TLS: 20003, DNS: 20004}) {
		t.Fatal("overlaps")
	}
}

// portsFreeOn tells a block some socket holds from a free one.
func TestPortsFree(t *testing.T) {
	l, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	held := uint16(l.Addr().(*net.TCPAddr).Port)
	if portsFreeOn("127.0.0.1", Ports{HTTP: held, TLS: held + 1, DNS: held + 2}) {
		t.Errorf("port %s held, and free", strconv.Itoa(int(held)))
	}

	u, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer u.Close()
	udp := uint16(u.LocalAddr().(*net.UDPAddr).Port)
	if portsFreeOn("127.0.0.1", Ports{HTTP: udp + 1, TLS: udp + 2, DNS: udp}) {
		t.Errorf("UDP port %d held, and free", udp)
	}
}
