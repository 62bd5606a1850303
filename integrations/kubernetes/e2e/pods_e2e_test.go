//go:build e2e

package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/clientcmd"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
	"kvbox.dev/kvbox/registry"
	"kvbox.dev/kvbox/snapshot"
)

// The test registry testenv/setup.sh starts in the test namespace.
const testRegistry = "127.0.0.1:5000"

// fleetRun is a local fleet of this test: the control plane and the two
// kvbox nodes of testenv/fleet.sh nodes.
type fleetRun struct {
	t       *testing.T
	repo    string
	state   string // KVBOX_FLEET_STATE
	cache   string
	nodeDir string // KVBOX_FLEET_NODE_STATE: node X's state dir is this followed by X
	env     map[string]string
	client  kubernetes.Interface
	// snapshotTokens are the token-shaped strings of pushSource's
	// snapshot.
	snapshotTokens map[string]bool
}

func (f *fleetRun) sh(args ...string) (string, error) {
	cmd := exec.Command("bash", append([]string{filepath.Join(f.repo, "testenv/fleet.sh")}, args...)...)
	// Each pod requests its snapshot's vCPU, and TestFleetPods runs up
	// to 3 pods a node at once: the nodes commit 8 vCPUs whatever this
	// host's CPUs (KVBOX_NODE_CPUS, kvbox-node's --cpus).
	cmd.Env = append(os.Environ(), "KVBOX_FLEET_STATE="+f.state, "KVBOX_FLEET_CACHE="+f.cache, "KVBOX_TESTENV_NS="+testNetns,
		"KVBOX_FLEET_NODE_STATE="+f.nodeDir, "KVBOX_NODE_CPUS=8")
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	f.t.Logf("fleet.sh %s:\n%s", strings.Join(args, " "), out.String())
	return out.String(), err
}

func (f *fleetRun) must(args ...string) string {
	f.t.Helper()
	out, err := f.sh(args...)
	if err != nil {
		f.t.Fatalf("fleet.sh %s: %v", strings.Join(args, " "), err)
	}
	return out
}

// kubectlCmd is the fleet's kubectl as its admin, with its discovery cache in
// the fleet's state (KUBECACHEDIR of the env file) rather than in ~/.kube.
func (f *fleetRun) kubectlCmd(ctx context.Context, args ...string) *exec.Cmd {
	return exec.CommandContext(ctx, f.env["KUBECTL"], append([]string{
		"--kubeconfig", f.env["KUBECONFIG"], "--cache-dir", f.env["KUBECACHEDIR"]}, args...)...)
}

// kubectl runs the fleet's kubectl as its admin.
func (f *fleetRun) kubectl(args ...string) (string, int) {
	cmd := f.kubectlCmd(context.Background(), args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		f.t.Fatalf("kubectl %s: %v", strings.Join(args, " "), err)
	}
	return out.String(), code
}

