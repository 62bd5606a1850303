package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
)

const (
	nodeName = "kvbox-bench"
	// The node's address on the namespace's loopback: its kubelet API
	// listens there only.
	nodeAddr = "127.0.0.2"
)

// fleet is the bench's control plane (testenv/fleet.sh, in a state folder
// of its own) and its one kvbox-node.
type fleet struct {
	o      *options
	tmp    string
	state  string // KVBOX_FLEET_STATE
	client kubernetes.Interface
	node   *exec.Cmd
	subnet string // the node's podCIDR: its boxes' subnet
	domain string // the node's domain type (its label)
}

// detached runs outside the bench's process group: a Ctrl-C at the
// terminal reaches the bench, which lets a step under way finish and then
// removes what it made, not the child halfway through.
func detached(cmd *exec.Cmd) *exec.Cmd {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return cmd
}

// sh runs testenv/fleet.sh; its log lines go to stderr, its stdout is
// returned.
func (f *fleet) sh(args ...string) (string, error) {
	cmd := detached(exec.Command("bash", append([]string{filepath.Join(f.o.repo, "testenv", "fleet.sh")}, args...)...))
	cmd.Env = append(os.Environ(), "KVBOX_FLEET_STATE="+f.state, "KVBOX_FLEET_CACHE="+f.o.fleetCache, "KVBOX_TESTENV_NS="+testNetns)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, os.Stderr
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("testenv/fleet.sh %s: %w", strings.Join(args, " "), err)
	}
	return out.String(), nil
}

// up starts the control plane and the node, and adds their removal (and
// that of everything in the node's state dir) to cl.
func (f *fleet) up(ctx context.Context, cl *cleanups) error {
	nodeBin, err := f.buildNode(ctx)
	if err != nil {
		return err
	}
	creds, err := f.startControlPlane(ctx, cl)
	if err != nil {
		return err
	}
	exited, logName, err := f.startNode(nodeBin, creds, cl)
	if err != nil {
		return err
	}
	return f.waitNodeReady(ctx, exited, logName)
}

// buildNode is the kvbox-node binary: the one given, else one built from
// this tree.
func (f *fleet) buildNode(ctx context.Context) (string, error) {
	nodeBin := f.o.kvboxNode
	if nodeBin == "" {
		nodeBin = filepath.Join(f.tmp, "kvbox-node")
		say("building kvbox-node")
		b := detached(exec.Command("nice", "-n", "10", "go", "build", "-o", nodeBin, "./cmd/kvbox-node"))
		b.Dir = filepath.Join(f.o.repo, "integrations", "kubernetes")
		if out, err := b.CombinedOutput(); err != nil {
			return "", fmt.Errorf("go build kvbox-node: %v\n%s", err, out)
		}
	}
	if err := ctx.Err(); err != nil {
		return "", err
	}
	return nodeBin, nil
}

// startControlPlane starts the control plane (testenv/fleet.sh up), makes
// the bench's client of it, and the node's credentials; creds is their
// folder.
func (f *fleet) startControlPlane(ctx context.Context, cl *cleanups) (creds string, err error) {
	cl.add(func() error { _, err := f.sh("down"); return err })
	say("starting the control plane (testenv/fleet.sh up)")
	if _, err := f.sh("up"); err != nil {
		return "", err
	}
	env, err := readEnv(filepath.Join(f.state, "env"))
	if err != nil {
		return "", err
	}
	cfg, err := clientcmd.BuildConfigFromFlags("", env["KUBECONFIG"])
	if err != nil {
		return "", err
	}
	// The bench's client makes many requests in a row; client-go's
	// default rate limit (5 a second) would be part of what is timed.
	cfg.QPS, cfg.Burst = 200, 400
	if f.client, err = kubernetes.NewForConfig(cfg); err != nil {
		return "", err
	}
	out, err := f.sh("node-credentials", nodeName, nodeAddr)
	if err != nil {
		return "", err
	}
	creds = strings.TrimSpace(lastLine(out))
	if err := ctx.Err(); err != nil {
		return "", err
	}
	return creds, nil
}

// startNode starts kvbox-node on its own state dir, its output to a log
// (logName); exited gets its end. Stopping it (SIGTERM, then a kill) and
// removing the state dir go to cl.
func (f *fleet) startNode(nodeBin, creds string, cl *cleanups) (exited chan error, logName string, err error) {
	// The node's state dir: QEMU (libvirt's user) reads the snapshots in
	// it. Removed with its boxes, snapshots and bridge at the end.
	if err := os.Mkdir(f.o.nodeDir, 0o751); err != nil {
		return nil, "", fmt.Errorf("the node's state dir: %w", err)
	}
	cl.add(f.removeNodeDir)
	logf, err := os.Create(filepath.Join(f.tmp, "kvbox-node.log"))
	if err != nil {
		return nil, "", err
	}
	f.node = detached(exec.Command(nodeBin, "--name", nodeName, "--node-address", nodeAddr,
		"--kubeconfig", filepath.Join(creds, "kubeconfig"), "--tls-cert-file", filepath.Join(creds, "kubelet.crt"),
		"--tls-private-key-file", filepath.Join(creds, "kubelet.key"), "--client-ca-file", filepath.Join(creds, "ca.crt"),
		"--state-dir", f.o.nodeDir, "--bridge", f.o.bridge, "--insecure-registry", f.o.registry, "--status-interval", "2s",
		// Each pod requests its snapshot's vCPU: room for the Deployment
		// and the pods timed one at a time, whatever this host's CPUs.
		"--cpus", strconv.Itoa(f.o.replicas+2)))
	f.node.Stdout, f.node.Stderr = logf, logf
	if err := f.node.Start(); err != nil {
		logf.Close()
		return nil, "", fmt.Errorf("starting kvbox-node: %w", err)
	}
	exited = make(chan error, 1)
	go func() { exited <- f.node.Wait(); logf.Close() }()
	cl.add(func() error {
		f.node.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
			return nil
		case <-time.After(15 * time.Second):
			f.node.Process.Kill()
			<-exited
			return errors.New("kvbox-node did not stop within 15 s of SIGTERM: killed")
		}
	})
	return exited, logf.Name(), nil
}

