package kvboxnode

import (
	"context"
	"fmt"
	"math"
	"sort"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
)

// Objects reads the ConfigMaps and Secrets a pod names. kvbox-node reads
// each one a pod names when it starts the pod, with the node's own rights
// (the API server's Node authorizer lets a node read those of pods bound
// to it, and no other): it never watches them cluster-wide.
type Objects interface {
	ConfigMap(ctx context.Context, namespace, name string) (*corev1.ConfigMap, error)
	Secret(ctx context.Context, namespace, name string) (*corev1.Secret, error)
}

// envContext is what a pod's environment may refer to beyond its spec.
type envContext struct {
	hostIP, podIP string
	// allocatable is the node's, for a resourceFieldRef of a limit the
	// container does not set (as a kubelet does).
	allocatable corev1.ResourceList
}

// Env is the container's environment as a kubelet makes it: envFrom first
// (ConfigMaps and Secrets, each key with the prefix), then env in order,
// each value with $(NAME) references to variables defined before it
// expanded. A ConfigMap, Secret or key that is missing and not optional
// is an error that names it.
func Env(ctx context.Context, p *corev1.Pod, objs Objects, ec envContext) ([]string, error) {
	c := &p.Spec.Containers[0]
	vars := map[string]string{}
	var order []string
	set := func(k, v string) {
		if _, ok := vars[k]; !ok {
			order = append(order, k)
		}
		vars[k] = v
	}
	for _, from := range c.EnvFrom {
		var data map[string]string
		switch {
		case from.ConfigMapRef != nil:
			cm, err := objs.ConfigMap(ctx, p.Namespace, from.ConfigMapRef.Name)
			if optionalMissing(err, from.ConfigMapRef.Optional) {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("envFrom configMap %q: %w", from.ConfigMapRef.Name, err)
			}
			data = cm.Data
		case from.SecretRef != nil:
			s, err := objs.Secret(ctx, p.Namespace, from.SecretRef.Name)
			if optionalMissing(err, from.SecretRef.Optional) {
				continue
			}
			if err != nil {
				return nil, fmt.Errorf("envFrom secret %q: %w", from.SecretRef.Name, err)
			}
			data = map[string]string{}
			for k, v := range s.Data {
				data[k] = string(v)
			}
		}
		keys := make([]string, 0, len(data))
		for k := range data {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			set(from.Prefix+k, data[k])
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			set(e.Name, Expand(e.Value, vars))
			continue
		}
		v, skip, err := valueFrom(ctx, p, c, e, objs, ec)
		if err != nil {
			return nil, fmt.Errorf("env %s: %w", e.Name, err)
		}
		if !skip {
			set(e.Name, v)
		}
	}
	out := make([]string, 0, len(order))
	for _, k := range order {
		out = append(out, k+"="+vars[k])
	}
	return out, nil
}

func optionalMissing(err error, optional *bool) bool {
	return err != nil && apierrors.IsNotFound(err) && optional != nil && *optional
}

func valueFrom(ctx context.Context, p *corev1.Pod, c *corev1.Container, e corev1.EnvVar, objs Objects, ec envContext) (v string, skip bool, err error) {
	f := e.ValueFrom
	switch {
	case f.FieldRef != nil:
		v, err := fieldValue(p, f.FieldRef.FieldPath, ec)
		return v, false, err
	case f.ResourceFieldRef != nil:
		v, err := resourceValue(c, f.ResourceFieldRef, ec)
		return v, false, err
	case f.ConfigMapKeyRef != nil:
		r := f.ConfigMapKeyRef
		cm, err := objs.ConfigMap(ctx, p.Namespace, r.Name)
		return keyValue("configMap", r.Name, r.Key, r.Optional, err, func() map[string]string { return cm.Data })
	case f.SecretKeyRef != nil:
		r := f.SecretKeyRef
		s, err := objs.Secret(ctx, p.Namespace, r.Name)
		return keyValue("secret", r.Name, r.Key, r.Optional, err, func() map[string][]byte { return s.Data })
	}
	return "", false, fmt.Errorf("a valueFrom kvbox does not know")
}

