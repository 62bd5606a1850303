package kvboxnode

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/sirupsen/logrus"
	vklog "github.com/virtual-kubelet/virtual-kubelet/log"
	vklogrus "github.com/virtual-kubelet/virtual-kubelet/log/logrus"
	vknode "github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apiserver/pkg/server/dynamiccertificates"
	"k8s.io/client-go/informers"
	corev1informers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/record"

	"kvbox.dev/kvbox/network"
)

// Config is how kvbox-node runs.
type Config struct {
	Name string // the Node's name
	// Kubeconfig is the file with the API server's address and this node's
	// credentials; empty uses the in-cluster configuration.
	Kubeconfig string
	Address    netip.Addr // the node's address: the kubelet API listens there only
	Port       int        // the kubelet API's port
	// TLSCertFile and TLSKeyFile are the kubelet API's serving certificate
	// (for Address, from a CA the API server trusts); ClientCAFile is the CA
	// of the client certificates it accepts (the API server's).
	TLSCertFile, TLSKeyFile, ClientCAFile string

	StateDir string
	// Bridge is the bridge of this node's boxes; Subnet their subnet, or
	// the zero prefix for the node's podCIDR (given by the cluster's node
	// IPAM), so that pod addresses are unique across the cluster.
	Bridge string
	Subnet netip.Prefix
	// Open opens the kvbox library for this host, once the subnet is known.
	Open OpenFunc

	Capacity   CapacityConfig
	Thresholds Thresholds
	// Interval is how often the host is looked at (libvirt, disk, memory)
	// and a change reported in the node's conditions.
	Interval time.Duration

	// CacheBudget is the disk the snapshot cache may hold (0: no limit).
	CacheBudget int64
	// InsecureRegistries are registries (HOST[:PORT]) spoken to in plain
	// HTTP; every other is spoken to over HTTPS only.
	InsecureRegistries []string
	// NodeCredentialsFor are registries (HOST[:PORT]) for which every pod
	// pulls with the node's own credentials (root's docker config and
	// credential helpers); any other gets a pod's own imagePullSecrets'
	// or none.
	NodeCredentialsFor []string
	// MaxSnapshotCPUs, MaxSnapshotMemory and MaxSnapshotDisk cap what a
	// pulled snapshot may be (0: the node's CPUs, the node's memory, the
	// size of the state dir's filesystem).
	MaxSnapshotCPUs   int
	MaxSnapshotMemory int64
	MaxSnapshotDisk   int64
	// RuntimeClass is the RuntimeClass a pod may name ("": kvbox).
	RuntimeClass string
	// Workers is how many pods virtual-kubelet syncs at once (0: twice
	// the CPUs).
	Workers int
	Log     *slog.Logger
}

