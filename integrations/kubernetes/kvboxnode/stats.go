package kvboxnode

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"strconv"
	"strings"
	"time"

	dto "github.com/prometheus/client_model/go"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
)

// podStats is one reading of a running pod's box.
type podStats struct {
	ps    *podState
	ns    string
	name  string
	uid   string
	cname string
	start metav1.Time
	st    BoxStats
	cores *uint64 // nanocores since the reading before, when there is one
}

// readStats reads every running pod's box.
func (p *Provider) readStats(ctx context.Context) []podStats {
	p.mu.Lock()
	all := make([]*podState, 0, len(p.pods))
	for _, ps := range p.pods {
		all = append(all, ps)
	}
	p.mu.Unlock()
	var out []podStats
	for _, ps := range all {
		ps.mu.Lock()
		box, up := ps.box, ps.boxUp
		x := podStats{ps: ps, ns: ps.pod.Namespace, name: ps.pod.Name, uid: string(ps.pod.UID), cname: ps.pod.Spec.Containers[0].Name, start: *ps.startTime}
		ps.mu.Unlock()
		if box == "" || !up {
			continue
		}
		st, err := p.lib.Stats(ctx, box)
		if err != nil {
			continue
		}
		x.st = st
		p.statsMu.Lock()
		if prev, ok := p.lastStat[box]; ok && st.At.After(prev.At) && st.CPUTime >= prev.CPUTime {
			c := uint64(float64(st.CPUTime-prev.CPUTime) / st.At.Sub(prev.At).Seconds())
			x.cores = &c
		}
		p.lastStat[box] = st
		p.statsMu.Unlock()
		out = append(out, x)
	}
	return out
}

// GetStatsSummary is the kubelet's /stats/summary (metrics-server, kubectl
// top): per pod, its box's CPU time and memory, the working set being
// what only the box holds (its private pages), the usage that and the
// snapshot's pages it maps (shared with its siblings).
func (p *Provider) GetStatsSummary(ctx context.Context) (*statsv1alpha1.Summary, error) {
	now := metav1.NewTime(p.now())
	s := &statsv1alpha1.Summary{Node: statsv1alpha1.NodeStats{NodeName: p.cfg.NodeName, StartTime: metav1.NewTime(bootTime())}}
	if cpu, ok := hostCPUTime(); ok {
		s.Node.CPU = &statsv1alpha1.CPUStats{Time: now, UsageCoreNanoSeconds: &cpu}
	}
	if total, avail, ok := hostMemory(); ok {
		used := total - avail
		s.Node.Memory = &statsv1alpha1.MemoryStats{Time: now, AvailableBytes: &avail, UsageBytes: &used, WorkingSetBytes: &used}
	}
	for _, x := range p.readStats(ctx) {
		t := metav1.NewTime(x.st.At)
		cpuNs := uint64(x.st.CPUTime)
		private, usage := uint64(x.st.Private), uint64(x.st.Private+x.st.Shared)
		cpu := &statsv1alpha1.CPUStats{Time: t, UsageCoreNanoSeconds: &cpuNs, UsageNanoCores: x.cores}
		mem := &statsv1alpha1.MemoryStats{Time: t, WorkingSetBytes: &private, RSSBytes: &private, UsageBytes: &usage}
		s.Pods = append(s.Pods, statsv1alpha1.PodStats{
			PodRef:     statsv1alpha1.PodReference{Name: x.name, Namespace: x.ns, UID: x.uid},
			StartTime:  x.start,
			CPU:        cpu,
			Memory:     mem,
			Containers: []statsv1alpha1.ContainerStats{{Name: x.cname, StartTime: x.start, CPU: cpu, Memory: mem}},
		})
	}
	return s, nil
}

