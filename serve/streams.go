package serve

import (
	"context"
	"net"
	"net/http"
	"strconv"
	"time"
)

// A box's streams: every HTTP connection serve makes to a box is a stream
// through its agent (Host.Dial), and the agent carries a bounded number of
// them per connection, part of which it keeps for envd. Requests to envd
// come from the sandbox's owner (its access token is checked first, but
// for GET /health); requests to its other ports come from whoever has the
// URL (E2B's default: no credential, see docs/e2b.md). So:
//
//   - a stream to a port other than envd's ends with its request: the
//     transport keeps none idle (an idle one would hold an agent stream
//     for whoever asked last), and one whose client went is closed, which
//     ends it through the agent both ways (guest-agent/stream.go);
//   - at most PortRequests requests to those ports are in flight per box
//     at once; past them serve answers 503, so that they cannot take all
//     of the agent's streams;
//   - envd's transport keeps a few idle streams, bounded in all.

const (
	// defaultPortRequests is Config.PortRequests' default. It is below the
	// agent's cap for streams to guest ports, so that serve's clear answer
	// comes before the agent refuses a dial, with room left for streams
	// that end a moment after their request (the agent's close waits for
	// the guest to take the last bytes), and it is well above what the
	// browsers of a few users of an app open at once.
	defaultPortRequests = 128
	// envdIdle bounds the idle streams kept to a box's envd (in all, not
	// per host: MaxIdleConnsPerHost alone bounds one host:port, and a
	// MaxIdleConns of zero is no bound). Each holds one of the agent's
	// streams kept for envd; a few save the SDK's next calls a dial.
	envdIdle = 16
	// envdIdleTimeout: an SDK busy with a sandbox calls again sooner than
	// this; the streams of one that stopped go.
	envdIdleTimeout = 30 * time.Second
)

// boxStreams is what serve holds of one box instance's streams: a
// transport to its envd, one to its other ports, and the slots of the
// requests in flight to those. A new box of the name gets others, so no
// connection is ever reused across boxes.
type boxStreams struct {
	envd, ports *http.Transport
	slots       chan struct{}
}

// transport makes the streams of box id.
func (s *Server) transport(id string) *boxStreams {
	dial := func(ctx context.Context, _, addr string) (net.Conn, error) {
		target := addr
		if h, _, err := net.SplitHostPort(addr); err == nil && h == envdHost {
			target = envdHost
		}
		return s.host.Dial(ctx, id, target)
	}
	return &boxStreams{
		envd: &http.Transport{
			DialContext: dial,
			// Responses are passed on as they are.
			DisableCompression:  true,
			MaxIdleConns:        envdIdle,
			MaxIdleConnsPerHost: envdIdle,
			IdleConnTimeout:     envdIdleTimeout,
		},
		ports: &http.Transport{
			DialContext:        dial,
			DisableCompression: true,
			// A stream is closed once its request is done.
			DisableKeepAlives: true,
		},
		slots: make(chan struct{}, s.cfg.PortRequests),
	}
}

// CloseIdleConnections closes the idle streams (envd's: the ports keep
// none).
func (b *boxStreams) CloseIdleConnections() {
	b.envd.CloseIdleConnections()
	b.ports.CloseIdleConnections()
}

// take takes a slot for a request to a port other than envd's; release
// gives it back. ok is false when every slot is taken.
func (b *boxStreams) take() (release func(), ok bool) {
	select {
	case b.slots <- struct{}{}:
		return func() { <-b.slots }, true
	default:
		return nil, false
	}
}

// portsBusy answers a request to a port of a sandbox whose ports have
// every slot taken, in E2B's proxy's JSON.
func portsBusy(w http.ResponseWriter, id string, port, n int) {
	w.Header().Set("Retry-After", "1")
	writeJSON(w, http.StatusServiceUnavailable, map[string]any{"sandboxId": id, "code": http.StatusServiceUnavailable,
		"message": "the sandbox's ports have " + strconv.Itoa(n) + " requests in flight, kvbox serve's bound: try again later",
		"port":    strconv.Itoa(port)})
}