// Run registers the node and runs its pods (status, lease, kubelet API)
// until ctx ends. Boxes are left running when it returns: a restarted
// kvbox-node finds them again.
func Run(ctx context.Context, c Config) error {
	if c.Log == nil {
		c.Log = slog.Default()
	}
	// virtual-kubelet's own lines, through its logrus adapter (its slog
	// adapter panics on an Error whose first argument is not a string).
	vklog.L = vklogrus.FromLogrus(logrus.NewEntry(logrus.StandardLogger()))
	if err := c.check(); err != nil {
		return err
	}
	// The address alone first: a wrong one is refused before anything is
	// registered; again once the boxes' subnet is known.
	ifaces, err := checkAddress(c)
	if err != nil {
		return err
	}
	tlsConfig, caPEM, err := serverTLS(c)
	if err != nil {
		return err
	}
	client, err := newClient(c.Kubeconfig)
	if err != nil {
		return err
	}
	subnet, netCfg, err := nodeNetwork(ctx, client, c, ifaces)
	if err != nil {
		return err
	}
	lib, err := c.Open(ctx, netCfg)
	if err != nil {
		return err
	}
	defer lib.Close()
	facts, err := lib.Facts(ctx)
	if err != nil {
		return err
	}
	n, capacity, err := describeNode(ctx, client, c, facts, netCfg, subnet)
	if err != nil {
		return err
	}

	eb := record.NewBroadcaster()
	recorder := eb.NewRecorder(scheme.Scheme, corev1.EventSource{Component: "kvbox-node", Host: c.Name})
	cache, prov, found, err := startPods(ctx, client, c, lib, capacity, recorder)
	if err != nil {
		return err
	}
	st := watchStatus(ctx, c, lib, n, cache)
	podFactory, podInformer, pc, err := podController(client, c, prov, recorder)
	if err != nil {
		return err
	}
	nc, err := nodeController(client, st, n)
	if err != nil {
		return err
	}
	handler, err := kubeletAPI(client, c.Name, caPEM, prov, podInformer)
	if err != nil {
		return err
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	eb.StartRecordingToSink(&corev1client.EventSinkImpl{Interface: client.CoreV1().Events(corev1.NamespaceAll)})
	defer eb.Shutdown()
	listen, srv, err := serveKubeletAPI(c, handler, tlsConfig)
	if err != nil {
		return err
	}
	defer srv.Close()
	podFactory.Start(ctx.Done())
	return runControllers(ctx, c, pc, nc, prov, func() {
		c.Log.Info("node ready", "node", c.Name, "kubelet-api", "https://"+listen, "subnet", subnet, "bridge", c.Bridge,
			"cpus", capacity.CPUs, "memory", quantity(capacity.Memory), "boxes", capacity.Boxes, "domain-type", facts.Compat.DomainType,
			"arch", facts.Compat.Arch, "qemu", version(facts.Compat.QEMU), "machines", len(facts.Compat.Machines),
			"agent-protocol", facts.Compat.AgentProtocol(), "pods-found", len(found), "cached-snapshots", len(n.Status.Images))
	})
}

// check refuses a configuration Run cannot start with, in one line, and
// fills in the default RuntimeClass.
func (c *Config) check() error {
	if errs := validation.IsDNS1123Subdomain(c.Name); len(errs) > 0 {
		return fmt.Errorf("--name %q is not a valid node name: %s", c.Name, errs[0])
	}
	if c.Port <= 0 || c.Port > 65535 {
		return fmt.Errorf("--kubelet-port %d: give a TCP port", c.Port)
	}
	if c.Open == nil {
		return errors.New("kvbox-node: no library to open")
	}
	if c.RuntimeClass == "" {
		c.RuntimeClass = DefaultRuntimeClass
	}
	return nil
}

// checkAddress is the host's interfaces, with the node address checked
// against them and the configured network.
func checkAddress(c Config) ([]Interface, error) {
	ifaces, err := HostInterfaces()
	if err != nil {
		return nil, err
	}
	if err := CheckNodeAddress(c.Address, ifaces, network.Config{Bridge: c.Bridge, Subnet: c.Subnet}); err != nil {
		return nil, err
	}
	return ifaces, nil
}

// nodeNetwork registers the Node and settles its boxes' network: the
// configured subnet, or the podCIDR the cluster's node IPAM gives the
// registered Node (tainted before the subnet is asked for); the node
// address is checked again against it.
func nodeNetwork(ctx context.Context, client kubernetes.Interface, c Config, ifaces []Interface) (netip.Prefix, network.Config, error) {
	reg, err := registerNode(ctx, client, c)
	if err != nil {
		return netip.Prefix{}, network.Config{}, err
	}
	subnet := c.Subnet
	if !subnet.IsValid() {
		if subnet, err = waitPodCIDR(ctx, client, c.Name, reg); err != nil {
			return netip.Prefix{}, network.Config{}, err
		}
	}
	netCfg, err := network.Parse(c.Bridge, subnet.String())
	if err != nil {
		return netip.Prefix{}, network.Config{}, err
	}
	if err := CheckNodeAddress(c.Address, ifaces, netCfg); err != nil {
		return netip.Prefix{}, network.Config{}, err
	}
	return subnet, netCfg, nil
}

// describeNode is the Node as this host makes it: its capacity, and its
// labels (the host's restore class), which the registered Node is given.
func describeNode(ctx context.Context, client kubernetes.Interface, c Config, facts HostFacts, netCfg network.Config, subnet netip.Prefix) (*corev1.Node, Capacity, error) {
	capacity, err := ResolveCapacity(c.Capacity, HostResources{CPUs: facts.CPUs, Memory: facts.Memory}, netCfg)
	if err != nil {
		return nil, Capacity{}, err
	}
	nodeLabels, skipped := Labels(c.Name, facts.Compat)
	if len(skipped) > 0 {
		c.Log.Warn("machine types left out of the node's labels (not valid label keys)", "machines", strings.Join(skipped, ","))
	}
	if err := checkLabelValues(nodeLabels); err != nil {
		return nil, Capacity{}, err
	}
	if err := labelNode(ctx, client, c.Name, nodeLabels); err != nil {
		return nil, Capacity{}, err
	}
	var uts unix.Utsname
	_ = unix.Uname(&uts)
	n := NewNode(NodeFacts{Name: c.Name, Address: c.Address, Port: c.Port, Host: facts.Compat, Labels: nodeLabels, Capacity: capacity,
		Kernel: unix.ByteSliceToString(uts.Release[:]), PodCIDR: subnet})
	return n, capacity, nil
}

// startPods loads the snapshot cache and makes the provider, which finds
// this host's pods again (their names are returned).
func startPods(ctx context.Context, client kubernetes.Interface, c Config, lib Library, capacity Capacity, recorder record.EventRecorder) (*Cache, *Provider, []string, error) {
	dir := filepath.Join(c.StateDir, "kvbox-node")
	cache, err := NewCache(lib, filepath.Join(dir, "cache"), c.CacheBudget, c.InsecureRegistries, c.Log)
	if err != nil {
		return nil, nil, nil, err
	}
	if err := cache.Load(ctx); err != nil {
		return nil, nil, nil, fmt.Errorf("snapshot cache: %w", err)
	}
	maxDisk := c.MaxSnapshotDisk
	if maxDisk == 0 {
		var fs unix.Statfs_t
		if err := unix.Statfs(c.StateDir, &fs); err != nil {
			return nil, nil, nil, fmt.Errorf("the state dir's filesystem: %w", err)
		}
		maxDisk = int64(fs.Blocks) * fs.Bsize
	}
	cache.SetSnapshotCaps(cmp.Or(c.MaxSnapshotCPUs, capacity.CPUs), cmp.Or(c.MaxSnapshotMemory, capacity.Memory), maxDisk)
	var nodeCreds authn.Keychain
	if len(c.NodeCredentialsFor) > 0 {
		regs := map[string]bool{}
		for _, r := range c.NodeCredentialsFor {
			regs[r] = true
		}
		nodeCreds = NodeKeychain{Registries: regs}
	}
	prov := NewProvider(ctx, lib, cache, ProviderConfig{NodeName: c.Name, NodeIP: c.Address.String(), RuntimeClass: c.RuntimeClass,
		Dir: dir, Allocatable: capacity.ResourceList(), NodeCredentials: nodeCreds, Objects: apiObjects{client}, Recorder: recorder, Log: c.Log,
		GetPod: func(ctx context.Context, ns, name string) (*corev1.Pod, error) {
			return client.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		},
		Forget: func(ctx context.Context, ns, name string, uid types.UID) error {
			return client.CoreV1().Pods(ns).Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: new(int64), Preconditions: metav1.NewUIDPreconditions(string(uid))})
		}})
	found, removed, err := prov.Recover(ctx)
	if len(found) > 0 || len(removed) > 0 {
		c.Log.Info("found this host's pods again", "pods", strings.Join(found, ","), "removed-boxes", strings.Join(removed, ","))
	}
	if err != nil {
		c.Log.Warn("while finding this host's pods again", "err", err)
	}
	return cache, prov, found, nil
}

