package main

// Published ports (kvbox new --publish) are held by a detached
// `kvbox port-forward --listen-fds` child per box (kvbox.Config's
// HolderCommand, the library's publish.go says how): `new` binds the
// sockets itself before it creates the box, so a taken port fails the
// command with nothing created.

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/kvbox"
)

// holderCommand re-runs this kvbox as the port holder of box with ports,
// taking the listeners as fds 3.. and writing on readyFD once it forwards.
func (a *app) holderCommand(box string, ports []kvbox.Port, readyFD int) *exec.Cmd {
	self, err := os.Executable()
	if err != nil {
		self = os.Args[0]
	}
	args := []string{"--state-dir", a.stateDir, "--connect", a.uri, "--dial-timeout", a.dialTimeout.String(),
		"port-forward", kvbox.HolderArg, "--ready-fd", strconv.Itoa(readyFD), box}
	for _, p := range ports {
		args = append(args, p.String())
	}
	return exec.Command(self, args...)
}

// signalReady tells the parent of a --listen-fds child that it runs.
func signalReady(fd int, err error) {
	if fd <= 0 {
		return
	}
	f := os.NewFile(uintptr(fd), "ready")
	defer f.Close()
	if err != nil {
		fmt.Fprintf(f, "error: %s\n", message(err))
		return
	}
	fmt.Fprintln(f, "ok")
}

func closeListeners(ls []*net.TCPListener) {
	for _, l := range ls {
		l.Close()
	}
}

// publish starts box b's --publish holder; if it cannot, the box is removed
// (new --publish gives the box with its ports or nothing).
func (a *app) publish(ctx context.Context, b domain.Box, o *newOptions) error {
	if len(o.ports) == 0 {
		return nil
	}
	k, err := a.lib()
	if err != nil {
		return err
	}
	if err := k.Publish(ctx, b, o.ports, o.listeners); err != nil {
		return err
	}
	for _, p := range o.ports {
		fmt.Fprintf(a.io.Out, "✓ published %s -> %s:%d (until the box stops or is removed)\n", p.ListenAddr(), b.Name, p.GuestPort)
	}
	return nil
}
