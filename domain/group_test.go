package domain

import (
	"errors"
	"strings"
	"testing"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/network"
	"kvbox.dev/kvbox/statedir"
)

// Two groups never share a bridge: a new group whose bridge name a box of
// another group is on already is refused with one line, before anything
// is made.
func TestNewGroupBridgeFree(t *testing.T) {
	a, b := "group-22235", "group-30796"
	other := []Box{{Name: "api", Meta: Meta{Group: a, Bridge: network.GroupBridge(a)}}}
	if err := bridgeFree(other, b, network.GroupBridge(b)); err != nil {
		t.Errorf("a group beside another group's box on its own bridge: %v", err)
	}
	// Were the new names to agree: the box's bridge is the new group's.
	clash := []Box{{Name: "api", Meta: Meta{Group: a, Bridge: network.GroupBridge(b)}}}
	err := bridgeFree(clash, b, network.GroupBridge(b))
	if !errors.Is(err, base.ErrInvalid) || !strings.Contains(err.Error(), a) || strings.Contains(err.Error(), "\n") {
		t.Errorf("a group whose bridge another group's box is on: %v", err)
	}
	if err := bridgeFree(clash, a, network.GroupBridge(b)); err != nil {
		t.Errorf("a group's own box: %v", err)
	}
}

// A group's box is on its group's bridge; metadata naming another bridge
// (kvbox's main one, another group's) is refused.
func TestGroupOfBridge(t *testing.T) {
	h := &Host{StateDir: statedir.Default}
	br := network.GroupBridge("web")
	nc, err := h.groupOf(Box{Name: "api", Meta: Meta{Group: "web", Bridge: br, Gateway: "172.30.5.1", Prefix: 24}})
	if err != nil || nc.Bridge != br || nc.Group != "web" {
		t.Errorf("bridge %s: %+v, %v", br, nc, err)
	}
	for _, other := range []string{"kvbox0", network.GroupBridge("api")} {
		if _, err := h.groupOf(Box{Name: "api", Meta: Meta{Group: "web", Bridge: other, Gateway: "172.30.5.1", Prefix: 24}}); err == nil {
			t.Errorf("a group box's metadata naming bridge %s is taken", other)
		}
	}
}

// The groups of one name of two state dirs are two networks: two bridges,
// each marked as its own state dir's, which the other's prune leaves.
func TestGroupsOfTwoStateDirs(t *testing.T) {
	a, b := &Host{StateDir: statedir.Default}, &Host{StateDir: "/var/lib/kvbox-b/"}
	ka, kb := a.groupKey("web"), b.groupKey("web")
	if ka == kb || network.GroupBridge(ka) == network.GroupBridge(kb) {
		t.Fatalf("group web of two state dirs: keys %q %q, bridges %s %s", ka, kb, network.GroupBridge(ka), network.GroupBridge(kb))
	}
	if ka != "web" || network.GroupBridge(ka) != network.GroupBridge("web") {
		t.Errorf("the default state dir's group web has key %q: its bridge changed", ka)
	}
	for _, tc := range []struct {
		h    *Host
		key  string
		owns bool
	}{{a, ka, true}, {a, kb, false}, {b, kb, true}, {b, ka, false}, {b, "web@/var/lib/kvbox-bb", false}} {
		if got := tc.h.ownsGroupKey(tc.key); got != tc.owns {
			t.Errorf("state dir %s owns group key %q: %v, want %v", tc.h.StateDir, tc.key, got, tc.owns)
		}
	}
	bx := Box{Name: "api", Meta: Meta{Group: "web", Bridge: network.GroupBridge(kb), Gateway: "172.30.5.1", Prefix: 24, Dir: "/var/lib/kvbox-b/boxes/api"}}
	if nc, err := b.groupOf(bx); err != nil || nc.Group != kb {
		t.Errorf("state dir b's group box: %+v %v", nc, err)
	}
	if _, err := a.groupOf(bx); err == nil {
		t.Error("the default state dir takes another's group bridge for its group web's")
	}
}
