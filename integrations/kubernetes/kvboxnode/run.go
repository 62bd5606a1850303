package kvboxnode

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/sirupsen/logrus"
	vklog "github.com/virtual-kubelet/virtual-kubelet/log"
	vklogrus "github.com/virtual-kubelet/virtual-kubelet/log/logrus"
	vknode "github.com/virtual-kubelet/virtual-kubelet/node"
	"github.com/virtual-kubelet/virtual-kubelet/node/nodeutil"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apiserver/pkg/server/dynamiccertificates"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"libvirt.org/go/libvirt"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/snapshot"
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

	LibvirtURI string
	StateDir   string
	Net        network.Config // the bridge and subnet of this node's boxes
	DomainType string         // kvm, qemu, or "" for kvm where the host offers it

	Capacity   CapacityConfig
	Thresholds Thresholds
	// Interval is how often the host is looked at (libvirt, disk, memory)
	// and a change reported in the node's conditions.
	Interval time.Duration
	Log      *slog.Logger
}

// Run registers the node and keeps it (status, lease, kubelet API) until
// ctx ends. Boxes are left running when it returns.
func Run(ctx context.Context, c Config) error {
	if c.Log == nil {
		c.Log = slog.Default()
	}
	// virtual-kubelet's own lines, through its logrus adapter (its slog
	// adapter panics on an Error whose first argument is not a string).
	vklog.L = vklogrus.FromLogrus(logrus.NewEntry(logrus.StandardLogger()))
	if errs := validation.IsDNS1123Subdomain(c.Name); len(errs) > 0 {
		return fmt.Errorf("--name %q is not a valid node name: %s", c.Name, errs[0])
	}
	if c.Port <= 0 || c.Port > 65535 {
		return fmt.Errorf("--kubelet-port %d: give a TCP port", c.Port)
	}
	ifaces, err := HostInterfaces()
	if err != nil {
		return err
	}
	if err := CheckNodeAddress(c.Address, ifaces, c.Net); err != nil {
		return err
	}
	tlsConfig, caPEM, err := serverTLS(c)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(c.StateDir, domain.StateDirMode); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}

	lv := &libvirtSession{uri: c.LibvirtURI}
	conn, err := lv.get()
	if err != nil {
		return err
	}
	defer lv.close()
	host := &domain.Host{Conn: conn, URI: c.LibvirtURI, StateDir: c.StateDir, Net: c.Net, DomainTypeOverride: c.DomainType}
	hostType, err := host.DomainType()
	if err != nil {
		return err
	}
	hc, err := snapshot.HostCompatOf(conn, hostType)
	if err != nil {
		return fmt.Errorf("read this host's restore class from libvirt: %s", domain.LibvirtMessage(err))
	}
	info, err := conn.GetNodeInfo()
	if err != nil {
		return fmt.Errorf("read this host's CPUs and memory from libvirt: %s", domain.LibvirtMessage(err))
	}
	capacity, err := ResolveCapacity(c.Capacity, HostResources{CPUs: int(info.Cpus), Memory: int64(info.Memory) * 1024}, c.Net)
	if err != nil {
		return err
	}
	labels, skipped := Labels(c.Name, hc)
	if len(skipped) > 0 {
		c.Log.Warn("machine types left out of the node's labels (not valid label keys)", "machines", strings.Join(skipped, ","))
	}
	if err := checkLabelValues(labels); err != nil {
		return err
	}
	var uts unix.Utsname
	_ = unix.Uname(&uts)

	client, err := newClient(c.Kubeconfig)
	if err != nil {
		return err
	}
	auth, err := nodeutil.WebhookAuth(client, c.Name, func(w *nodeutil.WebhookAuthConfig) error {
		ca, err := dynamiccertificates.NewStaticCAContent("client-ca", caPEM)
		w.AuthnConfig.ClientCertificateCAContentProvider = ca
		return err
	})
	if err != nil {
		return fmt.Errorf("kubelet API authentication: %w", err)
	}

	n := NewNode(NodeFacts{Name: c.Name, Address: c.Address, Port: c.Port, Host: hc, Labels: labels, Capacity: capacity,
		Kernel: unix.ByteSliceToString(uts.Release[:])})
	st := &nodeStatus{cfg: c, lv: lv, node: n}
	n.Status.Conditions = Conditions(st.look(), c.Thresholds, nil, metav1.Now())

	if c.Kubeconfig != "" {
		// nodeutil.NewNode makes a default client from $KUBECONFIG before
		// taking ours, and says so at length when it cannot.
		os.Setenv("KUBECONFIG", c.Kubeconfig)
	}
	mux := http.NewServeMux()
	vk, err := nodeutil.NewNode(c.Name,
		func(nodeutil.ProviderConfig) (nodeutil.Provider, vknode.NodeProvider, error) { return pods{}, st, nil },
		nodeutil.WithClient(client),
		func(cfg *nodeutil.NodeConfig) error {
			cfg.NodeSpec = *n.DeepCopy()
			cfg.HTTPListenAddr = net.JoinHostPort(c.Address.String(), strconv.Itoa(c.Port))
			cfg.TLSConfig = tlsConfig
			cfg.Handler = nodeutil.WithAuth(auth, mux)
			// A Node someone deleted is registered again at the next update.
			cfg.NodeStatusUpdateErrorHandler = func(ctx context.Context, err error) error {
				if !apierrors.IsNotFound(err) {
					return err
				}
				_, err = client.CoreV1().Nodes().Create(ctx, st.current(), metav1.CreateOptions{})
				return err
			}
			return nil
		},
		nodeutil.AttachProviderRoutes(mux),
	)
	if err != nil {
		return fmt.Errorf("set up node %s: %w", c.Name, err)
	}
	done := make(chan error, 1)
	go func() { done <- vk.Run(ctx) }()
	select {
	case <-vk.Ready():
	case err := <-done:
		return fmt.Errorf("node %s: %w", c.Name, err)
	}
	c.Log.Info("node registered", "node", c.Name, "kubelet-api", "https://"+net.JoinHostPort(c.Address.String(), strconv.Itoa(c.Port)),
		"cpus", capacity.CPUs, "memory", quantity(capacity.Memory), "boxes", capacity.Boxes,
		"domain-type", hc.DomainType, "arch", hc.Arch, "qemu", version(hc.QEMU), "machines", len(hc.Machines), "agent-protocol", hc.AgentProtocol())
	err = <-done
	if ctx.Err() != nil {
		return nil
	}
	return err
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
	return kubernetes.NewForConfig(cfg)
}

