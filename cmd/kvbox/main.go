// Command kvbox starts, snapshots and clones libvirt boxes.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"kvbox.dev/kvbox/domain"
)

func main() {
	if err := domain.CloseInheritedOnExec(); err != nil {
		os.Stderr.WriteString("kvbox: " + err.Error() + "\n")
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], stdio())
	stop()
	os.Exit(code)
}