// watchStatus is the node's status from a first look at the host and the
// cache's images on: the images again whenever the cache changes, and the
// cache collected until ctx ends.
func watchStatus(ctx context.Context, c Config, lib Library, n *corev1.Node, cache *Cache) *nodeStatus {
	st := &nodeStatus{cfg: c, lib: lib, node: n}
	n.Status.Conditions = Conditions(st.look(ctx), c.Thresholds, nil, metav1.Now())
	n.Status.Images = cache.Images()
	cache.OnChange(func() { st.setImages(cache.Images()) })
	go cache.Collect(ctx)
	return st
}

// podController is virtual-kubelet's pod controller over the pods bound to
// this node, put together here rather than by its nodeutil.NewNode, whose
// informers watch every Secret and ConfigMap of the cluster: pods'
// environments are read per pod with the node's own rights (apiObjects),
// and the downward API is resolved by the provider (Env), so the informers
// of Secrets, ConfigMaps and Services it asks for are never started.
func podController(client kubernetes.Interface, c Config, prov *Provider, recorder record.EventRecorder) (informers.SharedInformerFactory, corev1informers.PodInformer, *vknode.PodController, error) {
	podFactory := informers.NewSharedInformerFactoryWithOptions(client, time.Minute, nodeutil.PodInformerFilter(c.Name))
	idle := informers.NewSharedInformerFactory(client, 0)
	podInformer := podFactory.Core().V1().Pods()
	pc, err := vknode.NewPodController(vknode.PodControllerConfig{
		PodClient: client.CoreV1(), PodInformer: podInformer, EventRecorder: recorder, Provider: prov,
		ConfigMapInformer: idle.Core().V1().ConfigMaps(), SecretInformer: idle.Core().V1().Secrets(), ServiceInformer: idle.Core().V1().Services(),
		SkipDownwardAPIResolution: true,
	})
	if err != nil {
		return nil, nil, nil, fmt.Errorf("pod controller: %w", err)
	}
	return podFactory, podInformer, pc, nil
}

