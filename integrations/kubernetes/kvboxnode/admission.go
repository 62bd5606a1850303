package kvboxnode

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// podSize is what a pod's box takes of the node: its requests, and at
// least its snapshot's vCPUs and RAM (a clone has its snapshot's size).
type podSize struct {
	milliCPU, memory int64
}

// sizeOf is pod's size with a box of s's vCPUs and RAM.
func sizeOf(pod *corev1.Pod, cpus int, memory int64) podSize {
	req := pod.Spec.Containers[0].Resources.Requests
	return podSize{milliCPU: max(req.Cpu().MilliValue(), int64(cpus)*1000), memory: max(req.Memory().Value(), memory)}
}

// admit takes pod's size of the node's allocatable for ps, as a kubelet's
// admission does: a pod that would take the node past its allocatable
// cpu, memory or pods fails, with the kubelet's reason (OutOfcpu,
// OutOfmemory, OutOfpods) and message. The scheduler counts the same
// requests, so this refuses what it placed only when the node was
// overcommitted by other means (a pod bound by name, a smaller
// allocatable since a restart); it is what keeps a node from running
// more boxes than it has RAM for.
func (p *Provider) admit(ps *podState, pod *corev1.Pod, s Snapshot) (reason string, err error) {
	want := sizeOf(pod, s.CPUs, s.Memory)
	p.admitMu.Lock()
	defer p.admitMu.Unlock()
	if _, ok := p.admitted[ps]; ok {
		p.admitted[ps] = want
		return "", nil
	}
	var used podSize
	for _, u := range p.admitted {
		used.milliCPU += u.milliCPU
		used.memory += u.memory
	}
	alloc := p.cfg.Allocatable
	for _, r := range []struct {
		name                 corev1.ResourceName
		requested, used, cap int64
	}{
		{corev1.ResourceCPU, want.milliCPU, used.milliCPU, quantityOr(alloc, corev1.ResourceCPU, true)},
		{corev1.ResourceMemory, want.memory, used.memory, quantityOr(alloc, corev1.ResourceMemory, false)},
		{corev1.ResourcePods, 1, int64(len(p.admitted)), quantityOr(alloc, corev1.ResourcePods, false)},
	} {
		if r.cap >= 0 && r.used+r.requested > r.cap {
			return "OutOf" + string(r.name), fmt.Errorf("Pod was rejected: Node didn't have enough resource: %s, requested: %d, used: %d, capacity: %d",
				r.name, r.requested, r.used, r.cap)
		}
	}
	p.admitted[ps] = want
	return "", nil
}

// quantityOr is resource n of l (milli-units for milli), or -1 when l does
// not give it (no bound).
func quantityOr(l corev1.ResourceList, n corev1.ResourceName, milli bool) int64 {
	q, ok := l[n]
	if !ok {
		return -1
	}
	if milli {
		return q.MilliValue()
	}
	return q.Value()
}

// hold counts ps's box, which runs already (a restart found it), in the
// node's use whatever it comes to.
func (p *Provider) hold(ps *podState, pod *corev1.Pod, b Box) {
	p.admitMu.Lock()
	defer p.admitMu.Unlock()
	p.admitted[ps] = sizeOf(pod, b.CPUs, b.Memory)
}

// release gives back what ps's box took (its box is gone, or was never
// made).
func (p *Provider) release(ps *podState) {
	p.admitMu.Lock()
	defer p.admitMu.Unlock()
	delete(p.admitted, ps)
}

// needs is what a pod needs to give for a box of s: its vCPUs and RAM as
// requests.
func needs(s Snapshot) string {
	return fmt.Sprintf("resources.requests cpu: %s, memory: %s", resource.NewQuantity(int64(s.CPUs), resource.DecimalSI),
		resource.NewQuantity(s.Memory, resource.BinarySI))
}
