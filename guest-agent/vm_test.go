package agent

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"kvbox.dev/kvbox/testenv/gate"
)

// TestVM boots the tiny guest image (testenv/tiny/build.sh OUTDIR, see
// gate.TinyImage) under raw QEMU with four agent ports and talks to the real
// agent:
//
//	KVBOX_AGENT_IMAGE=/tmp/img go test -run TestVM -v ./guest-agent
func TestVM(t *testing.T) {
	gate.Long(t)
	gate.Tools(t, "qemu-system-x86_64", "qemu-img")
	vm := bootTinyVM(t)
	booted := time.Now()
	c := vm.dial(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	vm.ctx = ctx
	in, err := c.Ping(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ready after %v: %+v", time.Since(booted), in)

	vm.exec(t, c)
	vm.tty(t, c)
	vm.probePorts(t, c)
	vm.twoPorts(t, c)
	vm.hostGone(t, c)
	// Reconnect to port 0 (stale bytes possible) and re-identify.
	c, err = DialSerial(ctx, vm.socks[:1])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	vm.identify(t, c)
	vm.agentRestart(t, c)
}

// tinyVM is TestVM's guest: its folder (disk, console log, sockets) and
// its four agent ports' sockets.
type tinyVM struct {
	dir   string
	socks []string
	ctx   context.Context // bounds each call to the agent
}

// bootTinyVM starts QEMU on an overlay of the tiny image with four agent
// ports and one the agent does not serve (probe.sock), killed when t ends.
func bootTinyVM(t *testing.T) *tinyVM {
	img := gate.TinyImage(t)
	vm := &tinyVM{dir: t.TempDir()}
	dir := vm.dir
	if out, err := exec.Command("qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", filepath.Join(img, "disk.qcow2"), filepath.Join(dir, "disk.qcow2")).CombinedOutput(); err != nil {
		t.Fatalf("qemu-img: %v %s", err, out)
	}
	cmdline, _ := os.ReadFile(filepath.Join(img, "cmdline"))
	// TCG unless told otherwise: KVM on this bench's nested hosts hung
	// right after the kernel's decompression.
	accel, cpuModel := "tcg", "max"
	if os.Getenv("KVBOX_AGENT_ACCEL") == "kvm" {
		accel, cpuModel = "kvm", "host"
	}
	args := []string{"-machine", "q35,accel=" + accel, "-cpu", cpuModel, "-m", "256", "-smp", "1", "-nographic", "-nodefaults",
		"-serial", "file:" + filepath.Join(dir, "console.log"),
		"-kernel", filepath.Join(img, "vmlinuz"), "-initrd", filepath.Join(img, "initrd.img"),
		"-append", strings.TrimSpace(string(cmdline)),
		"-drive", "if=virtio,format=qcow2,file=" + filepath.Join(dir, "disk.qcow2"),
		// A NIC on a hub with no other port: its frames go nowhere.
		"-netdev", "hubport,id=n0,hubid=0", "-device", "virtio-net-pci,netdev=n0,mac=52:54:00:00:00:01",
		"-device", "virtio-serial-pci,id=vser0"}
	for k := range 4 {
		p := filepath.Join(dir, fmt.Sprintf("agent.%d.sock", k))
		vm.socks = append(vm.socks, p)
		args = append(args, "-chardev", fmt.Sprintf("socket,id=agent%d,path=%s,server=on,wait=off", k, p),
			"-device", fmt.Sprintf("virtserialport,bus=vser0.0,chardev=agent%d,name=%s%d", k, SerialPortPrefix, k))
	}
	// A port the agent does not serve, to observe virtio_console itself.
	args = append(args, "-chardev", "socket,id=probe,path="+filepath.Join(dir, "probe.sock")+",server=on,wait=off",
		"-device", "virtserialport,bus=vser0.0,chardev=probe,name=org.kvbox-test.probe")
	qemu := exec.Command("qemu-system-x86_64", args...)
	qemu.Stderr = os.Stderr
	if err := qemu.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		qemu.Process.Kill()
		qemu.Wait()
		if t.Failed() || os.Getenv("KVBOX_AGENT_CONSOLE") != "" {
			b, _ := os.ReadFile(filepath.Join(dir, "console.log"))
			t.Logf("console:\n%s", b)
		}
	})
	return vm
}

