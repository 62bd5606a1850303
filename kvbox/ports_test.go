package kvbox

import (
	"errors"
	"testing"

	"kvbox.dev/kvbox/base"
)

func TestParsePort(t *testing.T) {
	for in, want := range map[string]Port{
		"8080:8000":           {"127.0.0.1", 8080, 8000},
		"0.0.0.0:8080:8000":   {"0.0.0.0", 8080, 8000},
		"[::1]:2222:22":       {"::1", 2222, 22},
		"0:80":                {"127.0.0.1", 0, 80},
		"10.1.2.3:65535:1":    {"10.1.2.3", 65535, 1},
		"127.0.0.1:8081:8000": {"127.0.0.1", 8081, 8000},
	} {
		got, err := ParsePort(in)
		if err != nil || got != want {
			t.Errorf("%q: %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, in := range []string{"", "8080", "8080:0", "8080:70000", "x:8080:80", "[::1:80:80", "a:b", "-1:80", "host.example:80:80"} {
		if _, err := ParsePort(in); !errors.Is(err, base.ErrInvalid) {
			t.Errorf("%q: %v, want a usage error", in, err)
		}
	}
	if _, err := ParsePorts([]string{"8080:80", "127.0.0.1:8080:81"}); !errors.Is(err, base.ErrInvalid) {
		t.Errorf("the same host port twice: %v", err)
	}
}