// keyValue is the value of key in a ConfigMap's or a Secret's data (kind
// and name say which; err is how reading it went): an optional one that
// is missing, or has no such key, is skipped.
func keyValue[V ~string | ~[]byte](kind, name, key string, optional *bool, err error, data func() map[string]V) (v string, skip bool, _ error) {
	if optionalMissing(err, optional) {
		return "", true, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("%s %q: %w", kind, name, err)
	}
	d, ok := data()[key]
	if !ok {
		if optional != nil && *optional {
			return "", true, nil
		}
		return "", false, fmt.Errorf("%s %q has no key %q", kind, name, key)
	}
	return string(d), false, nil
}

// fieldValue is a fieldRef's value (the paths the API server accepts for
// an environment variable).
func fieldValue(p *corev1.Pod, path string, ec envContext) (string, error) {
	if k, ok := subscript(path, "metadata.labels"); ok {
		return p.Labels[k], nil
	}
	if k, ok := subscript(path, "metadata.annotations"); ok {
		return p.Annotations[k], nil
	}
	switch path {
	case "metadata.name":
		return p.Name, nil
	case "metadata.namespace":
		return p.Namespace, nil
	case "metadata.uid":
		return string(p.UID), nil
	case "spec.nodeName":
		return p.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return p.Spec.ServiceAccountName, nil
	case "status.hostIP", "status.hostIPs":
		return ec.hostIP, nil
	case "status.podIP", "status.podIPs":
		return ec.podIP, nil
	}
	return "", fmt.Errorf("fieldRef %q is not one kvbox knows", path)
}

// subscript reads `prefix['key']`.
func subscript(path, prefix string) (string, bool) {
	rest, ok := strings.CutPrefix(path, prefix+"['")
	if !ok {
		return "", false
	}
	return strings.CutSuffix(rest, "']")
}

// resourceValue is a resourceFieldRef's value: the container's limit (the
// node's allocatable when it sets none) or request, in units of the
// divisor, rounded up.
func resourceValue(c *corev1.Container, r *corev1.ResourceFieldSelector, ec envContext) (string, error) {
	kind, name, ok := strings.Cut(r.Resource, ".")
	if !ok || (kind != "limits" && kind != "requests") {
		return "", fmt.Errorf("resourceFieldRef %q is not limits.X or requests.X", r.Resource)
	}
	rn := corev1.ResourceName(name)
	var q resource.Quantity
	var have bool
	if kind == "limits" {
		q, have = c.Resources.Limits[rn]
		if !have {
			q, have = ec.allocatable[rn]
		}
	} else {
		q, have = c.Resources.Requests[rn]
	}
	if !have {
		return "0", nil
	}
	div := r.Divisor
	if div.IsZero() {
		div = resource.MustParse("1")
	}
	if rn == corev1.ResourceCPU {
		return fmt.Sprint(int64(math.Ceil(float64(q.MilliValue()) / float64(div.MilliValue())))), nil
	}
	return fmt.Sprint(int64(math.Ceil(float64(q.Value()) / float64(div.Value())))), nil
}

// Expand replaces $(NAME) with the variable's value where vars has it, and
// $$ with $, as Kubernetes expands env values, command and args; other
// text, and a reference to an unknown variable, is kept as written.
func Expand(s string, vars map[string]string) string {
	if !strings.Contains(s, "$") {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 >= len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String()
			}
			name := s[i+2 : i+2+end]
			if v, ok := vars[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+3+end])
			}
			i += 2 + end
		default:
			b.WriteByte('$')
		}
	}
	return b.String()
}

// envMap turns NAME=VALUE lines into a map for Expand.
func envMap(env []string) map[string]string {
	m := map[string]string{}
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		m[k] = v
	}
	return m
}
