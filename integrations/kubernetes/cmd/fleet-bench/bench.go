package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/integrations/kubernetes/kvboxnode"
	"kvbox.dev/kvbox/testenv/benchstat"
)

const (
	ns = "default"
	// benchLabel marks every pod the bench makes; the tracker watches
	// these.
	benchLabel = "kvbox.dev/bench"
	// How long one pod, or the whole Deployment, may take to run before
	// the bench gives up (a bound on waiting, not a figure).
	podTimeout = 5 * time.Minute
)

// bench pushes the snapshot, then times the two sections and prints them.
func bench(ctx context.Context, f *fleet, cl *cleanups) error {
	id := randomID()
	ref, digest, err := pushSource(ctx, f.o, cl, id)
	if err != nil {
		return err
	}
	tr, err := startTracker(ctx, f.client)
	if err != nil {
		return err
	}
	removeBenchPods(f, cl)
	snap, err := warmUp(ctx, f, tr, id, ref, digest)
	if err != nil {
		return err
	}
	var t fleetTimes
	if err := t.podsAndCLI(ctx, f, tr, id, ref, snap); err != nil {
		return err
	}
	if err := t.scaleAndCount(ctx, f, tr, id, ref, snap); err != nil {
		return err
	}
	t.print(f, ref, snap)
	return nil
}

// removeBenchPods has the bench's Deployments and pods removed first at
// the end: before the node goes, so that it removes their boxes itself;
// what is left is removed from its state dir after.
func removeBenchPods(f *fleet, cl *cleanups) {
	pods := f.client.CoreV1().Pods(ns)
	cl.add(func() error {
		dctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		f.client.AppsV1().Deployments(ns).DeleteCollection(dctx, metav1.DeleteOptions{}, metav1.ListOptions{LabelSelector: benchLabel})
		zero := int64(0)
		if err := pods.DeleteCollection(dctx, metav1.DeleteOptions{GracePeriodSeconds: &zero}, metav1.ListOptions{LabelSelector: benchLabel}); err != nil {
			return fmt.Errorf("deleting the bench's pods: %w", err)
		}
		return nil
	})
}

// warmUp runs a first pod, which pulls the snapshot into the node's cache,
// and a first CLI clone of that very snapshot (snap, its name in the
// node's cache): not counted, they pay for the pull and the page cache.
func warmUp(ctx context.Context, f *fleet, tr *tracker, id, ref, digest string) (snap string, err error) {
	say("pushed %s (%s); the first pod pulls it", ref, digest)
	first, err := timePod(ctx, f, tr, "fleetbench-first-"+id, ref)
	if err != nil {
		return "", err
	}
	if snap, err = f.cachedSnapshot(digest); err != nil {
		return "", err
	}
	say("first pod Running %.0f ms after its creation (its pull included); the node caches the snapshot as %s", ms(first.running), snap)
	if _, err := f.kvbox("new", "--from", snap, "fleetbench-cli-first"); err != nil {
		return "", err
	}
	if _, err := f.kvbox("rm", "--force", "fleetbench-cli-first"); err != nil {
		return "", err
	}
	return snap, nil
}

// fleetTimes is what the bench measured: pods one at a time beside the
// CLI's clones, then a Deployment scaled up beside kvbox new --count.
type fleetTimes struct {
	podRunning, podReady, cli []time.Duration
	dep                       scaleTimes
	many                      time.Duration
}

// podsAndCLI times o.n pods created one at a time, each followed by a
// kvbox new --from of the same snapshot (removed at once).
func (t *fleetTimes) podsAndCLI(ctx context.Context, f *fleet, tr *tracker, id, ref, snap string) error {
	for i := range f.o.n {
		if err := ctx.Err(); err != nil {
			return err
		}
		r, err := timePod(ctx, f, tr, fmt.Sprintf("fleetbench-%s-%d", id, i), ref)
		if err != nil {
			return err
		}
		t.podRunning, t.podReady = append(t.podRunning, r.running), append(t.podReady, r.ready)
		box := fmt.Sprintf("fleetbench-cli-%d", i)
		d, err := f.kvbox("new", "--from", snap, box)
		if err != nil {
			return err
		}
		t.cli = append(t.cli, d)
		if _, err := f.kvbox("rm", "--force", box); err != nil {
			return err
		}
		say("%d/%d: pod Running %.0f ms (Ready %.0f ms), kvbox new --from %.0f ms", i+1, f.o.n, ms(r.running), ms(r.ready), ms(d))
	}
	return nil
}

