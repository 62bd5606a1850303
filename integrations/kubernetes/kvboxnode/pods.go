package kvboxnode

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/virtual-kubelet/virtual-kubelet/errdefs"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/record"

	agent "kvbox.dev/kvbox/guest-agent"
)

// Reasons kvbox-node gives in pods' statuses, beside the kubelet's own
// (ContainerCreating, ErrImagePull, ImagePullBackOff, CrashLoopBackOff,
// Completed, Error, DeadlineExceeded).
const (
	// ReasonUnsupported: the pod asks for what kvbox cannot honour.
	ReasonUnsupported = "KvboxUnsupported"
	// ReasonIncompatible: this host cannot restore the snapshot.
	ReasonIncompatible = "KvboxIncompatible"
	// ReasonTooSmall: the pod's requests or limits are below the
	// snapshot's size (a pod without requests asks for nothing).
	ReasonTooSmall = "KvboxLimitsTooSmall"
	// ReasonBoxStopped: the pod's box stopped, and its restart policy
	// keeps it stopped.
	ReasonBoxStopped = "KvboxBoxStopped"
	// ReasonNodeRestarted: kvbox-node restarted while the command ran;
	// the agent ended the command with its connection.
	ReasonNodeRestarted = "KvboxNodeRestarted"
)

// ProviderConfig is how the provider runs pods.
type ProviderConfig struct {
	NodeName string
	NodeIP   string
	// RuntimeClass is the one RuntimeClass a pod may name.
	RuntimeClass string
	// Dir is kvbox-node's folder: its pods' logs, its cache's files.
	Dir string
	// Allocatable is the node's: what its pods' boxes may take together
	// (cpu, memory, pods), and resourceFieldRefs of unset limits.
	Allocatable corev1.ResourceList
	// NodeCredentials is the node's own credentials, for the registries
	// the operator named for them (NodeKeychain), which every pod gets;
	// nil: none, a pod pulls with its own imagePullSecrets or anonymously.
	NodeCredentials authn.Keychain
	// MaxClones bounds the clones made at once (0: twice the CPUs, at
	// least 2).
	MaxClones int
	// Check is how often a running pod's readiness and box are looked at
	// (0: 5s); a readinessProbe's own period replaces it.
	Check time.Duration

	Objects  Objects
	Recorder record.EventRecorder
	Log      *slog.Logger
	// GetPod reads a pod from the API server (what a restart finds).
	GetPod func(ctx context.Context, namespace, name string) (*corev1.Pod, error)
	// Forget deletes a pod whose box is gone from the API server at once,
	// as a kubelet does once a pod's containers stopped (nil: virtual-
	// kubelet does, after the pod's grace period).
	Forget func(ctx context.Context, namespace, name string, uid types.UID) error
}

// Provider turns the pods bound to this node into warm clones: virtual
// kubelet's PodLifecycleHandler and PodNotifier, and the kubelet API's
// logs, exec, port-forward and stats.
type Provider struct {
	cfg    ProviderConfig
	lib    Library
	cache  *Cache
	now    func() time.Time
	ctx    context.Context // the provider's life
	clones chan struct{}   // slots of clones at once

	mu   sync.Mutex
	pods map[string]*podState // by namespace/name

	notifyMu sync.Mutex
	notify   func(*corev1.Pod)

	statsMu  sync.Mutex
	lastStat map[string]BoxStats // by box, for rates

	admitMu  sync.Mutex
	admitted map[*podState]podSize // pods whose box runs or is being made
}

// NewProvider is the provider of lib's host. ctx bounds the goroutines it
// starts for pods.
func NewProvider(ctx context.Context, lib Library, cache *Cache, c ProviderConfig) *Provider {
	if c.Log == nil {
		c.Log = slog.Default()
	}
	if c.MaxClones <= 0 {
		c.MaxClones = max(2, 2*runtime.NumCPU())
	}
	if c.Check <= 0 {
		c.Check = 5 * time.Second
	}
	if c.RuntimeClass == "" {
		c.RuntimeClass = DefaultRuntimeClass
	}
	return &Provider{cfg: c, lib: lib, cache: cache, now: time.Now, ctx: ctx, clones: make(chan struct{}, c.MaxClones),
		pods: map[string]*podState{}, lastStat: map[string]BoxStats{}, admitted: map[*podState]podSize{}}
}

