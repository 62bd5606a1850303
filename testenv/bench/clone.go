package main

import (
	"context"
	"fmt"
	"time"

	"kvbox.dev/kvbox/domain"
)

// removes holds how long each `kvbox rm --force` of a running clone took.
var removes []time.Duration

// timedRemove removes a running clone as `kvbox rm --force` does and
// records how long it took.
func timedRemove(ctx context.Context, h *domain.Host, name string) error {
	t0 := time.Now()
	err := h.Remove(ctx, name, true)
	removes = append(removes, time.Since(t0))
	return err
}

// printRemoves prints the median rm of a running clone, and its ratio to
// the median warm clone measured in the same run.
func printRemoves(clone time.Duration) {
	if len(removes) == 0 {
		return
	}
	m := median(removes)
	fmt.Printf("rm --force of a running clone (median of %d) %5.0f ms   (clone + rm %0.f ms; rm/clone %.2f)\n",
		len(removes), ms(m), ms(clone+m), float64(m)/float64(clone))
}
