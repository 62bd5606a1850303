// Package progress is how a long operation tells whoever asked for it how
// it goes: the kvbox library and the packages under it report to a
// Reporter, and each front shows it its own way (the CLI's terminal draws
// a line a stage; a server may log, or show nothing).
package progress

// Reporter is told how a long operation goes. Its methods may be called
// from several goroutines at once.
type Reporter interface {
	// Log is a line for a person, between stages: what happened, what
	// the operation waits for.
	Log(line string)
	// Stage starts a step that runs for a while (a build's stage, a part
	// of a transfer, the save of a box's memory); several may run at once.
	Stage(name string) Stage
}

// Stage is a step in progress; End it when it is over.
type Stage interface {
	// Status says what the step does now (the last line of a tool, how
	// much memory is copied).
	Status(s string)
	// Bytes says how far the step's bytes are; total is negative while
	// unknown.
	Bytes(done, total int64)
	// End ends the step: it is no longer shown.
	End()
}

// Of is r, or a Reporter that shows nothing when r is nil.
func Of(r Reporter) Reporter {
	if r == nil {
		return none{}
	}
	return r
}

type none struct{}

func (none) Log(string)         {}
func (none) Stage(string) Stage { return none{} }
func (none) Status(string)      {}
func (none) Bytes(int64, int64) {}
func (none) End()               {}
