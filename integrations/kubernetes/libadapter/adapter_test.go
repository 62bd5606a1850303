package libadapter

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/snapshot"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
)

// The library's error kinds reach the provider as kvboxnode's errors, the
// library's one line unchanged (a pod's status shows it as it is).
func TestKind(t *testing.T) {
	incompat := snapshot.Compat{DomainType: "kvm"}.Check(nil, "qemu")
	for _, tc := range []struct {
		err  error
		want error
	}{
		{base.Errorf(base.NotFound, "box %q not found", "web"), kvboxnode.ErrNotFound},
		{base.Errorf(base.Exists, "box %q exists", "web"), kvboxnode.ErrExists},
		{base.Errorf(base.Busy, "snapshot %q has clones", "warm"), kvboxnode.ErrBusy},
		{fmt.Errorf("snapshot %q: %w", "warm", incompat), kvboxnode.ErrIncompatible},
	} {
		got := kind(tc.err)
		if !errors.Is(got, tc.want) || got.Error() != tc.err.Error() {
			t.Errorf("kind(%q) = %q, errors.Is %v: %v", tc.err, got, tc.want, errors.Is(got, tc.want))
		}
	}
	if got := kind(incompat); strings.Count(got.Error(), "incompatible host") != 1 {
		t.Errorf("refusal %q", got)
	}
	if kind(nil) != nil {
		t.Error("kind(nil) is not nil")
	}
	other := errors.New("libvirt: broken pipe")
	if got := kind(other); got != other {
		t.Errorf("kind of an error of no kind: %v", got)
	}
}
