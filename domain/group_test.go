package domain

import (
	"errors"
	"strings"
	"testing"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/network"
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
	for _, br := range []string{network.LegacyGroupBridge("web"), network.GroupBridge("web")} {
		nc, err := groupOf(Box{Name: "api", Meta: Meta{Group: "web", Bridge: br, Gateway: "172.30.5.1", Prefix: 24}})
		if err != nil || nc.Bridge != br || nc.Group != "web" {
			t.Errorf("bridge %s: %+v, %v", br, nc, err)
		}
	}
	if _, err := groupOf(Box{Name: "api", Meta: Meta{Group: "web", Bridge: "kvbox0", Gateway: "172.30.5.1", Prefix: 24}}); err == nil {
		t.Errorf("a group box's metadata naming another bridge is taken")
	}
}
