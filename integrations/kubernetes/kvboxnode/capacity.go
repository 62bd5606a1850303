package kvboxnode

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"kvbox.dev/kvbox/network"
)

// DefaultMaxBoxes caps the boxes a node takes when not told otherwise: the
// kubelet's default number of pods.
const DefaultMaxBoxes = 110

// DefaultReservedMemory is the host's RAM kvbox leaves to the host itself
// (libvirtd, QEMU's own overhead, kvbox-node) when deriving the node's
// memory from the host's.
const DefaultReservedMemory = 1 << 30

// HostResources is what the host has, as libvirt reports it.
type HostResources struct {
	CPUs   int
	Memory int64 // bytes
}

// CapacityConfig is what the operator asked for; zero derives the value
// from the host.
type CapacityConfig struct {
	CPUs           int   // vCPUs kvbox may commit; 0: the host's CPUs
	Memory         int64 // bytes of RAM kvbox may commit; 0: the host's less ReservedMemory
	ReservedMemory int64 // bytes kept for the host when Memory is derived
	MaxBoxes       int   // 0: DefaultMaxBoxes, or fewer if the subnet holds fewer
}

// Capacity is what the node offers the scheduler: vCPUs, RAM and boxes
// (Kubernetes' cpu, memory and pods).
type Capacity struct {
	CPUs   int
	Memory int64
	Boxes  int
}

// ResolveCapacity turns what the operator asked for into the node's
// capacity, from the host's resources and the subnet boxes get addresses
// from (a node cannot hold more boxes than it has addresses for).
func ResolveCapacity(c CapacityConfig, host HostResources, net network.Config) (Capacity, error) {
	var out Capacity
	switch {
	case c.CPUs < 0:
		return out, fmt.Errorf("--cpus %d: give a positive number of vCPUs, or 0 for the host's", c.CPUs)
	case c.CPUs > 0:
		out.CPUs = c.CPUs
	case host.CPUs > 0:
		out.CPUs = host.CPUs
	default:
		return out, fmt.Errorf("libvirt reports no CPUs for this host: give --cpus")
	}
	switch {
	case c.Memory < 0 || c.ReservedMemory < 0:
		return out, fmt.Errorf("--memory and --reserved-memory cannot be negative")
	case c.Memory > 0:
		out.Memory = c.Memory
	case c.ReservedMemory >= host.Memory:
		return out, fmt.Errorf("--reserved-memory %s leaves nothing of the host's %s for boxes: give a smaller one, or --memory",
			quantity(c.ReservedMemory), quantity(host.Memory))
	default:
		out.Memory = host.Memory - c.ReservedMemory
	}
	addresses := net.Addresses()
	switch {
	case c.MaxBoxes < 0:
		return out, fmt.Errorf("--max-boxes %d: give a positive number, or 0 for the default", c.MaxBoxes)
	case c.MaxBoxes > addresses:
		return out, fmt.Errorf("--max-boxes %d: the subnet %s has addresses for %d boxes only: give a larger --subnet or fewer boxes",
			c.MaxBoxes, net.Subnet, addresses)
	case c.MaxBoxes > 0:
		out.Boxes = c.MaxBoxes
	default:
		out.Boxes = min(DefaultMaxBoxes, addresses)
	}
	if out.Boxes == 0 {
		return out, fmt.Errorf("the subnet %s has no address for a box: give a larger --subnet", net.Subnet)
	}
	return out, nil
}

// ResourceList is the capacity as a node's capacity and allocatable.
func (c Capacity) ResourceList() corev1.ResourceList {
	return corev1.ResourceList{
		corev1.ResourceCPU:    *resource.NewQuantity(int64(c.CPUs), resource.DecimalSI),
		corev1.ResourceMemory: *resource.NewQuantity(c.Memory, resource.BinarySI),
		corev1.ResourcePods:   *resource.NewQuantity(int64(c.Boxes), resource.DecimalSI),
	}
}

func quantity(bytes int64) string {
	q := resource.NewQuantity(bytes, resource.BinarySI)
	return q.String()
}
