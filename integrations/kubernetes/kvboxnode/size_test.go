package kvboxnode

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// A pod's size is its snapshot's: a pod without requests asks for nothing
// and is refused, saying what the snapshot needs; so are requests or
// limits below the snapshot's vCPUs, RAM or disk. Requests of the size
// pass, with or without limits above it.
func TestCheckFits(t *testing.T) {
	s := Snapshot{Name: "pod-sha256-ab", CPUs: 2, Memory: 512 << 20, Disk: 4 << 30}
	rl := func(kv ...string) corev1.ResourceList {
		l := corev1.ResourceList{}
		for i := 0; i < len(kv); i += 2 {
			l[corev1.ResourceName(kv[i])] = resource.MustParse(kv[i+1])
		}
		return l
	}
	for _, tc := range []struct {
		name     string
		req, lim corev1.ResourceList
		want     string // "" passes
	}{
		{"no requests", nil, nil, "no requests.cpu"},
		{"memory not requested", rl("cpu", "2"), nil, "no requests.memory"},
		{"cpu requested below the vCPUs", rl("cpu", "500m", "memory", "512Mi"), nil, "requests.cpu 500m is less than the snapshot's vCPUs (2)"},
		{"memory requested below the RAM", rl("cpu", "2", "memory", "256Mi"), nil, "requests.memory 256Mi is less than the snapshot's RAM (512Mi)"},
		{"a memory limit below the RAM", rl("cpu", "2", "memory", "512Mi"), rl("memory", "300Mi"), "limits.memory 300Mi"},
		{"disk requested below the snapshot's", rl("cpu", "2", "memory", "512Mi", "ephemeral-storage", "1Gi"), nil, "requests.ephemeral-storage 1Gi"},
		{"requests of the size", rl("cpu", "2", "memory", "512Mi"), nil, ""},
		{"more, and limits", rl("cpu", "3", "memory", "1Gi", "ephemeral-storage", "8Gi"), rl("cpu", "4", "memory", "2Gi"), ""},
	} {
		p := testPod("web", "u1")
		p.Spec.Containers[0].Resources = corev1.ResourceRequirements{Requests: tc.req, Limits: tc.lim}
		err := CheckFits(p, s)
		switch {
		case tc.want == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
			t.Errorf("%s: %v; want a refusal with %q", tc.name, err, tc.want)
		case tc.want != "" && !strings.Contains(err.Error(), "cpu: 2, memory: 512Mi"):
			t.Errorf("%s: %q does not say what the snapshot needs", tc.name, err)
		}
	}
}

// A pod that would take the node past its allocatable fails as a
// kubelet's admission fails it (phase Failed, reason OutOfmemory, its
// message), and gets no box; once a box is gone its room is the next
// pod's.
func TestProviderAdmitsWithinAllocatable(t *testing.T) {
	lib := newFakeLib()
	p, cancel := testProvider(t, lib, &apiPods{pods: map[string]*corev1.Pod{}})
	defer cancel()
	p.cfg.Allocatable = Capacity{CPUs: 8, Memory: 600 << 20, Boxes: 110}.ResourceList()
	one, two, three := testPod("web-1", "11111111"), testPod("web-2", "22222222"), testPod("web-3", "33333333")
	for _, pod := range []*corev1.Pod{one, two} {
		if err := p.CreatePod(context.Background(), pod); err != nil {
			t.Fatal(err)
		}
		waitStatus(t, p, pod.Name, ready)
	}
	if err := p.CreatePod(context.Background(), three); err != nil {
		t.Fatal(err)
	}
	st := waitStatus(t, p, "web-3", func(st *corev1.PodStatus) bool { return st.Phase != corev1.PodPending })
	if st.Phase != corev1.PodFailed || st.Reason != "OutOfmemory" ||
		!strings.Contains(st.Message, "Node didn't have enough resource: memory, requested: 268435456, used: 536870912, capacity: 629145600") {
		t.Errorf("a third pod of 256Mi on a node of 600Mi: %s %s: %s", st.Phase, st.Reason, st.Message)
	}
	if _, ok := lib.box(BoxName("team", "web-3", "33333333")); ok {
		t.Error("the pod refused for memory has a box")
	}
	del := one.DeepCopy()
	now := metav1.Now()
	del.DeletionTimestamp = &now
	if err := p.DeletePod(context.Background(), del); err != nil {
		t.Fatal(err)
	}
	four := testPod("web-4", "44444444")
	if err := p.CreatePod(context.Background(), four); err != nil {
		t.Fatal(err)
	}
	waitStatus(t, p, "web-4", ready)
}
