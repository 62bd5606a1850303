//go:build e2e

// Package e2e runs kvbox-node against a real control plane: testenv/fleet.sh
// up (etcd, kube-apiserver, kube-scheduler, kube-controller-manager on
// loopback), two kvbox-node processes, and client-go. It lives in this
// module, not in testenv, so that kvbox's own module does not require the
// Kubernetes libraries. Run it inside the test namespace:
//
//	ip netns exec kvbox-test go test -tags e2e -count=1 -v ./e2e
package e2e

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
	"kvbox.dev/kvbox/snapshot"
	"kvbox.dev/kvbox/testenv/gate"
)

const (
	testNetns = "kvbox-test"
	// The fleet's node-monitor grace period; fleet.sh's default.
	grace = 20 * time.Second
)

// The fleet's listening ports (fleet.sh): etcd client and peer, API
// server, scheduler, controller manager.
var fleetPorts = []int{2379, 2380, 6443, 10259, 10257}

type node struct {
	name   string
	addr   string
	cmd    *exec.Cmd
	log    string
	done   chan error // the process's end, once
	exited bool
	err    error
}

// exitedNow reports whether the process ended, without waiting.
func (n *node) exitedNow() bool {
	if !n.exited {
		select {
		case n.err = <-n.done:
			n.exited = true
		default:
		}
	}
	return n.exited
}

// stop sends sig and waits for the end (bounded by the caller's test).
func (n *node) stop(sig os.Signal) error {
	if !n.exited {
		n.cmd.Process.Signal(sig)
		n.err = <-n.done
		n.exited = true
	}
	return n.err
}

func TestFleetNodes(t *testing.T) {
	r := startFleetNodes(t)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	r.ctx = ctx
	host := readHostFacts(t)

	// kvbox-a with its capacity given, its boxes on the podCIDR the node
	// IPAM gives it; kvbox-b with the host's capacity, its boxes capped by
	// the /28 subnet it is given (13 addresses). Bridges of their own.
	a := r.start("kvbox-a", "127.0.0.2", "--cpus", "4", "--memory", "6Gi", "--bridge", "kvfa0")
	b := r.start("kvbox-b", "127.0.0.3", "--subnet", "172.31.3.0/28", "--bridge", "kvfb0")

	r.checkNodesReady(a, b, host)
	r.checkPodCIDRs(a, b)
	if t.Failed() {
		t.FailNow()
	}
	r.checkLeases(a, b)
	tolerating, boundTo := r.checkTaint(a, b)
	r.checkKubeletAPI(a, b, tolerating, boundTo)
	r.stopNodes(a, b)
	r.checkDown()
}

// nodesRun is one run of TestFleetNodes: its control plane (fleet.sh in
// a state folder of the test's) and the kvbox-node it built.
type nodesRun struct {
	t           *testing.T
	ctx         context.Context
	repo, cache string
	bin         string // the control plane's binaries
	tmp, state  string
	kvboxNode   string
	client      kubernetes.Interface
	downDone    bool
}

