// Command kvbox-agent is the kvbox guest agent. It runs inside a box, as a
// child of a busybox init script or as a systemd service, and answers the
// host over the box's virtio-serial ports and, where the guest has it,
// vsock. Build it static: CGO_ENABLED=0 go build -o bin/kvbox-agent ./cmd/kvbox-agent
//
// The runtime does not look at the CPU count every second (a box's vCPUs do
// not change while it runs): an idle box stays idle, and a clone, whose
// every code path runs cold under emulation, is not held up by it.
//
//go:debug updatemaxprocs=0
package main

import (
	"context"
	"flag"
	"log"
	"os"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"time"

	agent "kvbox.dev/kvbox/guest-agent"

	"github.com/mdlayher/vsock"
	"golang.org/x/sys/unix"
)

func main() {
	// The agent's binary run by an exec of its own (a file copy, the
	// after-clone hooks) is one of its helpers.
	if len(os.Args) > 1 {
		if run := agent.Helper(os.Args[1]); run != nil {
			os.Exit(run(os.Args[2:]))
		}
	}
	stateDir := flag.String("state-dir", "/var/lib/kvbox-agent", "where the identity is persisted")
	sysClass := flag.String("sys-class", "/sys/class/virtio-ports", "virtio-serial ports in sysfs")
	devDir := flag.String("dev", "/dev", "where the port devices are")
	noVsock := flag.Bool("no-vsock", false, "do not listen on vsock")
	sshKeys := flag.Bool("ssh-host-keys", false, "make the missing SSH host keys and exit (ssh.service runs this before sshd)")
	flag.Parse()
	if *sshKeys {
		if _, err := agent.NewLinuxSystem().SSHHostKeys(false); err != nil {
			log.Fatalf("kvbox-agent: %v", err)
		}
		return
	}

	log.SetFlags(log.Lmicroseconds)
	log.SetPrefix("kvbox-agent: ")
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	// The console may go away (a systemd journal restart, a closed
	// serial line): never die of SIGPIPE on stderr.
	signal.Ignore(syscall.SIGPIPE, syscall.SIGHUP)

	srv := &agent.Server{System: agent.NewLinuxSystem(), StateDir: *stateDir, Boost: true}
	log.Printf("version %s starting, pid %d", agent.Version, os.Getpid())
	startThreads(8)
	if err := agent.SetTimerSlack(time.Millisecond); err != nil {
		log.Printf("timer slack: %v", err)
	}

	// A sandbox's envd (configured by an earlier envd-init) serves on.
	if err := srv.RestoreEnvd(); err != nil {
		log.Printf("%v", err)
	}

	// Re-apply a persisted identity (a rebooted clone keeps its address)
	// without holding up readiness; the NIC driver may still be loading.
	go reapplyIdentity(ctx, srv)

	vsockDone := make(chan struct{})
	go func() {
		defer close(vsockDone)
		if !*noVsock {
			serveVsock(ctx, srv)
		}
	}()
	srv.ServeSerialPorts(ctx, *sysClass, *devDir)
	<-vsockDone
	log.Printf("stopping")
}

func reapplyIdentity(ctx context.Context, srv *agent.Server) {
	id, ok, err := agent.LoadIdentity(srv.StateDir)
	if err != nil {
		log.Printf("identity: %v", err)
		return
	}
	if !ok {
		return
	}
	for i := 0; ; i++ {
		err := srv.System.ApplyIdentity(id)
		if err == nil {
			log.Printf("identity re-applied: hostname=%q address=%q", id.Hostname, id.Address)
			return
		}
		if i == 20 {
			log.Printf("identity not re-applied: %v", err)
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// serveVsock listens on vsock port agent.VsockPort (privileged) for any CID
// and serves only the host's connections, so a clone with a new
// CID needs no restart. The vsock transport module may load after the
// agent starts; keep trying quietly.
func serveVsock(ctx context.Context, srv *agent.Server) {
	logged := false
	for delay := 500 * time.Millisecond; ; delay = min(2*delay, 30*time.Second) {
		l, err := vsock.ListenContextID(unix.VMADDR_CID_ANY, agent.VsockPort, nil)
		if err == nil {
			log.Printf("listening on vsock port %d", agent.VsockPort)
			err = srv.Serve(ctx, l)
			l.Close()
			if ctx.Err() != nil {
				return
			}
			log.Printf("vsock: %v", err)
			continue
		}
		if !logged {
			log.Printf("no vsock yet (%v); serial ports only until it appears", err)
			logged = true
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(delay):
		}
	}
}

// startThreads has the runtime make n OS threads now; it keeps the idle
// ones. A clone's re-identification blocks in several system calls at once
// (netlink, files, the port), and a thread made then is a clone(2) on cold
// code in the middle of it.
func startThreads(n int) {
	var held sync.WaitGroup
	release := make(chan struct{})
	for range n {
		held.Add(1)
		go func() {
			runtime.LockOSThread() // the thread is this goroutine's: the next one needs another
			held.Done()
			<-release
			runtime.UnlockOSThread()
		}()
	}
	held.Wait()
	close(release)
}