// dial connects to port 0 once the guest opens it.
func (vm *tinyVM) dial(t *testing.T) *Client {
	// Ready = answers Ping. One DialSerial with the whole boot timeout:
	// QEMU holds the connection until the guest opens the port, and the
	// HELLO is answered as soon as the agent reads it.
	t0 := time.Now()
	for {
		if _, err := os.Stat(vm.socks[0]); err == nil || time.Since(t0) > 10*time.Second {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	// QEMU binds the socket before it listens: a connect in between is
	// refused, so that is tried again.
	dctx, dcancel := context.WithTimeout(context.Background(), 90*time.Second)
	c, err := DialSerial(dctx, vm.socks[:1])
	for errors.Is(err, syscall.ECONNREFUSED) && dctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
		c, err = DialSerial(dctx, vm.socks[:1])
	}
	dcancel()
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// sh runs script in the guest through c: its output (stdout, then
// stderr) and exit code.
func (vm *tinyVM) sh(t *testing.T, c *Client, script string) (string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code, err := c.Exec(vm.ctx, ExecRequest{Argv: []string{"sh", "-c", script}}, nil, &out, &errb, nil)
	if err != nil {
		t.Fatalf("%s: %v", script, err)
	}
	return out.String() + errb.String(), code
}

// exec: output, exit code and a large stdin.
func (vm *tinyVM) exec(t *testing.T, c *Client) {
	if out, code := vm.sh(t, c, "echo hi; echo err >&2; exit 4"); out != "hi\nerr\n" || code != 4 {
		t.Errorf("exec: %q %d", out, code)
	}
	var out bytes.Buffer
	payload := bytes.Repeat([]byte("kvbox\n"), 100000)
	if code, err := c.Exec(vm.ctx, ExecRequest{Argv: []string{"sh", "-c", "cat | md5sum"}}, bytes.NewReader(payload), &out, nil, nil); err != nil || code != 0 {
		t.Fatal(code, err)
	}
	t.Logf("stdin md5 in guest: %s", out.String())
}

// tty: a shell on a terminal of the size asked.
func (vm *tinyVM) tty(t *testing.T, c *Client) {
	var tty syncBuffer
	pr, pw := testPipe()
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(vm.ctx, ExecRequest{Argv: []string{"sh"}, TTY: true, Rows: 30, Cols: 100}, pr, &tty, nil, nil)
		done <- err
	}()
	pw.Write([]byte("stty size; tty; exit\n"))
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s := tty.String(); !strings.Contains(s, "30 100") || !strings.Contains(s, "/dev/pts/") {
		t.Errorf("tty output %q", s)
	}
}

// probePorts: what a port does with no host connected (virtio_console):
// reads return EOF at once, writes block. With a host: reads block.
func (vm *tinyVM) probePorts(t *testing.T, c *Client) {
	probe := `for p in /sys/class/virtio-ports/*; do [ "$(cat $p/name)" = org.kvbox-test.probe ] && d=/dev/${p##*/}; done
		timeout 1 cat $d; echo "read without host: rc=$?"
		timeout 1 sh -c "echo x > $d"; echo "write without host: rc=$?"`
	got, _ := vm.sh(t, c, probe)
	t.Logf("probe:\n%s", got)
	if !strings.Contains(got, "read without host: rc=0") {
		t.Errorf("read without host did not return EOF at once: %q", got)
	}
	if hc, err := net.Dial("unix", filepath.Join(vm.dir, "probe.sock")); err == nil {
		time.Sleep(100 * time.Millisecond)
		got, _ = vm.sh(t, c, strings.Replace(probe, "without", "with", 2))
		t.Logf("probe with a host:\n%s", got)
		hc.Close()
	}
}

// twoPorts: two connections, on ports of their own, run at once.
func (vm *tinyVM) twoPorts(t *testing.T, c *Client) {
	c2, err := DialSerial(vm.ctx, vm.socks)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for _, cl := range []*Client{c, c2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if out, code := vm.sh(t, cl, "sleep 0.3; echo par"); out != "par\n" || code != 0 {
				t.Errorf("parallel: %q %d", out, code)
			}
		}()
	}
	wg.Wait()
	c2.Close()
}