// podState is one pod and where it is.
type podState struct {
	key string
	uid types.UID

	mu  sync.Mutex
	pod *corev1.Pod // as the API server gave it (CreatePod, UpdatePod)

	box     string // its box, once cloned
	ip      string
	imageID string // REPO@DIGEST
	env     []string

	phase          corev1.PodPhase
	reason, msg    string
	startTime      *metav1.Time
	boxUp          bool // the box runs (the pod's "sandbox")
	ready          bool
	waiting        *corev1.ContainerStateWaiting
	running        *corev1.ContainerStateRunning
	terminated     *corev1.ContainerStateTerminated
	last           *corev1.ContainerStateTerminated
	restarts       int32
	started        bool
	conditionSince map[corev1.PodConditionType]metav1.Time
	conditionWas   map[corev1.PodConditionType]corev1.ConditionStatus

	// logs: the folder of the command's output, and done closed when the
	// current run's output is complete (for kubectl logs -f).
	logDir  string
	logDone chan struct{}

	cancel context.CancelFunc
	ctx    context.Context
	done   chan struct{} // closed when the pod's goroutine returned
}

func (ps *podState) terminal() bool {
	return ps.phase == corev1.PodSucceeded || ps.phase == corev1.PodFailed
}

func podKey(namespace, name string) string { return namespace + "/" + name }

func (p *Provider) newState(pod *corev1.Pod) *podState {
	ctx, cancel := context.WithCancel(p.ctx)
	ps := &podState{key: podKey(pod.Namespace, pod.Name), uid: pod.UID, pod: pod.DeepCopy(), phase: corev1.PodPending,
		conditionSince: map[corev1.PodConditionType]metav1.Time{}, conditionWas: map[corev1.PodConditionType]corev1.ConditionStatus{},
		logDir: filepath.Join(p.cfg.Dir, "logs", pod.Namespace+"_"+pod.Name+"_"+string(pod.UID)),
		ctx:    ctx, cancel: cancel, done: make(chan struct{}), logDone: make(chan struct{})}
	ps.waiting = &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}
	if pod.Status.StartTime != nil {
		ps.startTime = pod.Status.StartTime.DeepCopy()
	} else {
		t := metav1.NewTime(p.now())
		ps.startTime = &t
	}
	return ps
}

// NotifyPods takes virtual-kubelet's callback for status changes.
func (p *Provider) NotifyPods(ctx context.Context, f func(*corev1.Pod)) {
	p.notifyMu.Lock()
	p.notify = f
	p.notifyMu.Unlock()
}

// ReportAll reports every pod the provider holds (those a restart found),
// once virtual-kubelet's pod controller knows them.
func (p *Provider) ReportAll() {
	p.mu.Lock()
	all := make([]*podState, 0, len(p.pods))
	for _, ps := range p.pods {
		all = append(all, ps)
	}
	p.mu.Unlock()
	for _, ps := range all {
		p.update(ps, nil)
	}
}

// update changes ps under its lock and reports its new status.
func (p *Provider) update(ps *podState, change func()) {
	ps.mu.Lock()
	if change != nil {
		change()
	}
	pod := p.podWithStatus(ps)
	ps.mu.Unlock()
	p.notifyMu.Lock()
	f := p.notify
	p.notifyMu.Unlock()
	if f != nil {
		f(pod)
	}
}

func (p *Provider) event(ps *podState, typ, reason, format string, a ...any) {
	if p.cfg.Recorder == nil {
		return
	}
	ps.mu.Lock()
	pod := ps.pod.DeepCopy()
	ps.mu.Unlock()
	p.cfg.Recorder.Eventf(pod, typ, reason, format, a...)
}

func (p *Provider) get(namespace, name string) *podState {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.pods[podKey(namespace, name)]
}

// CreatePod takes a pod bound to this node: it is checked at once (a pod
// kvbox cannot honour fails with the line that says why), then its box is
// made in the background and its status reported as it goes.
func (p *Provider) CreatePod(ctx context.Context, pod *corev1.Pod) error {
	key := podKey(pod.Namespace, pod.Name)
	p.mu.Lock()
	old := p.pods[key]
	if old != nil && old.uid == pod.UID {
		p.mu.Unlock()
		return nil
	}
	ps := p.newState(pod)
	p.pods[key] = ps
	p.mu.Unlock()
	if old != nil {
		// Another pod of that name before it: its box goes.
		p.stop(ctx, old)
	}
	if err := CheckPod(pod, p.cfg.RuntimeClass); err != nil {
		p.cfg.Log.Info("pod refused", "pod", key, "err", err)
		p.event(ps, corev1.EventTypeWarning, ReasonUnsupported, "%s", err)
		p.update(ps, func() { p.fail(ps, ReasonUnsupported, err.Error(), 0) })
		close(ps.done)
		return nil
	}
	go p.run(ps)
	return nil
}

