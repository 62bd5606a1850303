//go:build e2e

package e2e

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
)

// warmPool: kubernetes-sigs/agent-sandbox on kvbox nodes. A SandboxWarmPool
// of 2 from a SandboxTemplate whose pod is a warm clone of the pushed
// snapshot (the fleet's agent-sandbox controller makes the pods); then a
// SandboxClaim, Ready on one of the pool's clones that ran before the claim
// was made (adopted, not cloned for it) and serving the page, while the pool
// makes a new clone to be back at 2. Deleting claim and pool removes every
// box they had.
func (r *podsRun) warmPool() {
	pool, claim := "pool-"+r.id, "claim-"+r.id
	selector, warm := r.fillPool(pool)
	defer r.deleteObjects("sandboxwarmpool/"+pool, "sandboxtemplate/"+pool)
	t0 := time.Now()
	p, box := r.claimFromPool(pool, claim, warm)

	// The pool refills: two Ready clones besides the claimed one.
	poll(r.ctx, r.t, "the warm pool back at 2 Ready beside the claimed clone", func() bool {
		r.failIfPodFailed(selector)
		n := 0
		for _, q := range r.readyPods(selector) {
			if q.UID != p.UID {
				n++
			}
		}
		return n == 2
	})
	r.t.Logf("the pool back at 2 Ready %.1fs after the claim was made", time.Since(t0).Seconds())

	gone := map[string]bool{box: true}
	for _, q := range r.readyPods(selector) {
		gone[kvboxnode.BoxName(q.Namespace, q.Name, string(q.UID))] = true
	}
	r.deleteObjects("sandboxclaim/"+claim, "sandboxwarmpool/"+pool, "sandboxtemplate/"+pool)
	poll(r.ctx, r.t, "the boxes of the claim and the pool gone", func() bool {
		for b := range fleetBoxes(r.t, r.f) {
			if gone[b] {
				return false
			}
		}
		return true
	})
}

// fillPool makes the template and the warm pool of 2, waits for both of its
// clones to be Ready and returns the pool's pod selector and its pods.
func (r *podsRun) fillPool(pool string) (string, []corev1.Pod) {
	t, ctx := r.t, r.ctx
	r.applyManifest(pool+".yaml", fmt.Sprintf(`apiVersion: extensions.agents.x-k8s.io/v1beta1
kind: SandboxTemplate
metadata: {name: %[1]s, namespace: %[2]s}
spec:
  networkPolicyManagement: Unmanaged
  podTemplate:
    spec:
      runtimeClassName: %[3]s
      containers:
      - name: box
        image: %[4]s
        ports: [{containerPort: 8080}]
        resources: {requests: {cpu: "1", memory: 256Mi}}
---
apiVersion: extensions.agents.x-k8s.io/v1beta1
kind: SandboxWarmPool
metadata: {name: %[1]s, namespace: %[2]s}
spec:
  replicas: 2
  sandboxTemplateRef: {name: %[1]s}
`, pool, r.ns, kvboxnode.DefaultRuntimeClass, r.ref))
	t0 := time.Now()
	var selector string
	poll(ctx, t, "the warm pool's 2 sandboxes Ready", func() bool {
		var st struct {
			Status struct {
				ReadyReplicas int32  `json:"readyReplicas"`
				Selector      string `json:"selector"`
			} `json:"status"`
		}
		r.getObject("sandboxwarmpool/"+pool, &st)
		selector = st.Status.Selector
		r.failIfPodFailed(selector)
		return st.Status.ReadyReplicas == 2 && selector != ""
	})
	warm := r.readyPods(selector)
	if len(warm) != 2 {
		t.Fatalf("the warm pool is Ready with %d Ready pods (selector %q), want 2", len(warm), selector)
	}
	t.Logf("warm pool of 2 Ready %.1fs after it was made: %s, %s", time.Since(t0).Seconds(), warm[0].Name, warm[1].Name)
	return selector, warm
}

