package serve

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"
)

// The JSON of E2B's control plane, written from its public OpenAPI
// contract (the Sandbox, SandboxDetail, ListedSandbox, NewSandbox and Error
// schemas): field names and which ones an SDK's parser requires. The
// Python SDK's parsers pop every required field (a missing clientID is a
// KeyError), so each is always written.

// clientID is every sandbox's clientID: required by the parsers, meaningless
// here.
const clientID = "kvbox"

// sandboxJSON is the Sandbox schema: what create, connect, resume and each
// fork answer.
type sandboxJSON struct {
	TemplateID      string `json:"templateID"`
	SandboxID       string `json:"sandboxID"`
	Alias           string `json:"alias,omitempty"`
	ClientID        string `json:"clientID"`
	EnvdVersion     string `json:"envdVersion"`
	EnvdAccessToken string `json:"envdAccessToken,omitempty"`
	// TrafficAccessToken is null unless the sandbox's other ports want
	// one (network.allowPublicTraffic false).
	TrafficAccessToken *string `json:"trafficAccessToken"`
	// Domain is always given: without it the SDKs fall back to e2b.app.
	Domain string `json:"domain"`
}

// listedJSON is the ListedSandbox schema (GET /v2/sandboxes).
type listedJSON struct {
	TemplateID   string            `json:"templateID"`
	Alias        string            `json:"alias,omitempty"`
	SandboxID    string            `json:"sandboxID"`
	ClientID     string            `json:"clientID"`
	StartedAt    time.Time         `json:"startedAt"`
	EndAt        time.Time         `json:"endAt"`
	CPUCount     int               `json:"cpuCount"`
	MemoryMB     int64             `json:"memoryMB"`
	DiskSizeMB   int64             `json:"diskSizeMB"`
	Metadata     map[string]string `json:"metadata"`
	State        string            `json:"state"`
	EnvdVersion  string            `json:"envdVersion"`
	VolumeMounts []struct{}        `json:"volumeMounts"`
}

// detailJSON is the SandboxDetail schema (GET /sandboxes/{id}).
type detailJSON struct {
	listedJSON
	EnvdAccessToken     string        `json:"envdAccessToken,omitempty"`
	Domain              string        `json:"domain"`
	AllowInternetAccess bool          `json:"allowInternetAccess"`
	Lifecycle           lifecycleJSON `json:"lifecycle"`
}

type lifecycleJSON struct {
	AutoResume bool   `json:"autoResume"`
	OnTimeout  string `json:"onTimeout"`
}

// snapshotJSON is the SnapshotInfo schema.
type snapshotJSON struct {
	SnapshotID string   `json:"snapshotID"`
	Names      []string `json:"names"`
}

// forkResultJSON is one element of a fork's answer: a sandbox or an error.
type forkResultJSON struct {
	Sandbox *sandboxJSON `json:"sandbox,omitempty"`
	Error   *errorJSON   `json:"error,omitempty"`
}

// errorJSON is the Error schema: the JS SDK compares code with a number
// (kill's `error.code === 404`), so it is the HTTP status, never a name.
type errorJSON struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// newSandboxJSON is the NewSandbox schema, as far as kvbox serve reads it.
// Fields it does not know are ignored (each SDK release adds some); fields
// it knows but cannot honour are refused by create with a line saying so.
type newSandboxJSON struct {
	TemplateID          string            `json:"templateID"`
	Timeout             *int64            `json:"timeout"`
	Metadata            map[string]string `json:"metadata"`
	EnvVars             map[string]string `json:"envVars"`
	Secure              *bool             `json:"secure"`
	AllowInternetAccess *bool             `json:"allow_internet_access"`
	AutoPause           *bool             `json:"autoPause"`
	AutoPauseMemory     *bool             `json:"autoPauseMemory"`
	AutoResume          *struct {
		Enabled bool `json:"enabled"`
	} `json:"autoResume"`
	Network *struct {
		AllowPublicTraffic *bool           `json:"allowPublicTraffic"`
		AllowOut           []string        `json:"allowOut"`
		DenyOut            []string        `json:"denyOut"`
		Rules              json.RawMessage `json:"rules"`
		EgressProxy        json.RawMessage `json:"egressProxy"`
		MaskRequestHost    *string         `json:"maskRequestHost"`
	} `json:"network"`
	MCP          json.RawMessage   `json:"mcp"`
	VolumeMounts []json.RawMessage `json:"volumeMounts"`
	IAM          json.RawMessage   `json:"iam"`
}

// timeoutJSON is the body of timeout, connect and resume; durationJSON of
// refreshes; forkJSON of fork; snapshotReqJSON of snapshots; pauseJSON of
// pause.
type timeoutJSON struct {
	Timeout *int64 `json:"timeout"`
	// Memory false on connect or resume asks for a cold boot from the
	// disk.
	Memory *bool `json:"memory"`
}

type durationJSON struct {
	Duration *int64 `json:"duration"`
}

type forkJSON struct {
	Timeout *int64 `json:"timeout"`
	Count   *int   `json:"count"`
}

type snapshotReqJSON struct {
	Name   string `json:"name"`
	Memory *bool  `json:"memory"`
}

// pauseJSON's Memory false pauses without the memory (a filesystem-only
// pause).
type pauseJSON struct {
	Memory *bool `json:"memory"`
}

// maxBody bounds a control-plane request body.
const maxBody = 1 << 20

// apiError is an error with the HTTP status it is answered with.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func errorf(status int, format string, a ...any) *apiError {
	return &apiError{status, fmt.Sprintf(format, a...)}
}

// writeJSON answers status with v.
func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	json.NewEncoder(w).Encode(v)
}

// writeError answers with the Error schema.
func writeError(w http.ResponseWriter, status int, format string, a ...any) {
	writeJSON(w, status, errorJSON{Code: status, Message: fmt.Sprintf(format, a...)})
}

// decodeBody reads a JSON body into v: an empty body is {} when empty is
// allowed; a malformed or oversized one is a 400 or 413 saying so.
func decodeBody(w http.ResponseWriter, r *http.Request, v any, emptyOK bool) *apiError {
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxBody))
	var tooBig *http.MaxBytesError
	switch {
	case errors.As(err, &tooBig):
		return errorf(http.StatusRequestEntityTooLarge, "request body larger than %d bytes", maxBody)
	case err != nil:
		return errorf(http.StatusBadRequest, "reading the request body: %v", err)
	case len(strings.TrimSpace(string(body))) == 0:
		if emptyOK {
			return nil
		}
		return errorf(http.StatusBadRequest, "the request needs a JSON body")
	}
	if err := json.Unmarshal(body, v); err != nil {
		return errorf(http.StatusBadRequest, "the request body is not the JSON this call takes: %v", err)
	}
	return nil
}