// UpdatePod takes a changed pod: its labels, annotations and deadline.
// A new image or containers are refused: a box is not replaced under a
// running pod (delete the pod).
func (p *Provider) UpdatePod(ctx context.Context, pod *corev1.Pod) error {
	ps := p.get(pod.Namespace, pod.Name)
	if ps == nil || ps.uid != pod.UID {
		return p.CreatePod(ctx, pod)
	}
	ps.mu.Lock()
	oldImage := ps.pod.Spec.Containers[0].Image
	ps.mu.Unlock()
	if len(pod.Spec.Containers) != 1 || pod.Spec.Containers[0].Image != oldImage || len(pod.Spec.EphemeralContainers) > 0 {
		return fmt.Errorf("pod %s/%s: kvbox cannot change a running pod's containers or image (its box is a clone of the old one): delete the pod", pod.Namespace, pod.Name)
	}
	ps.mu.Lock()
	status := ps.pod.Status
	ps.pod = pod.DeepCopy()
	ps.pod.Status = status
	ps.mu.Unlock()
	return nil
}

// DeletePod removes the pod's box, as kvbox rm --force does, and its logs.
func (p *Provider) DeletePod(ctx context.Context, pod *corev1.Pod) error {
	key := podKey(pod.Namespace, pod.Name)
	p.mu.Lock()
	ps := p.pods[key]
	if ps != nil && pod.UID != "" && ps.uid != pod.UID {
		ps = nil
	}
	p.mu.Unlock()
	if ps == nil {
		return errdefs.NotFoundf("pod %s is not on this node", key)
	}
	if err := p.stop(ctx, ps); err != nil {
		return err
	}
	p.mu.Lock()
	if p.pods[key] == ps {
		delete(p.pods, key)
	}
	p.mu.Unlock()
	os.RemoveAll(ps.logDir)
	p.update(ps, func() {
		if !ps.terminal() {
			p.finish(ps, corev1.PodSucceeded, "Terminated", "the pod's box was removed", 0, "Terminated")
		}
	})
	if p.cfg.Forget != nil && pod.DeletionTimestamp != nil {
		if err := p.cfg.Forget(ctx, pod.Namespace, pod.Name, ps.uid); err != nil && !apierrors.IsNotFound(err) && !apierrors.IsConflict(err) {
			p.cfg.Log.Warn("the deleted pod stays in the API server until its grace period ends", "pod", key, "err", err)
		}
	}
	return nil
}

// stop ends the pod's goroutine and removes its box.
func (p *Provider) stop(ctx context.Context, ps *podState) error {
	ps.cancel()
	select {
	case <-ps.done:
	case <-ctx.Done():
		return ctx.Err()
	}
	ps.mu.Lock()
	box := ps.box
	ps.mu.Unlock()
	if box == "" {
		p.release(ps)
		return nil
	}
	if err := p.lib.Remove(ctx, box); err != nil && !errors.Is(err, ErrNotFound) {
		return fmt.Errorf("remove box %s of pod %s: %w", box, ps.key, err)
	}
	p.release(ps)
	p.statsMu.Lock()
	delete(p.lastStat, box)
	p.statsMu.Unlock()
	return nil
}

func (p *Provider) GetPod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	ps := p.get(namespace, name)
	if ps == nil {
		return nil, errdefs.NotFoundf("pod %s is not on this node", podKey(namespace, name))
	}
	ps.mu.Lock()
	defer ps.mu.Unlock()
	return p.podWithStatus(ps), nil
}