// nodeController is virtual-kubelet's node controller: the node's status
// and lease.
func nodeController(client kubernetes.Interface, st *nodeStatus, n *corev1.Node) (*vknode.NodeController, error) {
	nc, err := vknode.NewNodeController(st, n, client.CoreV1().Nodes(),
		vknode.WithNodeEnableLeaseV1(nodeutil.NodeLeaseV1Client(client), vknode.DefaultLeaseDuration),
		vknode.WithNodeStatusUpdateErrorHandler(func(ctx context.Context, err error) error {
			// A Node someone deleted is registered again at the next update.
			if !apierrors.IsNotFound(err) {
				return err
			}
			_, err = client.CoreV1().Nodes().Create(ctx, st.current(), metav1.CreateOptions{})
			return err
		}))
	if err != nil {
		return nil, fmt.Errorf("node controller: %w", err)
	}
	return nc, nil
}

// kubeletAPI is the kubelet API's handler (logs, exec, attach,
// port-forward, pods, stats), behind the API server's authentication and
// authorization: client certificates from the CA in caPEM, or tokens it
// vouches for.
func kubeletAPI(client kubernetes.Interface, name string, caPEM []byte, prov *Provider, podInformer corev1informers.PodInformer) (http.Handler, error) {
	auth, err := nodeutil.WebhookAuth(client, name, func(w *nodeutil.WebhookAuthConfig) error {
		ca, err := dynamiccertificates.NewStaticCAContent("client-ca", caPEM)
		w.AuthnConfig.ClientCertificateCAContentProvider = ca
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("kubelet API authentication: %w", err)
	}
	return nodeutil.WithAuth(auth, api.PodHandler(api.PodHandlerConfig{
		RunInContainer: prov.RunInContainer, AttachToContainer: prov.AttachToContainer, GetContainerLogs: prov.GetContainerLogs,
		GetPods: prov.GetPods, GetPodsFromKubernetes: func(context.Context) ([]*corev1.Pod, error) { return podInformer.Lister().List(labels.Everything()) },
		GetStatsSummary: prov.GetStatsSummary, GetMetricsResource: prov.GetMetricsResource, PortForward: prov.PortForward,
	}, false)), nil
}

// serveKubeletAPI serves the kubelet API over TLS on the node address;
// listen is its HOST:PORT.
func serveKubeletAPI(c Config, handler http.Handler, tlsConfig *tls.Config) (listen string, srv *http.Server, err error) {
	listen = net.JoinHostPort(c.Address.String(), strconv.Itoa(c.Port))
	l, err := tls.Listen("tcp", listen, tlsConfig)
	if err != nil {
		return "", nil, fmt.Errorf("kubelet API on %s: %w", listen, err)
	}
	srv = &http.Server{Handler: handler, TLSConfig: tlsConfig, ReadHeaderTimeout: 30 * time.Second}
	go srv.Serve(l)
	return listen, srv, nil
}

// runControllers runs the pod controller, and once it has synced the
// pods and every pod's status is reported, the node controller, until ctx
// ends (nil) or one of them fails; ready is called once both are ready.
func runControllers(ctx context.Context, c Config, pc *vknode.PodController, nc *vknode.NodeController, prov *Provider, ready func()) error {
	workers := c.Workers
	if workers <= 0 {
		workers = max(2, 2*runtime.NumCPU())
	}
	done := make(chan error, 2)
	go func() { done <- pc.Run(ctx, workers) }()
	select {
	case <-pc.Ready():
	case err := <-done:
		return fmt.Errorf("pods of node %s: %w", c.Name, err)
	case <-ctx.Done():
		return nil
	}
	prov.ReportAll()
	go func() { done <- nc.Run(ctx) }()
	select {
	case <-nc.Ready():
	case err := <-done:
		return fmt.Errorf("node %s: %w", c.Name, err)
	case <-ctx.Done():
		return nil
	}
	ready()
	err := <-done
	if ctx.Err() != nil {
		return nil
	}
	return err
}

// registerNode makes sure the Node exists: created tainted from its first
// moment (ordinary pods never land on it) and not Ready until virtual-
// kubelet's node controller reports it, or as a restart finds it.
func registerNode(ctx context.Context, client kubernetes.Interface, c Config) (*corev1.Node, error) {
	nodes := client.CoreV1().Nodes()
	n, err := nodes.Get(ctx, c.Name, metav1.GetOptions{})
	if err == nil {
		return n, nil
	}
	if !apierrors.IsNotFound(err) {
		return nil, fmt.Errorf("read node %s: %w", c.Name, err)
	}
	n = &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: c.Name, Labels: map[string]string{"type": "virtual-kubelet", "kubernetes.io/hostname": c.Name,
			"kubernetes.io/os": "linux", "kubernetes.io/arch": runtime.GOARCH, LabelNode: "true"}},
		Spec: corev1.NodeSpec{Taints: []corev1.Taint{{Key: TaintKey, Value: TaintValue, Effect: corev1.TaintEffectNoSchedule}}},
	}
	created, err := nodes.Create(ctx, n, metav1.CreateOptions{})
	if apierrors.IsAlreadyExists(err) {
		return nodes.Get(ctx, c.Name, metav1.GetOptions{})
	}
	if err != nil {
		return nil, fmt.Errorf("register node %s: %w", c.Name, err)
	}
	return created, nil
}

