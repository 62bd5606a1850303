package agent

import (
	"fmt"
	"time"
)

// killGrace is how long Exec waits for the exit after killing a command
// whose timeout passed.
const killGrace = 10 * time.Second

// TimeoutError is Exec's error when ExecRequest.Timeout passed: the
// command's process group was killed (SIGKILL) and has exited.
type TimeoutError struct{ After time.Duration }

func (e *TimeoutError) Error() string {
	return fmt.Sprintf("timed out after %s: the command's process group was killed", e.After)
}
