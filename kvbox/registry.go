package kvbox

import (
	"context"

	"kvbox.dev/kvbox/registry"
)

// RegistryOptions say how to reach a registry (plain HTTP, credentials)
// and where a transfer reports.
type RegistryOptions = registry.Options

// Pull fetches the snapshot artifact at ref ("REPO:TAG", or "REPO@DIGEST"
// to get exactly what Resolve gave) as snapshot name, after checking this
// host can restore it: a snapshot it cannot is refused in one line before
// anything is fetched (errors.Is snapshot.ErrIncompatible). The artifact is
// untrusted input (package registry).
func (h *Host) Pull(ctx context.Context, ref, name string, o RegistryOptions) (registry.PullResult, error) {
	var err error
	if o.DomainType, err = h.d.DomainType(); err != nil {
		return registry.PullResult{}, err
	}
	if o.Emulator, err = h.d.Emulator(); err != nil {
		return registry.PullResult{}, err
	}
	return registry.Pull(ctx, h.d.Conn(), h.cfg.StateDir, ref, name, o)
}

// Resolve is the digest of the snapshot artifact ref names now (one
// registry round trip), for a cache keyed by digest.
func (h *Host) Resolve(ctx context.Context, ref string, o RegistryOptions) (string, error) {
	d, _, err := registry.Inspect(ctx, ref, o)
	if err != nil {
		return "", err
	}
	return d.String(), nil
}

// Push sends snapshot name, and the base image under it, to ref as an
// artifact (package registry): only the parts the registry lacks travel.
// The agent token it carries is the snapshot's own, which no box keeps.
func (h *Host) Push(ctx context.Context, name, ref string, o RegistryOptions) (registry.PushResult, error) {
	s, err := h.snaps.Get(name)
	if err != nil {
		return registry.PushResult{}, err
	}
	return registry.Push(ctx, h.cfg.StateDir, s, ref, o)
}
