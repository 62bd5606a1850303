package envd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/klauspost/compress/gzip"

	"kvbox.dev/kvbox/guest-agent/envd/spec/filesystem"
	"kvbox.dev/kvbox/guest-agent/envd/spec/filesystem/filesystemconnect"
	"kvbox.dev/kvbox/guest-agent/envd/spec/process"
	"kvbox.dev/kvbox/guest-agent/envd/spec/process/processconnect"
	"kvbox.dev/kvbox/guest-agent/guestexec"
	"kvbox.dev/kvbox/testenv/gate"
)

// The tests below drive envd the way the SDKs do, byte for byte: each
// request is written as raw HTTP/1.1 on a TCP connection (the headers the
// SDKs send, Connect's JSON envelopes), and the answers are pinned as JSON
// (proto3's JSON: int64 as strings, enums by name, defaults left out,
// oneofs by the name of the field set).

// newTestServer serves envd as the host reaches it (HostHandler).
func newTestServer(t *testing.T, cfg Config) (*Server, string) {
	t.Helper()
	s := New(Options{})
	if err := s.SetConfig(cfg); err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(s.HostHandler())
	t.Cleanup(srv.Close)
	return s, strings.TrimPrefix(srv.URL, "http://")
}

// newLocalServer serves envd as the guest's processes reach it (its
// loopback door), with the local token tok.
func newLocalServer(t *testing.T, cfg Config, tok string) (*Server, string) {
	t.Helper()
	s := New(Options{})
	if err := s.SetConfig(cfg); err != nil {
		t.Fatal(err)
	}
	s.SetLocalToken(tok)
	srv := httptest.NewServer(s)
	t.Cleanup(srv.Close)
	return s, strings.TrimPrefix(srv.URL, "http://")
}

// roundTrip writes one raw HTTP/1.1 request and reads its response.
func roundTrip(t *testing.T, addr, raw string) (*http.Response, []byte) {
	t.Helper()
	resp, conn := send(t, addr, raw)
	defer conn.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return resp, b
}

// send writes one raw request and returns the response, its body unread.
func send(t *testing.T, addr, raw string) (*http.Response, net.Conn) {
	t.Helper()
	conn, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.WriteString(conn, raw); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
	if err != nil {
		t.Fatal(err)
	}
	return resp, conn
}

// request builds a raw HTTP/1.1 request with a body and Content-Length.
func request(method, path string, headers []string, body []byte) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %s HTTP/1.1\r\nHost: 127.0.0.1:49983\r\nUser-Agent: e2b-js-sdk/2.51.0\r\n", method, path)
	for _, h := range headers {
		b.WriteString(h + "\r\n")
	}
	fmt.Fprintf(&b, "Content-Length: %d\r\n\r\n", len(body))
	b.Write(body)
	return b.String()
}

// unary is a Connect unary call with the JSON codec, as connect-es sends it.
func unary(method string, body string, extra ...string) string {
	h := append([]string{"Content-Type: application/json", "Connect-Protocol-Version: 1",
		"E2b-Sandbox-Id: sbx1", "E2b-Sandbox-Port: 49983"}, extra...)
	return request("POST", "/"+method, h, []byte(body))
}

// envelope frames one Connect streaming message.
func envelope(flags byte, msg string) []byte {
	b := []byte{flags, 0, 0, 0, 0}
	binary.BigEndian.PutUint32(b[1:], uint32(len(msg)))
	return append(b, msg...)
}

// streaming is a Connect server-streaming call with the JSON codec.
func streaming(method, body string, extra ...string) string {
	h := append([]string{"Content-Type: application/connect+json", "Connect-Protocol-Version: 1",
		"Connect-Timeout-Ms: 60000", "Keepalive-Ping-Interval: 50"}, extra...)
	return request("POST", "/"+method, h, envelope(0, body))
}

// frame is one message of a streaming answer: its flags and its JSON.
type frame struct {
	flags byte
	json  string
}

// compact is JSON without whitespace: protojson varies its spacing on
// purpose, the bytes the SDKs parse are the same.
func compact(s string) string {
	var b bytes.Buffer
	if err := json.Compact(&b, []byte(s)); err != nil {
		return s
	}
	return b.String()
}

func readFrame(t *testing.T, r io.Reader) frame {
	t.Helper()
	var hdr [5]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		t.Fatalf("read a frame: %v", err)
	}
	b := make([]byte, binary.BigEndian.Uint32(hdr[1:]))
	if _, err := io.ReadFull(r, b); err != nil {
		t.Fatalf("read a frame: %v", err)
	}
	return frame{hdr[0], compact(string(b))}
}

