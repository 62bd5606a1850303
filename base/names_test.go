package base

import (
	"errors"
	"strings"
	"testing"
)

func TestValidName(t *testing.T) {
	for _, tc := range []struct {
		name string
		ok   bool
	}{
		{"dev", true}, {"agent-1", true}, {"a.b_c", true}, {strings.Repeat("a", 63), true},
		{"", false}, {strings.Repeat("a", 64), false}, {"a/b", false}, {"a b", false},
		{"..", false}, {"a..b", false}, {".hidden", false}, {"-x", false}, {"ünï", false}, {"a\nb", false},
	} {
		err := ValidName(tc.name)
		if (err == nil) != tc.ok {
			t.Errorf("ValidName(%q) = %v, want ok=%v", tc.name, err, tc.ok)
		}
		if err != nil && (!errors.Is(err, ErrInvalid) || KindOf(err) != Invalid) {
			t.Errorf("ValidName(%q) error is not of kind Invalid", tc.name)
		}
		if err != nil && strings.Contains(err.Error(), "invalid") {
			t.Errorf("ValidName(%q) = %q: the kind is glued into the message", tc.name, err)
		}
	}
}

func TestParseSize(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
	}{
		{"512M", 512 << 20}, {"4G", 4 << 30}, {"4GiB", 4 << 30}, {"4gb", 4 << 30}, {"1.5G", 3 << 29},
		{"1048576", 1 << 20}, {"2T", 2 << 40}, {"64k", 64 << 10},
	} {
		got, err := ParseSize(tc.in)
		if err != nil || got != tc.want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", tc.in, got, err, tc.want)
		}
	}
	for _, bad := range []string{"", "G", "-1G", "0", "abc", "4X", "1e30", "NaN", "4 G B"} {
		if got, err := ParseSize(bad); err == nil {
			t.Errorf("ParseSize(%q) = %d, want an error", bad, got)
		}
	}
}

func TestFormatSize(t *testing.T) {
	for in, want := range map[int64]string{4 << 30: "4 GB", 512 << 20: "512 MB", 412 << 20: "412 MB", 3 << 29: "1.5 GB", 100: "100 B"} {
		if got := FormatSize(in); got != want {
			t.Errorf("FormatSize(%d) = %q, want %q", in, got, want)
		}
	}
}

// A hostname is checked as the guest's agent checks it, so a clone is
// refused before it is made, not by its agent halfway.
func TestValidHostname(t *testing.T) {
	for h, ok := range map[string]bool{
		"web-0": true, "a.b-c.d": true, "A1": true, strings.Repeat("a", 64): true,
		"": false, strings.Repeat("a", 65): false, "-web": false, "web-": false, "a..b": false, ".a": false,
		"web_0": false, "web 0": false, "wéb": false, "a\nb": false,
	} {
		err := ValidHostname(h)
		if (err == nil) != ok {
			t.Errorf("ValidHostname(%q) = %v, want ok %v", h, err, ok)
		}
		if err != nil && KindOf(err) != Invalid {
			t.Errorf("ValidHostname(%q): kind %v, want Invalid", h, KindOf(err))
		}
	}
}
