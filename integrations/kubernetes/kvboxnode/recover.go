package kvboxnode

import (
	"context"
	"errors"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// Recover finds this host's pods again from its boxes' labels, with no
// database of its own, before virtual-kubelet asks for them: a box whose
// pod is still bound here is that pod's again, as it is (it kept running
// while kvbox-node was down); a box whose pod is gone, or is another pod of
// that name now, is removed; so is a box a kvbox-node killed mid-clone
// left without its labels. A pod's command did not survive (the agent
// ends a command with the connection that started it): it is counted as a
// run that ended, and its restart policy says what follows.
func (p *Provider) Recover(ctx context.Context) (found, removed []string, err error) {
	boxes, err := p.lib.Boxes(ctx)
	if err != nil {
		return nil, nil, err
	}
	remove := func(b Box, why string) error {
		p.cfg.Log.Info("removing a box", "box", b.Name, "why", why)
		if err := p.lib.Remove(ctx, b.Name); err != nil && !errors.Is(err, ErrNotFound) {
			return fmt.Errorf("remove box %s (%s): %w", b.Name, why, err)
		}
		removed = append(removed, b.Name)
		return nil
	}
	var errs []error
	for _, b := range boxes {
		pod, why, err := p.podOfBox(ctx, b)
		if err != nil {
			return found, removed, err
		}
		if pod == nil {
			if why != "" {
				errs = append(errs, remove(b, why))
			}
			continue
		}
		ps := p.adopt(pod, b)
		if len(pod.Spec.Containers[0].Command) > 0 {
			if err := p.commandLost(ctx, ps, pod, b); err != nil {
				errs = append(errs, err)
			}
		}
		if !ps.terminal() {
			p.hold(ps, pod, b)
		}
		p.resume(ps)
		found = append(found, ps.key)
	}
	return found, removed, errors.Join(errs...)
}

// podOfBox is the pod a box of this host belongs to, when it is still
// bound here; else nil, and why the box goes ("": it stays, being no pod's
// box). err says the pod could not be read.
func (p *Provider) podOfBox(ctx context.Context, b Box) (pod *corev1.Pod, why string, err error) {
	ns, name, uid := b.Labels[LabelPodNamespace], b.Labels[LabelPodName], b.Labels[LabelPodUID]
	if ns == "" || name == "" || uid == "" {
		if boxNameForm.MatchString(b.Name) && b.Snapshot != "" {
			return nil, "a clone a killed kvbox-node left without its pod's labels", nil
		}
		return nil, "", nil
	}
	pod, err = p.cfg.GetPod(ctx, ns, name)
	switch {
	case apierrors.IsNotFound(err):
		return nil, "its pod " + ns + "/" + name + " is gone", nil
	case err != nil:
		return nil, "", fmt.Errorf("read pod %s/%s: %w", ns, name, err)
	case string(pod.UID) != uid || pod.Spec.NodeName != p.cfg.NodeName:
		return nil, "pod " + ns + "/" + name + " is another one now", nil
	case pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
		return nil, "its pod " + ns + "/" + name + " is ending", nil
	}
	return pod, "", nil
}

// adopt is the state of a pod whose box b a restart found: running, with
// its container's state, restarts and last termination as the API server
// kept them.
func (p *Provider) adopt(pod *corev1.Pod, b Box) *podState {
	ps := p.newState(pod)
	ps.box, ps.ip, ps.boxUp = b.Name, b.IP, b.Running()
	ps.imageID, _ = DigestRef(b.Labels[LabelImage], b.Labels[LabelDigest])
	ps.phase, ps.waiting = corev1.PodRunning, nil
	if cs := pod.Status.ContainerStatuses; len(cs) == 1 {
		ps.restarts = cs[0].RestartCount
		if cs[0].LastTerminationState.Terminated != nil {
			ps.last = cs[0].LastTerminationState.Terminated.DeepCopy()
		}
		if r := cs[0].State.Running; r != nil {
			ps.running = r.DeepCopy()
		}
		ps.started = ps.running != nil
	}
	return ps
}

// commandLost counts the pod's command, which did not survive the
// restart, as a run that ended: its restart policy Never fails the pod
// (and its box goes), any other runs the command again.
func (p *Provider) commandLost(ctx context.Context, ps *podState, pod *corev1.Pod, b Box) error {
	t := &corev1.ContainerStateTerminated{ExitCode: 137, Reason: ReasonNodeRestarted, FinishedAt: metav1.NewTime(p.now()),
		Message: "kvbox-node restarted while the command ran; its agent connection, and with it the command, ended"}
	if ps.running != nil {
		t.StartedAt = ps.running.StartedAt
	}
	ps.running = nil
	if pod.Spec.RestartPolicy == corev1.RestartPolicyNever {
		ps.terminated = t
		p.fail(ps, ReasonNodeRestarted, t.Message, 137)
		if err := p.lib.Remove(ctx, b.Name); err != nil && !errors.Is(err, ErrNotFound) {
			return err
		}
		return nil
	}
	ps.last = t
	ps.restarts++
	ps.running = &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(p.now())}
	return nil
}

// resume takes a found pod on: kept among the provider's pods, and
// supervised unless it has ended.
func (p *Provider) resume(ps *podState) {
	p.mu.Lock()
	p.pods[ps.key] = ps
	p.mu.Unlock()
	if ps.terminal() {
		close(ps.done)
		return
	}
	go func() {
		defer close(ps.done)
		p.supervise(ps.ctx, ps, true)
	}()
}