// startFleetNodes builds kvbox-node and brings the control plane up (a
// second fleet.sh up finds it up and leaves it alone); fleet.sh down when
// the test ends, unless the test did it.
func startFleetNodes(t *testing.T) *nodesRun {
	repo, cache := fleetPrerequisites(t, "openssl", "curl", "ip", "go")
	bin := filepath.Join(cache, "v1.37.2", "bin")
	tmp := t.TempDir()
	r := &nodesRun{t: t, repo: repo, cache: cache, bin: bin, tmp: tmp, state: filepath.Join(tmp, "fleet")}

	r.kvboxNode = filepath.Join(tmp, "kvbox-node")
	if out, err := exec.Command("go", "build", "-o", r.kvboxNode, "../cmd/kvbox-node").CombinedOutput(); err != nil {
		t.Fatalf("go build kvbox-node: %v\n%s", err, out)
	}

	t.Cleanup(func() {
		if !r.downDone {
			r.fleet("down")
		}
	})
	r.fleet("up")
	env := readEnv(t, filepath.Join(r.state, "env"))
	if env["KUBECTL"] != filepath.Join(bin, "kubectl") || env["KUBECONFIG"] == "" ||
		!strings.HasPrefix(env["KUBECACHEDIR"], r.state+"/") {
		t.Fatalf("fleet env file: %v", env)
	}
	// fleet.sh up again finds it up and leaves it alone.
	if out := r.fleet("up"); !strings.Contains(out, "already up") {
		t.Fatalf("a second up did not find the fleet up:\n%s", out)
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", env["KUBECONFIG"])
	if err != nil {
		t.Fatal(err)
	}
	r.client = kubernetes.NewForConfigOrDie(cfg)
	return r
}

// fleet runs testenv/fleet.sh on the test's state folder and returns what
// it printed; a failure fails the test.
func (r *nodesRun) fleet(args ...string) string {
	t := r.t
	t.Helper()
	cmd := exec.Command("bash", append([]string{filepath.Join(r.repo, "testenv/fleet.sh")}, args...)...)
	cmd.Env = append(os.Environ(), "KVBOX_FLEET_STATE="+r.state, "KVBOX_FLEET_CACHE="+r.cache, "KVBOX_TESTENV_NS="+testNetns)
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		t.Fatalf("fleet.sh %s: %v\n%s", strings.Join(args, " "), err, out.String())
	}
	t.Logf("fleet.sh %s:\n%s", strings.Join(args, " "), out.String())
	return out.String()
}

// hostFacts is what this host is, read through kvbox's library, to hold
// the nodes' labels and capacity to.
type hostFacts struct {
	domainType string
	compat     snapshot.HostCompat
	qemu       uint32
	cpus       uint   // the host's CPUs
	memory     uint64 // the host's memory, KiB
}

func readHostFacts(t *testing.T) hostFacts {
	conn, err := domain.Connect(domain.DefaultURI())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	dh := &domain.Host{DomainTypeOverride: os.Getenv("KVBOX_DOMAIN_TYPE")}
	dh.SetConn(conn)
	hostType, err := dh.DomainType()
	if err != nil {
		t.Fatal(err)
	}
	hc, err := snapshot.HostCompatOf(conn, hostType)
	if err != nil {
		t.Fatal(err)
	}
	qemu, err := conn.GetVersion()
	if err != nil {
		t.Fatal(err)
	}
	info, err := conn.GetNodeInfo()
	if err != nil {
		t.Fatal(err)
	}
	return hostFacts{domainType: hostType, compat: hc, qemu: qemu, cpus: info.Cpus, memory: info.Memory}
}

// start starts kvbox-node name on addr with extra flags, its credentials
// from fleet.sh node-credentials, its log kept (shown when the test
// fails); it is killed when the test ends.
func (r *nodesRun) start(name, addr string, extra ...string) *node {
	t := r.t
	creds := strings.TrimSpace(lastLine(r.fleet("node-credentials", name, addr)))
	n := &node{name: name, addr: addr, log: filepath.Join(r.tmp, name+".log"), done: make(chan error, 1)}
	logf, err := os.Create(n.log)
	if err != nil {
		t.Fatal(err)
	}
	args := append([]string{"--name", name, "--node-address", addr, "--kubeconfig", filepath.Join(creds, "kubeconfig"),
		"--tls-cert-file", filepath.Join(creds, "kubelet.crt"), "--tls-private-key-file", filepath.Join(creds, "kubelet.key"),
		"--client-ca-file", filepath.Join(creds, "ca.crt"), "--state-dir", filepath.Join(r.tmp, "state-"+name),
		"--status-interval", "2s"}, extra...)
	n.cmd = exec.Command(r.kvboxNode, args...)
	n.cmd.Stdout, n.cmd.Stderr = logf, logf
	if err := n.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { n.done <- n.cmd.Wait(); logf.Close() }()
	t.Cleanup(func() {
		n.stop(os.Kill)
		if t.Failed() {
			b, _ := os.ReadFile(n.log)
			t.Logf("%s's log:\n%s", name, tail(string(b), 40))
		}
	})
	return n
}