// waitNodeReady waits for the node to be Ready with a podCIDR, and keeps
// its subnet and domain type; a node that exited meanwhile ends the wait
// (its log says why).
func (f *fleet) waitNodeReady(ctx context.Context, exited chan error, logName string) error {
	say("waiting for node %s to be Ready with a podCIDR", nodeName)
	wctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	err := wait.PollUntilContextCancel(wctx, 300*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		select {
		case err := <-exited:
			exited <- err
			return false, fmt.Errorf("kvbox-node exited (%v): see %s", err, logName)
		default:
		}
		nd, err := f.client.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		for _, c := range nd.Status.Conditions {
			if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue && nd.Spec.PodCIDR != "" {
				f.subnet, f.domain = nd.Spec.PodCIDR, nd.Labels["kvbox.dev/domain-type"]
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("node %s Ready: %w", nodeName, err)
	}
	return nil
}

// kvbox runs the CLI on the node's state dir, bridge and subnet, timed as
// a whole command.
func (f *fleet) kvbox(args ...string) (time.Duration, error) {
	return runKvbox(f.o.kvbox, append([]string{"--state-dir", f.o.nodeDir, "--bridge", f.o.bridge, "--subnet", f.subnet}, args...)...)
}

func runKvbox(bin string, args ...string) (time.Duration, error) {
	cmd := detached(exec.Command(bin, args...))
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	t0 := time.Now()
	err := cmd.Run()
	d := time.Since(t0)
	if err != nil {
		return d, fmt.Errorf("kvbox %s: %v\n%s", strings.Join(args, " "), err, strings.TrimSpace(out.String()))
	}
	return d, nil
}

func kvboxJSON(bin string, v any, args ...string) error {
	cmd := detached(exec.Command(bin, args...))
	var errb bytes.Buffer
	cmd.Stderr = &errb
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("kvbox %s: %v: %s", strings.Join(args, " "), err, strings.TrimSpace(errb.String()))
	}
	return json.Unmarshal(out, v)
}

// removeNodeDir removes every box whose folder is in the node's state dir
// (kvbox ls lists every box of the libvirtd), then its snapshots, its
// bridge and the folder.
func (f *fleet) removeNodeDir() error {
	dir := f.o.nodeDir
	global := []string{"--state-dir", dir}
	var errs []error
	var boxes []struct {
		Name string `json:"name"`
		Dir  string `json:"dir"`
	}
	if err := kvboxJSON(f.o.kvbox, &boxes, append(global, "ls", "--json")...); err != nil {
		errs = append(errs, err)
	}
	for _, b := range boxes {
		if strings.HasPrefix(b.Dir, dir+"/") {
			if _, err := runKvbox(f.o.kvbox, append(global, "rm", "--force", b.Name)...); err != nil {
				errs = append(errs, err)
			}
		}
	}
	var snaps []struct {
		Name string `json:"name"`
	}
	if err := kvboxJSON(f.o.kvbox, &snaps, append(global, "snapshots", "ls", "--json")...); err != nil {
		errs = append(errs, err)
	}
	for _, s := range snaps {
		if _, err := runKvbox(f.o.kvbox, append(global, "snapshots", "rm", s.Name)...); err != nil {
			errs = append(errs, err)
		}
	}
	if f.subnet != "" {
		if _, err := f.kvbox("network", "rm"); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("the node's state dir %s kept (it still holds something): %w", dir, errors.Join(errs...))
	}
	return os.RemoveAll(dir)
}

func readEnv(path string) (map[string]string, error) {
	fh, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer fh.Close()
	env := map[string]string{}
	sc := bufio.NewScanner(fh)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), "="); ok && !strings.HasPrefix(k, "#") {
			env[k] = v
		}
	}
	return env, sc.Err()
}

func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}

// cachedSnapshot is the snapshot of digest in the node's cache: its name
// begins with kvboxnode.CacheNamePrefix (the rest is drawn at its pull).
func (f *fleet) cachedSnapshot(digest string) (string, error) {
	var snaps []struct {
		Name string `json:"name"`
	}
	if err := kvboxJSON(f.o.kvbox, &snaps, "--state-dir", f.o.nodeDir, "snapshots", "ls", "--json"); err != nil {
		return "", err
	}
	for _, s := range snaps {
		if strings.HasPrefix(s.Name, kvboxnode.CacheNamePrefix(digest)+"-") {
			return s.Name, nil
		}
	}
	return "", fmt.Errorf("no snapshot of %s in the node's state dir %s", digest, f.o.nodeDir)
}
