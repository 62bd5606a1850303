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
// another group is on already (under the old 32-bit naming, group-22235 and
// group-30796 had one) is refused with one line, before anything is made.
func TestNewGroupBridgeFree(t *testing.T) {
	a, b := "group-22235", "group-30796"
	old := []Box{{Name: "api", Meta: Meta{Group: a, Bridge: network.LegacyGroupBridge(a)}}}
	if err := bridgeFree(old, b, network.GroupBridge(b)); err != nil {
		t.Errorf("a group beside one on an old bridge whose old name it shared: %v", err)
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

// A box an older kvbox put in a group keeps its bridge (the old name).
func TestGroupOfLegacyBridge(t *testing.T) {
	h := &Host{StateDir: statedir.Default}
	for _, br := range []string{network.LegacyGroupBridge("web"), network.GroupBridge("web")} {
		nc, err := h.groupOf(Box{Name: "api", Meta: Meta{Group: "web", Bridge: br, Gateway: "172.30.5.1", Prefix: 24}})
		if err != nil || nc.Bridge != br || nc.Group != "web" {
			t.Errorf("bridge %s: %+v, %v", br, nc, err)
		}
	}
	if _, err := h.groupOf(Box{Name: "api", Meta: Meta{Group: "web", Bridge: "kvbox0", Gateway: "172.30.5.1", Prefix: 24}}); err == nil {
		t.Errorf("a group box's metadata naming another bridge is taken")
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
