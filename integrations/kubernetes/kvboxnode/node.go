package kvboxnode

import (
	"fmt"
	"net/netip"
	"runtime"
	"strings"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kvbox.dev/kvbox/snapshot"
)

// KubeletVersion is the version the node reports: the Kubernetes release
// whose kubelet API (k8s.io/client-go and friends) kvbox-node is built
// against, marked as kvbox's.
const KubeletVersion = "v1.37.2-kvbox"

// NodeFacts is everything the Node object says about the host.
type NodeFacts struct {
	Name     string
	Address  netip.Addr // the node's address, where the kubelet API listens
	Port     int        // the kubelet API's port
	Host     snapshot.HostCompat
	Labels   map[string]string
	Capacity Capacity
	// Kernel is the host's kernel release.
	Kernel string
	// PodCIDR is the subnet of the node's boxes.
	PodCIDR netip.Prefix
}

// NewNode is the Node object kvbox-node registers, conditions aside: its
// labels, the taint that keeps ordinary Pods off it, its capacity, its
// addresses and the kubelet API's port.
func NewNode(f NodeFacts) *corev1.Node {
	res := f.Capacity.ResourceList()
	var cidrs []string
	if f.PodCIDR.IsValid() {
		cidrs = []string{f.PodCIDR.String()}
	}
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: f.Name, Labels: f.Labels},
		Spec: corev1.NodeSpec{
			PodCIDR: strings.Join(cidrs, ""), PodCIDRs: cidrs,
			Taints: []corev1.Taint{{Key: TaintKey, Value: TaintValue, Effect: corev1.TaintEffectNoSchedule}},
		},
		Status: corev1.NodeStatus{
			Phase:       corev1.NodeRunning,
			Capacity:    res,
			Allocatable: res.DeepCopy(),
			Addresses: []corev1.NodeAddress{
				{Type: corev1.NodeInternalIP, Address: f.Address.String()},
				{Type: corev1.NodeHostName, Address: f.Name},
			},
			DaemonEndpoints: corev1.NodeDaemonEndpoints{KubeletEndpoint: corev1.DaemonEndpoint{Port: int32(f.Port)}},
			NodeInfo: corev1.NodeSystemInfo{
				OperatingSystem:         "linux",
				Architecture:            runtime.GOARCH,
				KernelVersion:           f.Kernel,
				OSImage:                 fmt.Sprintf("kvbox on QEMU %s, libvirt %s (%s)", version(f.Host.QEMU), version(f.Host.Libvirt), f.Host.DomainType),
				ContainerRuntimeVersion: "kvbox://" + version(f.Host.QEMU),
				KubeletVersion:          KubeletVersion,
			},
		},
	}
}

// version prints libvirt's encoding of a version (major*1e6+minor*1e3+micro).
func version(v uint64) string {
	return fmt.Sprintf("%d.%d.%d", v/1000000, v/1000%1000, v%1000)
}