// GetMetricsResource is the kubelet's /metrics/resource (metrics-server's
// source): the same readings as Prometheus metrics.
func (p *Provider) GetMetricsResource(ctx context.Context) ([]*dto.MetricFamily, error) {
	gauge, counter := dto.MetricType_GAUGE, dto.MetricType_COUNTER
	fam := func(name, help string, typ dto.MetricType) *dto.MetricFamily {
		return &dto.MetricFamily{Name: &name, Help: &help, Type: &typ}
	}
	label := func(kv ...string) []*dto.LabelPair {
		var out []*dto.LabelPair
		for i := 0; i+1 < len(kv); i += 2 {
			n, v := kv[i], kv[i+1]
			out = append(out, &dto.LabelPair{Name: &n, Value: &v})
		}
		return out
	}
	add := func(f *dto.MetricFamily, v float64, at time.Time, labels []*dto.LabelPair) {
		ms := at.UnixMilli()
		m := &dto.Metric{Label: labels, TimestampMs: &ms}
		if f.GetType() == dto.MetricType_COUNTER {
			m.Counter = &dto.Counter{Value: &v}
		} else {
			m.Gauge = &dto.Gauge{Value: &v}
		}
		f.Metric = append(f.Metric, m)
	}
	nodeCPU := fam("node_cpu_usage_seconds_total", "Cumulative cpu time consumed by the node in core-seconds", counter)
	nodeMem := fam("node_memory_working_set_bytes", "Current working set of the node in bytes", gauge)
	podCPU := fam("pod_cpu_usage_seconds_total", "Cumulative cpu time consumed by the pod in core-seconds", counter)
	podMem := fam("pod_memory_working_set_bytes", "Current working set of the pod in bytes: the box's private memory", gauge)
	cCPU := fam("container_cpu_usage_seconds_total", "Cumulative cpu time consumed by the container in core-seconds", counter)
	cMem := fam("container_memory_working_set_bytes", "Current working set of the container in bytes: the box's private memory", gauge)
	cStart := fam("container_start_time_seconds", "Start time of the container since unix epoch in seconds", gauge)
	scrape := fam("scrape_error", "1 if there was an error while getting container metrics, 0 otherwise", gauge)
	now := p.now()
	if cpu, ok := hostCPUTime(); ok {
		add(nodeCPU, float64(cpu)/1e9, now, nil)
	}
	if total, avail, ok := hostMemory(); ok {
		add(nodeMem, float64(total-avail), now, nil)
	}
	for _, x := range p.readStats(ctx) {
		pl := label("namespace", x.ns, "pod", x.name)
		cl := label("container", x.cname, "namespace", x.ns, "pod", x.name)
		add(podCPU, x.st.CPUTime.Seconds(), x.st.At, pl)
		add(podMem, float64(x.st.Private), x.st.At, pl)
		add(cCPU, x.st.CPUTime.Seconds(), x.st.At, cl)
		add(cMem, float64(x.st.Private), x.st.At, cl)
		add(cStart, float64(x.start.Unix()), x.st.At, cl)
	}
	add(scrape, 0, now, nil)
	return []*dto.MetricFamily{nodeCPU, nodeMem, podCPU, podMem, cCPU, cMem, cStart, scrape}, nil
}

// hostCPUTime is the CPU time the host spent busy, all CPUs, in ns
// (/proc/stat's first line less idle and iowait).
func hostCPUTime() (uint64, bool) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, false
	}
	line, _, _ := bytes.Cut(b, []byte("\n"))
	f := strings.Fields(string(line))
	if len(f) < 8 || f[0] != "cpu" {
		return 0, false
	}
	var busy uint64
	for i, v := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		n, _ := strconv.ParseUint(v, 10, 64)
		busy += n
	}
	// USER_HZ is 100 on Linux.
	return busy * 1e7, true
}

// hostMemory is MemTotal and MemAvailable in bytes.
func hostMemory() (total, avail uint64, ok bool) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, 0, false
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 3 {
			continue
		}
		v, _ := strconv.ParseUint(f[1], 10, 64)
		switch f[0] {
		case "MemTotal:":
			total = v * 1024
		case "MemAvailable:":
			avail = v * 1024
		}
	}
	return total, avail, total > 0
}

func bootTime() time.Time {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return time.Time{}
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "btime "); ok {
			n, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return time.Unix(n, 0)
		}
	}
	return time.Time{}
}
