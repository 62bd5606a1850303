// Command kvbox-node registers this libvirt host as a Kubernetes Node
// (package kvboxnode) and keeps it until interrupted.
package main

import (
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/api/resource"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/network"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
	"kvbox.dev/kvbox/integrations/kubernetes/libadapter"
)

func main() {
	if err := newCmd().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "kvbox-node:", err)
		os.Exit(1)
	}
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

// options are kvbox-node's flags: the node's configuration, the library's,
// and the flags parsed into them when it runs.
type options struct {
	c                                            kvboxnode.Config
	lib                                          libadapter.Config
	address, subnet, domType                     string
	memory, reserved, minFreeDisk, minFreeMemory string
	cacheSize, maxSnapMemory, maxSnapDisk        string
}

func newCmd() *cobra.Command {
	var o options
	cmd := &cobra.Command{
		Use:   "kvbox-node --name NAME --node-address IP --kubeconfig FILE --tls-cert-file F --tls-private-key-file F --client-ca-file F",
		Short: "Run this libvirt host's kvbox boxes as a Kubernetes node's pods",
		Long: `kvbox-node registers this host as a Kubernetes Node: its capacity (vCPUs and
RAM kvbox may commit, boxes), the taint kvbox.dev/vm=true:NoSchedule, labels
with the host's restore class (domain type, architecture, QEMU, machine
types, agent protocol), its conditions and lease, and the kubelet API on the
node address only. A Pod bound to it whose image is a kvbox snapshot's
registry reference becomes a warm clone of that snapshot on this host (pulled
once into the node's cache), on the node's podCIDR; kubectl exec, logs,
port-forward and the kubelet's stats reach it through its agent. Run it as
root, next to libvirtd; its boxes keep running while it is down, and it finds
them again when it starts.`,
		Example: `  kvbox-node --name kvbox-a --node-address 10.0.0.5 --kubeconfig /etc/kvbox/node.kubeconfig \
    --tls-cert-file /etc/kvbox/kubelet.crt --tls-private-key-file /etc/kvbox/kubelet.key \
    --client-ca-file /etc/kvbox/ca.crt`,
		Args:          cobra.NoArgs,
		SilenceUsage:  true,
		SilenceErrors: true,
		RunE:          func(*cobra.Command, []string) error { return run(&o) },
	}
	o.addFlags(cmd)
	return cmd
}

// run parses the flags and runs the node until interrupted.
func run(o *options) error {
	if err := o.parse(); err != nil {
		return err
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("kvbox-node manages libvirt domains and kvbox's state dir: run it as root")
	}
	c := o.c
	c.Log = slog.New(slog.NewTextHandler(os.Stderr, nil))
	slog.SetDefault(c.Log)
	o.lib.StateDir = c.StateDir
	c.Open = libadapter.Opener(o.lib)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return kvboxnode.Run(ctx, c)
}

// parse puts the flags given as text into the configurations: the node
// address, the subnet, the domain type, the quantities; and refuses a
// status interval that is not positive.
func (o *options) parse() error {
	var err error
	if o.address != "" {
		if o.c.Address, err = netip.ParseAddr(o.address); err != nil {
			return fmt.Errorf("--node-address %q is not an IP address", o.address)
		}
	}
	switch o.subnet {
	case "", "podcidr":
	default:
		if o.c.Subnet, err = netip.ParsePrefix(o.subnet); err != nil {
			return fmt.Errorf("--subnet %q: give a subnet like 10.244.7.0/24, or podcidr for the node's", o.subnet)
		}
	}
	switch o.domType {
	case "auto", "":
		o.lib.DomainType = ""
	case "kvm", "qemu":
		o.lib.DomainType = o.domType
	default:
		return fmt.Errorf("--domain-type %q: give auto, kvm or qemu", o.domType)
	}
	for _, q := range []struct {
		flag, v string
		to      *int64
	}{{"--memory", o.memory, &o.c.Capacity.Memory}, {"--reserved-memory", o.reserved, &o.c.Capacity.ReservedMemory},
		{"--min-free-disk", o.minFreeDisk, &o.c.Thresholds.MinFreeDisk}, {"--min-free-memory", o.minFreeMemory, &o.c.Thresholds.MinFreeMemory},
		{"--snapshot-cache-size", o.cacheSize, &o.c.CacheBudget},
		{"--max-snapshot-memory", o.maxSnapMemory, &o.c.MaxSnapshotMemory}, {"--max-snapshot-disk", o.maxSnapDisk, &o.c.MaxSnapshotDisk}} {
		v, err := resource.ParseQuantity(q.v)
		if err != nil {
			return fmt.Errorf("%s %q is not a quantity like 8Gi", q.flag, q.v)
		}
		*q.to = v.Value()
	}
	if o.c.MaxSnapshotCPUs < 0 || o.c.MaxSnapshotMemory < 0 || o.c.MaxSnapshotDisk < 0 {
		return fmt.Errorf("--max-snapshot-cpus, --max-snapshot-memory and --max-snapshot-disk cannot be negative")
	}
	for _, r := range o.c.NodeCredentialsFor {
		if r == "" || strings.ContainsAny(r, "/ ") {
			return fmt.Errorf("--node-credentials-for %q: give registries as HOST[:PORT], as an image reference names them", r)
		}
	}
	if o.c.Interval <= 0 {
		return fmt.Errorf("--status-interval %s: give a positive duration", o.c.Interval)
	}
	return nil
}

