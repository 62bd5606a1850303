package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/kvbox"
	"kvbox.dev/kvbox/snapshot"
)

var registryAddr = flag.String("registry", "127.0.0.1:5000", "plain-HTTP OCI registry to time push and pull against (\"\" skips)")

// benchRegistry times a push of snap (and its base image), a second push
// of the same snapshot, and a pull into a fresh state dir, with bytes on
// the wire against bytes on disk. The peer, timed on the same files in
// the same run, is `tar --sparse | zstd -1` of the same folders: what a
// hand-rolled transfer would send.
func benchRegistry(ctx context.Context, e *env) error {
	if *registryAddr == "" {
		fmt.Println("skipped: -registry \"\"")
		return nil
	}
	snap, err := e.warmSnapshot(ctx)
	if err != nil {
		return err
	}
	return registryTimes(ctx, e, snap)
}

// registryTimes times the push, the second push and the pull of snap, and
// the tar|zstd peer on the same files.
func registryTimes(ctx context.Context, e *env, snap snapshot.Snapshot) error {
	if *registryAddr == "" {
		return nil
	}
	ref := fmt.Sprintf("%s/kvbox-bench/%s:%d", *registryAddr, snap.Name, time.Now().UnixNano())
	o := kvbox.RegistryOptions{Insecure: true}
	t0 := time.Now()
	first, err := e.k.Push(ctx, snap.Name, ref, o)
	if err != nil {
		return err
	}
	pushT := time.Since(t0)
	t0 = time.Now()
	again, err := e.k.Push(ctx, snap.Name, ref, o)
	if err != nil {
		return err
	}
	againT := time.Since(t0)
	// The pull is a new host's: a state dir of its own, without the base
	// image, so that all of the artifact comes over the wire.
	dir, err := os.MkdirTemp("", "kvbox-bench-pull-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	fresh, err := kvbox.Open(ctx, kvbox.Config{StateDir: dir, Network: e.k.Network()})
	if err != nil {
		return err
	}
	defer fresh.Close()
	t0 = time.Now()
	pulled, err := fresh.Pull(ctx, ref, snap.Name, o)
	if err != nil {
		return err
	}
	pullT := time.Since(t0)

	var apparent int64
	for _, p := range first.Parts {
		apparent += p.Apparent
	}
	imgDir := filepath.Dir(snap.BaseDisk)
	t0 = time.Now()
	cmd := exec.CommandContext(ctx, "sh", "-c", `tar --sparse -cf - -C "$1" . -C "$2" . | zstd -1 -T1 -q -c | wc -c`, "sh", snap.Dir, imgDir)
	out, err := cmd.Output()
	peerT := time.Since(t0)
	peer := strings.TrimSpace(string(out))
	if err != nil {
		peer = "n/a (" + err.Error() + ")"
	}

	fmt.Printf("\nregistry %s, snapshot %s with its base image (%d parts)\n", *registryAddr, snap.Name, len(first.Parts))
	fmt.Printf("  on disk %s, apparent %s\n", base.FormatSize(first.OnDisk), base.FormatSize(apparent))
	fmt.Printf("  push            %8.0f ms   sent %s (encode %.0f ms)\n", ms(pushT), base.FormatSize(first.Sent), ms(first.Encode))
	fmt.Printf("  push again      %8.0f ms   sent %s (unchanged: nothing but requests)\n", ms(againT), base.FormatSize(again.Sent))
	fmt.Printf("  pull            %8.0f ms   received %s, unpacked %s on disk\n", ms(pullT), base.FormatSize(pulled.Received), base.FormatSize(pulled.Snapshot.SizeBytes))
	fmt.Printf("  peer tar --sparse | zstd -1   %8.0f ms   %s bytes\n", ms(peerT), peer)
	fmt.Printf("  ratio sent / on disk: %.3f\n", float64(first.Sent)/float64(max(first.OnDisk, 1)))
	return nil
}
