//go:build e2e

package testenv

import (
	"bytes"
	"encoding/json"

	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The registry testenv/setup.sh starts on the namespace's loopback, and
// where it keeps blobs (to tamper with one).
const (
	testRegistry     = "127.0.0.1:5000"
	testRegistryData = "/var/lib/kvbox-testenv/registry/data/docker/registry/v2/blobs"
)

type pushPart struct {
	Title  string `json:"title"`
	Digest string `json:"digest"`
	Blob   int64  `json:"blob_bytes"`
}

type pushResult struct {
	Digest string     `json:"digest"`
	Parts  []pushPart `json:"parts"`
	Sent   int64      `json:"sent_bytes"`
	OnDisk int64      `json:"on_disk_bytes"`
	Known  int        `json:"known_parts"`
	Encode int64      `json:"encode_ns"`
}

func needRegistry(t *testing.T) {
	t.Helper()
	resp, err := http.Get("http://" + testRegistry + "/v2/")
	if err != nil {
		t.Fatalf("no OCI registry on %s in this namespace (testenv/setup.sh starts one): %v", testRegistry, err)
	}
	resp.Body.Close()
}

func push(t *testing.T, global []string, snap, ref string) pushResult {
	t.Helper()
	out := mustKvbox(t, append(global, "snapshots", "push", "--insecure", "--json", snap, ref)...)
	var r pushResult
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("push --json: %v\n%s", err, out)
	}
	return r
}

// host2 is a second host's kvbox: its own state dir, bridge and subnet
// (sharing this machine's libvirtd).
func host2(t *testing.T, tag, subnet string) []string {
	dir := t.TempDir()
	// QEMU (libvirt-qemu) reads the snapshot and image files in it
	os.Chmod(filepath.Dir(dir), 0o755)
	os.Chmod(dir, 0o755)
	g := []string{"--state-dir", dir, "--bridge", "kvr" + runID[3:] + tag, "--subnet", subnet}
	t.Cleanup(func() { kvbox(t, append(g, "network", "rm")...) })
	return g
}

func dirOf(g []string) string { return g[1] }

// listed returns the names of the snapshots a state dir lists.
func listed(t *testing.T, g []string) []string {
	var names []string
	for _, s := range listSnapshots(t, g...) {
		names = append(names, s.Name)
	}
	return names
}