// checkNodesReady: both nodes Ready, with their capacity, labels, taint
// and addresses.
func (r *nodesRun) checkNodesReady(a, b *node, host hostFacts) {
	t, ctx, client := r.t, r.ctx, r.client
	hostType, hc, qemu := host.domainType, host.compat, host.qemu
	wantCap := map[string][3]int64{
		a.name: {4, 6 << 30, kvboxnode.DefaultMaxBoxes},
		b.name: {int64(host.cpus), int64(host.memory)*1024 - kvboxnode.DefaultReservedMemory, 13},
	}
	for _, n := range []*node{a, b} {
		nd := waitNode(ctx, t, client, n, "Ready", func(nd *corev1.Node) bool { return condition(nd, corev1.NodeReady) == corev1.ConditionTrue })
		want := wantCap[n.name]
		st := nd.Status
		if st.Capacity.Cpu().Value() != want[0] || st.Capacity.Memory().Value() != want[1] || st.Capacity.Pods().Value() != want[2] {
			t.Errorf("%s capacity cpu %v memory %v pods %v, want %v", n.name, st.Capacity.Cpu(), st.Capacity.Memory(), st.Capacity.Pods(), want)
		}
		if !equalResources(st.Capacity, st.Allocatable) {
			t.Errorf("%s allocatable %v differs from capacity %v", n.name, st.Allocatable, st.Capacity)
		}
		l := nd.Labels
		for k, v := range map[string]string{
			kvboxnode.LabelDomainType: hostType, kvboxnode.LabelArch: hc.Arch, kvboxnode.LabelQEMU: strconv.FormatUint(uint64(qemu), 10),
			kvboxnode.LabelAgentProtocol: hc.AgentProtocol(), "kubernetes.io/hostname": n.name,
			// The q35 machine of this QEMU's release, which kvbox's boxes use.
			kvboxnode.MachineLabelPrefix + fmt.Sprintf("pc-q35-%d.%d", qemu/1000000, qemu/1000%1000): "true",
		} {
			if l[k] != v {
				t.Errorf("%s label %s = %q, want %q", n.name, k, l[k], v)
			}
		}
		for _, m := range hc.Machines {
			if l[kvboxnode.MachineLabelPrefix+m] != "true" {
				t.Errorf("%s lacks the label of machine type %s", n.name, m)
			}
		}
		if !slices.ContainsFunc(nd.Spec.Taints, func(x corev1.Taint) bool {
			return x.Key == "kvbox.dev/vm" && x.Value == "true" && x.Effect == corev1.TaintEffectNoSchedule
		}) {
			t.Errorf("%s taints %v lack kvbox.dev/vm=true:NoSchedule", n.name, nd.Spec.Taints)
		}
		if !slices.Contains(st.Addresses, corev1.NodeAddress{Type: corev1.NodeInternalIP, Address: n.addr}) ||
			st.DaemonEndpoints.KubeletEndpoint.Port != 10250 {
			t.Errorf("%s addresses %v, kubelet port %d", n.name, st.Addresses, st.DaemonEndpoints.KubeletEndpoint.Port)
		}
	}
}

// checkPodCIDRs: the controller manager's node IPAM gave each node its
// own podCIDR.
func (r *nodesRun) checkPodCIDRs(a, b *node) {
	t := r.t
	cidrs := map[string]string{}
	for _, n := range []*node{a, b} {
		nd := waitNode(r.ctx, t, r.client, n, "a podCIDR", func(nd *corev1.Node) bool { return nd.Spec.PodCIDR != "" })
		p, err := netip.ParsePrefix(nd.Spec.PodCIDR)
		if err != nil || !netip.MustParsePrefix("172.31.0.0/23").Contains(p.Addr()) {
			t.Errorf("%s podCIDR %q is not in the cluster CIDR", n.name, nd.Spec.PodCIDR)
		}
		cidrs[n.name] = nd.Spec.PodCIDR
	}
	if cidrs[a.name] == cidrs[b.name] {
		t.Errorf("both nodes got podCIDR %s", cidrs[a.name])
	}
}

