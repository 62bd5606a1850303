// Package benchstat is what kvbox's benches (testenv/bench, and the
// fleet's in integrations/kubernetes) summarise their timings with.
package benchstat

import (
	"slices"
	"time"
)

// Pct is the p-th percentile of ds (nearest rank); 0 for none.
func Pct(ds []time.Duration, p int) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := (p*len(s) + 99) / 100
	return s[max(0, min(len(s)-1, i-1))]
}

// Ms is d in milliseconds, to the microsecond.
func Ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