// readAllFrames reads frames up to and with the end-stream one.
func readAllFrames(t *testing.T, r io.Reader) []frame {
	t.Helper()
	var fs []frame
	for {
		f := readFrame(t, r)
		fs = append(fs, f)
		if f.flags&2 != 0 {
			return fs
		}
	}
}

func b64(s string) string { return base64.StdEncoding.EncodeToString([]byte(s)) }

func jsonMap(t *testing.T, s string) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.Unmarshal([]byte(s), &m); err != nil {
		t.Fatalf("%q: %v", s, err)
	}
	return m
}

var pidRE = func(s string) (uint32, bool) {
	var m struct {
		Event struct {
			Start *struct {
				Pid uint32 `json:"pid"`
			} `json:"start"`
		} `json:"event"`
	}
	if json.Unmarshal([]byte(s), &m) != nil || m.Event.Start == nil {
		return 0, false
	}
	return m.Event.Start.Pid, true
}

func TestStartStreamsStartDataEnd(t *testing.T) {
	_, addr := newTestServer(t, Config{})
	resp, conn := send(t, addr, streaming("process.Process/Start",
		`{"process":{"cmd":"/bin/sh","args":["-c","printf hi; printf oops >&2; exit 3"],"envs":{}},"stdin":false}`))
	defer conn.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/connect+json" {
		t.Fatalf("answer %d %q", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	fs := readAllFrames(t, resp.Body)
	if _, ok := pidRE(fs[0].json); !ok || fs[0].flags != 0 {
		t.Fatalf("first frame %+v: want the start event", fs[0])
	}
	var stdout, stderr string
	for _, f := range fs[1 : len(fs)-2] {
		m := jsonMap(t, f.json)
		data := m["event"].(map[string]any)["data"].(map[string]any)
		if len(data) != 1 {
			t.Fatalf("data event %s: want one of stdout, stderr (a oneof)", f.json)
		}
		for k, v := range data {
			b, _ := base64.StdEncoding.DecodeString(v.(string))
			if k == "stdout" {
				stdout += string(b)
			} else {
				stderr += string(b)
			}
		}
	}
	if stdout != "hi" || stderr != "oops" {
		t.Errorf("stdout %q stderr %q", stdout, stderr)
	}
	end := fs[len(fs)-2].json
	if want := `{"event":{"end":{"exitCode":3,"exited":true,"status":"exit status 3"}}}`; end != want {
		t.Errorf("end event %s, want %s", end, want)
	}
	if last := fs[len(fs)-1]; last.flags != 2 || last.json != "{}" {
		t.Errorf("end of stream %+v, want flags 2 and {}", last)
	}

	// Exit 0: the default value is left out.
	resp, conn = send(t, addr, streaming("process.Process/Start", `{"process":{"cmd":"true"}}`))
	defer conn.Close()
	fs = readAllFrames(t, resp.Body)
	if end, want := fs[len(fs)-2].json, `{"event":{"end":{"exited":true,"status":"exit status 0"}}}`; end != want {
		t.Errorf("end event %s, want %s", end, want)
	}
}

// A command the SDKs send: /bin/bash -l -c CMD, environment in order, as
// the user of the Basic authorization, in the default workdir.
func TestStartAsUserWithEnvironment(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a process as another user")
	}
	dir := t.TempDir()
	os.Chmod(filepath.Dir(dir), 0o755) // nobody may go there
	os.Chmod(dir, 0o755)
	_, addr := newTestServer(t, Config{EnvVars: map[string]string{"A": "sandbox", "B": "sandbox"}, DefaultWorkdir: dir,
		SandboxID: "sbx1", TemplateID: "tpl"})
	resp, conn := send(t, addr, streaming("process.Process/Start",
		`{"process":{"cmd":"/bin/sh","args":["-c","id -un; pwd; echo $A $B $E2B_SANDBOX $E2B_SANDBOX_ID $E2B_TEMPLATE_ID $USER"],"envs":{"B":"call"}}}`,
		"Authorization: Basic "+b64("nobody:")))
	defer conn.Close()
	var out string
	for _, f := range readAllFrames(t, resp.Body) {
		var m struct {
			Event struct {
				Data *struct{ Stdout []byte }
			}
		}
		json.Unmarshal([]byte(f.json), &m)
		if m.Event.Data != nil {
			out += string(m.Event.Data.Stdout)
		}
	}
	if want := "nobody\n" + dir + "\nsandbox call true sbx1 tpl nobody\n"; out != want {
		t.Errorf("output %q, want %q", out, want)
	}

	resp, b := roundTrip(t, addr, streaming("process.Process/Start", `{"process":{"cmd":"true"}}`, "Authorization: Basic "+b64("no-such-user-kvbox:")))
	if resp.StatusCode == 200 && !strings.Contains(string(b), `"code":"invalid_argument"`) {
		t.Errorf("unknown user: %d %q", resp.StatusCode, b)
	}
}