// checkLeases: each node holds its lease, and renews it.
func (r *nodesRun) checkLeases(a, b *node) {
	t, ctx, client := r.t, r.ctx, r.client
	for _, n := range []*node{a, b} {
		first := lease(ctx, t, client, n.name)
		if first.Spec.HolderIdentity == nil || *first.Spec.HolderIdentity != n.name {
			t.Fatalf("%s's lease holder %v", n.name, first.Spec.HolderIdentity)
		}
		var renewed *coordinationv1.Lease
		poll(ctx, t, n.name+"'s lease renewed", func() bool {
			renewed = lease(ctx, t, client, n.name)
			return renewed.Spec.RenewTime.After(first.Spec.RenewTime.Time)
		})
		t.Logf("%s's lease renewed: %s -> %s", n.name, first.Spec.RenewTime.Format(time.RFC3339Nano), renewed.Spec.RenewTime.Format(time.RFC3339Nano))
	}
}

// checkTaint: a pod without the toleration is not scheduled: the
// scheduler says the taint is why. One with it (returned, with its node)
// is bound to a kvbox node; the other stays Pending, unbound.
func (r *nodesRun) checkTaint(a, b *node) (tolerating *corev1.Pod, boundTo string) {
	t, ctx, client := r.t, r.ctx, r.client
	plain := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "no-toleration", Namespace: "default"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "127.0.0.1:5000/fleet/none:1"}}},
	}
	if _, err := client.CoreV1().Pods("default").Create(ctx, plain, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	var why string
	poll(ctx, t, "the scheduler's verdict on the pod without the toleration", func() bool {
		p, err := client.CoreV1().Pods("default").Get(ctx, plain.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodScheduled && c.Status == corev1.ConditionFalse && c.Reason == corev1.PodReasonUnschedulable {
				why = c.Message
				return true
			}
		}
		return false
	})
	t.Logf("pod without the toleration: %s", why)
	if !strings.Contains(why, "0/2 nodes are available") || !strings.Contains(why, "2 node(s) had untolerated taint") {
		t.Errorf("the scheduler's reason is not the taint on both nodes: %q", why)
	}
	tolerating = plain.DeepCopy()
	tolerating.Name = "tolerates-kvbox"
	tolerating.Spec.Tolerations = []corev1.Toleration{{Key: "kvbox.dev/vm", Operator: corev1.TolerationOpEqual, Value: "true", Effect: corev1.TaintEffectNoSchedule}}
	if _, err := client.CoreV1().Pods("default").Create(ctx, tolerating, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	poll(ctx, t, "the tolerating pod bound", func() bool {
		p, err := client.CoreV1().Pods("default").Get(ctx, tolerating.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		boundTo = p.Spec.NodeName
		return boundTo != ""
	})
	if boundTo != a.name && boundTo != b.name {
		t.Fatalf("the tolerating pod went to %q", boundTo)
	}
	// Scheduled after it, the pod without the toleration is still Pending, unbound.
	if p, err := client.CoreV1().Pods("default").Get(ctx, plain.Name, metav1.GetOptions{}); err != nil || p.Spec.NodeName != "" || p.Status.Phase != corev1.PodPending {
		t.Fatalf("pod without the toleration: node %q phase %s (%v)", p.Spec.NodeName, p.Status.Phase, err)
	}
	return tolerating, boundTo
}

// checkKubeletAPI: the kubelet API through the API server (TLS to the
// node's address, verified with the fleet's CA; the API server's client
// certificate authorized): a pod's log request reaches the node's
// provider, which answers that the pod (its image is in no registry) has
// no box yet. (nodes/proxy is not used: the API server proxies to no
// loopback address.) Directly, it wants credentials, the node's own, and
// listens on the node address only. The tolerating pod is deleted after.
func (r *nodesRun) checkKubeletAPI(a, b *node, tolerating *corev1.Pod, boundTo string) {
	t, ctx, client, state := r.t, r.ctx, r.client, r.state
	raw, err := client.CoreV1().Pods("default").GetLogs(tolerating.Name, &corev1.PodLogOptions{}).DoRaw(ctx)
	if err == nil || !strings.Contains(string(raw), "has no running box yet") {
		t.Fatalf("the log of a pod on %s through the API server: %v (%s)", boundTo, err, raw)
	}
	t.Logf("the log of a pod on %s through the API server: %v: %s", boundTo, err, raw)
	caPool := x509.NewCertPool()
	ca, err := os.ReadFile(filepath.Join(state, "pki", "ca.crt"))
	if err != nil || !caPool.AppendCertsFromPEM(ca) {
		t.Fatalf("fleet CA: %v", err)
	}
	// Directly: the serving certificate is the node address's, from the
	// fleet's CA; no credentials get 401, another node's get 403.
	bCert, err := tls.LoadX509KeyPair(filepath.Join(state, "nodes", b.name, "client.crt"), filepath.Join(state, "nodes", b.name, "client.key"))
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		who   string
		certs []tls.Certificate
		want  int
	}{{"no credentials", nil, http.StatusUnauthorized}, {"kvbox-b's client certificate", []tls.Certificate{bCert}, http.StatusForbidden}} {
		hc := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: caPool, Certificates: tc.certs}}}
		resp, err := hc.Get("https://" + net.JoinHostPort(a.addr, "10250") + "/pods")
		if err != nil {
			t.Fatalf("kvbox-a's kubelet API with %s: %v", tc.who, err)
		}
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("kvbox-a's kubelet API with %s: %s, want %d", tc.who, resp.Status, tc.want)
		}
	}
	// Bound to the node address only: not on 127.0.0.1, the same port.
	if c, err := net.DialTimeout("tcp", "127.0.0.1:10250", 5*time.Second); err == nil {
		c.Close()
		t.Errorf("something answers on 127.0.0.1:10250: the kubelet API listens beyond its node address")
	} else if !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("127.0.0.1:10250: %v, want connection refused", err)
	}
	if err := client.CoreV1().Pods("default").Delete(ctx, tolerating.Name, *metav1.NewDeleteOptions(0)); err != nil {
		t.Fatal(err)
	}
}

