package main

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/domain"
	"kvbox.dev/kvbox/kvbox"
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
		{[]string{"new", "--count", "0", "agent"}, "give 1 or more"},
		{[]string{"new", "--count", "2", strings.Repeat("x", 62)}, "characters long"},
		{[]string{"new", "--count", "2", "a/b"}, "may only hold"},
		{[]string{"exec", "dev"}, "a box name and a command"},
		{[]string{"cp", "--max-size", "0", "dev:/x", "."}, "--max-size \"0\" is not a size"},
		{[]string{"cp", "--max-size", "lots", "dev:/x", "."}, "--max-size \"lots\" is not a size"},
		{[]string{"ls", "extra"}, "takes no arguments"},
		{[]string{"ls", "--bogus"}, "unknown flag"},
		{[]string{"images", "import", "x"}, "an image name and a disk file"},
		{[]string{"images", "import", "x", "d", "--agent", "maybe"}, "--agent takes yes, no or unknown"},
		{[]string{"images", "build", "ubuntu"}, "two images, debian and code-interpreter"},
		{[]string{"snapshots", "new", "dev"}, "a box name and a snapshot name"},
		{[]string{"--domain-type", "xen", "ls"}, `--domain-type "xen": give auto, kvm or qemu`},
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
			if sub.Runnable() && !sub.HasSubCommands() && sub.Example == "" && sub.Name() != "help" && sub.Name() != "completion" && c.Name() != "completion" {
				t.Errorf("kvbox %s has no example in its help", sub.CommandPath())
			}
		}
	}
}

// An unknown command, at the top or in a group, is a usage error in one
// line: a script must not take it for success.
func TestUnknownCommandIsUsage(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"bogus"}, `unknown command "bogus" for "kvbox"`},
		{[]string{"snapshots", "bogus", "a", "b"}, `unknown command "bogus" for "kvbox snapshots"`},
		{[]string{"images", "bogus"}, `unknown command "bogus" for "kvbox images"`},
		{[]string{"network", "bogus"}, `unknown command "bogus" for "kvbox network"`},
		{[]string{"completion", "bogus"}, `unknown command "bogus" for "kvbox completion"`},
	} {
		code, stdout, stderr := runTest(tc.args...)
		if code != exitUsage || !strings.Contains(stderr, tc.want) || strings.Count(stderr, "\n") != 1 || stdout != "" {
			t.Errorf("kvbox %q: exit %d, stdout %q, stderr %q; want exit %d and one line with %q", tc.args, code, stdout, stderr, exitUsage, tc.want)
		}
	}
	// A group alone still shows its help.
	if code, stdout, _ := runTest("snapshots"); code != 0 || !strings.Contains(stdout, "Available Commands") {
		t.Errorf("kvbox snapshots: exit %d, stdout %q; want its help", code, stdout)
	}
}

// An error's kind picks the exit code and is not in its text: what kvbox
// prints is the sentence, and nothing is cut out of it.
func TestErrorKindsNotInText(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
		code int
	}{
		{domain.NoBoxError{Name: "nonexist"}, `box "nonexist" does not exist (kvbox ls lists boxes)`, exitNotFound},
		{base.Errorf(base.Busy, "box %q is paused", "a"), `box "a" is paused`, exitBusy},
		{usage("kvbox exec takes a box name"), "kvbox exec takes a box name", exitUsage},
		{errors.New("plain"), "plain", exitError},
	} {
		if got := tc.err.Error(); got != tc.want {
			t.Errorf("%q prints %q, want %q", tc.err, got, tc.want)
		}
		if got := exitCode(tc.err); got != tc.code {
			t.Errorf("%q exits %d, want %d", tc.err, got, tc.code)
		}
	}
	if exitCode(domain.NoBoxError{Name: "x"}) != exitNotFound {
		t.Error("a missing box does not exit with exitNotFound")
	}
	if exitCode(&kvbox.ManyError{Msg: "could not remove a", Cause: domain.NoBoxError{Name: "a"}}) != exitNotFound {
		t.Error("a failed rm does not keep its first failure's exit code")
	}
	if exitCode(base.Errorf(base.Interrupted, "x")) != exitInterrupted {
		t.Error("an interrupted lock wait does not exit 130")
	}
}

// A guest exit code no process can have is an error, never 0 by truncation.
func TestGuestExit(t *testing.T) {
	for code, want := range map[int]int{0: 0, 1: 1, 255: 255, 137: 137, 256: exitError, 512: exitError, -1: exitError} {
		got := 0
		if err := guestExit(code); err != nil {
			var ec exitCodeError
			if errors.As(err, &ec) {
				got = ec.code
			} else {
				got = exitCode(err)
			}
		}
		if got != want {
			t.Errorf("guest exit %d: kvbox exits %d, want %d", code, got, want)
		}
	}
}
