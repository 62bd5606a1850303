package kvboxnode

import (
	"context"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// mapObjects is a namespace's ConfigMaps and Secrets in memory.
type mapObjects struct {
	configMaps map[string]map[string]string
	secrets    map[string]map[string][]byte
}

func (o mapObjects) ConfigMap(ctx context.Context, ns, name string) (*corev1.ConfigMap, error) {
	d, ok := o.configMaps[name]
	if !ok {
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "configmaps"}, name)
	}
	return &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Data: d}, nil
}

func (o mapObjects) Secret(ctx context.Context, ns, name string) (*corev1.Secret, error) {
	d, ok := o.secrets[name]
	if !ok {
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "secrets"}, name)
	}
	return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Data: d}, nil
}

// An env value from a ConfigMap's or a Secret's key: the value, an
// optional one skipped when its object or key is missing, and an error
// that names what is missing otherwise.
func TestEnvKeyRefs(t *testing.T) {
	objs := mapObjects{
		configMaps: map[string]map[string]string{"web": {"mode": "fast"}},
		secrets:    map[string]map[string][]byte{"db": {"password": []byte("s3cret")}},
	}
	yes := true
	cm := func(name, key string, optional *bool) *corev1.EnvVarSource {
		return &corev1.EnvVarSource{ConfigMapKeyRef: &corev1.ConfigMapKeySelector{
			LocalObjectReference: corev1.LocalObjectReference{Name: name}, Key: key, Optional: optional}}
	}
	sec := func(name, key string, optional *bool) *corev1.EnvVarSource {
		return &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{
			LocalObjectReference: corev1.LocalObjectReference{Name: name}, Key: key, Optional: optional}}
	}
	for _, tc := range []struct {
		name string
		from *corev1.EnvVarSource
		want string // the environment, or the error's text
	}{
		{"configMap key", cm("web", "mode", nil), "A=before V=fast"},
		{"secret key", sec("db", "password", nil), "A=before V=s3cret"},
		{"optional configMap missing", cm("nope", "mode", &yes), "A=before"},
		{"optional configMap key missing", cm("web", "nope", &yes), "A=before"},
		{"optional secret missing", sec("nope", "password", &yes), "A=before"},
		{"optional secret key missing", sec("db", "nope", &yes), "A=before"},
		{"configMap missing", cm("nope", "mode", nil), `env V: configMap "nope": configmaps "nope" not found`},
		{"configMap key missing", cm("web", "nope", nil), `env V: configMap "web" has no key "nope"`},
		{"secret missing", sec("nope", "password", nil), `env V: secret "nope": secrets "nope" not found`},
		{"secret key missing", sec("db", "nope", nil), `env V: secret "db" has no key "nope"`},
	} {
		p := testPod("web-1", "u1")
		p.Spec.Containers[0].Env = []corev1.EnvVar{{Name: "A", Value: "before"}, {Name: "V", ValueFrom: tc.from}}
		env, err := Env(context.Background(), p, objs, envContext{})
		got := strings.Join(env, " ")
		if err != nil {
			got = err.Error()
		}
		if got != tc.want {
			t.Errorf("%s: got %q, want %q", tc.name, got, tc.want)
		}
	}
}
