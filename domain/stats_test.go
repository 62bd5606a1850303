package domain

import "testing"

// Rss and Anonymous are read in bytes; the other lines, and lines that are
// not "Key: N kB", are left alone.
func TestSmapsRollup(t *testing.T) {
	in := `55d1c0a00000-7ffd2b9fe000 ---p 00000000 00:00 0                          [rollup]
Rss:              524288 kB
Pss:              300000 kB
Pss_Anon:         100000 kB
Anonymous:        131072 kB
LazyFree:              0 kB
Swap:                 12 kB
bogus line
`
	rss, anon := smapsRollup([]byte(in))
	if rss != 512<<20 || anon != 128<<20 {
		t.Errorf("rss %d, anon %d; want %d, %d", rss, anon, 512<<20, 128<<20)
	}
}