func TestProcessEnvOrder(t *testing.T) {
	env := processEnv(Config{SandboxID: "s", EnvVars: map[string]string{"PATH": "/sbx", "Z": "1"}},
		&guestexec.User{Name: "user", Home: "/home/user"}, map[string]string{"Z": "2", "Y": "3"})
	want := []string{"PATH=/sbx", "HOME=/home/user", "USER=user", "LOGNAME=user", "E2B_SANDBOX=true", "E2B_SANDBOX_ID=s", "Z=2", "Y=3"}
	if !slices.Equal(env, want) {
		t.Errorf("env %q, want %q", env, want)
	}
}

func TestKeepaliveWhenIdle(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "f")
	if err := exec.Command("mkfifo", fifo).Run(); err != nil {
		t.Fatal(err)
	}
	_, addr := newTestServer(t, Config{})
	raw := strings.Replace(streaming("process.Process/Start", fmt.Sprintf(`{"process":{"cmd":"/bin/sh","args":["-c","read x < %s; echo $x"]}}`, fifo)),
		"Keepalive-Ping-Interval: 50", "Keepalive-Ping-Interval: 1", 1)
	resp, conn := send(t, addr, raw)
	defer conn.Close()
	readFrame(t, resp.Body) // start
	if f := readFrame(t, resp.Body); f.json != `{"event":{"keepalive":{}}}` {
		t.Fatalf("an idle stream sent %s, want a keepalive", f.json)
	}
	if err := os.WriteFile(fifo, []byte("done\n"), 0); err != nil {
		t.Fatal(err)
	}
	fs := readAllFrames(t, resp.Body)
	var out string
	for _, f := range fs {
		if strings.Contains(f.json, `"stdout"`) {
			var m struct {
				Event struct{ Data struct{ Stdout []byte } }
			}
			json.Unmarshal([]byte(f.json), &m)
			out += string(m.Event.Data.Stdout)
		}
	}
	if out != "done\n" {
		t.Errorf("output %q", out)
	}
}

// listPids is List's answer as pids.
func listPids(t *testing.T, addr string) map[uint32]string {
	t.Helper()
	resp, b := roundTrip(t, addr, unary("process.Process/List", `{}`))
	if resp.StatusCode != 200 {
		t.Fatalf("List: %d %s", resp.StatusCode, b)
	}
	var l struct {
		Processes []struct {
			Pid uint32
			Tag string
		}
	}
	if err := json.Unmarshal(b, &l); err != nil {
		t.Fatal(err)
	}
	m := map[uint32]string{}
	for _, p := range l.Processes {
		m[p.Pid] = p.Tag
	}
	return m
}

// The process outlives the client's disconnect; it is reattached by tag,
// fed through SendInput, and its end reaches the new stream.
func TestDisconnectReattachInput(t *testing.T) {
	_, addr := newTestServer(t, Config{})
	resp, conn := send(t, addr, streaming("process.Process/Start",
		`{"process":{"cmd":"/bin/sh","args":["-c","read x; echo got $x"]},"tag":"job1","stdin":true}`))
	pid, ok := pidRE(readFrame(t, resp.Body).json)
	if !ok {
		t.Fatal("no start event")
	}
	conn.Close()
	if tags := listPids(t, addr); tags[pid] != "job1" {
		t.Fatalf("after the disconnect List says %v, want pid %d tagged job1", tags, pid)
	}
	resp, conn = send(t, addr, streaming("process.Process/Connect", `{"process":{"tag":"job1"}}`))
	defer conn.Close()
	if p, ok := pidRE(readFrame(t, resp.Body).json); !ok || p != pid {
		t.Fatalf("Connect's first event: want start{pid:%d}", pid)
	}
	r, b := roundTrip(t, addr, unary("process.Process/SendInput",
		fmt.Sprintf(`{"process":{"pid":%d},"input":{"stdin":"%s"}}`, pid, b64("hello\n"))))
	if r.StatusCode != 200 || compact(string(b)) != "{}" {
		t.Fatalf("SendInput: %d %s", r.StatusCode, b)
	}
	fs := readAllFrames(t, resp.Body)
	if got, want := fs[0].json, `{"event":{"data":{"stdout":"`+b64("got hello\n")+`"}}}`; got != want {
		t.Errorf("data %s, want %s", got, want)
	}
	if !strings.Contains(fs[len(fs)-2].json, `"end"`) {
		t.Errorf("no end event: %v", fs)
	}
	r, b = roundTrip(t, addr, unary("process.Process/SendSignal", fmt.Sprintf(`{"process":{"pid":%d},"signal":"SIGNAL_SIGKILL"}`, pid)))
	if r.StatusCode != 404 || jsonMap(t, string(b))["code"] != "not_found" {
		t.Errorf("a signal to an ended process: %d %s, want 404 not_found", r.StatusCode, b)
	}
}

