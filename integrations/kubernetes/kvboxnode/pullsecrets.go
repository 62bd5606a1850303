package kvboxnode

import (
	"context"
	"fmt"

	"github.com/google/go-containerregistry/pkg/authn"
	k8schain "github.com/google/go-containerregistry/pkg/authn/kubernetes"
	"github.com/google/go-containerregistry/pkg/name"
	corev1 "k8s.io/api/core/v1"
)

// PullKeychain is the keychain of one pod's pull: the credentials its
// imagePullSecrets hold for the image's repository (matched as a kubelet
// matches them: host with wildcards, port, path prefix; the first secret
// that matches wins), else the node's (nil: none), else anonymous. A
// secret that is no docker config is skipped, as a kubelet does, and
// reported in skipped.
func PullKeychain(ctx context.Context, secrets []corev1.Secret, node authn.Keychain) (kc authn.Keychain, skipped []error) {
	var chain []authn.Keychain
	for _, s := range secrets {
		k, err := k8schain.NewFromPullSecrets(ctx, []corev1.Secret{s})
		if err != nil {
			skipped = append(skipped, fmt.Errorf("imagePullSecret %q: %w", s.Name, err))
			continue
		}
		chain = append(chain, k)
	}
	if node != nil {
		chain = append(chain, node)
	}
	return authn.NewMultiKeychain(chain...), skipped
}

// NodeKeychain is the node's own credentials (docker's config and its
// credential helpers, as root reads them: authn.DefaultKeychain) for the
// registries --node-credentials-for names, and none for any other: every
// pod that names an image of those registries gets them.
type NodeKeychain struct {
	Registries map[string]bool // HOST[:PORT], as a reference names it
	Keychain   authn.Keychain  // nil: authn.DefaultKeychain
}

func (k NodeKeychain) Resolve(r authn.Resource) (authn.Authenticator, error) {
	if !k.Registries[r.RegistryStr()] {
		return authn.Anonymous, nil
	}
	if k.Keychain == nil {
		return authn.DefaultKeychain.Resolve(r)
	}
	return k.Keychain.Resolve(r)
}

// Credentialed says whether o sends credentials for ref's repository:
// what it pulls is then not for every pod of the node (Cache.Acquire).
// A keychain that cannot say counts as sending some.
func Credentialed(o PullOptions, ref string) bool {
	if o.Keychain == nil {
		return false
	}
	r, err := name.ParseReference(ref, name.WeakValidation)
	if err != nil {
		return true
	}
	a, err := o.Keychain.Resolve(r.Context())
	if err != nil {
		return true
	}
	if a == authn.Anonymous {
		return false
	}
	cfg, err := a.Authorization()
	return err != nil || cfg == nil || *cfg != authn.AuthConfig{}
}
