package guestexec

import (
	"os/exec"
	"strings"
	"sync"
	"testing"
)

// Wire's pipes: stdout and stderr apart, stdin when asked (else none on
// the agent's side), and Pump reads each to its end.
func TestWirePipes(t *testing.T) {
	for _, withStdin := range []bool{true, false} {
		cmd := exec.Command("sh", "-c", "echo out; echo err >&2; cat")
		s, ends, err := Wire(cmd, false, 0, 0, withStdin)
		if err != nil {
			t.Fatal(err)
		}
		if s.PTY != nil || len(s.Outs) != 2 || (s.Stdin != nil) != withStdin || cmd.SysProcAttr == nil || !cmd.SysProcAttr.Setpgid {
			t.Fatalf("stdin %v: %+v, %+v", withStdin, s, cmd.SysProcAttr)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		ends.Close()
		if withStdin {
			s.Stdin.WriteString("in\n")
			s.Stdin.Close()
		}
		var d Drain
		got := make([]strings.Builder, 2)
		var wg sync.WaitGroup
		for i, f := range s.Outs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				d.Pump(f, 2, func(b []byte) bool { got[i].Write(b); return true })
			}()
		}
		wg.Wait()
		if err := cmd.Wait(); err != nil {
			t.Fatal(err)
		}
		want := "out\n"
		if withStdin {
			want += "in\n"
		}
		if got[0].String() != want || got[1].String() != "err\n" {
			t.Errorf("stdin %v: stdout %q, stderr %q", withStdin, got[0].String(), got[1].String())
		}
	}
}

// Pump stops when its reader says so.
func TestPumpStops(t *testing.T) {
	cmd := exec.Command("sh", "-c", "echo abcdef")
	s, ends, err := Wire(cmd, false, 0, 0, false)
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ends.Close()
	defer s.Close()
	n := 0
	var d Drain
	d.Pump(s.Outs[0], 2, func([]byte) bool { n++; return false })
	cmd.Wait()
	if n != 1 {
		t.Errorf("%d chunks after the reader said stop", n)
	}
}