// Connect-Timeout-Ms bounds the process, not only the stream.
func TestConnectTimeoutKillsTheProcess(t *testing.T) {
	_, addr := newTestServer(t, Config{})
	raw := strings.Replace(streaming("process.Process/Start", `{"process":{"cmd":"sleep","args":["60"]}}`),
		"Connect-Timeout-Ms: 60000", "Connect-Timeout-Ms: 300", 1)
	resp, conn := send(t, addr, raw)
	defer conn.Close()
	pid, _ := pidRE(readFrame(t, resp.Body).json)
	fs := readAllFrames(t, resp.Body)
	if last := fs[len(fs)-1]; last.flags != 2 || !strings.Contains(last.json, `"code":"deadline_exceeded"`) {
		t.Errorf("stream end %+v, want deadline_exceeded", last)
	}
	for i := 0; ; i++ {
		if _, running := listPids(t, addr)[pid]; !running {
			break
		}
		if i == 200 {
			t.Fatalf("process %d still runs after its call's timeout", pid)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err := exec.Command("kill", "-0", strconv.Itoa(int(pid))).Run(); err == nil {
		t.Errorf("process %d is alive", pid)
	}
}

func TestSignalKillsAndPTY(t *testing.T) {
	_, addr := newTestServer(t, Config{})
	resp, conn := send(t, addr, streaming("process.Process/Start",
		`{"process":{"cmd":"/bin/sh","args":["-c","stty size; exec sleep 60"]},"pty":{"size":{"cols":80,"rows":24}}}`))
	defer conn.Close()
	pid, _ := pidRE(readFrame(t, resp.Body).json)
	f := readFrame(t, resp.Body)
	var m struct {
		Event struct{ Data struct{ Pty []byte } }
	}
	json.Unmarshal([]byte(f.json), &m)
	if !strings.Contains(string(m.Event.Data.Pty), "24 80") {
		t.Errorf("pty output %s: want the terminal's size", f.json)
	}
	r, b := roundTrip(t, addr, unary("process.Process/Update", fmt.Sprintf(`{"process":{"pid":%d},"pty":{"size":{"cols":100,"rows":30}}}`, pid)))
	if r.StatusCode != 200 {
		t.Errorf("Update: %d %s", r.StatusCode, b)
	}
	r, b = roundTrip(t, addr, unary("process.Process/SendSignal", fmt.Sprintf(`{"process":{"pid":%d},"signal":"SIGNAL_SIGKILL"}`, pid)))
	if r.StatusCode != 200 {
		t.Fatalf("SendSignal: %d %s", r.StatusCode, b)
	}
	fs := readAllFrames(t, resp.Body)
	if end, want := fs[len(fs)-2].json, `{"event":{"end":{"exitCode":-1,"status":"signal: killed"}}}`; end != want {
		t.Errorf("end %s, want %s", end, want)
	}
}

// The loopback door wants the local token; the host's does not (serve
// checked the client's before the request crossed into the box).
func TestAccessToken(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "f")
	os.WriteFile(file, []byte("data"), 0o644)
	s, addr := newLocalServer(t, Config{}, "secret")
	stat := fmt.Sprintf(`{"path":%q}`, file)
	for _, tc := range []struct {
		name   string
		raw    string
		status int
		code   string
	}{
		{"rpc without a token", unary("filesystem.Filesystem/Stat", stat), 401, "unauthenticated"},
		{"rpc with a wrong token", unary("filesystem.Filesystem/Stat", stat, "X-Access-Token: wrong"), 401, "unauthenticated"},
		{"rpc with the token", unary("filesystem.Filesystem/Stat", stat, "X-Access-Token: secret"), 200, ""},
		// A stream's error is its end-of-stream message (Connect).
		{"stream without a token", streaming("process.Process/Start", `{"process":{"cmd":"true"}}`), 200, "stream:unauthenticated"},
		{"health needs none", request("GET", "/health", nil, nil), 204, ""},
		{"files without a token", request("GET", "/files?path="+file, nil, nil), 401, ""},
		{"files with the token", request("GET", "/files?path="+file, []string{"X-Access-Token: secret"}, nil), 200, ""},
		{"files signed", request("GET", "/files?path="+file+"&signature="+url.QueryEscape(Signature(file, "read", "", "secret", 0)), nil, nil), 200, ""},
		{"files signed for writing", request("GET", "/files?path="+file+"&signature="+url.QueryEscape(Signature(file, "write", "", "secret", 0)), nil, nil), 401, ""},
		{"files signed, expired", request("GET", fmt.Sprintf("/files?path=%s&signature=%s&signature_expiration=1000", file, url.QueryEscape(Signature(file, "read", "", "secret", 1000))), nil, nil), 401, ""},
		{"files signed, not expired", request("GET", fmt.Sprintf("/files?path=%s&signature=%s&signature_expiration=%d", file, url.QueryEscape(Signature(file, "read", "", "secret", 1<<40)), 1<<40), nil, nil), 200, ""},
		{"envs", request("GET", "/envs", nil, nil), 401, ""},
	} {
		resp, b := roundTrip(t, addr, tc.raw)
		if resp.StatusCode != tc.status {
			t.Errorf("%s: %d %s, want %d", tc.name, resp.StatusCode, b, tc.status)
			continue
		}
		if code, ok := strings.CutPrefix(tc.code, "stream:"); ok {
			if fs := readAllFrames(t, bytes.NewReader(b)); !strings.Contains(fs[len(fs)-1].json, `"code":"`+code+`"`) {
				t.Errorf("%s: %v, want an end of stream with code %q", tc.name, fs, code)
			}
			continue
		}
		if tc.code != "" && jsonMap(t, string(b))["code"] != tc.code {
			t.Errorf("%s: %s, want code %q", tc.name, b, tc.code)
		}
		if tc.status == 401 && tc.code == "" && jsonMap(t, string(b))["code"] != float64(401) {
			t.Errorf("%s: %s, want a numeric code 401", tc.name, b)
		}
	}
	// The host's door: no token asked for, any token ignored.
	host := httptest.NewServer(s.HostHandler())
	defer host.Close()
	haddr := strings.TrimPrefix(host.URL, "http://")
	for name, raw := range map[string]string{
		"rpc":   unary("filesystem.Filesystem/Stat", stat),
		"files": request("GET", "/files?path="+file, nil, nil),
		"envs":  request("GET", "/envs", nil, nil),
	} {
		if resp, b := roundTrip(t, haddr, raw); resp.StatusCode != 200 {
			t.Errorf("the host's %s: %d %s", name, resp.StatusCode, b)
		}
	}
	// A new local token: the old one opens nothing; none at all shuts the
	// door but for /health.
	s.SetLocalToken("renewed")
	if resp, b := roundTrip(t, addr, unary("filesystem.Filesystem/Stat", stat, "X-Access-Token: secret")); resp.StatusCode != 401 {
		t.Errorf("the old local token: %d %s", resp.StatusCode, b)
	}
	if resp, b := roundTrip(t, addr, unary("filesystem.Filesystem/Stat", stat, "X-Access-Token: renewed")); resp.StatusCode != 200 {
		t.Errorf("the new local token: %d %s", resp.StatusCode, b)
	}
	s.SetLocalToken("")
	for name, raw := range map[string]string{
		"rpc with an empty token": unary("filesystem.Filesystem/Stat", stat, "X-Access-Token: "),
		"rpc with none":           unary("filesystem.Filesystem/Stat", stat),
		"files signed with ''":    request("GET", "/files?path="+file+"&signature="+url.QueryEscape(Signature(file, "read", "", "", 0)), nil, nil),
		"envs":                    request("GET", "/envs", nil, nil),
	} {
		if resp, b := roundTrip(t, addr, raw); resp.StatusCode != 401 {
			t.Errorf("no local token, %s: %d %s", name, resp.StatusCode, b)
		}
	}
	if resp, b := roundTrip(t, addr, request("GET", "/health", nil, nil)); resp.StatusCode != 204 {
		t.Errorf("no local token, /health: %d %s", resp.StatusCode, b)
	}
}

// The signature is the SDKs' (their getSignature), for a vector computed
// with sha256sum.
func TestSignatureVector(t *testing.T) {
	gate.Tools(t, "sha256sum", "xxd", "base64")
	out, err := exec.Command("sh", "-c", "printf '%s' '/home/user/a.txt:read:user:tok:1700000000' | sha256sum | cut -d' ' -f1 | xxd -r -p | base64 | tr -d '='").Output()
	if err != nil {
		t.Fatal(err)
	}
	if got, want := Signature("/home/user/a.txt", "read", "user", "tok", 1700000000), "v1_"+strings.TrimSpace(string(out)); got != want {
		t.Errorf("Signature = %s, want %s", got, want)
	}
}

func TestStatProtoJSON(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "five")
	os.WriteFile(file, []byte("12345"), 0o640)
	mt := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	os.Chtimes(file, mt, mt)
	os.Symlink(file, filepath.Join(dir, "link"))
	_, addr := newTestServer(t, Config{})
	resp, b := roundTrip(t, addr, unary("filesystem.Filesystem/Stat", fmt.Sprintf(`{"path":%q}`, file)))
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("Stat: %d %q %s", resp.StatusCode, resp.Header.Get("Content-Type"), b)
	}
	b = []byte(compact(string(b)))
	owner := userName(uint32(os.Geteuid()))
	group := groupName(uint32(os.Getegid()))
	want := fmt.Sprintf(`{"entry":{"name":"five","type":"FILE_TYPE_FILE","path":%q,"size":"5","mode":416,"permissions":"-rw-r-----","owner":%q,"group":%q,"modifiedTime":"2026-01-02T03:04:05Z"}}`,
		file, owner, group)
	if string(b) != want {
		t.Errorf("Stat answered\n%s\nwant\n%s", b, want)
	}
	_, b = roundTrip(t, addr, unary("filesystem.Filesystem/Stat", fmt.Sprintf(`{"path":%q}`, filepath.Join(dir, "link"))))
	e := jsonMap(t, string(b))["entry"].(map[string]any)
	if e["type"] != "FILE_TYPE_SYMLINK" || e["symlinkTarget"] != file {
		t.Errorf("symlink: %s", b)
	}
	resp, b = roundTrip(t, addr, unary("filesystem.Filesystem/Stat", `{"path":"/nonexistent-kvbox"}`, `X-Unknown-Field: ignored`))
	if resp.StatusCode != 404 || jsonMap(t, string(b))["code"] != "not_found" {
		t.Errorf("missing file: %d %s", resp.StatusCode, b)
	}
	// Unknown fields in a request are ignored (newer SDKs add some).
	resp, b = roundTrip(t, addr, unary("filesystem.Filesystem/Stat", fmt.Sprintf(`{"path":%q,"fromTheFuture":1}`, file)))
	if resp.StatusCode != 200 {
		t.Errorf("unknown field: %d %s", resp.StatusCode, b)
	}
}