// stopNodes: kvbox-b stopped for good is NotReady once its lease is older
// than the grace period; kvbox-a stays Ready. SIGTERM ends kvbox-a
// cleanly.
func (r *nodesRun) stopNodes(a, b *node) {
	t, ctx, client := r.t, r.ctx, r.client
	stopped := time.Now()
	b.stop(os.Kill)
	nd := waitNode(ctx, t, client, b, "NotReady", func(nd *corev1.Node) bool { return condition(nd, corev1.NodeReady) != corev1.ConditionTrue })
	t.Logf("kvbox-b NotReady (%s: %s) %.1fs after it was killed (grace period %s)", condition(nd, corev1.NodeReady),
		conditionReason(nd, corev1.NodeReady), time.Since(stopped).Seconds(), grace)
	if got, err := client.CoreV1().Nodes().Get(ctx, a.name, metav1.GetOptions{}); err != nil || condition(got, corev1.NodeReady) != corev1.ConditionTrue {
		t.Errorf("kvbox-a is not Ready while kvbox-b is down: %v", err)
	}
	// SIGTERM ends kvbox-node cleanly.
	if err := a.stop(syscall.SIGTERM); err != nil {
		t.Errorf("kvbox-a after SIGTERM: %v", err)
	}
}

// checkDown: fleet.sh down leaves no process, no listener, nothing in its
// state folder but logs.
func (r *nodesRun) checkDown() {
	t := r.t
	r.fleet("down")
	r.downDone = true
	if pids := processesOf(r.bin, r.state); len(pids) > 0 {
		t.Errorf("processes of the fleet left after down: %v", pids)
	}
	for _, p := range fleetPorts {
		if listening(t, p) {
			t.Errorf("port %d still listens in %s after down", p, testNetns)
		}
	}
	entries, _ := os.ReadDir(r.state)
	for _, e := range entries {
		if e.Name() != "logs" {
			t.Errorf("%s left in the fleet's state folder after down", e.Name())
		}
	}
}