func (p *Provider) GetPodStatus(ctx context.Context, namespace, name string) (*corev1.PodStatus, error) {
	pod, err := p.GetPod(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	return &pod.Status, nil
}

func (p *Provider) GetPods(ctx context.Context) ([]*corev1.Pod, error) {
	p.mu.Lock()
	all := make([]*podState, 0, len(p.pods))
	for _, ps := range p.pods {
		all = append(all, ps)
	}
	p.mu.Unlock()
	out := make([]*corev1.Pod, 0, len(all))
	for _, ps := range all {
		ps.mu.Lock()
		out = append(out, p.podWithStatus(ps))
		ps.mu.Unlock()
	}
	return out, nil
}

// fail makes the pod Failed (its container terminated with code, if it
// ran). The caller holds ps.mu.
func (p *Provider) fail(ps *podState, reason, msg string, code int32) {
	p.finish(ps, corev1.PodFailed, reason, msg, code, reason)
}

// finish ends the pod in phase. The caller holds ps.mu.
func (p *Provider) finish(ps *podState, phase corev1.PodPhase, reason, msg string, code int32, containerReason string) {
	ps.phase, ps.reason, ps.msg = phase, reason, msg
	ps.ready = false
	now := metav1.NewTime(p.now())
	if ps.terminated == nil {
		t := &corev1.ContainerStateTerminated{ExitCode: code, Reason: containerReason, Message: msg, FinishedAt: now}
		if ps.running != nil {
			t.StartedAt = ps.running.StartedAt
		}
		ps.terminated = t
	}
	ps.waiting, ps.running = nil, nil
	ps.boxUp = false
}

// backoff is the kubelet's: 10s doubling to 5 minutes.
type backoff struct{ next time.Duration }

func (b *backoff) step() time.Duration {
	if b.next == 0 {
		b.next = 10 * time.Second
	}
	d := b.next
	b.next = min(2*b.next, 5*time.Minute)
	return d
}

func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// run is a pod's life on this node: its box made (pull, clone), then its
// command run and its readiness watched until it ends or is deleted.
func (p *Provider) run(ps *podState) {
	defer close(ps.done)
	ctx := ps.ctx
	var b backoff
	for {
		err := p.start(ctx, ps)
		if err == nil {
			break
		}
		if ctx.Err() != nil {
			return
		}
		var perm *permanentError
		if errors.As(err, &perm) {
			p.cfg.Log.Info("pod failed", "pod", ps.key, "reason", perm.reason, "err", perm.err)
			msg := publicMessage(perm.err)
			p.event(ps, corev1.EventTypeWarning, perm.reason, "%s", msg)
			p.update(ps, func() { p.fail(ps, perm.reason, msg, 0) })
			return
		}
		wait := b.step()
		p.cfg.Log.Info("pod waits", "pod", ps.key, "err", err, "retry-in", wait)
		if !sleep(ctx, wait) {
			return
		}
	}
	p.supervise(ctx, ps, false)
}

// permanentError is a failure waiting does not mend: the pod fails.
type permanentError struct {
	reason string
	err    error
}

func (e *permanentError) Error() string { return e.err.Error() }

// pullOptions are the registry options of the pod's image: the
// credentials its imagePullSecrets hold for the image's repository, else
// the node's for the registries named for them, else none.
func (p *Provider) pullOptions(ctx context.Context, pod *corev1.Pod) (PullOptions, error) {
	ref := pod.Spec.Containers[0].Image
	var secrets []corev1.Secret
	for _, s := range pod.Spec.ImagePullSecrets {
		sec, err := p.cfg.Objects.Secret(ctx, pod.Namespace, s.Name)
		if apierrors.IsNotFound(err) {
			continue // as a kubelet: a missing pull secret is skipped
		}
		if err != nil {
			return PullOptions{}, fmt.Errorf("imagePullSecret %q: %w", s.Name, err)
		}
		secrets = append(secrets, *sec)
	}
	kc, skipped := PullKeychain(ctx, secrets, p.cfg.NodeCredentials)
	for _, err := range skipped {
		p.cfg.Log.Info("pull secret skipped", "pod", podKey(pod.Namespace, pod.Name), "err", err)
	}
	return p.cache.Options(ref, kc), nil
}

// start makes the pod's box: resolve, pull once, check, admit, clone.
func (p *Provider) start(ctx context.Context, ps *podState) error {
	ps.mu.Lock()
	pod := ps.pod.DeepCopy()
	ps.mu.Unlock()
	c := &pod.Spec.Containers[0]
	ref := c.Image
	o, err := p.pullOptions(ctx, pod)
	if err != nil {
		p.waitAs(ps, "ErrImagePull", err.Error())
		return err
	}
	digest, cached := p.cache.Cached(ref)
	resolved := false
	switch {
	case c.ImagePullPolicy == corev1.PullNever && !cached:
		err := fmt.Errorf("image %s is not in this node's cache and its pull policy is Never", ref)
		p.waitAs(ps, "ErrImageNeverPull", err.Error())
		return err
	case c.ImagePullPolicy == corev1.PullAlways || !cached:
		p.event(ps, corev1.EventTypeNormal, "Pulling", "Resolving image %q", ref)
		if digest, err = p.lib.Resolve(ctx, ref, o); err != nil {
			err = fmt.Errorf("resolve %s: %w", ref, err)
			p.waitAs(ps, "ErrImagePull", publicMessage(err))
			p.event(ps, corev1.EventTypeWarning, "Failed", "%s", publicMessage(err))
			return err
		}
		resolved = true
	}
	t0 := p.now()
	snap, release, err := p.cache.Acquire(ctx, ref, digest, o, resolved)
	if errors.Is(err, ErrIncompatible) {
		return &permanentError{ReasonIncompatible, err}
	}
	if err != nil {
		err = fmt.Errorf("pull %s: %w", ref, err)
		p.waitAs(ps, "ErrImagePull", publicMessage(err))
		p.event(ps, corev1.EventTypeWarning, "Failed", "%s", publicMessage(err))
		return err
	}
	defer release()
	p.event(ps, corev1.EventTypeNormal, "Pulled", "Image %q (%s) is in this node's cache as snapshot %s (%.3fs)", ref, digest, snap.Name, p.now().Sub(t0).Seconds())
	if err := CheckFits(pod, snap); err != nil {
		return &permanentError{ReasonTooSmall, err}
	}
	if reason, err := p.admit(ps, pod, snap); err != nil {
		return &permanentError{reason, err}
	}
	imageID, _ := DigestRef(ref, digest)
	name := BoxName(pod.Namespace, pod.Name, string(pod.UID))
	labels := map[string]string{LabelPodNamespace: pod.Namespace, LabelPodName: pod.Name, LabelPodUID: string(pod.UID),
		LabelHostname: Hostname(pod), LabelImage: ref, LabelDigest: digest}
	select {
	case p.clones <- struct{}{}:
	case <-ctx.Done():
		p.release(ps)
		return ctx.Err()
	}
	t1 := p.now()
	box, err := p.lib.Clone(ctx, CloneRequest{Snapshot: snap.Name, Name: name, Hostname: Hostname(pod), Labels: labels})
	<-p.clones
	if errors.Is(err, ErrIncompatible) {
		p.release(ps)
		return &permanentError{ReasonIncompatible, err}
	}
	if errors.Is(err, ErrExists) {
		// A box of this pod already (a restart found none: it was made
		// meanwhile by a kvbox-node killed mid-clone): take it.
		box, err = p.findBox(ctx, name)
	}
	if err != nil {
		p.release(ps)
		err = fmt.Errorf("clone %s from %s: %w", name, snap.Name, err)
		p.waitAs(ps, "CreateContainerError", err.Error())
		p.event(ps, corev1.EventTypeWarning, "Failed", "%s", err)
		return err
	}
	p.cfg.Log.Info("pod's box is running", "pod", ps.key, "box", box.Name, "ip", box.IP, "clone-seconds", p.now().Sub(t1).Seconds())
	p.event(ps, corev1.EventTypeNormal, "Created", "Box %s cloned from %s at %s (%.3fs)", box.Name, snap.Name, box.IP, p.now().Sub(t1).Seconds())
	p.update(ps, func() {
		ps.box, ps.ip, ps.imageID, ps.boxUp = box.Name, box.IP, imageID, true
	})
	go p.cache.Collect(p.ctx)
	return nil
}

func (p *Provider) findBox(ctx context.Context, name string) (Box, error) {
	boxes, err := p.lib.Boxes(ctx)
	if err != nil {
		return Box{}, err
	}
	for _, b := range boxes {
		if b.Name == name {
			return b, nil
		}
	}
	return Box{}, fmt.Errorf("box %s: %w", name, ErrNotFound)
}

// waitAs says the pod's container waits for reason.
func (p *Provider) waitAs(ps *podState, reason, msg string) {
	p.update(ps, func() { ps.waiting = &corev1.ContainerStateWaiting{Reason: reason, Message: msg} })
}

// commandResult is how one run of a pod's command ended.
type commandResult struct {
	code      int32
	reason    string
	msg       string
	startedAt metav1.Time
	err       error // the connection to the agent failed: the box may be gone
}

// supervise runs the pod's command (if any) and watches its box and
// readiness until the pod ends or is deleted. resumed says the box ran
// before (a restart of kvbox-node found it).
func (p *Provider) supervise(ctx context.Context, ps *podState, resumed bool) {
	ps.mu.Lock()
	pod := ps.pod.DeepCopy()
	hasCommand := len(pod.Spec.Containers[0].Command) > 0
	ps.mu.Unlock()
	env, ok := p.waitEnv(ctx, ps, pod)
	if !ok {
		return
	}

	var results chan commandResult
	startCommand := func() {
		results = make(chan commandResult, 1)
		go func() { results <- p.runCommand(ctx, ps, pod, env) }()
	}
	if hasCommand {
		startCommand()
	} else if !resumed {
		p.event(ps, corev1.EventTypeNormal, "Started", "Box running; the pod has no command")
	}
	p.markRunning(ps, resumed)
	var deadline <-chan time.Time
	if t := p.activeDeadline(ps, pod); t != nil {
		defer t.Stop()
		deadline = t.C
	}
	period, probeDelay := p.readinessSchedule(pod)
	probe := &prober{}
	tick := time.NewTimer(0)
	defer tick.Stop()
	var crash backoff
	var restartAt <-chan time.Time
	for {
		select {
		case <-ctx.Done():
			return
		case <-deadline:
			p.pastDeadline(ctx, ps)
			return
		case res := <-results:
			results = nil
			var done bool
			if restartAt, done = p.commandEnded(ctx, ps, pod, res, &crash); done {
				return
			}
		case <-restartAt:
			restartAt = nil
			p.update(ps, func() {
				ps.restarts++
				ps.waiting, ps.running = nil, &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(p.now())}
			})
			startCommand()
		case <-tick.C:
			tick.Reset(period)
			if done := p.checkReady(ctx, ps, pod, probe, probeDelay); done {
				return
			}
		}
	}
}

