package kvboxnode

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"

	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/snapshot"
)

// fakeLib is a host in memory: snapshots pulled, boxes cloned, commands
// that print their argv and exit with the code the test set.
type fakeLib struct {
	mu       sync.Mutex
	boxes    map[string]Box
	snaps    map[string]Snapshot
	pulls    int
	exitCode int
	removed  []string
	n        int
	// dial, when set, is what Dial connects a box's port to (a guest's
	// server in the test); else every port is closed.
	dial func(target string) (net.Conn, error)
	// console, when set, is the file every box's console log is; consoleRead
	// counts the bytes read of it.
	console     string
	consoleRead atomic.Int64
	// resolve, when set, answers Resolve (a registry that wants
	// credentials, or answers an error); resolves counts the calls.
	resolve  func(ref string, o PullOptions) (string, error)
	resolves int
	// size, when set, is the size of the snapshots Pull makes.
	size *Snapshot
}

// countedFile is a console log whose reads are counted.
type countedFile struct {
	*os.File
	n *atomic.Int64
}

func (f countedFile) Read(b []byte) (int, error) {
	n, err := f.File.Read(b)
	f.n.Add(int64(n))
	return n, err
}

func newFakeLib() *fakeLib {
	return &fakeLib{boxes: map[string]Box{}, snaps: map[string]Snapshot{}}
}

// box, put and counts read and write the fake's state under its lock, as
// the provider's goroutines do.
func (f *fakeLib) box(name string) (Box, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	b, ok := f.boxes[name]
	return b, ok
}

func (f *fakeLib) put(b Box) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.boxes[b.Name] = b
}

func (f *fakeLib) counts() (pulls, clones int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pulls, f.n
}

func (f *fakeLib) Facts(context.Context) (HostFacts, error) {
	return HostFacts{CPUs: 2, Memory: 4 << 30}, nil
}
func (f *fakeLib) Healthy(context.Context) error { return nil }
func (f *fakeLib) Clone(ctx context.Context, r CloneRequest) (Box, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.snaps[r.Snapshot]; !ok {
		return Box{}, fmt.Errorf("snapshot %s: %w", r.Snapshot, ErrNotFound)
	}
	if _, ok := f.boxes[r.Name]; ok {
		return Box{}, fmt.Errorf("box %s: %w", r.Name, ErrExists)
	}
	f.n++
	b := Box{Name: r.Name, State: "running", IP: fmt.Sprintf("172.31.0.%d", 10+f.n), Snapshot: r.Snapshot, Labels: r.Labels}
	f.boxes[r.Name] = b
	return b, nil
}
func (f *fakeLib) Remove(ctx context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.boxes[name]; !ok {
		return fmt.Errorf("box %s: %w", name, ErrNotFound)
	}
	delete(f.boxes, name)
	f.removed = append(f.removed, name)
	return nil
}
func (f *fakeLib) Boxes(context.Context) ([]Box, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Collect(maps.Values(f.boxes)), nil
}
func (f *fakeLib) Start(ctx context.Context, name string) (Box, error) {
	return Box{}, errors.ErrUnsupported
}
func (f *fakeLib) Ping(ctx context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.boxes[name]; !ok {
		return ErrNotFound
	}
	return nil
}
func (f *fakeLib) Exec(ctx context.Context, name string, r agent.ExecRequest, stdin io.Reader, stdout, stderr io.Writer, resize <-chan agent.WinSize) (int, error) {
	fmt.Fprintln(stdout, strings.Join(r.Argv, " "))
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.exitCode, nil
}
func (f *fakeLib) Dial(ctx context.Context, name, target string) (net.Conn, error) {
	if f.dial != nil {
		return f.dial(target)
	}
	a, b := net.Pipe()
	b.Close()
	return a, nil
}
func (f *fakeLib) ConsoleLog(name string) (io.ReadCloser, error) {
	if f.console != "" {
		file, err := os.Open(f.console)
		if err != nil {
			return nil, err
		}
		return countedFile{file, &f.consoleRead}, nil
	}
	return io.NopCloser(strings.NewReader("console of " + name + "\n")), nil
}
func (f *fakeLib) Stats(ctx context.Context, name string) (BoxStats, error) {
	return BoxStats{At: time.Now()}, nil
}
func (f *fakeLib) Snapshots(context.Context) ([]Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Collect(maps.Values(f.snaps)), nil
}
func (f *fakeLib) Snapshot(ctx context.Context, name string) (Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	s, ok := f.snaps[name]
	if !ok {
		return Snapshot{}, fmt.Errorf("snapshot %s: %w", name, ErrNotFound)
	}
	return s, nil
}
func (f *fakeLib) RemoveSnapshot(ctx context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.snaps, name)
	return nil
}