// claimFromPool claims a sandbox of the pool and checks the claim is Ready
// on one of the pool's clones made before it (warm), the same pod, serving
// the page; it returns that pod and its box.
func (r *podsRun) claimFromPool(pool, claim string, warm []corev1.Pod) (corev1.Pod, string) {
	t, ctx, f := r.t, r.ctx, r.f
	t0 := time.Now()
	r.applyManifest(claim+".yaml", fmt.Sprintf(`apiVersion: extensions.agents.x-k8s.io/v1beta1
kind: SandboxClaim
metadata: {name: %s, namespace: %s}
spec:
  warmPoolRef: {name: %s}
`, claim, r.ns, pool))
	var cs struct {
		Status struct {
			Conditions []metav1.Condition `json:"conditions"`
			Sandbox    struct {
				Name   string   `json:"name"`
				PodIPs []string `json:"podIPs"`
			} `json:"sandbox"`
		} `json:"status"`
	}
	poll(ctx, t, "claim "+claim+" Ready", func() bool {
		r.getObject("sandboxclaim/"+claim, &cs)
		return slices.ContainsFunc(cs.Status.Conditions, func(c metav1.Condition) bool {
			return c.Type == "Ready" && c.Status == metav1.ConditionTrue
		}) && len(cs.Status.Sandbox.PodIPs) > 0
	})
	readyAfter := time.Since(t0)
	claimed := slices.IndexFunc(warm, func(p corev1.Pod) bool { return p.Status.PodIP == cs.Status.Sandbox.PodIPs[0] })
	if claimed < 0 {
		t.Fatalf("claim %s is Ready on sandbox %s at %v, none of the pool's clones made before it (%s %s, %s %s)", claim,
			cs.Status.Sandbox.Name, cs.Status.Sandbox.PodIPs, warm[0].Name, warm[0].Status.PodIP, warm[1].Name, warm[1].Status.PodIP)
	}
	p := warm[claimed]
	cur, err := r.pods.Get(ctx, p.Name, metav1.GetOptions{})
	if err != nil || cur.UID != p.UID || !kvboxnode.PodReady(cur) {
		t.Fatalf("claimed pod %s: %v; want the same pod (uid %s), Ready", p.Name, err, p.UID)
	}
	box := checkServing(ctx, t, f, cur, r.page)
	t.Logf("claim %s Ready %.0f ms after it was made, on %s (box %s, made %.1fs before the claim)", claim,
		float64(readyAfter.Microseconds())/1000, p.Name, box, t0.Sub(p.CreationTimestamp.Time).Seconds())
	return p, box
}

// applyManifest applies YAML through the fleet's kubectl.
func (r *podsRun) applyManifest(name, yaml string) {
	path := filepath.Join(r.t.TempDir(), name)
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		r.t.Fatal(err)
	}
	if out, code := r.f.kubectl("apply", "-f", path); code != 0 {
		r.t.Fatalf("kubectl apply %s: exit %d\n%s", name, code, out)
	}
}

// getObject reads KIND/NAME of the run's namespace as JSON into v.
func (r *podsRun) getObject(obj string, v any) {
	out, code := r.f.kubectl("get", "-n", r.ns, obj, "-o", "json")
	if code != 0 {
		r.t.Fatalf("kubectl get %s: exit %d\n%s", obj, code, out)
	}
	if err := json.Unmarshal([]byte(out), v); err != nil {
		r.t.Fatalf("kubectl get %s: %v", obj, err)
	}
}

// deleteObjects deletes KIND/NAMEs of the run's namespace and waits for them
// to go; one already gone is fine.
func (r *podsRun) deleteObjects(objs ...string) {
	args := append([]string{"delete", "-n", r.ns, "--ignore-not-found", "--wait", "--timeout", "120s"}, objs...)
	if out, code := r.f.kubectl(args...); code != 0 {
		r.t.Errorf("kubectl delete %v: exit %d\n%s", objs, code, out)
	}
}

// failIfPodFailed ends the test when a pod the selector matches failed:
// a pool whose clones fail never becomes Ready.
func (r *podsRun) failIfPodFailed(selector string) {
	if selector == "" {
		return
	}
	l, err := r.pods.List(r.ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		r.t.Fatal(err)
	}
	for _, p := range l.Items {
		if p.Status.Phase == corev1.PodFailed {
			r.t.Fatalf("pod %s of the warm pool failed: %s: %s", p.Name, p.Status.Reason, p.Status.Message)
		}
	}
}

// readyPods lists the Ready pods the label selector matches.
func (r *podsRun) readyPods(selector string) []corev1.Pod {
	l, err := r.pods.List(r.ctx, metav1.ListOptions{LabelSelector: selector})
	if err != nil {
		r.t.Fatal(err)
	}
	var out []corev1.Pod
	for _, p := range l.Items {
		if p.DeletionTimestamp == nil && kvboxnode.PodReady(&p) {
			out = append(out, p)
		}
	}
	return out
}