// waitPodCIDR waits for the node's podCIDR from the cluster's node IPAM.
func waitPodCIDR(ctx context.Context, client kubernetes.Interface, name string, n *corev1.Node) (netip.Prefix, error) {
	warned := time.Now().Add(30 * time.Second)
	for {
		if n != nil && n.Spec.PodCIDR != "" {
			p, err := netip.ParsePrefix(n.Spec.PodCIDR)
			if err != nil || !p.Addr().Is4() {
				return netip.Prefix{}, fmt.Errorf("node %s's podCIDR %q is not an IPv4 subnet kvbox can use: give --subnet", name, n.Spec.PodCIDR)
			}
			return p.Masked(), nil
		}
		if time.Now().After(warned) {
			slog.Warn("the node has no podCIDR yet: does kube-controller-manager run with --allocate-node-cidrs? (else give --subnet)", "node", name)
			warned = time.Now().Add(time.Minute)
		}
		select {
		case <-ctx.Done():
			return netip.Prefix{}, fmt.Errorf("waiting for node %s's podCIDR: %w", name, ctx.Err())
		case <-time.After(500 * time.Millisecond):
		}
		var err error
		if n, err = client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{}); err != nil && ctx.Err() == nil {
			slog.Warn("reading the node", "node", name, "err", err)
		}
	}
}