// nodePid is the pid of the fleet's kvbox-node name.
func (f *fleetRun) nodePid(name string) int {
	b, err := os.ReadFile(filepath.Join(f.state, "run", name+".pid"))
	if err != nil {
		f.t.Fatalf("%s's pid file: %v", name, err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		f.t.Fatal(err)
	}
	return pid
}

func (f *fleetRun) nodeLog(name string) string {
	b, _ := os.ReadFile(filepath.Join(f.state, "logs", name+".log"))
	return tail(string(b), 60)
}

// upFleet starts the control plane and kvbox-a and kvbox-b (fleet.sh up,
// nodes) and stops them, their boxes, snapshots and bridges when the test
// ends (fleet.sh down).
func upFleet(t *testing.T) *fleetRun {
	repo, cache := fleetPrerequisites(t, "openssl", "curl", "ip", "go", "virsh")
	nodeDir := os.Getenv("KVBOX_FLEET_NODE_STATE")
	if nodeDir == "" {
		nodeDir = "/var/lib/kvbox-fleet-"
	}
	f := &fleetRun{t: t, repo: repo, state: filepath.Join(t.TempDir(), "fleet"), cache: cache, nodeDir: nodeDir}
	t.Cleanup(func() {
		if t.Failed() {
			for _, n := range []string{"kvbox-a", "kvbox-b"} {
				t.Logf("%s's log:\n%s", n, f.nodeLog(n))
			}
		}
		out, err := f.sh("down")
		if err != nil {
			t.Errorf("fleet.sh down: %v", err)
		}
		if strings.Contains(out, "could not remove") || strings.Contains(out, "does not name") {
			t.Errorf("fleet.sh down left something of the nodes, or found a node it had lost")
		}
		if pids := processesOf(filepath.Join(f.state, "bin"), ""); len(pids) > 0 {
			t.Errorf("kvbox-node processes left after down: %v", pids)
		}
		for _, n := range []string{"a", "b"} {
			if _, err := os.Stat(nodeDir + n); err == nil {
				t.Errorf("fleet.sh down left the state dir %s%s", nodeDir, n)
			}
			if _, err := net.InterfaceByName("kvf" + n + "0"); err == nil {
				t.Errorf("fleet.sh down left the bridge kvf%s0", n)
			}
		}
	})
	f.must("up")
	f.env = readEnv(t, filepath.Join(f.state, "env"))
	cfg, err := clientcmd.BuildConfigFromFlags("", f.env["KUBECONFIG"])
	if err != nil {
		t.Fatal(err)
	}
	f.client = kubernetes.NewForConfigOrDie(cfg)
	f.must("nodes")
	return f
}

func randomID(t *testing.T) string {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

// pushSource makes a box of the tiny image serving page on port 8080,
// snapshots it, pushes the snapshot to the test registry and removes box
// and snapshot; it returns the reference. The source's kvbox is this test
// run's (KVBOX_STATE_DIR, KVBOX_BRIDGE, KVBOX_SUBNET).
func pushSource(t *testing.T, f *fleetRun, id, page string) string {
	kvbox := filepath.Join(f.state, "bin", "kvbox")
	run := func(args ...string) string {
		t.Helper()
		out, err := exec.Command(kvbox, args...).CombinedOutput()
		if err != nil {
			t.Fatalf("kvbox %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	src := "fleetsrc-" + id
	defer exec.Command(kvbox, "rm", "--force", src).Run()
	defer exec.Command(kvbox, "snapshots", "rm", src).Run()
	run("new", "--image", "tiny", "--cpus", "1", "--memory", "256M", "--disk", "1G", src)
	run("exec", src, "--", "sh", "-c", "mkdir -p /www && echo '"+page+"' > /www/index.html && "+
		"setsid httpd -p 8080 -h /www </dev/null >/dev/null 2>&1; sleep 0.3; netstat -ltn | grep -q :8080")
	run("snapshots", "new", src, src)
	ref := testRegistry + "/fleet/web-" + id + ":v1"
	run("snapshots", "push", "--insecure", src, ref)
	// Every token-shaped string the snapshot holds (its memory and disk):
	// a pod's own local envd token must be none of them.
	stateDir := os.Getenv("KVBOX_STATE_DIR")
	if stateDir == "" {
		stateDir = "/var/lib/kvbox"
	}
	f.snapshotTokens = tokensIn(t, filepath.Join(stateDir, "snapshots", src))
	if len(f.snapshotTokens) == 0 {
		t.Fatalf("no token-shaped string in snapshot %s (its agent mints a local envd token before the copy): the scan read nothing", src)
	}
	return ref
}

// tokensIn is every run of exactly 64 hex digits (a local envd token's
// shape) in the files under dir.
func tokensIn(t *testing.T, dir string) map[string]bool {
	t.Helper()
	re := regexp.MustCompile(`[0-9a-f]{64,}`)
	out := map[string]bool{}
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.Type().IsRegular() {
			return err
		}
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range re.FindAll(b, -1) {
			if len(m) == 64 {
				out[string(m)] = true
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// sourceRequests is the size of pushSource's snapshot (1 vCPU, 256 MiB),
// which a pod of it requests: a kvbox node refuses a pod that asks for
// less than its snapshot's box.
var sourceRequests = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1"), corev1.ResourceMemory: resource.MustParse("256Mi")}

func kvboxPodSpec(image string, command ...string) corev1.PodSpec {
	rc := kvboxnode.DefaultRuntimeClass
	return corev1.PodSpec{
		RuntimeClassName: &rc,
		Containers: []corev1.Container{{Name: "box", Image: image, Command: command,
			Ports:     []corev1.ContainerPort{{ContainerPort: 8080}},
			Resources: corev1.ResourceRequirements{Requests: sourceRequests}}},
	}
}

// waitPod waits until ok holds for the pod, failing early when it ended.
func waitPod(ctx context.Context, t *testing.T, c kubernetes.Interface, ns, name, what string, ok func(*corev1.Pod) bool) *corev1.Pod {
	t.Helper()
	var got *corev1.Pod
	poll(ctx, t, "pod "+name+" "+what, func() bool {
		p, err := c.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("pod %s: %v", name, err)
		}
		got = p
		return ok(p)
	})
	return got
}

// domain is what libvirt says of a box: its state, and its QEMU's pid.
func domainState(t *testing.T, name string) (state string, exists bool) {
	out, err := exec.Command("virsh", "-c", "qemu:///system", "domstate", name).CombinedOutput()
	if err != nil {
		if strings.Contains(string(out), "ailed to get domain") || strings.Contains(string(out), "no domain") {
			return "", false
		}
		t.Fatalf("virsh domstate %s: %v\n%s", name, err, out)
	}
	return strings.TrimSpace(string(out)), true
}

func qemuPid(t *testing.T, name string) int {
	b, err := os.ReadFile(filepath.Join("/run/libvirt/qemu", name+".pid"))
	if err != nil {
		t.Fatalf("box %s's QEMU pid: %v", name, err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	return pid
}

// fleetBoxes lists the domains of the fleet's nodes' state dirs.
func fleetBoxes(t *testing.T, f *fleetRun) map[string]string {
	out := map[string]string{}
	for _, n := range []string{"a", "b"} {
		ents, err := os.ReadDir(filepath.Join(f.nodeDir+n, "boxes"))
		if err != nil && !os.IsNotExist(err) {
			t.Fatal(err)
		}
		for _, e := range ents {
			if _, ok := domainState(t, e.Name()); ok {
				out[e.Name()] = "kvbox-" + n
			}
		}
	}
	return out
}

func get(ctx context.Context, url string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return "", err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		return string(b), fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	return string(b), err
}

// checkServing checks a running pod: its box, named after it, runs on its
// node; its guest's hostname is the pod's name (kubectl exec); its address
// is on its node's podCIDR and serves page.
func checkServing(ctx context.Context, t *testing.T, f *fleetRun, p *corev1.Pod, page string) string {
	t.Helper()
	box := kvboxnode.BoxName(p.Namespace, p.Name, string(p.UID))
	if st, ok := domainState(t, box); !ok || st != "running" {
		t.Errorf("pod %s: its box %s is %q (exists %v)", p.Name, box, st, ok)
	}
	if _, err := os.Stat(filepath.Join(f.nodeDir+strings.TrimPrefix(p.Spec.NodeName, "kvbox-"), "boxes", box)); err != nil {
		t.Errorf("pod %s: its box is not in %s's state dir: %v", p.Name, p.Spec.NodeName, err)
	}
	nd, err := f.client.CoreV1().Nodes().Get(ctx, p.Spec.NodeName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cidr, err := netip.ParsePrefix(nd.Spec.PodCIDR)
	ip, err2 := netip.ParseAddr(p.Status.PodIP)
	if err != nil || err2 != nil || !cidr.Contains(ip) {
		t.Errorf("pod %s's address %q is not on its node %s's podCIDR %q", p.Name, p.Status.PodIP, p.Spec.NodeName, nd.Spec.PodCIDR)
	}
	out, code := f.kubectl("exec", "-n", p.Namespace, p.Name, "--", "hostname")
	if code != 0 || strings.TrimSpace(out) != p.Name {
		t.Errorf("kubectl exec %s -- hostname: %q (exit %d), want the pod's name", p.Name, out, code)
	}
	// The guest's local envd token is the pod's own, minted at its
	// clone's identify: none that its pushed snapshot holds.
	out, code = f.kubectl("exec", "-n", p.Namespace, p.Name, "--", "cat", "/var/lib/kvbox-agent/envd-token")
	if tok := strings.TrimSpace(out); code != 0 || len(tok) != 64 || f.snapshotTokens[tok] {
		t.Errorf("pod %s's local envd token %q (exit %d): want one of its own, not its snapshot's", p.Name, tok, code)
	}
	body, err := get(ctx, "http://"+p.Status.PodIP+":8080/")
	if err != nil || strings.TrimSpace(body) != page {
		t.Errorf("pod %s at %s:8080: %q, %v; want %q", p.Name, p.Status.PodIP, body, err, page)
	}
	return box
}

// TestFleetPods: pods whose image is a pushed kvbox snapshot run as warm
// clones on the fleet's two kvbox nodes (testenv/fleet.sh nodes), each with
// the pod's name as its hostname and its own address, serving what the
// source served; deleting a pod removes its box.
func TestFleetPods(t *testing.T) {
	f := upFleet(t)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	id := randomID(t)
	page := "fleet-page-" + id
	ref := pushSource(t, f, id, page)
	ns := "default"
	r := &podsRun{t: t, ctx: ctx, f: f, id: id, page: page, ref: ref, ns: ns, pods: f.client.CoreV1().Pods(ns)}

	p, box := r.onePod()
	r.stopIfFailed()
	r.podDeleted(p, box)
	r.stopIfFailed()
	r.deployment()
	r.stopIfFailed()
	r.warmPool()
	r.stopIfFailed()
	r.failingJob()
	r.stopIfFailed()
	r.nodeRestarted()
	r.stopIfFailed()
	r.incompatible()
	r.scaledToZero()
	r.stopIfFailed()
	r.nodeLost()
}

// podsRun is one run of TestFleetPods: its fleet, the pushed snapshot's
// reference and the page it serves, and the Deployment its steps share.
type podsRun struct {
	t                 *testing.T
	ctx               context.Context
	f                 *fleetRun
	id, page, ref, ns string
	pods              corev1client.PodInterface
	dep               *appsv1.Deployment
	webs              []corev1.Pod // the Deployment's pods, as last read
}

// stopIfFailed ends the test when a step failed: the next builds on it.
func (r *podsRun) stopIfFailed() {
	if r.t.Failed() {
		r.t.FailNow()
	}
}

// onePod: one pod is a warm clone, Running and Ready, its own hostname and
// address, serving the page; its box is returned.
func (r *podsRun) onePod() (*corev1.Pod, string) {
	t, ctx, f := r.t, r.ctx, r.f
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web-" + r.id}, Spec: kvboxPodSpec(r.ref)}
	if _, err := r.pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	p := waitPod(ctx, t, f.client, r.ns, pod.Name, "Running and Ready", func(p *corev1.Pod) bool {
		if p.Status.Phase == corev1.PodFailed {
			t.Fatalf("pod %s failed: %s: %s", p.Name, p.Status.Reason, p.Status.Message)
		}
		return kvboxnode.PodReady(p)
	})
	t.Logf("pod %s Running and Ready on %s at %s, %.1fs after its creation (first pull on that node)", p.Name, p.Spec.NodeName, p.Status.PodIP, time.Since(t0).Seconds())
	box := checkServing(ctx, t, f, p, r.page)
	cs := p.Status.ContainerStatuses
	if len(cs) != 1 || !strings.HasPrefix(cs[0].ImageID, testRegistry+"/fleet/web-"+r.id+"@sha256:") || cs[0].ContainerID != "kvbox://"+box {
		t.Errorf("pod %s's container status: %+v", p.Name, cs)
	}
	return p, box
}

// podDeleted: the pod deleted, its box goes with it.
func (r *podsRun) podDeleted(p *corev1.Pod, box string) {
	t, ctx := r.t, r.ctx
	if err := r.pods.Delete(ctx, p.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	poll(ctx, t, "pod "+p.Name+" gone", func() bool {
		_, err := r.pods.Get(ctx, p.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	})
	if st, ok := domainState(t, box); ok {
		t.Errorf("pod %s deleted, its box %s is still there (%s)", p.Name, box, st)
	}
	if _, err := os.Stat(filepath.Join(r.f.nodeDir+strings.TrimPrefix(p.Spec.NodeName, "kvbox-"), "boxes", box)); !os.IsNotExist(err) {
		t.Errorf("pod %s deleted, its box's folder stays: %v", p.Name, err)
	}
}

// deployment: a Deployment of 3, spread over both nodes: each pod its own
// box, hostname and address, serving the page; kubectl exec keeps the
// exit code, kubectl port-forward reaches the guest's port.
func (r *podsRun) deployment() {
	t, ctx, f := r.t, r.ctx, r.f
	three := int32(3)
	labels := map[string]string{"app": "webs-" + r.id}
	spec := kvboxPodSpec(r.ref)
	// Spread over the nodes that can take pods (a node down for good is
	// tainted, and then counts no more).
	honor := corev1.NodeInclusionPolicyHonor
	spec.TopologySpreadConstraints = []corev1.TopologySpreadConstraint{{MaxSkew: 1, TopologyKey: "kubernetes.io/hostname",
		WhenUnsatisfiable: corev1.DoNotSchedule, LabelSelector: &metav1.LabelSelector{MatchLabels: labels}, NodeTaintsPolicy: &honor}}
	r.dep = &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: "webs-" + r.id},
		Spec: appsv1.DeploymentSpec{Replicas: &three, Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: spec}}}
	if _, err := f.client.AppsV1().Deployments(r.ns).Create(ctx, r.dep, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	poll(ctx, t, "3 pods of the Deployment Ready", func() bool {
		l, err := r.pods.List(ctx, metav1.ListOptions{LabelSelector: "app=webs-" + r.id})
		if err != nil {
			t.Fatal(err)
		}
		r.webs = l.Items
		ready := 0
		for i := range r.webs {
			if r.webs[i].Status.Phase == corev1.PodFailed {
				t.Fatalf("pod %s failed: %s: %s", r.webs[i].Name, r.webs[i].Status.Reason, r.webs[i].Status.Message)
			}
			if kvboxnode.PodReady(&r.webs[i]) {
				ready++
			}
		}
		return len(r.webs) == 3 && ready == 3
	})
	t.Logf("Deployment of 3 Ready %.1fs after its creation", time.Since(t0).Seconds())
	webs := r.webs
	onNode, ips, boxes := map[string]int{}, map[string]bool{}, map[string]string{}
	for i := range webs {
		w := &webs[i]
		boxes[checkServing(ctx, t, f, w, r.page)] = w.Name
		onNode[w.Spec.NodeName]++
		ips[w.Status.PodIP] = true
		t.Logf("pod %s on %s at %s", w.Name, w.Spec.NodeName, w.Status.PodIP)
	}
	if onNode["kvbox-a"] == 0 || onNode["kvbox-b"] == 0 {
		t.Errorf("the Deployment's pods are not on both nodes: %v", onNode)
	}
	if len(ips) != 3 {
		t.Errorf("the Deployment's 3 pods have %d addresses", len(ips))
	}
	if out, code := f.kubectl("exec", webs[0].Name, "--", "sh", "-c", "echo to-stderr >&2; exit 7"); code != 7 || !strings.Contains(out, "to-stderr") {
		t.Errorf("kubectl exec of a command exiting 7: exit %d, output %q", code, out)
	}
	if got := fleetBoxes(t, f); len(got) != 3 {
		t.Errorf("the fleet's nodes run %d boxes for 3 pods: %v", len(got), got)
	}
	// kubectl port-forward reaches the guest's port through the API server
	// and the node (no route to the box needed).
	if body, err := portForward(ctx, t, f, webs[1].Name, 8080); err != nil || strings.TrimSpace(body) != r.page {
		t.Errorf("kubectl port-forward %s 8080: %q, %v; want %q", webs[1].Name, body, err, r.page)
	}
}

// failingJob: a Job whose command exits 3 fails, its pod's container with
// exit code 3; kubectl logs shows what the command printed; its box goes.
func (r *podsRun) failingJob() {
	t, ctx, f, ns, id := r.t, r.ctx, r.f, r.ns, r.id
	zero := int32(0)
	jspec := kvboxPodSpec(r.ref, "sh", "-c", "echo job-says-"+id+"; exit 3")
	jspec.RestartPolicy = corev1.RestartPolicyNever
	job := &batchv1.Job{ObjectMeta: metav1.ObjectMeta{Name: "exit3-" + id},
		Spec: batchv1.JobSpec{BackoffLimit: &zero, Template: corev1.PodTemplateSpec{Spec: jspec}}}
	if _, err := f.client.BatchV1().Jobs(ns).Create(ctx, job, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	poll(ctx, t, "Job "+job.Name+" Failed", func() bool {
		j, err := f.client.BatchV1().Jobs(ns).Get(ctx, job.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range j.Status.Conditions {
			if c.Type == batchv1.JobComplete && c.Status == corev1.ConditionTrue {
				t.Fatalf("Job %s completed; its command exits 3", job.Name)
			}
			if c.Type == batchv1.JobFailed && c.Status == corev1.ConditionTrue {
				t.Logf("Job %s failed: %s: %s", job.Name, c.Reason, c.Message)
				return true
			}
		}
		return false
	})
	jl, err := r.pods.List(ctx, metav1.ListOptions{LabelSelector: "batch.kubernetes.io/job-name=" + job.Name})
	if err != nil || len(jl.Items) != 1 {
		t.Fatalf("the Job's pods: %v (%v)", jl, err)
	}
	jp := &jl.Items[0]
	if cs := jp.Status.ContainerStatuses; jp.Status.Phase != corev1.PodFailed || len(cs) != 1 || cs[0].State.Terminated == nil || cs[0].State.Terminated.ExitCode != 3 {
		t.Errorf("the Job's pod %s: phase %s, container statuses %+v; want Failed, exit code 3", jp.Name, jp.Status.Phase, cs)
	}
	if out, code := f.kubectl("logs", jp.Name); code != 0 || strings.TrimSpace(out) != "job-says-"+id {
		t.Errorf("kubectl logs %s: %q (exit %d), want what its command printed", jp.Name, out, code)
	}
	if st, ok := domainState(t, kvboxnode.BoxName(ns, jp.Name, string(jp.UID))); ok {
		t.Errorf("the Job's pod ended, its box stays (%s)", st)
	}
}

// nodeRestarted: kvbox-a killed and started again: the same pods (no
// replacement, no restart), the same boxes (their QEMU processes ran on),
// no duplicate.
func (r *podsRun) nodeRestarted() {
	t, ctx, f := r.t, r.ctx, r.f
	before := map[types.UID]string{}
	pidsBefore := map[string]int{}
	for _, w := range r.webs {
		before[w.UID] = w.Spec.NodeName
		b := kvboxnode.BoxName(w.Namespace, w.Name, string(w.UID))
		pidsBefore[b] = qemuPid(t, b)
	}
	killed := f.nodePid("kvbox-a")
	if exe, err := os.Readlink(fmt.Sprintf("/proc/%d/exe", killed)); err != nil || exe != filepath.Join(f.state, "bin", "kvbox-node") {
		t.Fatalf("kvbox-a's pid file names %d, which runs %q (%v), not kvbox-node", killed, exe, err)
	}
	if err := syscall.Kill(killed, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	poll(ctx, t, "kvbox-a's process gone", func() bool {
		_, err := os.Stat(fmt.Sprintf("/proc/%d", killed))
		return os.IsNotExist(err)
	})
	os.Setenv("KVBOX_FLEET_NODE_BUILD", "0")
	defer os.Unsetenv("KVBOX_FLEET_NODE_BUILD")
	f.must("nodes")
	if again := f.nodePid("kvbox-a"); again == killed {
		t.Fatalf("kvbox-a was not started again (pid %d)", again)
	}
	poll(ctx, t, "the Deployment's pods Ready after kvbox-a's restart", func() bool {
		l, err := r.pods.List(ctx, metav1.ListOptions{LabelSelector: "app=webs-" + r.id})
		if err != nil {
			t.Fatal(err)
		}
		r.webs = l.Items
		for i := range r.webs {
			if !kvboxnode.PodReady(&r.webs[i]) {
				return false
			}
		}
		return true
	})
	if !strings.Contains(f.nodeLog("kvbox-a"), "found this host's pods again") {
		t.Errorf("kvbox-a's log does not say it found its pods again")
	}
	webs := r.webs
	if len(webs) != 3 {
		t.Errorf("after kvbox-a's restart the Deployment has %d pods", len(webs))
	}
	for _, w := range webs {
		if node, ok := before[w.UID]; !ok || node != w.Spec.NodeName {
			t.Errorf("after kvbox-a's restart pod %s (%s) on %s is not one of before: %v", w.Name, w.UID, w.Spec.NodeName, before)
		}
		if cs := w.Status.ContainerStatuses; len(cs) != 1 || cs[0].RestartCount != 0 {
			t.Errorf("after kvbox-a's restart pod %s's container statuses: %+v", w.Name, cs)
		}
	}
	after := fleetBoxes(t, f)
	if len(after) != 3 {
		t.Errorf("after kvbox-a's restart the nodes run %d boxes for 3 pods: %v", len(after), after)
	}
	for b, pid := range pidsBefore {
		if _, ok := after[b]; !ok {
			t.Errorf("after kvbox-a's restart box %s is gone", b)
		} else if got := qemuPid(t, b); got != pid {
			t.Errorf("after kvbox-a's restart box %s runs in another QEMU (%d, was %d)", b, got, pid)
		}
	}
	for i := range webs {
		checkServing(ctx, t, f, &webs[i], r.page)
	}
}

// incompatible: a snapshot these hosts cannot restore (a machine type
// their QEMU lacks): a pod that asks for that machine type through its
// node selector stays Pending with the scheduler's reason; one put on a
// node by name fails with kvbox's one line.
func (r *podsRun) incompatible() {
	t, ctx, f, ns, id := r.t, r.ctx, r.f, r.ns, r.id
	badRef := pushIncompatible(ctx, t, r.ref, "pc-q35-99.0")
	asking := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "needs-machine-" + id}, Spec: kvboxPodSpec(badRef)}
	asking.Spec.NodeSelector = map[string]string{kvboxnode.MachineLabelPrefix + "pc-q35-99.0": "true"}
	forced := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "forced-" + id}, Spec: kvboxPodSpec(badRef)}
	forced.Spec.NodeName = "kvbox-b"
	for _, pod := range []*corev1.Pod{asking, forced} {
		if _, err := r.pods.Create(ctx, pod, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitPod(ctx, t, f.client, ns, asking.Name, "unschedulable", func(p *corev1.Pod) bool {
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
				t.Logf("pod %s: %s", p.Name, c.Message)
				if !strings.Contains(c.Message, "node affinity/selector") {
					t.Errorf("pod %s is unschedulable for another reason: %s", p.Name, c.Message)
				}
				return true
			}
		}
		return false
	})
	fp := waitPod(ctx, t, f.client, ns, forced.Name, "Failed", func(p *corev1.Pod) bool { return p.Status.Phase == corev1.PodFailed })
	t.Logf("pod %s: %s: %s", fp.Name, fp.Status.Reason, fp.Status.Message)
	if fp.Status.Reason != kvboxnode.ReasonIncompatible || !strings.Contains(fp.Status.Message, "pc-q35-99.0") || strings.Contains(fp.Status.Message, "\n") {
		t.Errorf("pod %s forced onto kvbox-b: reason %q, message %q; want %s and one line naming the machine type", fp.Name, fp.Status.Reason, fp.Status.Message, kvboxnode.ReasonIncompatible)
	}
	for _, pod := range []*corev1.Pod{asking, forced} {
		if err := r.pods.Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// scale sets the Deployment's replicas.
func (r *podsRun) scale(replicas int32) {
	deps := r.f.client.AppsV1().Deployments(r.ns)
	scale, err := deps.GetScale(r.ctx, r.dep.Name, metav1.GetOptions{})
	if err != nil {
		r.t.Fatal(err)
	}
	scale.Spec.Replicas = replicas
	if _, err := deps.UpdateScale(r.ctx, r.dep.Name, scale, metav1.UpdateOptions{}); err != nil {
		r.t.Fatal(err)
	}
}

// scaledToZero: scaled to 0, no box is left on either node, and both
// still list the snapshot in their images (the scheduler prefers them for
// it).
func (r *podsRun) scaledToZero() {
	t, ctx, f := r.t, r.ctx, r.f
	r.scale(0)
	poll(ctx, t, "the Deployment's pods gone", func() bool {
		l, err := r.pods.List(ctx, metav1.ListOptions{LabelSelector: "app=webs-" + r.id})
		if err != nil {
			t.Fatal(err)
		}
		return len(l.Items) == 0
	})
	if got := fleetBoxes(t, f); len(got) != 0 {
		t.Errorf("scaled to 0, the nodes still run boxes: %v", got)
	}
	for _, n := range []string{"kvbox-a", "kvbox-b"} {
		nd, err := f.client.CoreV1().Nodes().Get(ctx, n, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		listed := false
		for _, im := range nd.Status.Images {
			if slices.Contains(im.Names, r.ref) && im.SizeBytes > 0 {
				listed = true
			}
		}
		if !listed {
			t.Errorf("scaled to 0, %s's images do not list %s: %+v", n, r.ref, nd.Status.Images)
		}
	}
}

// nodeLost: one node stopped for good: its pods are evicted once it is
// NotReady past their toleration, and made again on the other.
func (r *podsRun) nodeLost() {
	t, ctx, f := r.t, r.ctx, r.f
	r.scale(3)
	poll(ctx, t, "the Deployment at 3 again, over both nodes", func() bool {
		r.webs = readyPods(ctx, t, r.pods, "app=webs-"+r.id)
		on := map[string]bool{}
		for _, w := range r.webs {
			on[w.Spec.NodeName] = true
		}
		return len(r.webs) == 3 && len(on) == 2
	})
	stopped := time.Now()
	if err := syscall.Kill(f.nodePid("kvbox-b"), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	poll(ctx, t, "3 pods Ready on kvbox-a", func() bool {
		r.webs = readyPods(ctx, t, r.pods, "app=webs-"+r.id)
		for _, w := range r.webs {
			if w.Spec.NodeName != "kvbox-a" {
				return false
			}
		}
		return len(r.webs) == 3
	})
	t.Logf("kvbox-b stopped for good: its pods made again on kvbox-a, all Ready %.1fs after (grace period and toleration %s + 30s)", time.Since(stopped).Seconds(), grace)
	for i := range r.webs {
		checkServing(ctx, t, f, &r.webs[i], r.page)
	}
}

// portForward runs kubectl port-forward to the pod's port and fetches /
// through it.
func portForward(ctx context.Context, t *testing.T, f *fleetRun, pod string, port int) (string, error) {
	cmd := f.kubectlCmd(ctx, "port-forward", "--address", "127.0.0.1", pod, fmt.Sprintf(":%d", port))
	out, err := cmd.StdoutPipe()
	if err != nil {
		return "", err
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		return "", err
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	// "Forwarding from 127.0.0.1:LOCAL -> PORT"
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		return "", fmt.Errorf("kubectl port-forward: %v: %s", err, stderr.String())
	}
	local, _, ok := strings.Cut(strings.TrimPrefix(strings.TrimSpace(line), "Forwarding from "), " ->")
	if !ok {
		return "", fmt.Errorf("kubectl port-forward said %q", line)
	}
	return get(ctx, "http://"+local+"/")
}

// readyPods lists the Ready pods of selector that are not being deleted.
func readyPods(ctx context.Context, t *testing.T, pods corev1client.PodInterface, selector string) []corev1.Pod {
	l, err := pods.List(ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		t.Fatal(err)
	}
	var out []corev1.Pod
	for i := range l.Items {
		if l.Items[i].DeletionTimestamp == nil && kvboxnode.PodReady(&l.Items[i]) {
			out = append(out, l.Items[i])
		}
	}
	return out
}

// pushIncompatible pushes, beside ref, its artifact with a compatibility
// record that names machine type: the same parts, a manifest no host
// without that machine type can restore.
func pushIncompatible(ctx context.Context, t *testing.T, ref, machine string) string {
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	desc, err := remote.Get(r, remote.WithContext(ctx))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(desc.Manifest, &m); err != nil {
		t.Fatal(err)
	}
	ann, _ := m["annotations"].(map[string]any)
	raw, _ := ann[registry.AnnotCompat].(string)
	var c snapshot.Compat
	if err := json.Unmarshal([]byte(raw), &c); err != nil {
		t.Fatalf("the artifact's %s annotation: %v", registry.AnnotCompat, err)
	}
	c.Machine = machine
	b, err := json.Marshal(c)
	if err != nil {
		t.Fatal(err)
	}
	ann[registry.AnnotCompat] = string(b)
	if desc.Manifest, err = json.Marshal(m); err != nil {
		t.Fatal(err)
	}
	bad := r.Context().Tag("needs-" + machine)
	if err := remote.Put(bad, desc, remote.WithContext(ctx)); err != nil {
		t.Fatal(err)
	}
	return bad.String()
}
