package kvboxnode

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/snapshot"
)

var tcgHost = snapshot.HostCompat{
	DomainType: "qemu", Arch: "x86_64", DomainTypes: []string{"kvm", "qemu"},
	Machines: []string{"pc", "pc-i440fx-10.0", "pc-q35-10.0", "q35", "a-machine-type-whose-name-is-far-too-long-to-be-the-name-of-a-label-key"},
	QEMU:     10000002, Libvirt: 11003000, Agent: "0.1.0",
}

// The restore class a snapshot's Compat is matched against: one label per
// fact, one per machine type, the QEMU version as an integer.
func TestLabels(t *testing.T) {
	got, skipped := Labels("kvbox-a", tcgHost)
	want := map[string]string{
		"kubernetes.io/hostname":           "kvbox-a",
		LabelDomainType:                    "qemu",
		LabelArch:                          "x86_64",
		LabelQEMU:                          "10000002",
		LabelAgentProtocol:                 "0",
		"machine.kvbox.dev/pc":             "true",
		"machine.kvbox.dev/pc-i440fx-10.0": "true",
		"machine.kvbox.dev/pc-q35-10.0":    "true",
		"machine.kvbox.dev/q35":            "true",
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("label %s = %q, want %q", k, got[k], v)
		}
	}
	if len(skipped) != 1 || !strings.HasPrefix(skipped[0], "a-machine-type") {
		t.Errorf("skipped = %v, want the one machine type too long for a label key", skipped)
	}
	for k, v := range got {
		if errs := validation.IsQualifiedName(k); len(errs) > 0 {
			t.Errorf("label key %s: %v", k, errs)
		}
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			t.Errorf("label %s=%q: %v", k, v, errs)
		}
	}
	if err := checkLabelValues(got); err != nil {
		t.Errorf("checkLabelValues: %v", err)
	}
	// A compatibility record of another agent protocol maps to another label.
	h := tcgHost
	h.Agent = "2.0.1"
	if got, _ := Labels("kvbox-a", h); got[LabelAgentProtocol] != "2" {
		t.Errorf("agent 2.0.1: %s = %q, want 2", LabelAgentProtocol, got[LabelAgentProtocol])
	}
	if err := checkLabelValues(map[string]string{LabelArch: "not a label value"}); err == nil {
		t.Error("checkLabelValues accepted a value with spaces")
	}
}

