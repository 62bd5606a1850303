package kvbox

import (
	"context"
	"errors"
	"sync"
	"testing"

	"kvbox.dev/kvbox/base"
)

// RemoveMany removes each named box once, tells each outcome, and fails
// naming the boxes it could not remove with the first failure's kind;
// with force a name that is no box is no failure.
func TestRemoveMany(t *testing.T) {
	k, h := testDriverHost(t)
	ctx := context.Background()
	names := []string{"kvbox-unit-rm-a", "kvbox-unit-rm-b"}
	t.Cleanup(func() {
		for _, n := range names {
			if d, err := h.Conn().LookupDomainByName(n); err == nil {
				d.Undefine()
				d.Free()
			}
		}
	})
	for _, force := range []bool{false, true} {
		for _, n := range names {
			defineTestBox(t, h, n, nil)
		}
		var mu sync.Mutex
		told := map[string]error{}
		err := k.RemoveMany(ctx, []string{names[0], "kvbox-unit-rm-none", names[1], names[0]}, force, func(o Outcome) {
			mu.Lock()
			defer mu.Unlock()
			if _, again := told[o.Name]; again {
				t.Errorf("force %v: %s told twice", force, o.Name)
			}
			told[o.Name] = o.Err
		})
		for _, n := range names {
			if e, ok := told[n]; !ok || e != nil {
				t.Errorf("force %v: %s: told %v (%v), want removed", force, n, ok, e)
			}
			if _, gerr := h.Get(n); !errors.Is(gerr, base.ErrNotFound) {
				t.Errorf("force %v: %s is still there: %v", force, n, gerr)
			}
		}
		e, missingTold := told["kvbox-unit-rm-none"]
		var many *ManyError
		switch {
		case force && (err != nil || missingTold):
			t.Errorf("force: a name that is no box: %v (told %v), want skipped", err, missingTold)
		case !force && (!errors.As(err, &many) || many.Msg != "could not remove kvbox-unit-rm-none" || KindOf(err) != base.NotFound):
			t.Errorf("no force: %v (kind %v), want could not remove kvbox-unit-rm-none of kind NotFound", err, KindOf(err))
		case !force && KindOf(e) != base.NotFound:
			t.Errorf("no force: the missing box told %v", e)
		}
		if want := map[bool]int{false: 3, true: 2}[force]; len(told) != want {
			t.Errorf("force %v: told %d outcomes, want %d: %v", force, len(told), want, told)
		}
	}
}
