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
	img := gate.TinyImage(t)
	dir := t.TempDir()
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
	var socks []string
	for k := range 4 {
		p := filepath.Join(dir, fmt.Sprintf("agent.%d.sock", k))
		socks = append(socks, p)
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

	// Ready = answers Ping. One DialSerial with the whole boot timeout:
	// QEMU holds the connection until the guest opens the port, and the
	// HELLO is answered as soon as the agent reads it.
	booted := time.Now()
	for {
		if _, err := os.Stat(socks[0]); err == nil || time.Since(booted) > 10*time.Second {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	// QEMU binds the socket before it listens: a connect in between is
	// refused, so that is tried again.
	dctx, dcancel := context.WithTimeout(context.Background(), 90*time.Second)
	c, err := DialSerial(dctx, socks[:1])
	for errors.Is(err, syscall.ECONNREFUSED) && dctx.Err() == nil {
		time.Sleep(20 * time.Millisecond)
		c, err = DialSerial(dctx, socks[:1])
	}
	dcancel()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	in, err := c.Ping(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("ready after %v: %+v", time.Since(booted), in)

	sh := func(c *Client, script string) (string, int) {
		t.Helper()
		var out, errb bytes.Buffer
		code, err := c.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", script}}, nil, &out, &errb, nil)
		if err != nil {
			t.Fatalf("%s: %v", script, err)
		}
		return out.String() + errb.String(), code
	}
	if out, code := sh(c, "echo hi; echo err >&2; exit 4"); out != "hi\nerr\n" || code != 4 {
		t.Errorf("exec: %q %d", out, code)
	}
	var out bytes.Buffer
	payload := bytes.Repeat([]byte("kvbox\n"), 100000)
	if code, err := c.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", "cat | md5sum"}}, bytes.NewReader(payload), &out, nil, nil); err != nil || code != 0 {
		t.Fatal(code, err)
	}
	t.Logf("stdin md5 in guest: %s", out.String())

	// TTY.
	var tty syncBuffer
	pr, pw := testPipe()
	done := make(chan error, 1)
	go func() {
		_, err := c.Exec(ctx, ExecRequest{Argv: []string{"sh"}, TTY: true, Rows: 30, Cols: 100}, pr, &tty, nil, nil)
		done <- err
	}()
	pw.Write([]byte("stty size; tty; exit\n"))
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if s := tty.String(); !strings.Contains(s, "30 100") || !strings.Contains(s, "/dev/pts/") {
		t.Errorf("tty output %q", s)
	}

	// What a port does with no host connected (virtio_console): reads
	// return EOF at once, writes block. With a host: reads block.
	probe := `for p in /sys/class/virtio-ports/*; do [ "$(cat $p/name)" = org.kvbox-test.probe ] && d=/dev/${p##*/}; done
		timeout 1 cat $d; echo "read without host: rc=$?"
		timeout 1 sh -c "echo x > $d"; echo "write without host: rc=$?"`
	got, _ := sh(c, probe)
	t.Logf("probe:\n%s", got)
	if !strings.Contains(got, "read without host: rc=0") {
		t.Errorf("read without host did not return EOF at once: %q", got)
	}
	if hc, err := net.Dial("unix", filepath.Join(dir, "probe.sock")); err == nil {
		time.Sleep(100 * time.Millisecond)
		got, _ = sh(c, strings.Replace(probe, "without", "with", 2))
		t.Logf("probe with a host:\n%s", got)
		hc.Close()
	}

	// Two ports at once.
	c2, err := DialSerial(ctx, socks)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for _, cl := range []*Client{c, c2} {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if out, code := sh(cl, "sleep 0.3; echo par"); out != "par\n" || code != 0 {
				t.Errorf("parallel: %q %d", out, code)
			}
		}()
	}
	wg.Wait()
	c2.Close()

	// Agent CPU use while port 0 has no host: the read side must park.
	agentPid, _ := sh(c, "pidof kvbox-agent")
	agentPid = strings.TrimSpace(agentPid)
	cpu := func() int {
		s, _ := sh(c, "cat /proc/"+agentPid+"/stat")
		f := strings.Fields(s[strings.LastIndex(s, ")")+2:])
		u, _ := strconv.Atoi(f[11])
		st, _ := strconv.Atoi(f[12])
		return u + st
	}
	// A host that disconnects mid-exec: the process must die.
	go c.Exec(context.Background(), ExecRequest{Argv: []string{"sh", "-c", "echo $$ > /tmp/victim; exec sleep 1000"}}, nil, nil, nil, nil)
	time.Sleep(300 * time.Millisecond)
	c.Close()
	before := -1
	time.Sleep(100 * time.Millisecond)
	c, err = DialSerial(ctx, socks[1:2])
	if err != nil {
		t.Fatal(err)
	}
	before = cpu()
	time.Sleep(3 * time.Second) // ports 0, 2, 3 have no host now
	after := cpu()
	t.Logf("agent cpu ticks over 3 s idle with 3 ports unconnected: %d", after-before)
	if after-before > 30 {
		t.Errorf("agent spins: %d ticks in 3 s", after-before)
	}
	if out, _ := sh(c, "v=$(cat /tmp/victim); kill -0 $v 2>/dev/null && echo alive || echo dead"); out != "dead\n" {
		t.Errorf("exec of a disconnected host: %q", out)
	}
	c.Close()

	// Reconnect to port 0 (stale bytes possible) and re-identify.
	c, err = DialSerial(ctx, socks[:1])
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
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
	got, _ = sh(c, "hostname; cat /sys/class/net/eth0/address; ip -4 -o addr show dev eth0 | awk '{print $4}'; ip route | grep default; cat /etc/hosts /etc/resolv.conf /var/lib/kvbox-agent/identity.json; date -u +%Y")
	for _, want := range []string{"clone1", "52:54:00:00:00:42", "172.30.0.42/24", "default via 172.30.0.1", "127.0.1.1\tclone1", "nameserver 172.30.0.1", `"address": "172.30.0.42/24"`, "2030"} {
		if !strings.Contains(got, want) {
			t.Errorf("after Identify: %q lacks %q", got, want)
		}
	}
	if in, err := c.Ping(ctx); err != nil || !in.Capabilities.Identify || !in.Capabilities.Clock || !in.Capabilities.Entropy || !in.Capabilities.TTY {
		t.Errorf("capabilities: %+v %v", in, err)
	}

	// The agent restarts (init respawns it) while this host stays
	// connected: the call in flight fails with ErrAgentRestarted, the next
	// one works, and the persisted identity is applied again.
	_, err = c.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", "hostname other; kill $(pidof kvbox-agent); sleep 100"}}, nil, nil, nil, nil)
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
	if out, _ := sh(c, "ps -o pid,args | grep -c '[s]leep 100'"); out != "0\n" {
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
