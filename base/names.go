package base

import (
	"fmt"
	"regexp"
	"strconv"
	"strings"
)

// MaxNameLen bounds box, snapshot and image names: they become libvirt domain
// names, guest hostnames (63 bytes) and folder names.
const MaxNameLen = 63

var nameRE = regexp.MustCompile(`^[a-zA-Z0-9][a-zA-Z0-9_.-]*$`)

// ValidName checks a box, snapshot, image or group name.
func ValidName(name string) error {
	switch {
	case name == "":
		return Errorf(Invalid, "a name must not be empty")
	case len(name) > MaxNameLen:
		return Errorf(Invalid, "name %q is %d characters long; at most %d are allowed", name, len(name), MaxNameLen)
	case strings.Contains(name, ".."):
		return Errorf(Invalid, "name %q must not contain \"..\"", name)
	case !nameRE.MatchString(name):
		return Errorf(Invalid, "name %q may only hold letters, digits, '-', '_' and '.', and must start with a letter or digit", name)
	}
	return nil
}

// ValidHostname checks a guest hostname as the agent takes it: labels of
// letters, digits and '-' (none first or last) joined by dots, at most 64
// characters in all.
func ValidHostname(h string) error {
	bad := len(h) == 0 || len(h) > 64
	for _, label := range strings.Split(h, ".") {
		if bad {
			break
		}
		bad = label == "" || label[0] == '-' || label[len(label)-1] == '-' || !hostLabelRE.MatchString(label)
	}
	if bad {
		return Errorf(Invalid, "hostname %q: want letters, digits, '-' and '.', at most 64 characters", h)
	}
	return nil
}

var hostLabelRE = regexp.MustCompile(`^[a-zA-Z0-9-]+$`)

// ParseSize reads a size like 512M, 4G, 4GiB, 1.5G or plain bytes.
// Suffixes are binary (K = 1024).
func ParseSize(s string) (int64, error) {
	orig := s
	s = strings.TrimSpace(strings.ToUpper(s))
	s = strings.TrimSuffix(strings.TrimSuffix(s, "IB"), "B")
	mult := int64(1)
	if n := len(s); n > 0 {
		switch s[n-1] {
		case 'K':
			mult = 1 << 10
		case 'M':
			mult = 1 << 20
		case 'G':
			mult = 1 << 30
		case 'T':
			mult = 1 << 40
		}
		if mult != 1 {
			s = s[:n-1]
		}
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f <= 0 || f != f || f*float64(mult) > 1<<50 {
		return 0, Errorf(Invalid, "size %q is not a positive size like 512M, 4G or a number of bytes", orig)
	}
	return int64(f * float64(mult)), nil
}

// FormatSize prints bytes the way people write sizes: 4 GB, 512 MB, 3.2 GB.
func FormatSize(b int64) string {
	const unit = 1024
	if b < unit {
		return fmt.Sprintf("%d B", b)
	}
	div, exp := int64(unit), 0
	for n := b / unit; n >= unit; n /= unit {
		div *= unit
		exp++
	}
	v := float64(b) / float64(div)
	suffix := "KMGTPE"[exp : exp+1]
	if v == float64(int64(v)) || v >= 100 {
		return fmt.Sprintf("%.0f %sB", v, suffix)
	}
	return fmt.Sprintf("%.1f %sB", v, suffix)
}
