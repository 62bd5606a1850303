package kvboxnode

import (
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"regexp"
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Labels of a pod's box (Box.Labels, in its domain's metadata): who the box
// is, so that kvbox-node finds its pods again after a restart with no
// database of its own.
const (
	LabelPodNamespace = "kvbox.dev/pod-namespace"
	LabelPodName      = "kvbox.dev/pod-name"
	LabelPodUID       = "kvbox.dev/pod-uid"
	LabelHostname     = "kvbox.dev/hostname"
	LabelImage        = "kvbox.dev/image"  // the pod's image reference
	LabelDigest       = "kvbox.dev/digest" // the artifact's digest it resolved to
)

// maxBoxName is kvbox's limit on a box name (a libvirt domain name, a
// folder, a guest hostname).
const maxBoxName = 63

// BoxName is the box of a pod: namespace "." name "." the first 8 hex
// digits of its UID. A namespace holds no dot, so the name reads back; the
// UID's part keeps two incarnations of a pod name apart (a StatefulSet's
// web-0 made again while the old box goes), also across nodes that share
// a libvirtd. A name too long for kvbox keeps its start and a hash of the
// whole.
func BoxName(namespace, name, uid string) string {
	u := strings.ReplaceAll(strings.ToLower(uid), "-", "")
	if len(u) < 8 {
		u += strings.Repeat("0", 8-len(u))
	}
	full := namespace + "." + name + "." + u[:8]
	if len(full) <= maxBoxName {
		return full
	}
	sum := sha256.Sum256([]byte(namespace + "/" + name + "/" + uid))
	tail := "-" + hex.EncodeToString(sum[:])[:10] + "." + u[:8]
	head := strings.TrimRight((namespace + "." + name)[:maxBoxName-len(tail)], ".-")
	return head + tail
}

// boxNameForm matches the names BoxName makes: a box of this form without
// pod labels is one a kvbox-node killed mid-clone left.
var boxNameForm = regexp.MustCompile(`^[a-z0-9]([-a-z0-9]*[a-z0-9])?\.[a-z0-9][-a-z0-9.]*\.[0-9a-f]{8}$`)

// Hostname is the guest hostname of a pod, as a kubelet gives it: its
// spec.hostname, else its name, cut to 63 characters.
func Hostname(p *corev1.Pod) string {
	h := p.Spec.Hostname
	if h == "" {
		h = p.Name
	}
	if len(h) > 63 {
		h = strings.TrimRight(h[:63], "-.")
	}
	return h
}

// cacheNameStart begins the name of every snapshot of kvbox-node's cache.
const cacheNameStart = "pod-"

// CacheNamePrefix begins the snapshot names of an artifact in kvbox-node's
// cache: its digest's algorithm and the first 24 hex digits. The name is
// no proof of anything: a snapshot is the cache's by kvbox-node's mark
// (Snapshot.Owner), which anyone who can make snapshots of a name cannot
// give it.
func CacheNamePrefix(digest string) string {
	alg, hexPart, ok := strings.Cut(digest, ":")
	if !ok {
		alg, hexPart = "sha256", digest
	}
	if len(hexPart) > 24 {
		hexPart = hexPart[:24]
	}
	return cacheNameStart + alg + "-" + hexPart
}

// newCacheName is a name for a new snapshot of digest in the cache: its
// prefix and a random part, so that no snapshot someone made beforehand
// holds it.
func newCacheName(digest string) (string, error) {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		return "", err
	}
	return CacheNamePrefix(digest) + "-" + hex.EncodeToString(b), nil
}