// libvirtSession is a libvirt connection that is opened again after it
// broke (libvirtd restarted).
type libvirtSession struct {
	uri  string
	mu   sync.Mutex
	conn *libvirt.Connect
}

func (s *libvirtSession) get() (*libvirt.Connect, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn == nil {
		c, err := domain.Connect(s.uri)
		if err != nil {
			return nil, err
		}
		s.conn = c
	}
	return s.conn, nil
}

// broken drops a connection that failed, so the next get opens another.
func (s *libvirtSession) broken(c *libvirt.Connect) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn == c && c != nil {
		c.Close()
		s.conn = nil
	}
}

func (s *libvirtSession) close() { s.broken(s.conn) }

// nodeStatus is the node's status as the provider reports it: a look at
// the host every Interval, and an update when the conditions change. The
// labels are read once, at start: a QEMU upgraded under a running
// kvbox-node shows in them after kvbox-node restarts.
type nodeStatus struct {
	cfg  Config
	lv   *libvirtSession
	mu   sync.Mutex
	node *corev1.Node
}

// Ping says the node is alive; whether the host can run boxes is in its
// conditions, so that a libvirt outage shows as NotReady with the reason
// rather than as a node that stopped answering.
func (s *nodeStatus) Ping(ctx context.Context) error { return ctx.Err() }

func (s *nodeStatus) NotifyNodeStatus(ctx context.Context, cb func(*corev1.Node)) {
	go func() {
		t := time.NewTicker(s.cfg.Interval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if n := s.update(); n != nil {
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

// update looks at the host and returns the node to report, or nil when its
// conditions did not change.
func (s *nodeStatus) update() *corev1.Node {
	h := s.look()
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
func (s *nodeStatus) look() Health {
	h := Health{MemAvailable: -1}
	if conn, err := s.lv.get(); err != nil {
		h.Libvirt = err
	} else if _, err := conn.GetVersion(); err != nil {
		h.Libvirt = errors.New(domain.LibvirtMessage(err))
		s.lv.broken(conn)
	}
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
