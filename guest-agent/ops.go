package agent

import (
	"encoding/json"
	"fmt"
)

// The agent's operations: each method a host may call is registered once,
// from the init of the file that implements it (registerOp), with what it
// needs of the session and its handler, and session.request serves a
// request by looking its method up here. The helper modes of the agent's
// binary (what an exec of selfArgv0 runs) are registered the same way
// (registerHelper), and cmd/kvbox-agent looks its argv[1] up (Helper).

// access is what an operation needs of its session. The zero value asks
// for authorization: an operation that says nothing is never served before
// it.
type access uint8

const (
	// authorizedOnly: served to a session that presented the agent's
	// token (session.authorized); any other is answered ErrUnauthorized.
	authorizedOnly access = iota
	// beforeAuth: served to any session, authorized or not (ping, auth).
	beforeAuth
	// ownCheck: served to any session, and the handler decides whether
	// it may be (set-token asks session.authorized itself, after its
	// parameters).
	ownCheck
)

// opHandler serves one request of its method: gen is the session's
// generation when the request was read, id the request's frame id.
// It runs on the session's reader goroutine, which is where the session's
// authorization is kept: it answers (session.reply) before it returns or
// from goroutines of its own, and must not block the reader on slow work.
type opHandler func(ss *session, gen uint64, id uint32, params json.RawMessage)

type op struct {
	access access
	serve  opHandler
}

// opTable maps a method name to its operation.
type opTable map[string]op

// add registers an operation; a method registered twice is a programming
// error, found when the agent starts.
func (t opTable) add(method string, a access, serve opHandler) {
	if _, dup := t[method]; dup {
		panic(fmt.Sprintf("agent: operation %q registered twice", method))
	}
	t[method] = op{access: a, serve: serve}
}

// ops is the agent's operations, filled by init functions only
// (registerOp) and read-only once the agent runs.
var ops = opTable{}

// registerOp is called from the init of the file that implements method.
func registerOp(method string, a access, serve opHandler) { ops.add(method, a, serve) }

// request serves a request frame: the method looked up, its access
// checked, its handler called. A method the agent does not know is
// unauthorized to a session that is not authorized, and answered
// "unknown method" to one that is: hosts match that text to tell an older
// agent (Client.SetToken, Client.Reidentify, Forwarder.Connect).
func (ss *session) request(f frame) {
	gen := ss.gen.Load()
	var req request
	if err := json.Unmarshal(f.Payload, &req); err != nil {
		ss.reply(gen, f.ID, nil, fmt.Errorf("bad request: %v", err))
		return
	}
	o, known := ops[req.Method]
	if (!known || o.access == authorizedOnly) && !ss.authorized() {
		ss.reply(gen, f.ID, nil, ErrUnauthorized)
		return
	}
	if !known {
		ss.reply(gen, f.ID, nil, fmt.Errorf("unknown method %q", req.Method))
		return
	}
	o.serve(ss, gen, f.ID, req.Params)
}

// helpers are the agent binary's other mains, by their argv[1].
var helpers = map[string]func(args []string) int{}

// registerHelper is called from the init of the file that implements the
// helper run as the agent's binary with argv[1] arg.
func registerHelper(arg string, main func(args []string) int) {
	if _, dup := helpers[arg]; dup {
		panic(fmt.Sprintf("agent: helper %q registered twice", arg))
	}
	helpers[arg] = main
}

// Helper is the main of the agent binary run with argv[1] arg
// (FilesHelperArg, HooksHelperArg): it takes the arguments after arg and
// returns the exit code. It is nil for any other arg (the agent itself).
func Helper(arg string) func(args []string) int { return helpers[arg] }
