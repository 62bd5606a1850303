package kvboxnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/url"
	"strings"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// secrets is the API server's Secrets, by namespace/name.
type secrets map[string]corev1.Secret

func (secrets) ConfigMap(ctx context.Context, ns, name string) (*corev1.ConfigMap, error) {
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "configmaps"}, name)
}
func (s secrets) Secret(ctx context.Context, ns, name string) (*corev1.Secret, error) {
	if sec, ok := s[ns+"/"+name]; ok {
		return sec.DeepCopy(), nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "secrets"}, name)
}

var errUnauthorized = errors.New("UNAUTHORIZED: authentication required")

// privateRegistry answers only a pull with credentials for its
// repositories.
func privateRegistry(ref string, o PullOptions) (string, error) {
	if !Credentialed(o, ref) {
		return "", errUnauthorized
	}
	return fakeDigest, nil
}

// podIn is testPod in namespace ns, with pull secrets.
func podIn(ns, name, uid string, pullSecrets ...string) *corev1.Pod {
	p := testPod(name, uid)
	p.Namespace = ns
	p.Spec.Containers[0].ImagePullPolicy = corev1.PullIfNotPresent
	for _, s := range pullSecrets {
		p.Spec.ImagePullSecrets = append(p.Spec.ImagePullSecrets, corev1.LocalObjectReference{Name: s})
	}
	return p
}

func statusIn(t *testing.T, p *Provider, ns, name string, ok func(*corev1.PodStatus) bool) *corev1.PodStatus {
	t.Helper()
	for {
		st, err := p.GetPodStatus(context.Background(), ns, name)
		if err != nil {
			t.Fatal(err)
		}
		if ok(st) {
			return st
		}
		sleep(context.Background(), 10e6)
	}
}

func waiting(reason string) func(*corev1.PodStatus) bool {
	return func(st *corev1.PodStatus) bool {
		cs := st.ContainerStatuses
		return len(cs) == 1 && cs[0].State.Waiting != nil && cs[0].State.Waiting.Reason == reason
	}
}

// A snapshot pulled with a pod's credentials is cloned for a pod of
// another namespace only once that pod's own credentials resolved it: one
// without is refused (ErrImagePull, no box) although its pull policy is
// IfNotPresent and the node holds the snapshot; one with its own secret
// gets its box, from the one pull.
func TestCacheCredentialedEntryResolvedAgain(t *testing.T) {
	lib := newFakeLib()
	lib.resolve = privateRegistry
	p, cancel := testProvider(t, lib, &apiPods{pods: map[string]*corev1.Pod{}})
	defer cancel()
	p.cfg.Objects = secrets{
		"team/pull":  pullSecret("team", "pull", "127.0.0.1:5000", "team"),
		"other/pull": pullSecret("other", "pull", "127.0.0.1:5000", "other"),
	}
	owner := podIn("team", "web", "11111111", "pull")
	if err := p.CreatePod(context.Background(), owner); err != nil {
		t.Fatal(err)
	}
	statusIn(t, p, "team", "web", ready)

	stranger := podIn("other", "peek", "22222222")
	if err := p.CreatePod(context.Background(), stranger); err != nil {
		t.Fatal(err)
	}
	st := statusIn(t, p, "other", "peek", func(st *corev1.PodStatus) bool { return waiting("ErrImagePull")(st) || ready(st) })
	if ready(st) {
		t.Fatal("a pod without credentials is Ready on a snapshot pulled with another namespace's")
	}
	if msg := st.ContainerStatuses[0].State.Waiting.Message; !strings.Contains(msg, "credentials") {
		t.Errorf("the pod without credentials waits with %q", msg)
	}
	if _, ok := lib.box(BoxName("other", "peek", "22222222")); ok {
		t.Error("a pod without credentials was cloned from a snapshot pulled with another namespace's")
	}

	friend := podIn("other", "friend", "33333333", "pull")
	if err := p.CreatePod(context.Background(), friend); err != nil {
		t.Fatal(err)
	}
	statusIn(t, p, "other", "friend", ready)
	if pulls, _ := lib.counts(); pulls != 1 {
		t.Errorf("%d pulls; the snapshot was pulled once and resolved again for the second pod", pulls)
	}
}

