package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
)

func runTest(args ...string) (code int, stdout, stderr string) {
	var out, errb bytes.Buffer
	code = run(context.Background(), args, IO{In: strings.NewReader(""), Out: &out, Err: &errb})
	return code, out.String(), errb.String()
}

// Input a user can get wrong is refused before kvbox touches libvirt, with
// one line and the usage exit code.
func TestBadInputNeedsNoHost(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"new"}, "takes one box name"},
		{[]string{"new", "a", "b"}, "takes one box name"},
		{[]string{"new", "a/b"}, "may only hold"},
		{[]string{"new", ""}, "must not be empty"},
		{[]string{"new", "--memory", "4X", "dev"}, "not a positive size"},
		{[]string{"new", "--disk", "-8G", "dev"}, "not a positive size"},
		{[]string{"new", "--cpus", "two", "dev"}, "invalid argument"},
		{[]string{"exec", "dev"}, "a box name and a command"},
		{[]string{"ls", "extra"}, "takes no arguments"},
		{[]string{"ls", "--bogus"}, "unknown flag"},
		{[]string{"images", "import", "x"}, "an image name and a disk file"},
		{[]string{"images", "import", "x", "d", "--agent", "maybe"}, "--agent takes yes, no or unknown"},
		{[]string{"snapshots", "new", "dev"}, "a box name and a snapshot name"},
		{[]string{"--domain-type", "xen", "ls"}, "give auto, kvm or qemu"},
		{[]string{"--subnet", "nonsense", "ls"}, "not an IPv4 prefix"},
	} {
		code, _, stderr := runTest(tc.args...)
		if code != exitUsage || !strings.Contains(stderr, tc.want) || strings.Count(stderr, "\n") != 1 {
			t.Errorf("kvbox %q: exit %d, stderr %q; want exit %d and one line with %q", tc.args, code, stderr, exitUsage, tc.want)
		}
	}
}

func TestHelpHasExamples(t *testing.T) {
	root := (&app{}).newRoot()
	for _, c := range root.Commands() {
		for _, sub := range append(c.Commands(), c) {
			if sub.Runnable() && sub.Example == "" && sub.Name() != "help" && sub.Name() != "completion" {
				t.Errorf("kvbox %s has no example in its help", sub.CommandPath())
			}
		}
	}
}