// scaleAndCount times a Deployment scaled 0 -> o.replicas, then kvbox new
// --from --count o.replicas (its boxes removed after).
func (t *fleetTimes) scaleAndCount(ctx context.Context, f *fleet, tr *tracker, id, ref, snap string) error {
	replicas := f.o.replicas
	dep, err := timeScale(ctx, f, tr, "fleetbench-dep-"+id, ref, replicas)
	if err != nil {
		return err
	}
	t.dep = dep
	say("Deployment 0 → %d: all Running in %.0f ms", replicas, ms(dep.all))
	if err := ctx.Err(); err != nil {
		return err
	}
	t0 := time.Now()
	_, err = f.kvbox("new", "--from", snap, "--count", fmt.Sprint(replicas), "fleetbench-many")
	t.many = time.Since(t0)
	rm := []string{"rm", "--force"}
	for i := 1; i <= replicas; i++ {
		rm = append(rm, fmt.Sprintf("fleetbench-many-%d", i))
	}
	if _, rerr := f.kvbox(rm...); err == nil {
		err = rerr
	}
	if err != nil {
		return err
	}
	say("kvbox new --from --count %d: %.0f ms", replicas, ms(t.many))
	return nil
}

// print prints the fleet section: the setting, medians and 90th
// percentiles, and the ratios to the CLI.
func (t *fleetTimes) print(f *fleet, ref, snap string) {
	o := f.o
	podRunning, podReady, cli, dep, many := t.podRunning, t.podReady, t.cli, t.dep, t.many
	fmt.Printf("kvbox fleet bench: image %s, %s RAM, domain type %s; one kvbox-node (%s, podCIDR %s) on this host's libvirtd\n",
		o.image, o.memory, f.domain, nodeName, f.subnet)
	fmt.Printf("\n== fleet\n")
	fmt.Printf("snapshot %s, cached on the node as %s; the CLI clones it in the node's state dir\n", ref, snap)
	fmt.Printf("%d pods created one at a time and %d kvbox new --from, alternated; pod times from the create call to the watch seeing it\n", o.n, o.n)
	fmt.Printf("  %-44s %10s %10s\n", "", "p50", "p90")
	row := func(what string, ds []time.Duration) {
		fmt.Printf("  %-44s %7.0f ms %7.0f ms\n", what, ms(pct(ds, 50)), ms(pct(ds, 90)))
	}
	row("pod create to Running", podRunning)
	row("pod create to Ready", podReady)
	row("CLI kvbox new --from", cli)
	fmt.Printf("ratio pod create to Running / kvbox new --from: p50 %.2fx, p90 %.2fx (pod minus CLI, p50: %+.0f ms)\n",
		ratio(pct(podRunning, 50), pct(cli, 50)), ratio(pct(podRunning, 90), pct(cli, 90)), ms(pct(podRunning, 50)-pct(cli, 50)))
	fmt.Printf("Deployment scaled 0 -> %d, from the scale call: first pod Running %.0f ms, all %d Running %.0f ms; each pod p50 %.0f ms, p90 %.0f ms\n",
		o.replicas, ms(slices.Min(dep.each)), o.replicas, ms(dep.all), ms(pct(dep.each, 50)), ms(pct(dep.each, 90)))
	fmt.Printf("peer: kvbox new --from --count %d: %.0f ms\n", o.replicas, ms(many))
	fmt.Printf("ratio Deployment 0 -> %d all Running / kvbox new --from --count %d: %.2fx\n", o.replicas, o.replicas, ratio(dep.all, many))
}

func randomID() string {
	b := make([]byte, 4)
	rand.Read(b)
	return hex.EncodeToString(b)
}

