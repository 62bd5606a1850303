package agent

import (
	"fmt"
	"slices"
	"sort"
	"sync"
)

// Optional operations an agent may know, reported by Ping in
// Info.Features. The host asks before it relies on one, so that a new host
// talking to an old agent (inside an old snapshot) says what is missing
// instead of having its request half-understood: an old agent ignores
// fields it does not know, and would run a --user command as root.
const (
	// FeatureExecUser: ExecRequest.User and ExecRequest.EnvAdd.
	FeatureExecUser = "exec-user"
	// FeatureFiles: the agent's own file helpers (CopyIn, CopyOut).
	FeatureFiles = "files"
)

var (
	featuresMu sync.Mutex
	features   = map[string]bool{}
)

// registerFeature is called from the init of the file that implements it.
func registerFeature(name string) {
	featuresMu.Lock()
	defer featuresMu.Unlock()
	features[name] = true
}

// Features lists what this agent knows, sorted.
func Features() []string {
	featuresMu.Lock()
	defer featuresMu.Unlock()
	var l []string
	for f := range features {
		l = append(l, f)
	}
	sort.Strings(l)
	return l
}

// Has reports whether the agent that sent in knows feature f.
func (in Info) Has(f string) bool { return slices.Contains(in.Features, f) }

// ErrTooOld is wrapped by Require when the agent lacks a feature.
var ErrTooOld = fmt.Errorf("the guest agent is too old")

// Require returns an error naming what is missing unless the agent knows
// every feature in fs.
func (in Info) Require(what string, fs ...string) error {
	for _, f := range fs {
		if !in.Has(f) {
			return fmt.Errorf("%w for %s (agent %s lacks %q): boxes and snapshots made from an image built with this kvbox's agent have it (kvbox images build --agent)",
				ErrTooOld, what, in.Version, f)
		}
	}
	return nil
}

func init() { registerFeature(FeatureExecUser) }