// waitEnv is the pod's container environment, kept in ps: as a kubelet,
// the container waits until its config can be made (false: ctx ended
// first).
func (p *Provider) waitEnv(ctx context.Context, ps *podState, pod *corev1.Pod) ([]string, bool) {
	env, err := p.env(ctx, ps, pod)
	for err != nil {
		p.waitAs(ps, "CreateContainerConfigError", err.Error())
		if !sleep(ctx, 10*time.Second) {
			return nil, false
		}
		env, err = p.env(ctx, ps, pod)
	}
	ps.mu.Lock()
	ps.env = env
	ps.mu.Unlock()
	return env, true
}

// markRunning says the pod's container runs (since the pod's start time
// when a restart found its box) and the pod with it.
func (p *Provider) markRunning(ps *podState, resumed bool) {
	p.update(ps, func() {
		if ps.running == nil && !ps.terminal() {
			at := metav1.NewTime(p.now())
			if resumed && ps.pod.Status.StartTime != nil {
				at = *ps.pod.Status.StartTime
			}
			ps.running, ps.waiting, ps.started = &corev1.ContainerStateRunning{StartedAt: at}, nil, true
		}
		if ps.phase == corev1.PodPending {
			ps.phase = corev1.PodRunning
		}
	})
}

// activeDeadline is a timer that fires at the pod's activeDeadlineSeconds
// from its start, or nil when it has none.
func (p *Provider) activeDeadline(ps *podState, pod *corev1.Pod) *time.Timer {
	d := pod.Spec.ActiveDeadlineSeconds
	if d == nil {
		return nil
	}
	ps.mu.Lock()
	left := time.Duration(*d)*time.Second - p.now().Sub(ps.startTime.Time)
	ps.mu.Unlock()
	return time.NewTimer(max(left, 0))
}