// pushSource makes a box of the image in the source state dir, freezes it
// into a snapshot and pushes that to the test registry under the bench's
// name; box and local snapshot go at once, the pushed manifest at the end.
// It returns the reference and the manifest's digest.
func pushSource(ctx context.Context, o *options, cl *cleanups, id string) (ref, digest string, err error) {
	src := "fleetbench-src-" + id
	kv := func(args ...string) error {
		_, err := runKvbox(o.kvbox, append([]string{"--state-dir", o.sourceDir}, args...)...)
		return err
	}
	say("making the snapshot: a box of %s in %s, frozen, pushed to %s", o.image, o.sourceDir, o.registry)
	defer kv("rm", "--force", src)
	if err := kv("new", "--image", o.image, "--cpus", "1", "--memory", o.memory, "--disk", "1G", src); err != nil {
		return "", "", err
	}
	if err := ctx.Err(); err != nil {
		return "", "", err
	}
	defer kv("snapshots", "rm", src)
	if err := kv("snapshots", "new", src, src); err != nil {
		return "", "", err
	}
	if err := kv("rm", "--force", src); err != nil {
		return "", "", err
	}
	ref = o.registry + "/fleet-bench/" + o.image + "-" + id + ":v1"
	r, err := name.ParseReference(ref, name.Insecure)
	if err != nil {
		return "", "", err
	}
	cl.add(func() error {
		// The manifest, by digest: the tag goes with it. Its blobs stay
		// until the registry's garbage collection.
		d, err := remote.Head(r)
		if err != nil {
			return fmt.Errorf("the pushed snapshot %s: %w", ref, err)
		}
		if err := remote.Delete(r.Context().Digest(d.Digest.String())); err != nil {
			return fmt.Errorf("deleting the pushed snapshot %s: %w", ref, err)
		}
		return nil
	})
	if err := kv("snapshots", "push", "--insecure", src, ref); err != nil {
		return "", "", err
	}
	d, err := remote.Head(r, remote.WithContext(ctx))
	if err != nil {
		return "", "", fmt.Errorf("the pushed snapshot %s: %w", ref, err)
	}
	return ref, d.Digest.String(), nil
}

// podSpec is a pod of the bench's snapshot, requesting its size (1 vCPU,
// the source box's RAM): a kvbox node refuses a pod that asks for less.
func podSpec(o *options, ref string) corev1.PodSpec {
	rc := kvboxnode.DefaultRuntimeClass
	mem, _ := base.ParseSize(o.memory) // checked by main
	req := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("1"), corev1.ResourceMemory: *resource.NewQuantity(mem, resource.BinarySI)}
	return corev1.PodSpec{RuntimeClassName: &rc, Containers: []corev1.Container{{Name: "box", Image: ref,
		Resources: corev1.ResourceRequirements{Requests: req}}}}
}

type podTimes struct{ running, ready time.Duration }

// timePod creates a pod and times it from the create call to the watch
// seeing it Running, and Ready; then deletes it and waits until it is gone
// (its box removed by the node), untimed.
func timePod(ctx context.Context, f *fleet, tr *tracker, podName, ref string) (podTimes, error) {
	pods := f.client.CoreV1().Pods(ns)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: podName, Labels: map[string]string{benchLabel: "pod"}}, Spec: podSpec(f.o, ref)}
	t0 := time.Now()
	made, err := pods.Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		return podTimes{}, err
	}
	wctx, cancel := context.WithTimeout(ctx, podTimeout)
	defer cancel()
	var r podTimes
	err = tr.wait(wctx, func(s *trackState) (bool, error) {
		if msg, ok := s.failed[made.UID]; ok {
			return false, fmt.Errorf("pod %s failed: %s", podName, msg)
		}
		run, ok1 := s.running[made.UID]
		rdy, ok2 := s.ready[made.UID]
		r = podTimes{run.Sub(t0), rdy.Sub(t0)}
		return ok1 && ok2, nil
	})
	if err != nil {
		return r, fmt.Errorf("pod %s Running and Ready: %w", podName, err)
	}
	if err := pods.Delete(ctx, podName, metav1.DeleteOptions{}); err != nil {
		return r, err
	}
	return r, waitGone(ctx, f, "pod "+podName, func(ctx context.Context) (bool, error) {
		_, err := pods.Get(ctx, podName, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return true, nil
		}
		return false, err
	})
}