// fakeDigest is the digest every reference resolves to in the fake.
var fakeDigest = "sha256:" + strings.Repeat("ab", 32)

func (f *fakeLib) Resolve(ctx context.Context, ref string, o PullOptions) (string, error) {
	f.mu.Lock()
	f.resolves++
	resolve := f.resolve
	f.mu.Unlock()
	if resolve != nil {
		return resolve(ref, o)
	}
	return fakeDigest, nil
}

// Pull makes the snapshot as kvbox's pull and libadapter's mark do: a name
// taken is ErrExists; the snapshot is marked kvbox-node's, with the
// digest of the REPO@DIGEST reference.
func (f *fakeLib) Pull(ctx context.Context, ref, name string, o PullOptions) (Snapshot, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if _, ok := f.snaps[name]; ok {
		return Snapshot{}, fmt.Errorf("snapshot %s: %w", name, ErrExists)
	}
	f.pulls++
	_, digest, _ := strings.Cut(ref, "@")
	s := Snapshot{SizeBytes: 1 << 20, CPUs: 1, Memory: 256 << 20, Disk: 1 << 30}
	if f.size != nil {
		s = *f.size
	}
	s.Name, s.Owner, s.OwnerDigest = name, snapshot.OwnerKvboxNode, digest
	f.snaps[name] = s
	return s, nil
}
func (f *fakeLib) Close() error { return nil }

// apiPods is the API server's pods, as GetPod reads them.
type apiPods struct {
	mu   sync.Mutex
	pods map[string]*corev1.Pod
}

func (a *apiPods) get(ctx context.Context, ns, name string) (*corev1.Pod, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if p, ok := a.pods[ns+"/"+name]; ok {
		return p.DeepCopy(), nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, name)
}

type noObjects struct{}

func (noObjects) ConfigMap(ctx context.Context, ns, name string) (*corev1.ConfigMap, error) {
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "configmaps"}, name)
}
func (noObjects) Secret(ctx context.Context, ns, name string) (*corev1.Secret, error) {
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "secrets"}, name)
}

func testProvider(t *testing.T, lib *fakeLib, pods *apiPods) (*Provider, context.CancelFunc) {
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	cache, err := NewCache(lib, t.TempDir(), 0, nil, log)
	if err != nil {
		t.Fatal(err)
	}
	p := NewProvider(ctx, lib, cache, ProviderConfig{NodeName: "kvbox-a", NodeIP: "127.0.0.2", Dir: t.TempDir(), Log: log,
		Objects: noObjects{}, GetPod: pods.get, Check: 20 * time.Millisecond})
	return p, cancel
}

// testPod is a pod of the fake's snapshot (1 vCPU, 256 MiB), requesting
// its size.
func testPod(name, uid string, command ...string) *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: name, UID: types.UID(uid)},
		Spec: corev1.PodSpec{NodeName: "kvbox-a", RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{Name: "box", Image: "127.0.0.1:5000/team/web:v1", Command: command,
				Resources: corev1.ResourceRequirements{Requests: corev1.ResourceList{
					corev1.ResourceCPU: resource.MustParse("1"), corev1.ResourceMemory: resource.MustParse("256Mi")}}}}}}
}