func TestResolveCapacity(t *testing.T) {
	host := HostResources{CPUs: 8, Memory: 32 << 30}
	small, err := network.Parse("kvt0", "10.9.0.0/28") // 13 boxes
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		cfg  CapacityConfig
		net  network.Config
		want Capacity
		err  string
	}{
		{"derived from the host", CapacityConfig{ReservedMemory: DefaultReservedMemory}, network.Default,
			Capacity{CPUs: 8, Memory: 31 << 30, Boxes: DefaultMaxBoxes}, ""},
		{"given", CapacityConfig{CPUs: 32, Memory: 64 << 30, MaxBoxes: 200}, network.Default,
			Capacity{CPUs: 32, Memory: 64 << 30, Boxes: 200}, ""},
		{"boxes capped by a small subnet", CapacityConfig{ReservedMemory: DefaultReservedMemory}, small,
			Capacity{CPUs: 8, Memory: 31 << 30, Boxes: 13}, ""},
		{"more boxes than addresses", CapacityConfig{MaxBoxes: 14}, small, Capacity{}, "addresses for 13 boxes"},
		{"more boxes than the default subnet", CapacityConfig{MaxBoxes: 254}, network.Default, Capacity{}, "addresses for 253 boxes"},
		{"reserve eats the host", CapacityConfig{ReservedMemory: 32 << 30}, network.Default, Capacity{}, "leaves nothing"},
		{"negative cpus", CapacityConfig{CPUs: -1}, network.Default, Capacity{}, "--cpus -1"},
		{"negative memory", CapacityConfig{Memory: -1}, network.Default, Capacity{}, "cannot be negative"},
		{"negative boxes", CapacityConfig{MaxBoxes: -2}, network.Default, Capacity{}, "--max-boxes -2"},
	} {
		got, err := ResolveCapacity(tc.cfg, host, tc.net)
		switch {
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%s: error %v, want one with %q", tc.name, err, tc.err)
		case tc.err == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.err == "" && got != tc.want:
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
	if _, err := ResolveCapacity(CapacityConfig{}, HostResources{Memory: 1 << 30}, network.Default); err == nil {
		t.Error("a host without CPUs and no --cpus: no error")
	}
	rl := Capacity{CPUs: 4, Memory: 3 << 30, Boxes: 7}.ResourceList()
	if rl.Cpu().Value() != 4 || rl.Memory().Value() != 3<<30 || rl.Pods().Value() != 7 {
		t.Errorf("ResourceList = %v", rl)
	}
	if s := rl.Memory().String(); s != "3Gi" {
		t.Errorf("memory quantity %s, want 3Gi", s)
	}
}

func TestConditions(t *testing.T) {
	th := Thresholds{MinFreeDisk: 1 << 30, MinFreeMemory: 256 << 20}
	t0 := metav1.NewTime(time.Unix(1000, 0))
	t1 := metav1.NewTime(time.Unix(2000, 0))
	status := func(cs []corev1.NodeCondition) map[corev1.NodeConditionType]string {
		m := map[corev1.NodeConditionType]string{}
		for _, c := range cs {
			m[c.Type] = string(c.Status) + "/" + c.Reason
		}
		return m
	}
	healthy := Health{DiskFree: 10 << 30, MemAvailable: 4 << 30}
	ok := Conditions(healthy, th, nil, t0)
	want := map[corev1.NodeConditionType]string{
		corev1.NodeReady: "True/" + ReasonReady, corev1.NodeDiskPressure: "False/" + ReasonDiskOK,
		corev1.NodeMemoryPressure: "False/" + ReasonMemoryOK,
	}
	if got := status(ok); len(got) != len(want) || got[corev1.NodeReady] != want[corev1.NodeReady] ||
		got[corev1.NodeDiskPressure] != want[corev1.NodeDiskPressure] || got[corev1.NodeMemoryPressure] != want[corev1.NodeMemoryPressure] {
		t.Fatalf("healthy host: %v, want %v", got, want)
	}
	// The same look later changes nothing but heartbeats: no update is sent.
	again := Conditions(Health{DiskFree: 9 << 30, MemAvailable: 3 << 30}, th, ok, t1)
	if !sameConditions(ok, again) {
		t.Errorf("a second healthy look differs: %v vs %v", ok, again)
	}
	for _, c := range again {
		if !c.LastTransitionTime.Equal(&t0) || !c.LastHeartbeatTime.Equal(&t1) {
			t.Errorf("%s: transition %v heartbeat %v, want %v and %v", c.Type, c.LastTransitionTime, c.LastHeartbeatTime, t0, t1)
		}
	}
	down := Conditions(Health{Libvirt: errors.New("connection refused"), DiskFree: 100 << 20, MemAvailable: 100 << 20}, th, ok, t1)
	got := status(down)
	if got[corev1.NodeReady] != "False/"+ReasonLibvirtUnreachable || got[corev1.NodeDiskPressure] != "True/"+ReasonDiskPressure ||
		got[corev1.NodeMemoryPressure] != "True/"+ReasonMemoryPressure {
		t.Errorf("libvirt down, disk and memory short: %v", got)
	}
	if sameConditions(ok, down) {
		t.Error("a changed look compares the same")
	}
	for _, c := range down {
		if !c.LastTransitionTime.Equal(&t1) {
			t.Errorf("%s changed status but kept transition time %v", c.Type, c.LastTransitionTime)
		}
		if c.Type == corev1.NodeReady && !strings.Contains(c.Message, "connection refused") {
			t.Errorf("Ready message %q does not say why", c.Message)
		}
	}
	unknown := status(Conditions(Health{StateDir: errors.New("no such file"), MemAvailable: -1}, th, nil, t0))
	if unknown[corev1.NodeReady] != "False/"+ReasonStateDirUnusable || unknown[corev1.NodeDiskPressure] != "Unknown/"+ReasonUnknown ||
		unknown[corev1.NodeMemoryPressure] != "Unknown/"+ReasonUnknown {
		t.Errorf("state dir unusable, memory unknown: %v", unknown)
	}
}

func TestCheckNodeAddress(t *testing.T) {
	ifaces := []Interface{
		{Name: "lo", Loopback: true, Prefixes: []netip.Prefix{netip.MustParsePrefix("127.0.0.1/8")}},
		{Name: "eth0", Prefixes: []netip.Prefix{netip.MustParsePrefix("10.0.0.5/24")}},
		{Name: "kvbox0", Prefixes: []netip.Prefix{netip.MustParsePrefix("172.30.0.1/24"), netip.MustParsePrefix("192.168.79.1/24")}},
		{Name: "kvbt1", Prefixes: []netip.Prefix{netip.MustParsePrefix("192.168.77.1/24")}},
		{Name: "kvbg0011aabb", Prefixes: []netip.Prefix{netip.MustParsePrefix("192.168.78.1/24")}},
	}
	custom, err := network.Parse("kvbt1", "192.168.77.0/24")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		addr string
		net  network.Config
		err  string
	}{
		{"10.0.0.5", network.Default, ""},
		{"127.0.0.2", network.Default, ""}, // the loopback interface answers its whole prefix
		{"", network.Default, "give --node-address"},
		{"0.0.0.0", network.Default, "every address"},
		{"::", network.Default, "every address"},
		{"224.0.0.1", network.Default, "multicast"},
		{"172.30.0.1", network.Default, "where kvbox puts boxes"},
		{"172.30.9.1", network.Default, "where kvbox puts boxes"}, // the groups' pool
		{"192.168.77.1", custom, "where kvbox puts boxes"},
		{"192.168.79.1", network.Default, "kvbox bridge"}, // a second address on the bridge
		{"192.168.78.1", network.Default, "kvbox bridge"}, // a group's bridge
		{"10.0.0.6", network.Default, "not an address of this host"},
	} {
		var a netip.Addr
		if tc.addr != "" {
			a = netip.MustParseAddr(tc.addr)
		}
		err := CheckNodeAddress(a, ifaces, tc.net)
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("%s: %v", tc.addr, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("%s on %s: error %v, want one with %q", tc.addr, tc.net.Bridge, err, tc.err)
		}
	}
}