func TestFilesystemCalls(t *testing.T) {
	dir := t.TempDir()
	_, addr := newTestServer(t, Config{})
	call := func(method, body string) (int, map[string]any) {
		resp, b := roundTrip(t, addr, unary("filesystem.Filesystem/"+method, body))
		return resp.StatusCode, jsonMap(t, string(b))
	}
	if st, m := call("MakeDir", fmt.Sprintf(`{"path":"%s/a/b"}`, dir)); st != 200 || m["entry"].(map[string]any)["type"] != "FILE_TYPE_DIRECTORY" {
		t.Fatalf("MakeDir: %d %v", st, m)
	}
	if st, m := call("MakeDir", fmt.Sprintf(`{"path":"%s/a/b"}`, dir)); st != 409 || m["code"] != "already_exists" {
		t.Errorf("MakeDir again: %d %v", st, m)
	}
	os.WriteFile(dir+"/a/b/f", []byte("x"), 0o644)
	os.WriteFile(dir+"/a/g", nil, 0o644)
	st, m := call("ListDir", fmt.Sprintf(`{"path":"%s/a"}`, dir))
	names := func(m map[string]any) []string {
		var l []string
		for _, e := range m["entries"].([]any) {
			l = append(l, strings.TrimPrefix(e.(map[string]any)["path"].(string), dir+"/a/"))
		}
		slices.Sort(l)
		return l
	}
	if st != 200 || !slices.Equal(names(m), []string{"b", "g"}) {
		t.Errorf("ListDir: %d %v", st, m)
	}
	if _, m := call("ListDir", fmt.Sprintf(`{"path":"%s/a","depth":2}`, dir)); !slices.Equal(names(m), []string{"b", "b/f", "g"}) {
		t.Errorf("ListDir depth 2: %v", m)
	}
	if st, m := call("Move", fmt.Sprintf(`{"source":"%s/a/g","destination":"%s/c/d/g2"}`, dir, dir)); st != 200 || m["entry"].(map[string]any)["path"] != dir+"/c/d/g2" {
		t.Errorf("Move: %d %v", st, m)
	}
	if st, m := call("Remove", fmt.Sprintf(`{"path":"%s/a"}`, dir)); st != 200 || len(m) != 0 {
		t.Errorf("Remove: %d %v", st, m)
	}
	// A missing path is removed already, as E2B's envd has it.
	if st, m := call("Remove", fmt.Sprintf(`{"path":"%s/a"}`, dir)); st != 200 || len(m) != 0 {
		t.Errorf("Remove again: %d %v", st, m)
	}
}