// labelNode gives the Node this host's labels, and drops kvbox's labels it
// had that no longer hold (a QEMU upgraded since the last start).
func labelNode(ctx context.Context, client kubernetes.Interface, name string, want map[string]string) error {
	n, err := client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read node %s: %w", name, err)
	}
	patch := map[string]any{}
	for k, v := range want {
		if n.Labels[k] != v {
			patch[k] = v
		}
	}
	for k := range n.Labels {
		if _, ok := want[k]; !ok && (strings.HasPrefix(k, "kvbox.dev/") || strings.HasPrefix(k, MachineLabelPrefix)) && k != LabelNode {
			patch[k] = nil
		}
	}
	if len(patch) == 0 {
		return nil
	}
	b, err := json.Marshal(map[string]any{"metadata": map[string]any{"labels": patch}})
	if err != nil {
		return err
	}
	if _, err := client.CoreV1().Nodes().Patch(ctx, name, types.MergePatchType, b, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("label node %s: %w", name, err)
	}
	return nil
}

// apiObjects reads a pod's ConfigMaps and Secrets from the API server.
type apiObjects struct{ c kubernetes.Interface }

func (o apiObjects) ConfigMap(ctx context.Context, ns, name string) (*corev1.ConfigMap, error) {
	return o.c.CoreV1().ConfigMaps(ns).Get(ctx, name, metav1.GetOptions{})
}

func (o apiObjects) Secret(ctx context.Context, ns, name string) (*corev1.Secret, error) {
	return o.c.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
}

// serverTLS is the kubelet API's TLS: its serving certificate, and client
// certificates verified against the client CA when one is presented (the
// API server's); a request with neither a verified certificate nor a
// token the API server vouches for is refused by the authenticator.
func serverTLS(c Config) (*tls.Config, []byte, error) {
	if c.TLSCertFile == "" || c.TLSKeyFile == "" || c.ClientCAFile == "" {
		return nil, nil, fmt.Errorf("the kubelet API is served over TLS only: give --tls-cert-file, --tls-private-key-file and --client-ca-file (testenv/fleet.sh node-credentials makes them for a local fleet)")
	}
	caPEM, err := os.ReadFile(c.ClientCAFile)
	if err != nil {
		return nil, nil, fmt.Errorf("--client-ca-file: %w", err)
	}
	opt := nodeutil.WithTLSConfig(nodeutil.WithKeyPairFromPath(c.TLSCertFile, c.TLSKeyFile), nodeutil.WithCACert(caPEM),
		func(t *tls.Config) error {
			t.ClientAuth = tls.VerifyClientCertIfGiven
			return nil
		})
	var nc nodeutil.NodeConfig
	if err := opt(&nc); err != nil {
		return nil, nil, fmt.Errorf("kubelet API certificate (--tls-cert-file, --tls-private-key-file, --client-ca-file): %w", err)
	}
	return nc.TLSConfig, caPEM, nil
}

