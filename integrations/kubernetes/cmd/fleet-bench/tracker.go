package main

import (
	"context"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
)

// trackState is what the watch saw of the bench's pods: when each was
// first seen Running and Ready, which failed, their bench label.
type trackState struct {
	running, ready map[types.UID]time.Time
	failed         map[types.UID]string
	labels         map[types.UID]string
}

// tracker watches the bench's pods (an informer: a list, then a watch,
// started again if it breaks) and records when the client saw each change,
// to the resolution of the local clock.
type tracker struct {
	mu      sync.Mutex
	s       trackState
	changed chan struct{} // closed at each change, then made anew
}

func startTracker(ctx context.Context, c kubernetes.Interface) (*tracker, error) {
	tr := &tracker{changed: make(chan struct{}), s: trackState{running: map[types.UID]time.Time{}, ready: map[types.UID]time.Time{},
		failed: map[types.UID]string{}, labels: map[types.UID]string{}}}
	fac := informers.NewSharedInformerFactoryWithOptions(c, 0, informers.WithNamespace(ns),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = benchLabel }))
	inf := fac.Core().V1().Pods().Informer()
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(o any) { tr.see(o) },
		UpdateFunc: func(_, o any) { tr.see(o) },
	}); err != nil {
		return nil, err
	}
	fac.Start(ctx.Done())
	for typ, ok := range fac.WaitForCacheSync(ctx.Done()) {
		if !ok {
			return nil, fmt.Errorf("watching the bench's pods: the %v cache did not sync", typ)
		}
	}
	return tr, nil
}

func (tr *tracker) see(o any) {
	now := time.Now()
	p, ok := o.(*corev1.Pod)
	if !ok {
		return
	}
	tr.mu.Lock()
	defer tr.mu.Unlock()
	s := &tr.s
	s.labels[p.UID] = p.Labels[benchLabel]
	if _, seen := s.running[p.UID]; !seen && p.Status.Phase == corev1.PodRunning {
		s.running[p.UID] = now
	}
	if _, seen := s.ready[p.UID]; !seen && kvboxnode.PodReady(p) {
		s.ready[p.UID] = now
	}
	if _, seen := s.failed[p.UID]; !seen && p.Status.Phase == corev1.PodFailed {
		s.failed[p.UID] = fmt.Sprintf("%s: %s", p.Status.Reason, p.Status.Message)
	}
	close(tr.changed)
	tr.changed = make(chan struct{})
}

// wait calls done with the state (under the lock) at each change until it
// says so, returns an error, or ctx ends.
func (tr *tracker) wait(ctx context.Context, done func(*trackState) (bool, error)) error {
	for {
		tr.mu.Lock()
		ok, err := done(&tr.s)
		ch := tr.changed
		tr.mu.Unlock()
		if ok || err != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-ch:
		}
	}
}
