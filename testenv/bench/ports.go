package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os/exec"
	"regexp"
	"sync"
	"time"
)

// benchPorts compares `kvbox port-forward` (TCP through the agent's
// virtio-serial channel) with a direct TCP connection to the box's address
// on the bridge, in the same run against the same busybox httpd: download
// throughput of a 32 MB file, the time of one HTTP request on a new
// connection, and the wall time of 20 requests at once.
func benchPorts(ctx context.Context, e *env) error {
	const box = "bench-pf"
	if _, err := e.kvboxCLI(ctx, "new", "--image", e.im.Name, "--cpus", "1", "--memory", fmt.Sprint(e.memBytes>>20)+"M", box); err != nil {
		return err
	}
	defer e.kvboxCLI(context.Background(), "rm", "--force", box)
	if _, err := e.kvboxCLI(ctx, "exec", box, "--", "sh", "-c", "mkdir -p /www && echo hi > /www/index.html && "+
		"dd if=/dev/urandom of=/www/big bs=1M count=32 2>/dev/null && setsid httpd -p 8000 -h /www </dev/null >/dev/null 2>&1; sleep 0.3"); err != nil {
		return err
	}
	out, err := exec.CommandContext(ctx, "bin/kvbox", "--state-dir", e.stateDir, "ls", "--json").Output()
	if err != nil {
		return err
	}
	var boxes []struct{ Name, IP string }
	json.Unmarshal(out, &boxes)
	ip := ""
	for _, b := range boxes {
		if b.Name == box {
			ip = b.IP
		}
	}
	pf := exec.CommandContext(ctx, "bin/kvbox", "--state-dir", e.stateDir, "port-forward", box, "0:8000")
	stdout, _ := pf.StdoutPipe()
	if err := pf.Start(); err != nil {
		return err
	}
	defer func() { pf.Process.Kill(); pf.Wait() }()
	line, err := bufio.NewReader(stdout).ReadString('\n')
	m := regexp.MustCompile(`^forwarding (\S+) `).FindStringSubmatch(line)
	if err != nil || m == nil {
		return fmt.Errorf("port-forward: %q %v", line, err)
	}
	peers := []struct{ name, base string }{{"port-forward", "http://" + m[1]}, {"direct TCP", "http://" + ip + ":8000"}}
	res := map[string][3]time.Duration{}
	for round := 0; round < 3; round++ { // alternated, so load hits both
		for _, p := range peers {
			t, err := timePath(p.base)
			if err != nil {
				return fmt.Errorf("%s: %v", p.name, err)
			}
			r := res[p.name]
			for i := range r {
				r[i] += t[i]
			}
			res[p.name] = r
		}
	}
	// The channel itself, without a TCP stream: exec cat of the same file.
	var cat []time.Duration
	for range 3 {
		cmd := exec.CommandContext(ctx, "bin/kvbox", "--state-dir", e.stateDir, "exec", box, "--", "cat", "/www/big")
		t0 := time.Now()
		if err := cmd.Run(); err != nil {
			return fmt.Errorf("exec cat: %v", err)
		}
		cat = append(cat, time.Since(t0))
	}
	fmt.Printf("%-14s %12s %16s %18s\n", "path", "32 MB MB/s", "1 request (ms)", "20 at once (ms)")
	for _, p := range peers {
		r := res[p.name]
		fmt.Printf("%-14s %12.1f %16.2f %18.1f\n", p.name, 32*3/r[0].Seconds(), ms(r[1])/3, ms(r[2])/3)
	}
	fmt.Printf("%-14s %12.1f   (the agent channel without TCP: kvbox exec BOX -- cat, median of 3)\n", "exec cat", 32/median(cat).Seconds())
	f, d := res[peers[0].name], res[peers[1].name]
	fmt.Printf("port-forward / direct: throughput %.2fx, one request %.2fx the time, 20 at once %.2fx the time (means of 3 alternated rounds, one request: median of 20 per round)\n",
		d[0].Seconds()/f[0].Seconds(), ms(f[1])/ms(d[1]), ms(f[2])/ms(d[2]))
	return nil
}

// httpGet fetches url on a new connection and returns the body's length.
func httpGet(url string) (int64, error) {
	c := &http.Client{Timeout: 2 * time.Minute, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := c.Get(url)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	return io.Copy(io.Discard, resp.Body)
}

// timePath times one round against the server at base: the 32 MB download,
// the median of 20 single requests, and 20 requests at once.
func timePath(base string) ([3]time.Duration, error) {
	var r [3]time.Duration
	t0 := time.Now()
	if n, err := httpGet(base + "/big"); err != nil || n != 32<<20 {
		return r, fmt.Errorf("%d bytes, %v", n, err)
	}
	r[0] = time.Since(t0)
	var one []time.Duration
	for range 20 {
		t0 := time.Now()
		if _, err := httpGet(base + "/index.html"); err != nil {
			return r, err
		}
		one = append(one, time.Since(t0))
	}
	r[1] = median(one)
	t0 = time.Now()
	errs := make(chan error, 20)
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := httpGet(base + "/index.html"); err != nil {
				errs <- err
			}
		}()
	}
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return r, fmt.Errorf("parallel: %v", err)
	}
	r[2] = time.Since(t0)
	return r, nil
}