func TestUploadMultipartAndOctetStream(t *testing.T) {
	dir := t.TempDir()
	_, addr := newTestServer(t, Config{})
	target := dir + "/new/dir/file.txt"
	// As undici's FormData sends a Blob: the whole path in filename.
	body := "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + target + "\"\r\nContent-Type: application/octet-stream\r\n\r\nhello multipart\r\n--XyZ--\r\n"
	resp, b := roundTrip(t, addr, request("POST", "/files", []string{"Content-Type: multipart/form-data; boundary=XyZ"}, []byte(body)))
	if want := fmt.Sprintf(`[{"path":%q,"name":"file.txt","type":"file"}]`, target); resp.StatusCode != 200 || strings.TrimSpace(string(b)) != want {
		t.Fatalf("multipart upload: %d %s, want %s", resp.StatusCode, b, want)
	}
	if got, _ := os.ReadFile(target); string(got) != "hello multipart" {
		t.Errorf("file holds %q", got)
	}
	// ?path= names the target even when the part's filename does not.
	body = "--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"undefined\"\r\n\r\nsecond\r\n--XyZ--\r\n"
	resp, b = roundTrip(t, addr, request("POST", "/files?path="+target, []string{"Content-Type: multipart/form-data; boundary=XyZ"}, []byte(body)))
	if got, _ := os.ReadFile(target); resp.StatusCode != 200 || string(got) != "second" {
		t.Errorf("upload to ?path=: %d %s, file %q", resp.StatusCode, b, got)
	}
	// Octet-stream, gzip-encoded, zero bytes once decoded.
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Close()
	resp, b = roundTrip(t, addr, request("POST", "/files?path="+dir+"/empty", []string{"Content-Type: application/octet-stream", "Content-Encoding: gzip"}, gz.Bytes()))
	if st, err := os.Stat(dir + "/empty"); resp.StatusCode != 200 || err != nil || st.Size() != 0 {
		t.Errorf("empty gzip upload: %d %s %v", resp.StatusCode, b, err)
	}
	// Download: whole, a range, gzip.
	resp, b = roundTrip(t, addr, request("GET", "/files?path="+target, nil, nil))
	if resp.StatusCode != 200 || string(b) != "second" {
		t.Errorf("download: %d %q", resp.StatusCode, b)
	}
	resp, b = roundTrip(t, addr, request("GET", "/files?path="+target, []string{"Range: bytes=1-3"}, nil))
	if resp.StatusCode != 206 || string(b) != "eco" {
		t.Errorf("range: %d %q", resp.StatusCode, b)
	}
	resp, b = roundTrip(t, addr, request("GET", "/files?path="+target, []string{"Accept-Encoding: gzip"}, nil))
	zr, err := gzip.NewReader(bytes.NewReader(b))
	if resp.Header.Get("Content-Encoding") != "gzip" || err != nil {
		t.Fatalf("gzip download: %v %v", resp.Header, err)
	}
	if plain, _ := io.ReadAll(zr); string(plain) != "second" {
		t.Errorf("gzip download: %q", plain)
	}
	resp, b = roundTrip(t, addr, request("GET", "/files?path="+dir+"/missing", nil, nil))
	if resp.StatusCode != 404 || jsonMap(t, string(b))["code"] != float64(404) {
		t.Errorf("missing: %d %s", resp.StatusCode, b)
	}
	resp, b = roundTrip(t, addr, request("POST", "/files?path="+dir+"/new", []string{"Content-Type: application/octet-stream"}, []byte("x")))
	if resp.StatusCode != 400 {
		t.Errorf("upload onto a directory: %d %s", resp.StatusCode, b)
	}
}

