package kvboxnode

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Health is what one look at the host found.
type Health struct {
	// Libvirt is why libvirt did not answer; nil when it did.
	Libvirt error
	// StateDir is why the state dir's filesystem could not be read; nil
	// when DiskFree holds its free bytes.
	StateDir error
	DiskFree int64
	// MemAvailable is the host's available memory in bytes, -1 if unknown.
	MemAvailable int64
}

// Thresholds say when the node is under pressure.
type Thresholds struct {
	MinFreeDisk   int64 // bytes free in the state dir's filesystem
	MinFreeMemory int64 // bytes of available host memory
}

// Reasons of the node's conditions.
const (
	ReasonReady              = "KvboxReady"
	ReasonLibvirtUnreachable = "LibvirtUnreachable"
	ReasonStateDirUnusable   = "StateDirUnusable"
	ReasonDiskPressure       = "KvboxHasDiskPressure"
	ReasonDiskOK             = "KvboxHasSufficientDisk"
	ReasonMemoryPressure     = "KvboxHasMemoryPressure"
	ReasonMemoryOK           = "KvboxHasSufficientMemory"
	ReasonUnknown            = "KvboxCannotMeasure"
)

// Conditions are the node's conditions for h: Ready when libvirt answers and
// the state dir is usable; DiskPressure and MemoryPressure when free space
// or memory fall under t (the node controller then taints the node so the
// scheduler sends it no more boxes). A condition whose status is that of
// prev keeps prev's transition time.
func Conditions(h Health, t Thresholds, prev []corev1.NodeCondition, now metav1.Time) []corev1.NodeCondition {
	ready := cond(corev1.NodeReady, corev1.ConditionTrue, ReasonReady, "kvbox-node is ready: libvirt answers")
	switch {
	case h.Libvirt != nil:
		ready = cond(corev1.NodeReady, corev1.ConditionFalse, ReasonLibvirtUnreachable, "libvirt does not answer: "+h.Libvirt.Error())
	case h.StateDir != nil:
		ready = cond(corev1.NodeReady, corev1.ConditionFalse, ReasonStateDirUnusable, "kvbox's state dir: "+h.StateDir.Error())
	}
	disk := cond(corev1.NodeDiskPressure, corev1.ConditionFalse, ReasonDiskOK,
		fmt.Sprintf("the state dir's filesystem has at least %s free", quantity(t.MinFreeDisk)))
	switch {
	case h.StateDir != nil:
		disk = cond(corev1.NodeDiskPressure, corev1.ConditionUnknown, ReasonUnknown, "kvbox's state dir: "+h.StateDir.Error())
	case h.DiskFree < t.MinFreeDisk:
		disk = cond(corev1.NodeDiskPressure, corev1.ConditionTrue, ReasonDiskPressure,
			fmt.Sprintf("the state dir's filesystem has %s free, less than %s", quantity(h.DiskFree), quantity(t.MinFreeDisk)))
	}
	mem := cond(corev1.NodeMemoryPressure, corev1.ConditionFalse, ReasonMemoryOK,
		fmt.Sprintf("the host has at least %s of memory available", quantity(t.MinFreeMemory)))
	switch {
	case h.MemAvailable < 0:
		mem = cond(corev1.NodeMemoryPressure, corev1.ConditionUnknown, ReasonUnknown, "the host's available memory could not be read")
	case h.MemAvailable < t.MinFreeMemory:
		mem = cond(corev1.NodeMemoryPressure, corev1.ConditionTrue, ReasonMemoryPressure,
			fmt.Sprintf("the host has %s of memory available, less than %s", quantity(h.MemAvailable), quantity(t.MinFreeMemory)))
	}
	out := []corev1.NodeCondition{ready, mem, disk}
	for i := range out {
		out[i].LastHeartbeatTime = now
		out[i].LastTransitionTime = now
		for _, p := range prev {
			if p.Type == out[i].Type && p.Status == out[i].Status && !p.LastTransitionTime.IsZero() {
				out[i].LastTransitionTime = p.LastTransitionTime
			}
		}
	}
	return out
}

func cond(typ corev1.NodeConditionType, status corev1.ConditionStatus, reason, msg string) corev1.NodeCondition {
	return corev1.NodeCondition{Type: typ, Status: status, Reason: reason, Message: msg}
}

// sameConditions reports whether a and b say the same thing (heartbeats
// aside), so that an unchanged look at the host sends no update.
func sameConditions(a, b []corev1.NodeCondition) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].Type != b[i].Type || a[i].Status != b[i].Status || a[i].Reason != b[i].Reason || a[i].Message != b[i].Message {
			return false
		}
	}
	return true
}
