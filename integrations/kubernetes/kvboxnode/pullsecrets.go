package kvboxnode

import (
	"encoding/base64"
	"encoding/json"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	corev1 "k8s.io/api/core/v1"
)

// dockerAuth is one registry's entry of a docker config.
type dockerAuth struct {
	Username string `json:"username"`
	Password string `json:"password"`
	Auth     string `json:"auth"` // base64 of user:password
}

// DockerCredentials are the credentials an imagePullSecret (of type
// kubernetes.io/dockerconfigjson or kubernetes.io/dockercfg) holds for
// ref's registry; ok is false when it holds none.
func DockerCredentials(s *corev1.Secret, ref string) (PullOptions, bool) {
	r, err := name.ParseReference(ref, name.WeakValidation)
	if err != nil {
		return PullOptions{}, false
	}
	host := r.Context().RegistryStr()
	var auths map[string]dockerAuth
	switch s.Type {
	case corev1.SecretTypeDockerConfigJson:
		var cfg struct {
			Auths map[string]dockerAuth `json:"auths"`
		}
		if json.Unmarshal(s.Data[corev1.DockerConfigJsonKey], &cfg) != nil {
			return PullOptions{}, false
		}
		auths = cfg.Auths
	case corev1.SecretTypeDockercfg:
		if json.Unmarshal(s.Data[corev1.DockerConfigKey], &auths) != nil {
			return PullOptions{}, false
		}
	default:
		return PullOptions{}, false
	}
	for k, a := range auths {
		if registryHost(k) != host {
			continue
		}
		if a.Username == "" && a.Auth != "" {
			if b, err := base64.StdEncoding.DecodeString(a.Auth); err == nil {
				a.Username, a.Password, _ = strings.Cut(string(b), ":")
			}
		}
		if a.Username != "" {
			return PullOptions{Username: a.Username, Password: a.Password}, true
		}
	}
	return PullOptions{}, false
}

// registryHost is the registry of a docker config key, which may be a
// URL ("https://index.docker.io/v1/") or a host.
func registryHost(k string) string {
	k = strings.TrimPrefix(strings.TrimPrefix(k, "https://"), "http://")
	k, _, _ = strings.Cut(k, "/")
	if k == "docker.io" {
		return name.DefaultRegistry
	}
	return k
}
