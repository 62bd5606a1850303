// Package kvboxnode is kvbox-node: one libvirt host registered as a
// Kubernetes Node through virtual-kubelet. It owns the node's side: its
// labels (the host's restore class), capacity, taint, conditions, lease and
// addresses, and the kubelet API it serves to the API server. The pods a
// Pod becomes (warm clones) are the provider's.
package kvboxnode

import (
	"fmt"
	"runtime"
	"strconv"

	"k8s.io/apimachinery/pkg/util/validation"

	"kvbox.dev/kvbox/snapshot"
)

// Label keys of a kvbox node. A snapshot's compatibility record
// (snapshot.Compat) maps onto them as node affinity: its DomainType kvm onto
// LabelDomainType In [kvm], its Arch onto LabelArch, its Machine onto
// MachineLabelPrefix+Machine Exists, its QEMU onto LabelQEMU Gt QEMU-1, its
// agent's major version onto LabelAgentProtocol. The CPU comparison is not
// a label: CreatePod's Compat.Check still has the last word.
const (
	LabelDomainType    = "kvbox.dev/domain-type"
	LabelArch          = "kvbox.dev/arch"
	LabelQEMU          = "kvbox.dev/qemu" // an integer, Compat's encoding, for Gt/Lt
	LabelAgentProtocol = "kvbox.dev/agent-protocol"
	// LabelNode marks every kvbox node (value "true"): the node selector
	// of the kvbox RuntimeClass.
	LabelNode = "kvbox.dev/node"
	// MachineLabelPrefix, followed by a machine type, labels each machine
	// type the host's QEMU offers (value "true").
	MachineLabelPrefix = "machine.kvbox.dev/"
)

// Taint keeps every Pod that does not tolerate it off kvbox nodes: a Pod
// there becomes a virtual machine, which ordinary Pods do not expect.
const (
	TaintKey   = "kvbox.dev/vm"
	TaintValue = "true"
)

// Labels are the node's labels: its name, OS and architecture as every
// node has them, and the host's restore class. A machine type whose name
// cannot be a label key is left out and returned in skipped, so the caller
// can say so.
func Labels(name string, hc snapshot.HostCompat) (labels map[string]string, skipped []string) {
	labels = map[string]string{
		"type":                   "virtual-kubelet",
		"kubernetes.io/hostname": name,
		"kubernetes.io/os":       "linux",
		"kubernetes.io/arch":     runtime.GOARCH,
		LabelDomainType:          hc.DomainType,
		LabelArch:                hc.Arch,
		LabelQEMU:                strconv.FormatUint(hc.QEMU, 10),
		LabelAgentProtocol:       hc.AgentProtocol(),
		LabelNode:                "true",
	}
	for _, m := range hc.Machines {
		key := MachineLabelPrefix + m
		if len(validation.IsQualifiedName(key)) > 0 {
			skipped = append(skipped, m)
			continue
		}
		labels[key] = "true"
	}
	return labels, skipped
}

// checkLabelValues refuses a label whose value Kubernetes would refuse, so
// that a host kvbox-node cannot describe fails at start with a line that
// names it rather than at registration.
func checkLabelValues(labels map[string]string) error {
	for k, v := range labels {
		if errs := validation.IsValidLabelValue(v); len(errs) > 0 {
			return fmt.Errorf("node label %s=%q: %s", k, v, errs[0])
		}
	}
	return nil
}