// readinessSchedule is how often the pod's readiness is looked at (its
// readinessProbe's period, else Check) and when its probe may first run.
func (p *Provider) readinessSchedule(pod *corev1.Pod) (period time.Duration, probeDelay time.Time) {
	r := pod.Spec.Containers[0].ReadinessProbe
	period = p.cfg.Check
	if r != nil && r.PeriodSeconds > 0 {
		period = time.Duration(r.PeriodSeconds) * time.Second
	}
	if r != nil {
		probeDelay = p.now().Add(time.Duration(r.InitialDelaySeconds) * time.Second)
	}
	return period, probeDelay
}

// pastDeadline fails a pod active longer than its activeDeadlineSeconds.
func (p *Provider) pastDeadline(ctx context.Context, ps *podState) {
	p.cfg.Log.Info("pod past its activeDeadlineSeconds", "pod", ps.key)
	p.event(ps, corev1.EventTypeWarning, "DeadlineExceeded", "Pod was active on the node longer than the specified deadline")
	p.end(ctx, ps, func() {
		p.finish(ps, corev1.PodFailed, "DeadlineExceeded", "Pod was active on the node longer than the specified deadline", 137, "DeadlineExceeded")
	})
}

// commandEnded is what follows a run of the pod's command: the pod ends
// (its restart policy says no more), or the command runs again when
// restartAt fires, after the crash back-off. done says supervise returns
// (the pod ended, or its box stopped and boxStopped took it on).
func (p *Provider) commandEnded(ctx context.Context, ps *podState, pod *corev1.Pod, res commandResult, crash *backoff) (restartAt <-chan time.Time, done bool) {
	if res.err != nil && p.boxGone(ctx, ps) {
		p.boxStopped(ctx, ps, pod)
		return nil, true
	}
	restart := pod.Spec.RestartPolicy == corev1.RestartPolicyAlways ||
		(pod.Spec.RestartPolicy == corev1.RestartPolicyOnFailure && res.code != 0)
	term := &corev1.ContainerStateTerminated{ExitCode: res.code, Reason: res.reason, Message: res.msg,
		StartedAt: res.startedAt, FinishedAt: metav1.NewTime(p.now()), ContainerID: "kvbox://" + ps.box}
	p.cfg.Log.Info("pod's command ended", "pod", ps.key, "exit-code", res.code, "reason", res.reason, "restart", restart)
	if !restart {
		phase := corev1.PodSucceeded
		if res.code != 0 {
			phase = corev1.PodFailed
		}
		p.end(ctx, ps, func() {
			ps.terminated = term
			p.finish(ps, phase, "", "", res.code, res.reason)
		})
		return nil, true
	}
	if p.now().Sub(res.startedAt.Time) > 10*time.Minute {
		*crash = backoff{}
	}
	wait := crash.step()
	p.event(ps, corev1.EventTypeWarning, "BackOff", "Back-off %s restarting the command", wait)
	p.update(ps, func() {
		ps.last, ps.running, ps.ready = term, nil, false
		ps.waiting = &corev1.ContainerStateWaiting{Reason: "CrashLoopBackOff",
			Message: fmt.Sprintf("back-off %s restarting the failed command of pod %s", wait, ps.key)}
	})
	t := time.NewTimer(wait)
	return t.C, false
}