func newClient(kubeconfig string) (kubernetes.Interface, error) {
	var cfg *rest.Config
	var err error
	if kubeconfig == "" {
		cfg, err = rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("give --kubeconfig (or KUBECONFIG): not running in a cluster (%v)", err)
		}
	} else {
		if _, err := os.Stat(kubeconfig); err != nil {
			return nil, fmt.Errorf("--kubeconfig: %w", err)
		}
		cfg, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
		}
	}
	cfg.UserAgent = "kvbox-node"
	// Pods are cloned in parallel: more than client-go's default 5 QPS.
	cfg.QPS, cfg.Burst = 50, 100
	return kubernetes.NewForConfig(cfg)
}

// nodeStatus is the node's status as the provider reports it: a look at
// the host every Interval, and an update when the conditions or the cached
// images change. The labels are read once, at start: a QEMU upgraded
// under a running kvbox-node shows in them after kvbox-node restarts.
type nodeStatus struct {
	cfg  Config
	lib  Library
	mu   sync.Mutex
	node *corev1.Node
	cb   func(*corev1.Node)
}

// Ping says the node is alive; whether the host can run boxes is in its
// conditions, so that a libvirt outage shows as NotReady with the reason
// rather than as a node that stopped answering.
func (s *nodeStatus) Ping(ctx context.Context) error { return ctx.Err() }

func (s *nodeStatus) NotifyNodeStatus(ctx context.Context, cb func(*corev1.Node)) {
	s.mu.Lock()
	s.cb = cb
	s.mu.Unlock()
	go func() {
		t := time.NewTicker(s.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if n := s.update(ctx); n != nil {
				cb(n)
			}
		}
	}()
}

func (s *nodeStatus) current() *corev1.Node {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.node.DeepCopy()
}

// setImages reports the cache's images.
func (s *nodeStatus) setImages(images []corev1.ContainerImage) {
	s.mu.Lock()
	n := s.node.DeepCopy()
	n.Status.Images = images
	s.node = n
	cb := s.cb
	s.mu.Unlock()
	if cb != nil {
		cb(n.DeepCopy())
	}
}

// update looks at the host and returns the node to report, or nil when its
// conditions did not change.
func (s *nodeStatus) update(ctx context.Context) *corev1.Node {
	h := s.look(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	conds := Conditions(h, s.cfg.Thresholds, s.node.Status.Conditions, metav1.Now())
	if sameConditions(conds, s.node.Status.Conditions) {
		return nil
	}
	for _, c := range conds {
		if old := findCondition(s.node.Status.Conditions, c.Type); old == nil || old.Status != c.Status {
			s.cfg.Log.Info("node condition", "node", s.cfg.Name, "type", c.Type, "status", c.Status, "reason", c.Reason, "message", c.Message)
		}
	}
	n := s.node.DeepCopy()
	n.Status.Conditions = conds
	s.node = n
	return n.DeepCopy()
}

func findCondition(cs []corev1.NodeCondition, t corev1.NodeConditionType) *corev1.NodeCondition {
	for i := range cs {
		if cs[i].Type == t {
			return &cs[i]
		}
	}
	return nil
}

// look reads the host's health: libvirt answering, the state dir's free
// space, the host's available memory.
func (s *nodeStatus) look(ctx context.Context) Health {
	h := Health{MemAvailable: -1}
	h.Libvirt = s.lib.Healthy(ctx)
	var fs unix.Statfs_t
	if err := unix.Statfs(s.cfg.StateDir, &fs); err != nil {
		h.StateDir = err
	} else {
		h.DiskFree = int64(fs.Bavail) * fs.Bsize
	}
	if m, err := memAvailable(); err == nil {
		h.MemAvailable = m
	}
	return h
}

// memAvailable is MemAvailable of /proc/meminfo, in bytes.
func memAvailable() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, err
	}
	return parseMemAvailable(b)
}

func parseMemAvailable(meminfo []byte) (int64, error) {
	sc := bufio.NewScanner(bytes.NewReader(meminfo))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) == 3 && f[0] == "MemAvailable:" && f[2] == "kB" {
			kb, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("/proc/meminfo MemAvailable: %w", err)
			}
			return kb * 1024, nil
		}
	}
	return 0, errors.New("/proc/meminfo has no MemAvailable line")
}