func waitGone(ctx context.Context, f *fleet, what string, gone wait.ConditionWithContextFunc) error {
	wctx, cancel := context.WithTimeout(ctx, podTimeout)
	defer cancel()
	if err := wait.PollUntilContextCancel(wctx, 200*time.Millisecond, true, gone); err != nil {
		return fmt.Errorf("waiting for %s to go: %w", what, err)
	}
	return nil
}

type scaleTimes struct {
	all  time.Duration   // the scale call to the last pod Running
	each []time.Duration // the scale call to each pod Running
}

// timeScale makes a Deployment of 0 replicas, then times the scale call to
// replicas up to that many of its pods Running; then scales it back to 0,
// waits until its pods are gone, and deletes it, untimed.
func timeScale(ctx context.Context, f *fleet, tr *tracker, depName, ref string, replicas int) (scaleTimes, error) {
	deps := f.client.AppsV1().Deployments(ns)
	labels := map[string]string{benchLabel: depName}
	zero := int32(0)
	dep := &appsv1.Deployment{ObjectMeta: metav1.ObjectMeta{Name: depName, Labels: map[string]string{benchLabel: "deployment"}},
		Spec: appsv1.DeploymentSpec{Replicas: &zero, Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{ObjectMeta: metav1.ObjectMeta{Labels: labels}, Spec: podSpec(f.o, ref)}}}
	if _, err := deps.Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		return scaleTimes{}, err
	}
	// Observed by its controller (its ReplicaSet made) before the timing.
	if err := waitGone(ctx, f, "the Deployment's first rollout", func(ctx context.Context) (bool, error) {
		d, err := deps.Get(ctx, depName, metav1.GetOptions{})
		return err == nil && d.Status.ObservedGeneration >= d.Generation, err
	}); err != nil {
		return scaleTimes{}, err
	}
	sc, err := deps.GetScale(ctx, depName, metav1.GetOptions{})
	if err != nil {
		return scaleTimes{}, err
	}
	sc.Spec.Replicas = int32(replicas)
	t0 := time.Now()
	if _, err := deps.UpdateScale(ctx, depName, sc, metav1.UpdateOptions{}); err != nil {
		return scaleTimes{}, err
	}
	wctx, cancel := context.WithTimeout(ctx, podTimeout)
	defer cancel()
	var r scaleTimes
	err = tr.wait(wctx, func(s *trackState) (bool, error) {
		r.each = r.each[:0]
		for uid, l := range s.labels {
			if l != depName {
				continue
			}
			if msg, ok := s.failed[uid]; ok {
				return false, fmt.Errorf("a pod of the Deployment failed: %s", msg)
			}
			if at, ok := s.running[uid]; ok {
				r.each = append(r.each, at.Sub(t0))
			}
		}
		return len(r.each) >= replicas, nil
	})
	if err != nil {
		return r, fmt.Errorf("the Deployment's %d pods Running: %w (%d were)", replicas, err, len(r.each))
	}
	r.all = slices.Max(r.each)

	sc, err = deps.GetScale(ctx, depName, metav1.GetOptions{})
	if err != nil {
		return r, err
	}
	sc.Spec.Replicas = 0
	if _, err := deps.UpdateScale(ctx, depName, sc, metav1.UpdateOptions{}); err != nil {
		return r, err
	}
	sel := benchLabel + "=" + depName
	if err := waitGone(ctx, f, "the Deployment's pods", func(ctx context.Context) (bool, error) {
		l, err := f.client.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{LabelSelector: sel})
		return err == nil && len(l.Items) == 0, err
	}); err != nil {
		return r, err
	}
	return r, deps.Delete(ctx, depName, metav1.DeleteOptions{})
}

func ratio(a, b time.Duration) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// The timings' summaries, shared with the other bench.
var pct, ms = benchstat.Pct, benchstat.Ms