// waitStatus polls the provider's view of a pod until ok (bounded by the
// test's own timeout, not a timing claim).
func waitStatus(t *testing.T, p *Provider, name string, ok func(*corev1.PodStatus) bool) *corev1.PodStatus {
	t.Helper()
	for {
		st, err := p.GetPodStatus(context.Background(), "team", name)
		if err != nil {
			t.Fatal(err)
		}
		if ok(st) {
			return st
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func ready(st *corev1.PodStatus) bool {
	for _, c := range st.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// Two pods of one image: one pull, a box each named after its pod with
// the pod in its labels, Running and Ready at the box's address; deleting
// one removes its box only.
func TestProviderPodsAsClones(t *testing.T) {
	lib, apis := newFakeLib(), &apiPods{pods: map[string]*corev1.Pod{}}
	p, cancel := testProvider(t, lib, apis)
	defer cancel()
	one, two := testPod("web-1", "11111111-aaaa"), testPod("web-2", "22222222-bbbb")
	for _, pod := range []*corev1.Pod{one, two} {
		if err := p.CreatePod(context.Background(), pod); err != nil {
			t.Fatal(err)
		}
	}
	for _, pod := range []*corev1.Pod{one, two} {
		st := waitStatus(t, p, pod.Name, ready)
		box := BoxName("team", pod.Name, string(pod.UID))
		b, ok := lib.box(box)
		if !ok || st.Phase != corev1.PodRunning || st.PodIP != b.IP {
			t.Errorf("pod %s: phase %s, IP %q; box %s %v", pod.Name, st.Phase, st.PodIP, box, b)
		}
		if b.Labels[LabelPodName] != pod.Name || b.Labels[LabelPodUID] != string(pod.UID) || b.Labels[LabelHostname] != pod.Name {
			t.Errorf("box %s's labels %v", box, b.Labels)
		}
	}
	if pulls, _ := lib.counts(); pulls != 1 {
		t.Errorf("%d pulls for one image", pulls)
	}
	del := one.DeepCopy()
	now := metav1.Now()
	del.DeletionTimestamp = &now
	if err := p.DeletePod(context.Background(), del); err != nil {
		t.Fatal(err)
	}
	if _, ok := lib.box(BoxName("team", "web-1", "11111111-aaaa")); ok {
		t.Errorf("web-1 deleted, its box stays")
	}
	if _, ok := lib.box(BoxName("team", "web-2", "22222222-bbbb")); !ok {
		t.Errorf("web-1 deleted, web-2's box went too")
	}
}

// A pod whose command exits 3 fails, its container terminated with code 3,
// its box removed; its log is the command's output.
func TestProviderCommandExitCode(t *testing.T) {
	lib, apis := newFakeLib(), &apiPods{pods: map[string]*corev1.Pod{}}
	lib.exitCode = 3
	p, cancel := testProvider(t, lib, apis)
	defer cancel()
	pod := testPod("job-1", "33333333-cccc", "sh", "-c", "exit 3")
	if err := p.CreatePod(context.Background(), pod); err != nil {
		t.Fatal(err)
	}
	st := waitStatus(t, p, pod.Name, func(st *corev1.PodStatus) bool {
		return st.Phase == corev1.PodFailed || st.Phase == corev1.PodSucceeded
	})
	cs := st.ContainerStatuses
	if st.Phase != corev1.PodFailed || len(cs) != 1 || cs[0].State.Terminated == nil || cs[0].State.Terminated.ExitCode != 3 {
		t.Fatalf("pod of a command exiting 3: phase %s, %+v", st.Phase, cs)
	}
	if left, _ := lib.Boxes(context.Background()); len(left) != 0 {
		t.Errorf("the ended pod's box stays: %v", left)
	}
	r, err := p.GetContainerLogs(context.Background(), "team", pod.Name, "box", api.ContainerLogOpts{})
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(r)
	if strings.TrimSpace(string(b)) != "sh -c exit 3" {
		t.Errorf("the pod's log: %q", b)
	}
}

// A restarted provider finds its pods again from the boxes' labels: a box
// whose pod is still bound here is that pod's, as it is; one whose pod is
// gone, or a clone without labels of the pods' name form, is removed; no
// box is made again.
func TestProviderRecover(t *testing.T) {
	lib, apis := newFakeLib(), &apiPods{pods: map[string]*corev1.Pod{}}
	p, cancel := testProvider(t, lib, apis)
	kept, gone := testPod("web-1", "11111111-aaaa"), testPod("web-2", "22222222-bbbb")
	for _, pod := range []*corev1.Pod{kept, gone} {
		if err := p.CreatePod(context.Background(), pod); err != nil {
			t.Fatal(err)
		}
		waitStatus(t, p, pod.Name, ready)
	}
	cancel() // kvbox-node killed: the boxes stay
	lib.put(Box{Name: "team.web-3.33333333", State: "running", Snapshot: "pod-sha256-x"})
	lib.put(Box{Name: "users-own-box", State: "running"})
	running := kept.DeepCopy()
	running.Status = corev1.PodStatus{Phase: corev1.PodRunning, ContainerStatuses: []corev1.ContainerStatus{{Name: "box",
		State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}}}
	apis.pods["team/web-1"] = running
	_, clonesBefore := lib.counts()

	p2, cancel2 := testProvider(t, lib, apis)
	defer cancel2()
	found, removed, err := p2.Recover(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if strings.Join(found, ",") != "team/web-1" {
		t.Errorf("found %v, want team/web-1", found)
	}
	want := map[string]bool{BoxName("team", "web-2", "22222222-bbbb"): true, "team.web-3.33333333": true}
	if len(removed) != 2 || !want[removed[0]] || !want[removed[1]] {
		t.Errorf("removed %v, want %v", removed, want)
	}
	if _, ok := lib.box("users-own-box"); !ok {
		t.Errorf("a box not of kvbox-node's name form was removed")
	}
	// virtual-kubelet creates the pods it finds bound here: the same one
	// is taken as it is.
	if err := p2.CreatePod(context.Background(), running); err != nil {
		t.Fatal(err)
	}
	st := waitStatus(t, p2, "web-1", ready)
	_, clones := lib.counts()
	if b, _ := lib.box(BoxName("team", "web-1", "11111111-aaaa")); clones != clonesBefore || st.PodIP != b.IP {
		t.Errorf("after the restart: %d clones more, pod IP %q", clones-clonesBefore, st.PodIP)
	}
}

// Every field kvbox cannot honour is refused in one line naming it; what
// the API server adds to every pod passes.
func TestCheckPod(t *testing.T) {
	yes := true
	other := "runc"
	base := func() *corev1.Pod {
		p := testPod("web", "u")
		p.Spec.Volumes = []corev1.Volume{{Name: "kube-api-access-x1", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{}}}}
		p.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "kube-api-access-x1", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount"}}
		p.Spec.Containers[0].TerminationMessagePath = "/dev/termination-log"
		p.Spec.SecurityContext = &corev1.PodSecurityContext{}
		return p
	}
	if err := CheckPod(base(), DefaultRuntimeClass); err != nil {
		t.Fatalf("a plain pod: %v", err)
	}
	for _, tc := range []struct {
		field  string
		change func(*corev1.Pod)
	}{
		{"hostNetwork", func(p *corev1.Pod) { p.Spec.HostNetwork = true }},
		{"privileged", func(p *corev1.Pod) {
			p.Spec.Containers[0].SecurityContext = &corev1.SecurityContext{Privileged: &yes}
		}},
		{"2 containers", func(p *corev1.Pod) { p.Spec.Containers = append(p.Spec.Containers, p.Spec.Containers[0]) }},
		{"runtimeClassName runc", func(p *corev1.Pod) { p.Spec.RuntimeClassName = &other }},
		{`volume "data"`, func(p *corev1.Pod) {
			p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "data", VolumeSource: corev1.VolumeSource{HostPath: &corev1.HostPathVolumeSource{Path: "/"}}})
		}},
		{"hostPort", func(p *corev1.Pod) {
			p.Spec.Containers[0].Ports = []corev1.ContainerPort{{ContainerPort: 80, HostPort: 80}}
		}},
		{"livenessProbe", func(p *corev1.Pod) { p.Spec.Containers[0].LivenessProbe = &corev1.Probe{} }},
		{"args without command", func(p *corev1.Pod) { p.Spec.Containers[0].Command, p.Spec.Containers[0].Args = nil, []string{"x"} }},
		{"initContainers", func(p *corev1.Pod) { p.Spec.InitContainers = []corev1.Container{{Name: "i"}} }},
	} {
		p := base()
		tc.change(p)
		err := CheckPod(p, DefaultRuntimeClass)
		if err == nil || !strings.Contains(err.Error(), tc.field) || strings.Contains(err.Error(), "\n") {
			t.Errorf("%s: %v", tc.field, err)
		}
	}
}