// checkReady looks at the pod's readiness (its probe once past
// probeDelay) and reports a change. done says its box stopped and
// boxStopped took the pod on: supervise returns.
func (p *Provider) checkReady(ctx context.Context, ps *podState, pod *corev1.Pod, probe *prober, probeDelay time.Time) (done bool) {
	ready, err := p.ready(ctx, ps, pod, probe, p.now().After(probeDelay))
	if err != nil && p.boxGone(ctx, ps) {
		p.boxStopped(ctx, ps, pod)
		return true
	}
	ps.mu.Lock()
	running := ps.running != nil
	changed := ps.ready != (ready && running)
	ps.mu.Unlock()
	if changed {
		p.update(ps, func() { ps.ready = ready && ps.running != nil })
	}
	return false
}

// end finishes a pod that ran: its box goes (a finished pod holds no
// memory), its status stays until the pod is deleted.
func (p *Provider) end(ctx context.Context, ps *podState, change func()) {
	ps.mu.Lock()
	box := ps.box
	ps.mu.Unlock()
	if box != "" {
		if err := p.lib.Remove(context.WithoutCancel(ctx), box); err != nil && !errors.Is(err, ErrNotFound) {
			p.cfg.Log.Warn("the box of a finished pod stays", "pod", ps.key, "box", box, "err", err)
		} else {
			p.release(ps)
		}
	} else {
		p.release(ps)
	}
	p.update(ps, change)
}

// boxGone reports whether the pod's box no longer runs.
func (p *Provider) boxGone(ctx context.Context, ps *podState) bool {
	ps.mu.Lock()
	name := ps.box
	ps.mu.Unlock()
	b, err := p.findBox(ctx, name)
	if errors.Is(err, ErrNotFound) {
		return true
	}
	return err == nil && !b.Running()
}

// boxStopped is what happens to a pod whose box stopped under it: its
// restart policy Never fails it; otherwise the box boots again from its
// disk (kvbox start) and the pod goes on, its restart count one more.
func (p *Provider) boxStopped(ctx context.Context, ps *podState, pod *corev1.Pod) {
	ps.mu.Lock()
	name := ps.box
	ps.mu.Unlock()
	p.event(ps, corev1.EventTypeWarning, ReasonBoxStopped, "Box %s stopped", name)
	if pod.Spec.RestartPolicy == corev1.RestartPolicyNever {
		p.end(ctx, ps, func() { p.fail(ps, ReasonBoxStopped, fmt.Sprintf("box %s stopped", name), 137) })
		return
	}
	p.update(ps, func() {
		ps.last = &corev1.ContainerStateTerminated{ExitCode: 137, Reason: ReasonBoxStopped, Message: fmt.Sprintf("box %s stopped", name), FinishedAt: metav1.NewTime(p.now())}
		if ps.running != nil {
			ps.last.StartedAt = ps.running.StartedAt
		}
		ps.running, ps.ready, ps.boxUp = nil, false, false
		ps.waiting = &corev1.ContainerStateWaiting{Reason: "ContainerCreating", Message: "starting box " + name + " again"}
		ps.restarts++
	})
	var b backoff
	for {
		box, err := p.lib.Start(ctx, name)
		if err == nil {
			p.update(ps, func() { ps.ip, ps.boxUp = box.IP, true })
			break
		}
		if errors.Is(err, ErrNotFound) {
			p.end(ctx, ps, func() { p.fail(ps, ReasonBoxStopped, fmt.Sprintf("box %s is gone", name), 137) })
			return
		}
		p.waitAs(ps, "CreateContainerError", err.Error())
		if !sleep(ctx, b.step()) {
			return
		}
	}
	p.supervise(ctx, ps, false)
}

