package benchstat

import (
	"testing"
	"time"
)

func TestPct(t *testing.T) {
	ds := []time.Duration{5, 1, 4, 2, 3, 10, 9, 8, 7, 6}
	for _, tc := range []struct{ p, want int }{{50, 5}, {90, 9}, {100, 10}, {1, 1}, {0, 1}} {
		if got := Pct(ds, tc.p); got != time.Duration(tc.want) {
			t.Errorf("Pct(%d) = %d, want %d", tc.p, got, tc.want)
		}
	}
	if Pct(nil, 50) != 0 {
		t.Error("Pct of none is not 0")
	}
	if ds[0] != 5 {
		t.Error("Pct sorted its argument")
	}
	if Ms(1500*time.Microsecond) != 1.5 {
		t.Errorf("Ms(1.5ms) = %v", Ms(1500*time.Microsecond))
	}
}
