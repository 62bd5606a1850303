package main

// Published ports (kvbox new --publish) are held by a detached
// `kvbox port-forward --listen-fds` child per box (kvbox.Config's
// HolderCommand, the library's publish.go says how): Create and Clone bind
// the sockets before they make the box, so a taken port fails `new` with
// nothing created.

import (
	"os"
	"os/exec"
	"strconv"

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
