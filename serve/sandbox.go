package serve

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"time"

	agent "kvbox.dev/kvbox/guest-agent"
	"kvbox.dev/kvbox/guest-agent/envd"
)

// A sandbox is a box with these labels (its facts that are no secret).
const (
	// labelTemplate is the template (snapshot) as the SDK named it; a box
	// without it is no sandbox, and serve neither lists nor routes to it.
	labelTemplate = "e2b.template"
	// labelMetadata prefixes each key of the sandbox's metadata.
	labelMetadata = "e2b.metadata."
	// labelTimeout is the sandbox's timeout in seconds, which an
	// auto-resume gives it again.
	labelTimeout = "e2b.timeout"
	// labelAutoResume: a request to the paused sandbox resumes it.
	labelAutoResume = "e2b.auto-resume"
	// labelPaused is set (to pausedFilesystem) on the box of a sandbox
	// paused without its memory (pause with memory false): its box is shut
	// off, its disk kept, and connect cold-boots it.
	labelPaused      = "e2b.paused"
	pausedFilesystem = "filesystem"
)

func isSandbox(b Box) bool { return b.Labels[labelTemplate] != "" }

// metadataOf is a sandbox's metadata, from its labels.
func metadataOf(b Box) map[string]string {
	m := map[string]string{}
	for k, v := range b.Labels {
		if key, ok := strings.CutPrefix(k, labelMetadata); ok {
			m[key] = v
		}
	}
	return m
}

// templateID is the snapshot a sandbox was made from: for a fork, its
// source's.
func templateID(b Box) string {
	if t := b.Labels[labelTemplateID]; t != "" {
		return t
	}
	return b.Snapshot
}

// state is a sandbox's state in E2B's words.
func state(b Box) string {
	if isPaused(b) {
		return "paused"
	}
	return "running"
}

// diskPaused says b is the box of a sandbox paused without its memory: shut
// off, its disk kept, for connect to boot.
func diskPaused(b Box) bool {
	return b.State == Stopped && b.Labels[labelPaused] == pausedFilesystem
}

// isPaused says the sandbox is paused, with its memory (suspended) or
// without (diskPaused).
func isPaused(b Box) bool { return b.State == Suspended || diskPaused(b) }

// withLabel is labels with key set to value ("": without key).
func withLabel(labels map[string]string, key, value string) map[string]string {
	m := map[string]string{}
	for k, v := range labels {
		if k != key {
			m[k] = v
		}
	}
	if value != "" {
		m[key] = value
	}
	return m
}

// timeoutOf is the sandbox's timeout (labelTimeout), or def.
func timeoutOf(b Box, def time.Duration) time.Duration {
	if n, err := strconv.ParseInt(b.Labels[labelTimeout], 10, 64); err == nil && n > 0 {
		return time.Duration(n) * time.Second
	}
	return def
}

// endAt is when the sandbox times out; a paused one has no deadline.
func endAt(b Box) time.Time {
	if b.Expires != nil {
		return b.Expires.UTC()
	}
	return b.Created.UTC()
}

func (s *Server) sandboxJSON(b Box, rec record) sandboxJSON {
	j := sandboxJSON{TemplateID: templateID(b), SandboxID: b.Name, Alias: b.Labels[labelTemplate], ClientID: clientID,
		EnvdVersion: envd.Version, EnvdAccessToken: rec.AccessToken, Domain: s.cfg.Domain}
	if rec.TrafficToken != "" {
		t := rec.TrafficToken
		j.TrafficAccessToken = &t
	}
	return j
}

func listedOf(b Box) listedJSON {
	return listedJSON{TemplateID: templateID(b), Alias: b.Labels[labelTemplate], SandboxID: b.Name, ClientID: clientID,
		StartedAt: b.Created.UTC(), EndAt: endAt(b), CPUCount: max(b.CPUs, 1), MemoryMB: b.MemoryBytes >> 20, DiskSizeMB: b.DiskBytes >> 20,
		Metadata: metadataOf(b), State: state(b), EnvdVersion: envd.Version, VolumeMounts: []struct{}{}}
}

func (s *Server) detailOf(b Box, rec record) detailJSON {
	return detailJSON{listedJSON: listedOf(b), EnvdAccessToken: rec.AccessToken, Domain: s.cfg.Domain,
		AllowInternetAccess: !b.NoInternet,
		Lifecycle:           lifecycleJSON{AutoResume: b.Labels[labelAutoResume] == "true", OnTimeout: onTimeout(b)}}
}

// onTimeout is what the sandbox's timeout does, in E2B's words.
func onTimeout(b Box) string {
	if b.SuspendAtExpiry {
		return "pause"
	}
	return "kill"
}

// errGone is a sandbox serve cannot serve: no box of that id, a box that is
// no sandbox, or one stopped (dead to the SDK).
var errGone = errors.New("gone")

// lookup reads the sandbox's box from the host and keeps it: a sandbox
// that is gone is dropped (and its streams), a stopped one is errGone.
func (s *Server) lookup(ctx context.Context, id string) (Box, error) {
	if !validID(id) {
		return Box{}, errGone
	}
	b, err := s.host.Box(ctx, id)
	if errors.Is(err, ErrNotFound) || err == nil && !isSandbox(b) {
		s.drop(id)
		return Box{}, errGone
	}
	if err != nil {
		return Box{}, err
	}
	s.keep(b)
	if b.State == Stopped && !diskPaused(b) {
		return b, errGone
	}
	return b, nil
}

// cached is the sandbox's box as last seen, or read now. A sandbox that
// resumes itself is read each time: its timeout may have paused it (its
// reaper, behind serve's back), and a request must then resume it rather
// than find its streams gone.
func (s *Server) cached(ctx context.Context, id string) (Box, error) {
	s.mu.Lock()
	e := s.boxes[id]
	s.mu.Unlock()
	if e != nil && e.box.State == Running && e.box.Labels[labelAutoResume] != "true" {
		return e.box, nil
	}
	return s.lookup(ctx, id)
}

// keep records b as the sandbox's box; a box of another UUID (made anew
// under the name) gets new streams.
func (s *Server) keep(b Box) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return
	}
	e := s.boxes[b.Name]
	if e != nil && e.box.UUID == b.UUID {
		if b.State != Running && e.box.State == Running {
			// Its QEMU went (suspended, stopped): streams of the old one
			// are dead.
			e.tr.CloseIdleConnections()
		}
		e.box = b
		return
	}
	if e != nil {
		e.tr.CloseIdleConnections()
	}
	s.boxes[b.Name] = &entry{box: b, tr: s.transport(b.Name)}
}

// drop forgets a sandbox's box and closes its streams.
func (s *Server) drop(id string) {
	s.mu.Lock()
	e := s.boxes[id]
	delete(s.boxes, id)
	s.mu.Unlock()
	if e != nil {
		e.tr.CloseIdleConnections()
	}
}

// dropGone forgets the boxes of sandboxes that have no secrets any more.
func (s *Server) dropGone(context.Context) {
	s.mu.Lock()
	var gone []string
	for id := range s.boxes {
		if _, ok := s.secrets.get(id); !ok {
			gone = append(gone, id)
		}
	}
	s.mu.Unlock()
	for _, id := range gone {
		s.drop(id)
	}
}

// envdHost is the URL host of a box's envd on its transport: the agent's
// dial address for it.
const envdHost = agent.EnvdDialAddress
