package kvbox

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"slices"

	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/registry"
	"kvbox.dev/kvbox/snapshot"
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
// A snapshot that holds a box's agent token (an older kvbox took its
// source's own) gets it retired from every box first.
func (h *Host) Push(ctx context.Context, name, ref string, o RegistryOptions) (registry.PushResult, error) {
	s, err := h.snaps.Get(name)
	if err != nil {
		return registry.PushResult{}, err
	}
	if err := h.retireCopiedToken(ctx, s); err != nil {
		return registry.PushResult{}, err
	}
	return registry.Push(ctx, h.d.Conn(), h.cfg.StateDir, s, ref, o)
}

// retireCopiedToken: a snapshot takes an agent token minted for it, which
// no box keeps; one an older kvbox took holds its source's own token. Before
// such a snapshot leaves this host, every box that still has that token gets
// a new one (a box that is not running, at its next start).
func (h *Host) retireCopiedToken(ctx context.Context, s snapshot.Snapshot) error {
	tok, err := domain.ReadAgentToken(s.Dir)
	if err != nil || tok == nil {
		return err
	}
	boxes, err := h.d.Boxes()
	if err != nil {
		return err
	}
	for _, b := range boxes {
		if filepath.Dir(b.Dir) != h.layout.Boxes() || !slices.ContainsFunc(domain.AgentTokens(b.Dir), func(t []byte) bool { return bytes.Equal(t, tok) }) {
			continue
		}
		if err := h.d.RetireAgentToken(ctx, b.Name, tok); err != nil {
			return fmt.Errorf("snapshot %q holds the agent token of box %s (an older kvbox took it), which must get a new one before the snapshot leaves this host: %w", s.Name, b.Name, err)
		}
	}
	return nil
}
