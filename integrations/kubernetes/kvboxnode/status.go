package kvboxnode

import (
	"bufio"
	"context"
	"crypto/tls"
	"io"
	"net"
	"net/http"
	"strconv"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
)

// PodReady says a pod runs and its Ready condition is true, as the API
// server has its status: how the bench and the end-to-end tests read
// what a node reported.
func PodReady(p *corev1.Pod) bool {
	if p.Status.Phase != corev1.PodRunning {
		return false
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// podWithStatus is the pod as the API server has it, with the status this
// node gives it. The caller holds ps.mu.
func (p *Provider) podWithStatus(ps *podState) *corev1.Pod {
	pod := ps.pod.DeepCopy()
	st := &pod.Status
	st.Phase, st.Reason, st.Message = ps.phase, ps.reason, ps.msg
	st.HostIP = p.cfg.NodeIP
	st.HostIPs = []corev1.HostIP{{IP: p.cfg.NodeIP}}
	st.StartTime = ps.startTime.DeepCopy()
	if ps.ip != "" && !ps.terminal() {
		st.PodIP, st.PodIPs = ps.ip, []corev1.PodIP{{IP: ps.ip}}
	}
	c := pod.Spec.Containers[0]
	cs := corev1.ContainerStatus{Name: c.Name, Image: c.Image, ImageID: ps.imageID, Ready: ps.ready, RestartCount: ps.restarts}
	if ps.box != "" {
		cs.ContainerID = "kvbox://" + ps.box
	}
	started := ps.running != nil
	cs.Started = &started
	switch {
	case ps.terminated != nil:
		cs.State.Terminated = ps.terminated.DeepCopy()
		cs.State.Terminated.ContainerID = cs.ContainerID
	case ps.running != nil:
		cs.State.Running = ps.running.DeepCopy()
	case ps.waiting != nil:
		cs.State.Waiting = ps.waiting.DeepCopy()
	default:
		cs.State.Waiting = &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}
	}
	if ps.last != nil {
		cs.LastTerminationState.Terminated = ps.last.DeepCopy()
	}
	st.ContainerStatuses = []corev1.ContainerStatus{cs}
	now := metav1.NewTime(p.now())
	set := func(t corev1.PodConditionType, ok bool, reason string) {
		s := corev1.ConditionFalse
		if ok {
			s = corev1.ConditionTrue
		}
		if ps.conditionWas[t] != s {
			ps.conditionWas[t], ps.conditionSince[t] = s, now
		}
		c := corev1.PodCondition{Type: t, Status: s, LastTransitionTime: ps.conditionSince[t]}
		if !ok {
			c.Reason = reason
		}
		for i := range st.Conditions {
			if st.Conditions[i].Type == t {
				st.Conditions[i] = c
				return
			}
		}
		st.Conditions = append(st.Conditions, c)
	}
	set(corev1.PodReadyToStartContainers, ps.boxUp, "")
	set(corev1.PodInitialized, true, "")
	notReady := "ContainersNotReady"
	if ps.terminal() {
		notReady = "PodCompleted"
	}
	set(corev1.ContainersReady, ps.ready, notReady)
	set(corev1.PodReady, ps.ready, notReady)
	return pod
}

// prober runs a pod's readinessProbe and counts its results.
type prober struct {
	ok, failed int32
	state      bool
}

// ready says whether the pod is ready: its box's agent answers, each TCP
// port its container declares is open in the guest, and its
// readinessProbe (once past its initial delay) passes as often as it
// must. err says the agent could not be reached at all.
func (p *Provider) ready(ctx context.Context, ps *podState, pod *corev1.Pod, pr *prober, probing bool) (bool, error) {
	ps.mu.Lock()
	box, ip, env := ps.box, ps.ip, ps.env
	ps.mu.Unlock()
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := p.lib.Ping(pctx, box); err != nil {
		return false, err
	}
	c := &pod.Spec.Containers[0]
	for _, port := range c.Ports {
		if port.Protocol != "" && port.Protocol != corev1.ProtocolTCP {
			continue
		}
		conn, err := p.lib.Dial(pctx, box, "127.0.0.1:"+strconv.Itoa(int(port.ContainerPort)))
		if err != nil {
			return false, nil
		}
		conn.Close()
	}
	r := c.ReadinessProbe
	if r == nil {
		return true, nil
	}
	if !probing {
		return false, nil
	}
	timeout := time.Duration(max(r.TimeoutSeconds, 1)) * time.Second
	passed := p.probe(ctx, box, ip, pod, env, r, timeout)
	success, failure := max(r.SuccessThreshold, 1), max(r.FailureThreshold, 1)
	if passed {
		pr.ok, pr.failed = pr.ok+1, 0
		if pr.ok >= success {
			pr.state = true
		}
	} else {
		pr.failed, pr.ok = pr.failed+1, 0
		if pr.failed >= failure {
			pr.state = false
		}
	}
	return pr.state, nil
}

// probe runs a readinessProbe once, through the box's agent.
func (p *Provider) probe(ctx context.Context, box, ip string, pod *corev1.Pod, env []string, r *corev1.Probe, timeout time.Duration) bool {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	switch {
	case r.Exec != nil:
		req := execRequest(pod, env, r.Exec.Command)
		code, err := p.lib.Exec(ctx, box, req, nil, io.Discard, io.Discard, nil)
		return err == nil && code == 0
	case r.TCPSocket != nil:
		pt, ok := probePort(pod, r.TCPSocket.Port)
		if !ok {
			return false
		}
		conn, err := p.lib.Dial(ctx, box, "127.0.0.1:"+pt)
		if err != nil {
			return false
		}
		conn.Close()
		return true
	case r.HTTPGet != nil:
		return p.probeHTTP(ctx, box, ip, pod, r.HTTPGet)
	}
	return false
}

// probePort is the guest port a probe names: its number, or the name of
// one of the container's ports.
func probePort(pod *corev1.Pod, v intstr.IntOrString) (string, bool) {
	if v.Type == intstr.Int {
		return strconv.Itoa(v.IntValue()), true
	}
	for _, cp := range pod.Spec.Containers[0].Ports {
		if cp.Name == v.StrVal {
			return strconv.Itoa(int(cp.ContainerPort)), true
		}
	}
	return "", false
}

// What an httpGet probe reads of the guest's answer: its status line and
// headers, and of its body (read and dropped, as a kubelet reads at most
// this much of it).
const (
	maxProbeHeaderBytes = 64 << 10
	maxProbeBodyBytes   = 10 << 10
)

// probeHTTP is an httpGet probe: one request through the box's agent
// (over TLS unverified for HTTPS, as a kubelet), passed by a 2xx or 3xx.
// The guest's answer is untrusted: at most maxProbeHeaderBytes of status
// line and headers and maxProbeBodyBytes of body are read, and nothing
// after ctx's deadline (the probe's timeoutSeconds).
func (p *Provider) probeHTTP(ctx context.Context, box, ip string, pod *corev1.Pod, g *corev1.HTTPGetAction) bool {
	pt, ok := probePort(pod, g.Port)
	if !ok {
		return false
	}
	conn, err := p.lib.Dial(ctx, box, "127.0.0.1:"+pt)
	if err != nil {
		return false
	}
	defer conn.Close()
	// A read blocked past the deadline ends with the connection, whether
	// or not the stream honours deadlines.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	if d, ok := ctx.Deadline(); ok {
		conn.SetDeadline(d)
	}
	host := ip
	if g.Host != "" {
		host = g.Host
	}
	if g.Scheme == corev1.URISchemeHTTPS {
		// As a kubelet: TLS without verifying the certificate.
		tc := tls.Client(conn, &tls.Config{InsecureSkipVerify: true, ServerName: host})
		if err := tc.HandshakeContext(ctx); err != nil {
			return false
		}
		conn = tc
	}
	req, err := probeRequest(ctx, g, host, pt)
	if err != nil {
		return false
	}
	if err := req.Write(conn); err != nil {
		return false
	}
	// The status line and headers within their bound: past it the read
	// ends, and a header cut short fails the probe.
	lr := &io.LimitedReader{R: conn, N: maxProbeHeaderBytes}
	resp, err := http.ReadResponse(bufio.NewReaderSize(lr, 4<<10), req)
	if err != nil {
		return false
	}
	lr.N += maxProbeBodyBytes
	io.Copy(io.Discard, io.LimitReader(resp.Body, maxProbeBodyBytes))
	resp.Body.Close()
	return resp.StatusCode >= 200 && resp.StatusCode < 400
}

// probeRequest is an httpGet probe's request: its path ("/" for none),
// its headers (a Host header sets the request's host), kube-probe's
// user agent, and the connection closed after it.
func probeRequest(ctx context.Context, g *corev1.HTTPGetAction, host, port string) (*http.Request, error) {
	path := g.Path
	if path == "" {
		path = "/"
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+net.JoinHostPort(host, port)+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("User-Agent", "kube-probe/kvbox")
	for _, h := range g.HTTPHeaders {
		if h.Name == "Host" {
			req.Host = h.Value
			continue
		}
		req.Header.Add(h.Name, h.Value)
	}
	req.Close = true
	return req, nil
}