// hostGone: a host that disconnects mid-exec (c is closed) kills the
// process, and the agent's read side parks while ports have no host.
func (vm *tinyVM) hostGone(t *testing.T, c *Client) {
	// Agent CPU use while port 0 has no host: the read side must park.
	agentPid, _ := vm.sh(t, c, "pidof kvbox-agent")
	agentPid = strings.TrimSpace(agentPid)
	cpu := func(c *Client) int {
		s, _ := vm.sh(t, c, "cat /proc/"+agentPid+"/stat")
		f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
		u, _ := strconv.Atoi(f[11])
		st, _ := strconv.Atoi(f[12])
		return u + st
	}
	// A host that disconnects mid-exec: the process must die.
	go c.Exec(context.Background(), ExecRequest{Argv: []string{"sh", "-c", "echo $$ > /tmp/victim; exec sleep 1000"}}, nil, nil, nil, nil)
	time.Sleep(300 * time.Millisecond)
	c.Close()
	time.Sleep(100 * time.Millisecond)
	c, err := DialSerial(vm.ctx, vm.socks[1:2])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	before := cpu(c)
	time.Sleep(3 * time.Second) // ports 0, 2, 3 have no host now
	after := cpu(c)
	t.Logf("agent cpu ticks over 3 s idle with 3 ports unconnected: %d", after-before)
	if after-before > 30 {
		t.Errorf("agent spins: %d ticks in 3 s", after-before)
	}
	if out, _ := vm.sh(t, c, "v=$(cat /tmp/victim); kill -0 $v 2>/dev/null && echo alive || echo dead"); out != "dead\n" {
		t.Errorf("exec of a disconnected host: %q", out)
	}
}

// identify: a new identity, clock and entropy, as the guest shows them.
func (vm *tinyVM) identify(t *testing.T, c *Client) {
	ctx := vm.ctx
	id := Identity{Hostname: "clone1", MAC: "52:54:00:00:00:42", Address: "172.30.0.42/24", Gateway: "172.30.0.1", DNS: []string{"172.30.0.1"}}
	if err := c.Identify(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := c.SetClock(ctx, time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)); err != nil {
		t.Fatal(err)
	}
	if err := c.AddEntropy(ctx, bytes.Repeat([]byte{7}, 64)); err != nil {
		t.Fatal(err)
	}
	got, _ := vm.sh(t, c, "hostname; cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0 | awk '{print $4}'; ip route | grep default; cat /etc/hosts /etc/resolv.conf /var/lib/kvbox-agent/identity.json; date -u +%Y")
	for _, want := range []string{"clone1", "52:54:00:00:00:42", "172.30.0.42/24", "default via 172.30.0.1", "127.0.1.1\tclone1", "nameserver 172.30.0.1", `"address": "172.30.0.42/24"`, "2030"} {
		if !strings.Contains(got, want) {
			t.Errorf("after Identify: %q lacks %q", got, want)
		}
	}
	if in, err := c.Ping(ctx); err != nil || !in.Capabilities.Identify || !in.Capabilities.Clock || !in.Capabilities.Entropy || !in.Capabilities.TTY {
		t.Errorf("capabilities: %+v %v", in, err)
	}
}

// agentRestart: the agent restarts (init respawns it) while this host
// stays connected: the call in flight fails with ErrAgentRestarted, the
// next one works, and the persisted identity is applied again.
func (vm *tinyVM) agentRestart(t *testing.T, c *Client) {
	ctx := vm.ctx
	_, err := c.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", "hostname other; kill $(pidof kvbox-agent); sleep 100"}}, nil, nil, nil, nil)
	if !errors.Is(err, ErrAgentRestarted) {
		t.Fatalf("exec across a restart: %v", err)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		in, err := c.Ping(ctx)
		if err == nil && in.Hostname == "clone1" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the restart: %+v %v", in, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	if out, _ := vm.sh(t, c, "ps -o pid,args | grep -c '[s]leep 100'"); out != "0\n" {
		t.Errorf("the exec of the stopped agent survived: %q", out)
	}
}

func testPipe() (*os.File, *os.File) {
	r, w, err := os.Pipe()
	if err != nil {
		panic(err)
	}
	return r, w
}