func TestNewNode(t *testing.T) {
	labels, _ := Labels("kvbox-a", tcgHost)
	n := NewNode(NodeFacts{Name: "kvbox-a", Address: netip.MustParseAddr("127.0.0.2"), Port: 10250, Host: tcgHost,
		Labels: labels, Capacity: Capacity{CPUs: 2, Memory: 8 << 30, Boxes: 20}, Kernel: "6.1.0"})
	if len(n.Spec.Taints) != 1 || n.Spec.Taints[0] != (corev1.Taint{Key: "kvbox.dev/vm", Value: "true", Effect: corev1.TaintEffectNoSchedule}) {
		t.Errorf("taints %v", n.Spec.Taints)
	}
	if n.Status.Capacity.Pods().Value() != 20 || n.Status.Allocatable.Cpu().Value() != 2 {
		t.Errorf("capacity %v allocatable %v", n.Status.Capacity, n.Status.Allocatable)
	}
	if len(n.Status.Addresses) != 2 || n.Status.Addresses[0] != (corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: "127.0.0.2"}) {
		t.Errorf("addresses %v", n.Status.Addresses)
	}
	if n.Status.DaemonEndpoints.KubeletEndpoint.Port != 10250 {
		t.Errorf("kubelet port %d", n.Status.DaemonEndpoints.KubeletEndpoint.Port)
	}
	if !strings.Contains(n.Status.NodeInfo.OSImage, "QEMU 10.0.2") || n.Status.NodeInfo.ContainerRuntimeVersion != "kvbox://10.0.2" {
		t.Errorf("node info %+v", n.Status.NodeInfo)
	}
}

func TestParseMemAvailable(t *testing.T) {
	m, err := parseMemAvailable([]byte("MemTotal:       24591412 kB\nMemFree:        20000000 kB\nMemAvailable:   22000000 kB\n"))
	if err != nil || m != 22000000*1024 {
		t.Fatalf("parseMemAvailable = %d, %v", m, err)
	}
	if _, err := parseMemAvailable([]byte("MemTotal: 1 kB\n")); err == nil {
		t.Fatal("no MemAvailable line: no error")
	}
}

func TestPodReady(t *testing.T) {
	pod := func(phase corev1.PodPhase, conds ...corev1.PodCondition) *corev1.Pod {
		return &corev1.Pod{Status: corev1.PodStatus{Phase: phase, Conditions: conds}}
	}
	ready := corev1.PodCondition{Type: corev1.PodReady, Status: corev1.ConditionTrue}
	notReady := corev1.PodCondition{Type: corev1.PodReady, Status: corev1.ConditionFalse}
	scheduled := corev1.PodCondition{Type: corev1.PodScheduled, Status: corev1.ConditionTrue}
	for _, tc := range []struct {
		name string
		pod  *corev1.Pod
		want bool
	}{
		{"running and ready", pod(corev1.PodRunning, scheduled, ready), true},
		{"running, not ready", pod(corev1.PodRunning, scheduled, notReady), false},
		{"running, no Ready condition", pod(corev1.PodRunning, scheduled), false},
		{"pending", pod(corev1.PodPending, ready), false},
		{"succeeded", pod(corev1.PodSucceeded, ready), false},
	} {
		if got := PodReady(tc.pod); got != tc.want {
			t.Errorf("%s: PodReady = %v, want %v", tc.name, got, tc.want)
		}
	}
}