// fleetPrerequisites gates a test of a local fleet: root, tools, libvirt,
// the test namespace, the control plane testenv/fleet.sh build makes. It
// returns the repository's folder and the control plane's cache
// (KVBOX_FLEET_CACHE).
func fleetPrerequisites(t *testing.T, tools ...string) (repo, cache string) {
	gate.Root(t)
	gate.Tools(t, tools...)
	gate.LibvirtSocket(t)
	inTestNetns(t)
	repo, err := filepath.Abs("../../..")
	if err != nil {
		t.Fatal(err)
	}
	cache = os.Getenv("KVBOX_FLEET_CACHE")
	if cache == "" {
		cache = "/var/lib/kvbox-testenv/k8s"
	}
	for _, b := range []string{"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl"} {
		gate.File(t, filepath.Join(cache, "v1.37.2", "bin", b), "the control plane testenv/fleet.sh build makes (make testenv runs it)")
	}
	return repo, cache
}

// inTestNetns fails the test unless it runs inside the test namespace:
// everything it starts listens on this namespace's loopback.
func inTestNetns(t *testing.T) {
	out, _ := exec.Command("ip", "netns", "identify", strconv.Itoa(os.Getpid())).Output()
	if ns := strings.TrimSpace(string(out)); ns != testNetns {
		t.Fatalf("run this test inside the network namespace %s (ip netns exec %s go test -tags e2e ./e2e); this process is in %q", testNetns, testNetns, ns)
	}
}

func readEnv(t *testing.T, path string) map[string]string {
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && !strings.HasPrefix(k, "#") {
			env[k] = v
		}
	}
	return env
}

// poll waits until ok, for as long as ctx allows; waiting is bounded by the
// test's context, not a timing claim.
func poll(ctx context.Context, t *testing.T, what string, ok func() bool) {
	t.Helper()
	if err := wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(context.Context) (bool, error) { return ok(), nil }); err != nil {
		t.Fatalf("waiting for %s: %v", what, err)
	}
}

func waitNode(ctx context.Context, t *testing.T, c kubernetes.Interface, n *node, what string, ok func(*corev1.Node) bool) *corev1.Node {
	t.Helper()
	var got *corev1.Node
	poll(ctx, t, n.name+" "+what, func() bool {
		if what != "NotReady" && n.exitedNow() {
			b, _ := os.ReadFile(n.log)
			t.Fatalf("%s exited (%v):\n%s", n.name, n.err, tail(string(b), 30))
		}
		nd, err := c.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		got = nd
		return ok(nd)
	})
	return got
}

func lease(ctx context.Context, t *testing.T, c kubernetes.Interface, name string) *coordinationv1.Lease {
	t.Helper()
	l, err := c.CoordinationV1().Leases(corev1.NamespaceNodeLease).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatalf("lease of %s: %v", name, err)
	}
	return l
}

func condition(n *corev1.Node, typ corev1.NodeConditionType) corev1.ConditionStatus {
	for _, c := range n.Status.Conditions {
		if c.Type == typ {
			return c.Status
		}
	}
	return ""
}

func conditionReason(n *corev1.Node, typ corev1.NodeConditionType) string {
	for _, c := range n.Status.Conditions {
		if c.Type == typ {
			return c.Reason
		}
	}
	return ""
}

func equalResources(a, b corev1.ResourceList) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || v.Cmp(w) != 0 {
			return false
		}
	}
	return true
}

// processesOf lists processes running a binary of bin on the fleet's state.
func processesOf(bin, state string) []string {
	var out []string
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, d := range dirs {
		exe, err := os.Readlink(d + "/exe")
		if err != nil || !strings.HasPrefix(exe, bin+"/") {
			continue
		}
		if cmdline, err := os.ReadFile(d + "/cmdline"); err == nil && strings.Contains(string(cmdline), state+"/") {
			out = append(out, filepath.Base(d)+" "+exe)
		}
	}
	return out
}

// listening reports whether a TCP socket of this namespace listens on port
// (this process runs in the test namespace, so /proc/net/tcp is its).
func listening(t *testing.T, port int) bool {
	for _, f := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(string(b), "\n")[1:] {
			fields := strings.Fields(line)
			if len(fields) < 4 || fields[3] != "0A" { // LISTEN
				continue
			}
			if _, p, ok := strings.Cut(fields[1], ":"); ok {
				if v, err := strconv.ParseInt(p, 16, 32); err == nil && int(v) == port {
					return true
				}
			}
		}
	}
	return false
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