func TestWatchDirAndPolledWatcher(t *testing.T) {
	dir := t.TempDir()
	_, addr := newTestServer(t, Config{})
	resp, conn := send(t, addr, streaming("filesystem.Filesystem/WatchDir", fmt.Sprintf(`{"path":%q}`, dir)))
	defer conn.Close()
	if f := readFrame(t, resp.Body); f.json != `{"start":{}}` {
		t.Fatalf("first event %s, want start", f.json)
	}
	_, b := roundTrip(t, addr, unary("filesystem.Filesystem/CreateWatcher", fmt.Sprintf(`{"path":%q}`, dir)))
	id := jsonMap(t, string(b))["watcherId"].(string)
	os.WriteFile(dir+"/x", []byte("1"), 0o644)
	if f := readFrame(t, resp.Body); f.json != `{"filesystem":{"name":"x","type":"EVENT_TYPE_CREATE"}}` {
		t.Errorf("event %s", f.json)
	}
	var events []any
	for i := 0; len(events) == 0; i++ {
		_, b = roundTrip(t, addr, unary("filesystem.Filesystem/GetWatcherEvents", fmt.Sprintf(`{"watcherId":%q}`, id)))
		if evs, ok := jsonMap(t, string(b))["events"].([]any); ok {
			events = evs
		}
		if i == 200 {
			t.Fatal("the polled watcher saw nothing")
		}
		time.Sleep(20 * time.Millisecond)
	}
	if e := events[0].(map[string]any); e["name"] != "x" || e["type"] != "EVENT_TYPE_CREATE" {
		t.Errorf("polled events %v", events)
	}
	r, _ := roundTrip(t, addr, unary("filesystem.Filesystem/RemoveWatcher", fmt.Sprintf(`{"watcherId":%q}`, id)))
	r2, _ := roundTrip(t, addr, unary("filesystem.Filesystem/GetWatcherEvents", fmt.Sprintf(`{"watcherId":%q}`, id)))
	if r.StatusCode != 200 || r2.StatusCode != 404 {
		t.Errorf("RemoveWatcher %d, then GetWatcherEvents %d", r.StatusCode, r2.StatusCode)
	}
}

