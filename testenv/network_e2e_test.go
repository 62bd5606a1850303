//go:build e2e

package testenv

import (
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
)

// NAT is set up where the host has an uplink and removed with the network.
// The test makes a namespace of its own with a default route over a veth
// pair (a documentation-range address, nothing is sent anywhere), so the
// host's firewall is never touched.
func TestNetworkNATWithUplink(t *testing.T) {
	ns := "kvbox-nat-" + runID
	run := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
		if err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	run("ip", "netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	in := func(args ...string) string { return run(append([]string{"ip", "netns", "exec", ns}, args...)...) }
	in("ip", "link", "add", "up0", "type", "veth", "peer", "name", "up1")
	in("ip", "addr", "add", "192.0.2.1/24", "dev", "up0")
	in("ip", "link", "set", "up0", "up")
	in("ip", "link", "set", "up1", "up")
	in("ip", "route", "add", "default", "via", "192.0.2.254", "dev", "up0")

	kv := []string{kvboxBin, "--bridge", "kvnat0", "--subnet", "172.31.250.0/24", "--state-dir", t.TempDir()}
	var st struct {
		Present, NAT, Firewall bool
		Gateway                string
	}
	if err := json.Unmarshal([]byte(in(append(kv, "network", "up", "--json")...)), &st); err != nil {
		t.Fatal(err)
	}
	if !st.Present || !st.NAT || !st.Firewall || st.Gateway != "172.31.250.1" {
		t.Errorf("network up: %+v", st)
	}
	nat := in("iptables", "-t", "nat", "-S", "POSTROUTING")
	if !strings.Contains(nat, "-s 172.31.250.0/24 ! -o kvnat0") || !strings.Contains(nat, "MASQUERADE") {
		t.Errorf("no masquerade rule:\n%s", nat)
	}
	if fwd := in("cat", "/proc/sys/net/ipv4/ip_forward"); strings.TrimSpace(fwd) != "1" {
		t.Errorf("ip_forward = %s", fwd)
	}
	// Idempotent: a second up adds no second rule.
	in(append(kv, "network", "up")...)
	if n := strings.Count(in("iptables", "-t", "nat", "-S", "POSTROUTING"), "kvbox kvnat0"); n != 1 {
		t.Errorf("%d masquerade rules after two ups", n)
	}
	in(append(kv, "network", "rm")...)
	if rules := in("iptables-save"); strings.Contains(rules, "kvnat0") {
		t.Errorf("rules left after network rm:\n%s", rules)
	}
	// A new namespace forwards nothing: rm puts that back.
	if fwd := in("cat", "/proc/sys/net/ipv4/ip_forward"); strings.TrimSpace(fwd) != "0" {
		t.Errorf("ip_forward = %s after network rm, was 0 before up", fwd)
	}
	if out, err := exec.Command("ip", "netns", "exec", ns, "ip", "link", "show", "kvnat0").CombinedOutput(); err == nil {
		t.Errorf("bridge left after network rm: %s", out)
	}
	// Without an uplink (the test namespace) there is no NAT: on a network
	// of this test's own, since the default one may carry NAT that an
	// earlier --nat asked for (it stays until network rm) and boxes that are
	// not the tests'.
	own := []string{"--bridge", "kvnat1", "--subnet", "172.31.251.0/24"}
	mustKvbox(t, append(own, "network", "up")...)
	t.Cleanup(func() { kvbox(t, append(own, "network", "rm")...) })
	out, err := exec.Command(kvboxBin, append(own, "network", "show", "--json")...).Output()
	if err != nil || !strings.Contains(string(out), `"nat": false`) {
		t.Errorf("network show in %s: %v %s", testNetns, err, out)
	}
}
