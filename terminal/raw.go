package terminal

import (
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"golang.org/x/term"
)

// IsTerminal says f is a terminal.
func IsTerminal(f *os.File) bool { return term.IsTerminal(int(f.Fd())) }

// Raw puts the terminal f in raw mode, for a session on a terminal
// elsewhere (a box's), and tells resized its new size on each window
// change until restore, which puts the terminal back as it was. rows and
// cols are its size now (0 when unknown).
func Raw(f *os.File, resized func(rows, cols uint16)) (rows, cols uint16, restore func(), err error) {
	fd := int(f.Fd())
	if w, h, err := term.GetSize(fd); err == nil {
		rows, cols = uint16(h), uint16(w)
	}
	old, err := term.MakeRaw(fd)
	if err != nil {
		return 0, 0, nil, fmt.Errorf("put the terminal in raw mode: %w", err)
	}
	winch := make(chan os.Signal, 1)
	done := make(chan struct{})
	signal.Notify(winch, syscall.SIGWINCH)
	go func() {
		for {
			select {
			case <-done:
				return
			case <-winch:
				if w, h, err := term.GetSize(fd); err == nil {
					resized(uint16(h), uint16(w))
				}
			}
		}
	}()
	return rows, cols, func() {
		signal.Stop(winch)
		close(done)
		term.Restore(fd, old)
	}, nil
}