// env is the pod's container environment (ConfigMaps and Secrets read
// now, with the node's rights).
func (p *Provider) env(ctx context.Context, ps *podState, pod *corev1.Pod) ([]string, error) {
	ps.mu.Lock()
	ip := ps.ip
	ps.mu.Unlock()
	return Env(ctx, pod, p.cfg.Objects, envContext{hostIP: p.cfg.NodeIP, podIP: ip, allocatable: p.cfg.Allocatable})
}

// execRequest is how the pod's container runs argv: its environment, its
// working directory, its user.
func execRequest(pod *corev1.Pod, env, argv []string) agent.ExecRequest {
	r := agent.ExecRequest{Argv: argv, EnvAdd: env, Dir: pod.Spec.Containers[0].WorkingDir}
	if u, ok := RunAsUser(pod); ok {
		r.User = fmt.Sprint(u)
	}
	return r
}

// runCommand runs one run of the pod's command in its box, its output to
// the pod's log.
func (p *Provider) runCommand(ctx context.Context, ps *podState, pod *corev1.Pod, env []string) commandResult {
	c := &pod.Spec.Containers[0]
	vars := envMap(env)
	var argv []string
	for _, a := range append(append([]string{}, c.Command...), c.Args...) {
		argv = append(argv, Expand(a, vars))
	}
	ps.mu.Lock()
	box := ps.box
	rotate := ps.restarts > 0 || ps.last != nil
	done := make(chan struct{})
	ps.logDone = done
	ps.mu.Unlock()
	defer close(done)
	started := metav1.NewTime(p.now())
	lf, err := openLog(ps.logDir, p.now, rotate)
	if err != nil {
		return commandResult{code: 128, reason: "StartError", msg: "the pod's log: " + err.Error(), startedAt: started}
	}
	defer lf.Close()
	out, errw := &streamWriter{l: lf, stream: "stdout"}, &streamWriter{l: lf, stream: "stderr"}
	p.event(ps, corev1.EventTypeNormal, "Started", "Command %q started in box %s", strings.Join(argv, " "), box)
	code, err := p.lib.Exec(ctx, box, execRequest(pod, env, argv), nil, out, errw, nil)
	out.flush()
	errw.flush()
	res := commandResult{code: int32(code), startedAt: started}
	var re *agent.RemoteError
	switch {
	case errors.As(err, &re):
		// The agent could not start it (not found, not executable, a bad
		// user or folder): as a runtime's start error.
		res.code, res.reason, res.msg = 128, "StartError", re.Message
	case err != nil:
		res.code, res.reason, res.msg, res.err = 137, "Error", err.Error(), err
	case code == 0:
		res.reason = "Completed"
	case code < 0 || code > 255:
		res.code, res.reason, res.msg = 128, "Error", fmt.Sprintf("the agent reported exit code %d, which no process exits with", code)
	default:
		res.reason = "Error"
	}
	if res.code != 0 && c.TerminationMessagePolicy == corev1.TerminationMessageFallbackToLogsOnError && res.msg == "" {
		res.msg = lastLogLines(ps.logDir, 80, 4096)
	}
	return res
}

// lastLogLines is the end of the current run's log, for a termination
// message: at most n lines and max bytes.
func lastLogLines(dir string, n, maxBytes int) string {
	recs, _, err := readRecords(filepath.Join(dir, rotatedLogName), filepath.Join(dir, logFileName))
	if err != nil {
		return ""
	}
	if len(recs) > n {
		recs = recs[len(recs)-n:]
	}
	var b strings.Builder
	for _, r := range recs {
		b.WriteString(r.text)
		b.WriteByte('\n')
	}
	s := b.String()
	if len(s) > maxBytes {
		s = s[len(s)-maxBytes:]
	}
	return s
}