// A snapshot of a name the cache's once was (pod-ALG-HEX), made by
// someone else, is no snapshot of the cache's: a pod of that digest gets
// a snapshot pulled for it, and the look-alike is neither cloned nor
// removed. Nor is a snapshot put in the place of one of the cache's.
func TestCacheIgnoresLookAlike(t *testing.T) {
	lib := newFakeLib()
	lookAlike := "pod-sha256-" + strings.Repeat("ab", 16)
	lib.snaps[lookAlike] = Snapshot{Name: lookAlike, CPUs: 1, Memory: 256 << 20, Disk: 1 << 30, SizeBytes: 1 << 20}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	cache, err := NewCache(lib, t.TempDir(), 1, nil, log) // a budget of 1 byte: Collect removes what it may
	if err != nil {
		t.Fatal(err)
	}
	if err := cache.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	ref := "127.0.0.1:5000/team/web:v1"
	s, release, err := cache.Acquire(ctx, ref, fakeDigest, cache.Options(ref, nil), true)
	if err != nil {
		t.Fatal(err)
	}
	release()
	if s.Name == lookAlike || !ours(s, fakeDigest) {
		t.Errorf("the cache gave %+v; want a snapshot it pulled and marked, not the look-alike", s)
	}
	// Someone removes the cache's snapshot and makes one of their own of
	// its name.
	lib.mu.Lock()
	lib.snaps[s.Name] = Snapshot{Name: s.Name, CPUs: 1, Memory: 256 << 20, Disk: 1 << 30, SizeBytes: 1 << 20}
	lib.mu.Unlock()
	if err := cache.Collect(ctx); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{lookAlike, s.Name} {
		if _, err := lib.Snapshot(ctx, n); err != nil {
			t.Errorf("the cache removed snapshot %s, which is not its own: %v", n, err)
		}
	}
	s2, release, err := cache.Acquire(ctx, ref, fakeDigest, cache.Options(ref, nil), true)
	if err != nil {
		t.Fatal(err)
	}
	release()
	if s2.Name == s.Name || s2.Name == lookAlike || !ours(s2, fakeDigest) {
		t.Errorf("after its snapshot was replaced the cache gave %+v", s2)
	}
	if pulls, _ := lib.counts(); pulls != 2 {
		t.Errorf("%d pulls, want 2 (the first, and again once its snapshot was not its own)", pulls)
	}
}

// A registry's answer reaches a pod's status by its status code alone:
// a reference naming a service of the node's shows its creator none of
// what it answered.
func TestRegistryErrorKeepsItsBody(t *testing.T) {
	lib := newFakeLib()
	lib.resolve = func(ref string, o PullOptions) (string, error) {
		resp := &http.Response{StatusCode: http.StatusNotFound, Body: io.NopCloser(strings.NewReader("node-admin-page: the node's secret")),
			Request: &http.Request{Method: http.MethodGet, URL: &url.URL{Scheme: "https", Host: "127.0.0.1:8080", Path: "/v2/"}}}
		return "", fmt.Errorf("pull %s: %w", ref, transport.CheckError(resp, http.StatusOK))
	}
	p, cancel := testProvider(t, lib, &apiPods{pods: map[string]*corev1.Pod{}})
	defer cancel()
	pod := testPod("web", "u1")
	pod.Spec.Containers[0].Image = "127.0.0.1:8080/anything:v1"
	if err := p.CreatePod(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	st := waitStatus(t, p, "web", waiting("ErrImagePull"))
	msg := st.ContainerStatuses[0].State.Waiting.Message
	if strings.Contains(msg, "secret") || strings.Contains(msg, "node-admin-page") || !strings.Contains(msg, "404") {
		t.Errorf("the pod's status says %q; want the status code and no body", msg)
	}
}