// TestRegistryPushPull: a snapshot of a box serving HTTP is pushed to a
// real registry, removed here, pulled into a second host's state dir, and
// a clone there serves what the source served; a second push sends only
// what changed; a killed pull retried completes; a tampered blob and an
// incompatible host are refused.
func TestRegistryPushPull(t *testing.T) {
	needRegistry(t)
	srcName, snapName := name(t, "rsrc"), name(t, "rwarm")
	newBox(t, srcName)
	inBox(t, srcName, "mkdir -p /www && echo reg-"+srcName+" > /www/index.html && "+
		"setsid httpd -p 8080 -h /www </dev/null >/dev/null 2>&1; sleep 0.3; netstat -ltn | grep -q :8080")
	newSnapshot(t, srcName, snapName)
	ref := testRegistry + "/" + registryRepo + "/" + runID + ":v1"

	first := push(t, nil, snapName, ref)
	var blobs int64
	for _, p := range first.Parts {
		blobs += p.Blob
	}
	t.Logf("first push: %d bytes sent, %d bytes of blobs, %d bytes on disk, %d parts", first.Sent, blobs, first.OnDisk, len(first.Parts))
	if first.Sent < blobs {
		t.Errorf("first push sent %d bytes, less than its blobs (%d): a part was not uploaded", first.Sent, blobs)
	}
	if first.Sent >= first.OnDisk {
		t.Errorf("first push sent %d bytes, not less than the %d on disk: holes or compression lost", first.Sent, first.OnDisk)
	}
	again := push(t, nil, snapName, ref)
	if again.Digest != first.Digest || again.Sent > 4096 {
		t.Errorf("second push of the same snapshot: digest %s (first %s), %d bytes sent (want nothing but requests)", again.Digest, first.Digest, again.Sent)
	}
	// Its files were encoded by the first push: not one is encoded again.
	// (The first may know the base image's parts from other pushes.)
	if again.Known != len(again.Parts) {
		t.Errorf("second push of the same snapshot: %d of %d parts known from the first, want all", again.Known, len(again.Parts))
	}
	t.Logf("encode: first push %v (%d parts known before), second %v", time.Duration(first.Encode), first.Known, time.Duration(again.Encode))
	// On a terminal (script(1) gives kvbox one), a push to another
	// repository (nothing there yet) draws each part's progress ("0 B of
	// 2 MB (0%)" at least, drawn as a part starts).
	tty := exec.Command("script", "-qec", kvboxBin+" snapshots push --insecure "+snapName+" "+testRegistry+"/"+registryRepo+"/"+runID+"-tty:v1", "/dev/null")
	if out, err := tty.CombinedOutput(); err != nil || !strings.Contains(string(out), "snapshot/state ") || !strings.Contains(string(out), "%)") || !strings.Contains(string(out), "✓ pushed") {
		t.Errorf("push on a terminal shows no progress per part: %v\n%q", err, out)
	}
	// A newer snapshot of the same box: only the parts that changed travel.
	inBox(t, srcName, "echo changed > /www/changed.html; sync")
	snap2 := name(t, "rwarm2")
	newSnapshot(t, srcName, snap2)
	second := push(t, nil, snap2, testRegistry+"/"+registryRepo+"/"+runID+":v2")
	known := map[string]bool{}
	for _, p := range first.Parts {
		known[p.Digest] = true
	}
	var changed, unchanged int64
	for _, p := range second.Parts {
		if known[p.Digest] {
			unchanged += p.Blob
		} else {
			changed += p.Blob
		}
	}
	t.Logf("push of a newer snapshot: %d bytes sent, %d bytes in changed parts, %d bytes in unchanged parts", second.Sent, changed, unchanged)
	if unchanged == 0 || second.Sent > changed+16384 {
		t.Errorf("push of a newer snapshot sent %d bytes; changed parts are %d bytes, unchanged %d", second.Sent, changed, unchanged)
	}

	// Gone from here; a second host pulls it.
	mustKvbox(t, "snapshots", "rm", snapName)
	h2 := host2(t, "a", freeSubnet(t))
	pulled := name(t, "rpulled")
	out := mustKvbox(t, append(h2, "snapshots", "pull", "--insecure", ref, pulled)...)
	if !strings.Contains(out, "✓ snapshot "+pulled+" pulled from "+ref+"@"+first.Digest) {
		t.Errorf("pull printed %q", out)
	}
	t.Cleanup(func() { kvbox(t, append(h2, "snapshots", "rm", pulled)...) })
	if n := listed(t, h2); len(n) != 1 || n[0] != pulled {
		t.Fatalf("second host lists %v", n)
	}
	for _, f := range []string{"snapshots/" + pulled + "/domain.xml", "snapshots/" + pulled + "/snapshot.json"} {
		b, _ := os.ReadFile(filepath.Join(dirOf(h2), f))
		if bytes.Contains(b, []byte(stateDir+"/")) {
			t.Errorf("%s still names the first host's state dir", f)
		}
	}
	clone := name(t, "rclone")
	t.Cleanup(func() { kvbox(t, append(h2, "rm", "--force", clone)...) })
	mustKvbox(t, append(h2, "new", "--from", pulled, clone)...)
	var c box
	for _, b := range listBoxes2(t, h2) {
		if b.Name == clone {
			c = b
		}
	}
	var body string
	var err error
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(time.Second) {
		if body, err = httpGet("http://" + c.IP + ":8080/"); err == nil {
			break
		}
	}
	if err != nil || strings.TrimSpace(body) != "reg-"+srcName {
		t.Errorf("clone %s of the pulled snapshot at %s: %q %v", clone, c.IP, body, err)
	}

	t.Run("KilledPullResumes", func(t *testing.T) {
		h3 := host2(t, "b", freeSubnet(t))
		cache := filepath.Join(dirOf(h3), "registry-cache")
		n := name(t, "rkilled")
		cmd := exec.Command(kvboxBin, append(h3, "snapshots", "pull", "--insecure", ref, n)...)
		var errb bytes.Buffer
		cmd.Stderr = &errb
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		// kill it as soon as one part is complete in its cache
		killed := false
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
			ents, _ := os.ReadDir(cache)
			done := 0
			for _, e := range ents {
				if strings.HasPrefix(e.Name(), "sha256-") && !strings.HasSuffix(e.Name(), ".download") {
					done++
				}
			}
			if done >= 1 {
				killed = cmd.Process.Signal(syscall.SIGKILL) == nil
				break
			}
		}
		err := cmd.Wait()
		if !killed || err == nil {
			t.Fatalf("the pull was not killed halfway (killed %v, %v): %s", killed, err, errb.String())
		}
		if l := listed(t, h3); len(l) != 0 {
			t.Fatalf("a killed pull left %v listed", l)
		}
		r := kvbox(t, append(h3, "snapshots", "pull", "--insecure", ref, n)...)
		if r.code != 0 {
			t.Fatalf("retried pull: %s", r)
		}
		t.Cleanup(func() { kvbox(t, append(h3, "snapshots", "rm", n)...) })
		if !strings.Contains(r.stderr, "cached") {
			t.Errorf("the retried pull fetched every part again:\n%s", r.stderr)
		}
		if l := listed(t, h3); len(l) != 1 || l[0] != n {
			t.Errorf("after the retried pull: %v", l)
		}
		ents, _ := os.ReadDir(filepath.Join(dirOf(h3), "snapshots"))
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), ".") {
				t.Errorf("left behind: %s", e.Name())
			}
		}
	})

	t.Run("ConcurrentPullRefused", func(t *testing.T) {
		h4 := host2(t, "c", freeSubnet(t))
		cache := filepath.Join(dirOf(h4), "registry-cache")
		n := name(t, "rtwice")
		first := exec.Command(kvboxBin, append(h4, "snapshots", "pull", "--insecure", ref, n)...)
		var errb bytes.Buffer
		first.Stderr = &errb
		if err := first.Start(); err != nil {
			t.Fatal(err)
		}
		// stop the first pull while it downloads: it holds the name
		stopped := false
		for deadline := time.Now().Add(60 * time.Second); time.Now().Before(deadline) && !stopped; time.Sleep(2 * time.Millisecond) {
			ents, _ := os.ReadDir(cache)
			for _, e := range ents {
				if strings.HasSuffix(e.Name(), ".download") {
					stopped = first.Process.Signal(syscall.SIGSTOP) == nil
					break
				}
			}
		}
		if !stopped {
			first.Process.Kill()
			first.Wait()
			t.Fatalf("never saw the first pull download: %s", errb.String())
		}
		r := kvbox(t, append(h4, "snapshots", "pull", "--insecure", ref, n)...)
		first.Process.Signal(syscall.SIGCONT)
		err := first.Wait()
		t.Cleanup(func() { kvbox(t, append(h4, "snapshots", "rm", n)...) })
		if r.code != 5 || !strings.Contains(r.stderr, "another kvbox is pulling") || strings.Count(r.stderr, "\n") != 1 {
			t.Errorf("a second pull of the same name while one runs: %s; want exit 5 and one line", r)
		}
		if err != nil {
			t.Fatalf("the first pull, after the second was refused: %v\n%s", err, errb.String())
		}
		if l := listed(t, h4); len(l) != 1 || l[0] != n {
			t.Errorf("after both pulls: %v", l)
		}
	})

	t.Run("TamperedBlobRefused", func(t *testing.T) {
		var state pushPart
		for _, p := range first.Parts {
			if p.Title == "snapshot/state" {
				state = p
			}
		}
		hex := strings.TrimPrefix(state.Digest, "sha256:")
		path := filepath.Join(testRegistryData, "sha256", hex[:2], hex, "data")
		orig, err := os.ReadFile(path)
		if err != nil {
			t.Fatalf("the registry's copy of %s: %v", state.Title, err)
		}
		bad := bytes.Clone(orig)
		bad[len(bad)/2] ^= 0xff
		if err := os.WriteFile(path, bad, 0o644); err != nil {
			t.Fatal(err)
		}
		defer os.WriteFile(path, orig, 0o644)
		h4 := host2(t, "c", freeSubnet(t))
		r := kvbox(t, append(h4, "snapshots", "pull", "--insecure", ref, name(t, "rbad"))...)
		if r.code == 0 || !strings.Contains(r.stderr, "refused") || !strings.Contains(r.stderr, state.Digest) {
			t.Errorf("pull of a tampered blob: %s", r)
		}
		t.Logf("tampered: %s", strings.TrimSpace(lastLine(r.stderr)))
		if l := listed(t, h4); len(l) != 0 {
			t.Errorf("a refused pull left %v listed", l)
		}
		ents, _ := os.ReadDir(filepath.Join(dirOf(h4), "registry-cache"))
		for _, e := range ents {
			if strings.Contains(e.Name(), hex) {
				t.Errorf("the tampered blob was kept: %s", e.Name())
			}
		}
	})

	t.Run("IncompatibleRefused", func(t *testing.T) {
		// What a restore needs is recorded in the snapshot when it is
		// taken (compat.json): a host that took the same snapshot on
		// another machine type, domain type or agent protocol is a copy
		// with that one field changed.
		recorded, err := os.ReadFile(filepath.Join(stateDir, "snapshots", snap2, "compat.json"))
		if err != nil {
			t.Fatalf("the snapshot recorded no compat.json: %v", err)
		}
		var c map[string]any
		if err := json.Unmarshal(recorded, &c); err != nil {
			t.Fatal(err)
		}
		if c["agent"] == nil || c["qemu"] == nil || c["machine"] == nil {
			t.Fatalf("compat.json lacks the agent, QEMU or machine: %s", recorded)
		}
		for _, tc := range []struct {
			field string
			value any
			want  string
		}{
			{"machine", "pc-q35-99.0", "needs machine type pc-q35-99.0"},
			{"domain_type", "kvm", "needs domain type kvm"},
			{"agent", "9.0.0", "speaks protocol 9.0.0"},
			{"qemu", 99000000, "written by QEMU 99.0.0"},
		} {
			other := t.TempDir()
			dst := filepath.Join(other, "snapshots", "odd")
			os.MkdirAll(filepath.Dir(dst), 0o755)
			if out, err := exec.Command("cp", "-a", "--sparse=always", filepath.Join(stateDir, "snapshots", snap2), dst).CombinedOutput(); err != nil {
				t.Fatalf("cp: %v %s", err, out)
			}
			odd := map[string]any{}
			for k, v := range c {
				odd[k] = v
			}
			odd[tc.field] = tc.value
			b, _ := json.Marshal(odd)
			os.WriteFile(filepath.Join(dst, "compat.json"), b, 0o644)
			oref := testRegistry + "/" + registryRepo + "/" + runID + "-odd:latest"
			push(t, []string{"--state-dir", other}, "odd", oref)
			h5 := host2(t, "d", freeSubnet(t))
			r := kvbox(t, append(h5, "snapshots", "pull", "--insecure", oref, name(t, "rodd"))...)
			line := strings.TrimSpace(r.stderr)
			if r.code == 0 || !strings.Contains(line, tc.want) || strings.Count(line, "\n") != 0 {
				t.Errorf("pull of a snapshot whose %s is %v: want one line with %q, got %s", tc.field, tc.value, tc.want, r)
			}
			t.Logf("refused: %s", line)
			if ents, _ := os.ReadDir(filepath.Join(dirOf(h5), "registry-cache")); len(ents) != 0 {
				t.Errorf("an incompatible pull downloaded %d blobs first", len(ents))
			}
		}
	})
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	return s[strings.LastIndex(s, "\n")+1:]
}

func listBoxes2(t *testing.T, g []string) []box {
	t.Helper()
	var bs []box
	out := mustKvbox(t, append(g, "ls", "--json")...)
	if err := json.Unmarshal([]byte(out), &bs); err != nil {
		t.Fatalf("ls --json: %v\n%s", err, out)
	}
	return bs
}