// The binary codec and a Go Connect client: what a community SDK might
// send.
func TestBinaryCodec(t *testing.T) {
	dir := t.TempDir()
	os.WriteFile(dir+"/f", []byte("abc"), 0o644)
	s, _ := newLocalServer(t, Config{}, "tok")
	srv := httptest.NewServer(s)
	defer srv.Close()
	fc := filesystemconnect.NewFilesystemClient(srv.Client(), srv.URL)
	req := connect.NewRequest(&filesystem.ListDirRequest{Path: dir})
	req.Header().Set("X-Access-Token", "tok")
	res, err := fc.ListDir(context.Background(), req)
	if err != nil || len(res.Msg.Entries) != 1 || res.Msg.Entries[0].Size != 3 {
		t.Fatalf("ListDir over the binary codec: %v %v", res, err)
	}
	pc := processconnect.NewProcessClient(srv.Client(), srv.URL)
	sreq := connect.NewRequest(&process.StartRequest{Process: &process.ProcessConfig{Cmd: "echo", Args: []string{"bin"}}})
	sreq.Header().Set("X-Access-Token", "tok")
	stream, err := pc.Start(context.Background(), sreq)
	if err != nil {
		t.Fatal(err)
	}
	var out string
	for stream.Receive() {
		out += string(stream.Msg().GetEvent().GetData().GetStdout())
	}
	if err := stream.Err(); err != nil || out != "bin\n" {
		t.Errorf("Start over the binary codec: %q %v", out, err)
	}
	_, err = fc.Stat(context.Background(), connect.NewRequest(&filesystem.StatRequest{Path: dir}))
	if connect.CodeOf(err) != connect.CodeUnauthenticated {
		t.Errorf("no token: %v", err)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []Config{{EnvVars: map[string]string{"A=B": "x"}}, {EnvVars: map[string]string{"": "x"}}, {DefaultWorkdir: "rel"}} {
		if err := New(Options{}).SetConfig(c); err == nil {
			t.Errorf("SetConfig(%+v) accepted", c)
		}
	}
}

// StreamInput, a client stream no SDK sends today: a start event naming
// the process, then its input.
func TestStreamInput(t *testing.T) {
	_, addr := newTestServer(t, Config{})
	resp, conn := send(t, addr, streaming("process.Process/Start",
		`{"process":{"cmd":"/bin/sh","args":["-c","read x; echo got $x"]},"tag":"in","stdin":true}`))
	defer conn.Close()
	pid, _ := pidRE(readFrame(t, resp.Body).json)
	body := append(envelope(0, `{"start":{"process":{"tag":"in"}}}`), envelope(0, `{"data":{"input":{"stdin":"`+b64("streamed\n")+`"}}}`)...)
	r, b := roundTrip(t, addr, request("POST", "/process.Process/StreamInput",
		[]string{"Content-Type: application/connect+json", "Connect-Protocol-Version: 1"}, body))
	if fs := readAllFrames(t, bytes.NewReader(b)); r.StatusCode != 200 || fs[len(fs)-1].json != "{}" {
		t.Fatalf("StreamInput: %d %q", r.StatusCode, b)
	}
	fs := readAllFrames(t, resp.Body)
	if got, want := fs[0].json, `{"event":{"data":{"stdout":"`+b64("got streamed\n")+`"}}}`; got != want {
		t.Errorf("process %d output %s, want %s", pid, got, want)
	}
}
