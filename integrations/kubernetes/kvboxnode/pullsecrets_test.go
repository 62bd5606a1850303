package kvboxnode

import (
	"context"
	"encoding/base64"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// nodeDockerConfig gives this test process a docker config (in a folder
// of the test's, as HOME and DOCKER_CONFIG) with the node's credentials
// for the registries given: what root's ~/.docker/config.json holds on a
// node.
func nodeDockerConfig(t *testing.T, registries ...string) {
	home := t.TempDir()
	dir := filepath.Join(home, ".docker")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	auths := ""
	for i, r := range registries {
		if i > 0 {
			auths += ","
		}
		auths += `"` + r + `":{"auth":"` + base64.StdEncoding.EncodeToString([]byte("node:node-secret")) + `"}`
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(`{"auths":{`+auths+`}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("HOME", home)
	t.Setenv("DOCKER_CONFIG", dir)
	t.Setenv("XDG_RUNTIME_DIR", "")
	t.Setenv("XDG_CONFIG_HOME", "")
	t.Setenv("REGISTRY_AUTH_FILE", "")
}

func pullSecret(ns, name, registry, user string) corev1.Secret {
	cfg := `{"auths":{"` + registry + `":{"username":"` + user + `","password":"pw-` + user + `"}}}`
	return corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name}, Type: corev1.SecretTypeDockerConfigJson,
		Data: map[string][]byte{corev1.DockerConfigJsonKey: []byte(cfg)}}
}

// who is the user a keychain gives for ref's repository ("" for none).
func who(t *testing.T, kc authn.Keychain, ref string) string {
	t.Helper()
	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	a, err := kc.Resolve(r.Context())
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := a.Authorization()
	if err != nil {
		t.Fatal(err)
	}
	return cfg.Username
}

// A pod pulls with its own imagePullSecrets for the image's registry, or
// with nothing: never with the node's docker config, unless the operator
// named that registry for the node's credentials; then every pod gets
// them.
func TestPullKeychain(t *testing.T) {
	nodeDockerConfig(t, "127.0.0.1:5000", "registry.example")
	const private, shared = "127.0.0.1:5000/team/web:v1", "registry.example/base/web:v1"
	ctx := context.Background()

	none, _ := PullKeychain(ctx, nil, nil)
	if u := who(t, none, private); u != "" {
		t.Errorf("a pod without pull secrets pulls as %q; want no credentials", u)
	}
	if Credentialed(PullOptions{Keychain: none}, private) {
		t.Error("Credentialed for a pod without pull secrets")
	}
	other, _ := PullKeychain(ctx, []corev1.Secret{pullSecret("team", "s", "elsewhere.example", "them")}, nil)
	if u := who(t, other, private); u != "" {
		t.Errorf("a pull secret for another registry gave %q", u)
	}
	own, _ := PullKeychain(ctx, []corev1.Secret{pullSecret("team", "s", "127.0.0.1:5000", "team-user")}, nil)
	if u := who(t, own, private); u != "team-user" || !Credentialed(PullOptions{Keychain: own}, private) {
		t.Errorf("the pod's own pull secret: %q", u)
	}
	bad := corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "garbled"}, Type: corev1.SecretTypeDockerConfigJson,
		Data: map[string][]byte{corev1.DockerConfigJsonKey: []byte("{")}}
	kc, skipped := PullKeychain(ctx, []corev1.Secret{bad, pullSecret("team", "s", "127.0.0.1:5000", "team-user")}, nil)
	if u := who(t, kc, private); u != "team-user" || len(skipped) != 1 {
		t.Errorf("a garbled secret before a good one: %q, skipped %v", u, skipped)
	}

	node := NodeKeychain{Registries: map[string]bool{"registry.example": true}}
	withNode, _ := PullKeychain(ctx, nil, node)
	if u := who(t, withNode, shared); u != "node" {
		t.Errorf("a registry named for the node's credentials: %q, want the node's", u)
	}
	if u := who(t, withNode, private); u != "" {
		t.Errorf("a registry not named for the node's credentials gave %q", u)
	}
	both, _ := PullKeychain(ctx, []corev1.Secret{pullSecret("team", "s", "registry.example", "team-user")}, node)
	if u := who(t, both, shared); u != "team-user" {
		t.Errorf("the pod's own secret and the node's: %q, want the pod's", u)
	}
}