// addFlags defines kvbox-node's flags, with their defaults (some from the
// environment kvbox's CLI reads too).
func (o *options) addFlags(cmd *cobra.Command) {
	f, c, lib := cmd.Flags(), &o.c, &o.lib
	host, _ := os.Hostname()
	f.StringVar(&c.Name, "name", "kvbox-"+strings.ToLower(strings.SplitN(host, ".", 2)[0]), "the Node's name")
	f.StringVar(&o.address, "node-address", "", "the host's address the API server reaches this node on; the kubelet API listens there only (never one boxes reach)")
	f.IntVar(&c.Port, "kubelet-port", 10250, "the kubelet API's port")
	f.StringVar(&c.Kubeconfig, "kubeconfig", os.Getenv("KUBECONFIG"), "kubeconfig with the API server and this node's credentials; empty: in-cluster (KUBECONFIG)")
	f.StringVar(&c.TLSCertFile, "tls-cert-file", "", "the kubelet API's serving certificate, for the node address")
	f.StringVar(&c.TLSKeyFile, "tls-private-key-file", "", "its private key")
	f.StringVar(&c.ClientCAFile, "client-ca-file", "", "CA of the client certificates the kubelet API accepts (the API server's)")
	f.StringVar(&lib.URI, "connect", domain.DefaultURI(), "libvirt connection URI (LIBVIRT_DEFAULT_URI)")
	f.StringVar(&c.StateDir, "state-dir", envOr("KVBOX_STATE_DIR", "/var/lib/kvbox"), "where kvbox keeps boxes, images and snapshots (KVBOX_STATE_DIR)")
	f.StringVar(&c.Bridge, "bridge", envOr("KVBOX_BRIDGE", network.Default.Bridge), "bridge this node's boxes are put on (KVBOX_BRIDGE)")
	f.StringVar(&o.subnet, "subnet", "podcidr", "subnet of this node's boxes: podcidr for the node's podCIDR (the cluster's node IPAM), so that pod addresses are unique in the cluster, or a subnet")
	f.StringVar(&o.domType, "domain-type", envOr("KVBOX_DOMAIN_TYPE", "auto"), "libvirt domain type: auto (kvm where the host offers it), kvm or qemu (KVBOX_DOMAIN_TYPE)")
	cpus, _ := strconv.Atoi(os.Getenv("KVBOX_NODE_CPUS"))
	f.IntVar(&c.Capacity.CPUs, "cpus", cpus, "vCPUs kvbox may commit on this node (each pod requests its snapshot's vCPUs); 0: the host's CPUs (KVBOX_NODE_CPUS)")
	f.StringVar(&o.memory, "memory", "0", "RAM kvbox may commit on this node, e.g. 16Gi; 0: the host's less --reserved-memory")
	f.StringVar(&o.reserved, "reserved-memory", "1Gi", "RAM kept for the host when --memory is derived")
	f.IntVar(&c.Capacity.MaxBoxes, "max-boxes", 0, fmt.Sprintf("boxes this node runs at most; 0: %d, or fewer if the subnet has fewer addresses", kvboxnode.DefaultMaxBoxes))
	f.StringVar(&o.minFreeDisk, "min-free-disk", "1Gi", "the node reports DiskPressure with less free in the state dir's filesystem")
	f.StringVar(&o.minFreeMemory, "min-free-memory", "256Mi", "the node reports MemoryPressure with less host memory available")
	f.DurationVar(&c.Interval, "status-interval", 10*time.Second, "how often the host's health is looked at")
	f.StringVar(&o.cacheSize, "snapshot-cache-size", "20Gi", "disk the node's snapshot cache may hold; past it the least recently used snapshot no box is cloned from goes (0: no limit)")
	f.StringArrayVar(&c.InsecureRegistries, "insecure-registry", nil, "a registry (HOST[:PORT]) spoken to in plain HTTP (repeatable); every other is spoken to over HTTPS only, loopback and private hosts too")
	f.StringSliceVar(&c.NodeCredentialsFor, "node-credentials-for", nil, "registries (HOST[:PORT],...) for which every pod of this node pulls with the node's own credentials (root's docker config and credential helpers); a pod pulls from any other with its own imagePullSecrets, or anonymously")
	f.IntVar(&c.MaxSnapshotCPUs, "max-snapshot-cpus", 0, "the most vCPUs a pulled snapshot may have; 0: the node's CPUs")
	f.StringVar(&o.maxSnapMemory, "max-snapshot-memory", "0", "the most RAM a pulled snapshot may have, e.g. 8Gi; 0: the node's memory")
	f.StringVar(&o.maxSnapDisk, "max-snapshot-disk", "0", "the largest disk a pulled snapshot may have, e.g. 100Gi; 0: the size of the state dir's filesystem")
	f.StringVar(&c.RuntimeClass, "runtime-class", kvboxnode.DefaultRuntimeClass, "the RuntimeClass a pod may name")
	f.IntVar(&c.Workers, "workers", 0, "pods synced at once (0: twice the CPUs)")
}
