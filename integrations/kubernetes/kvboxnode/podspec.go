package kvboxnode

import (
	"fmt"
	"strings"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// DefaultRuntimeClass is the RuntimeClass a pod may name to land on kvbox
// nodes (its scheduling part carries the toleration and node selector).
const DefaultRuntimeClass = "kvbox"

// serviceAccountVolumePrefix names the volume the ServiceAccount admission
// plugin adds to every pod that mounts its token.
const serviceAccountVolumePrefix = "kube-api-access-"

// defaultTerminationMessagePath is the API server's default.
const defaultTerminationMessagePath = "/dev/termination-log"

// CheckPod refuses, in one line that says what to change, a pod kvbox
// cannot honour: a pod is one warm clone, whose container is a snapshot
// and at most one command run in it. Fields that only the scheduler reads
// (affinity, tolerations, priorities) pass; so does the service account
// token volume the API server adds to every pod (left out: a box reaches
// no API server, see the documentation).
func CheckPod(p *corev1.Pod, runtimeClass string) error {
	s := &p.Spec
	no := func(field, why string) error {
		return fmt.Errorf("pod %s/%s: %s is not supported on a kvbox node: %s", p.Namespace, p.Name, field, why)
	}
	if err := checkPodFields(s, runtimeClass, no); err != nil {
		return err
	}
	if err := checkPodSecurity(s.SecurityContext, no); err != nil {
		return err
	}
	saVolume, err := serviceAccountVolume(s.Volumes, no)
	if err != nil {
		return err
	}
	c := &s.Containers[0]
	cno := func(field, why string) error { return no("container "+c.Name+": "+field, why) }
	if err := checkContainerFields(c, saVolume, cno); err != nil {
		return err
	}
	if err := checkContainerSecurity(c.SecurityContext, cno); err != nil {
		return err
	}
	return checkRunAsUser(p, cno)
}

// refuse is how a check says a field is refused: field is what the pod
// sets, why what to do instead.
type refuse func(field, why string) error

// checkPodFields refuses the pod-level fields a box cannot honour.
func checkPodFields(s *corev1.PodSpec, runtimeClass string, no refuse) error {
	switch {
	case len(s.Containers) != 1:
		return no(fmt.Sprintf("a pod of %d containers", len(s.Containers)), "a pod is one box, give it one container")
	case len(s.InitContainers) > 0:
		return no("initContainers", "a box starts warm from its snapshot; do the init work before the snapshot")
	case len(s.EphemeralContainers) > 0:
		return no("ephemeralContainers", "use kubectl exec")
	case s.HostNetwork:
		return no("hostNetwork", "a box has its own address on the node's subnet")
	case s.HostPID:
		return no("hostPID", "a box is a virtual machine with its own kernel")
	case s.HostIPC:
		return no("hostIPC", "a box is a virtual machine with its own kernel")
	case s.HostUsers != nil && !*s.HostUsers:
		return no("hostUsers: false", "a box is a virtual machine; leave hostUsers out")
	case s.ShareProcessNamespace != nil && *s.ShareProcessNamespace:
		return no("shareProcessNamespace", "a pod has one container")
	case s.RuntimeClassName != nil && *s.RuntimeClassName != runtimeClass:
		return no("runtimeClassName "+*s.RuntimeClassName, fmt.Sprintf("give %s or none", runtimeClass))
	case len(s.HostAliases) > 0:
		return no("hostAliases", "put the names in the snapshot's /etc/hosts")
	case s.DNSConfig != nil || s.DNSPolicy == corev1.DNSNone:
		return no("dnsConfig", "a box uses the host's resolvers")
	case len(s.ReadinessGates) > 0:
		return no("readinessGates", "a pod is ready when its box answers and its ports are open")
	case len(s.ResourceClaims) > 0:
		return no("resourceClaims", "a box has its snapshot's devices only")
	case s.SetHostnameAsFQDN != nil && *s.SetHostnameAsFQDN:
		return no("setHostnameAsFQDN", "a box's hostname is the pod's name")
	case s.OS != nil && s.OS.Name != corev1.Linux:
		return no("os "+string(s.OS.Name), "kvbox runs Linux guests")
	case s.Resources != nil:
		return no("pod-level resources", "give the container's")
	}
	return nil
}

// serviceAccountVolume is the name of the pod's service account token
// volume ("" for none); any other volume is refused.
func serviceAccountVolume(volumes []corev1.Volume, no refuse) (string, error) {
	saVolume := ""
	for _, v := range volumes {
		if strings.HasPrefix(v.Name, serviceAccountVolumePrefix) && v.Projected != nil && saVolume == "" {
			saVolume = v.Name
			continue
		}
		return "", no(fmt.Sprintf("volume %q", v.Name), "a box has its snapshot's disk and nothing mounted from the host")
	}
	return saVolume, nil
}

// checkContainerFields refuses the container's fields a box cannot honour:
// its probes, hooks, streams, devices, mounts (but the service account
// token's, saVolume), host ports and file-backed environment.
func checkContainerFields(c *corev1.Container, saVolume string, cno refuse) error {
	switch {
	case c.Image == "":
		return cno("no image", "give the registry reference of a kvbox snapshot (kvbox snapshots push)")
	case len(c.Args) > 0 && len(c.Command) == 0:
		return cno("args without command", "a snapshot has no entrypoint: give command")
	case c.LivenessProbe != nil:
		return cno("livenessProbe", "kvbox restarts no box on a probe; use a readinessProbe")
	case c.StartupProbe != nil:
		return cno("startupProbe", "use a readinessProbe")
	case c.ReadinessProbe != nil && c.ReadinessProbe.GRPC != nil:
		return cno("a grpc readinessProbe", "use exec, tcpSocket or httpGet")
	case c.Lifecycle != nil:
		return cno("lifecycle hooks", "a snapshot's after-clone hooks run in every clone")
	case c.Stdin || c.StdinOnce || c.TTY:
		return cno("stdin and tty", "use kubectl exec")
	case c.TerminationMessagePath != "" && c.TerminationMessagePath != defaultTerminationMessagePath:
		return cno("terminationMessagePath", "kvbox reads no file of the guest for it; use terminationMessagePolicy FallbackToLogsOnError")
	case len(c.VolumeDevices) > 0:
		return cno("volumeDevices", "a box has its snapshot's devices only")
	case c.RestartPolicy != nil:
		return cno("a container restartPolicy", "give the pod's")
	case len(c.Resources.Claims) > 0:
		return cno("resources.claims", "a box has its snapshot's devices only")
	}
	for _, m := range c.VolumeMounts {
		if m.Name != saVolume || saVolume == "" {
			return cno(fmt.Sprintf("volumeMount %q", m.Name), "a box has its snapshot's disk and nothing mounted from the host")
		}
	}
	for _, port := range c.Ports {
		if port.HostPort != 0 || port.HostIP != "" {
			return cno(fmt.Sprintf("hostPort %d", port.HostPort), "a box is reached at its own address (or kubectl port-forward)")
		}
	}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.FileKeyRef != nil {
			return cno("env "+e.Name+" from fileKeyRef", "give a value, a configMap or a secret")
		}
	}
	return nil
}

// checkRunAsUser refuses a user the guest cannot have: a negative uid, or
// runAsNonRoot without a uid other than 0.
func checkRunAsUser(p *corev1.Pod, cno refuse) error {
	s, c := &p.Spec, &p.Spec.Containers[0]
	if u, ok := RunAsUser(p); ok && u < 0 {
		return cno("a negative runAsUser", "give a uid of the guest")
	}
	nonRoot := (s.SecurityContext != nil && s.SecurityContext.RunAsNonRoot != nil && *s.SecurityContext.RunAsNonRoot) ||
		(c.SecurityContext != nil && c.SecurityContext.RunAsNonRoot != nil && *c.SecurityContext.RunAsNonRoot)
	if u, ok := RunAsUser(p); nonRoot && (!ok || u == 0) {
		return cno("runAsNonRoot without a runAsUser other than 0", "give runAsUser: the uid of a user of the guest")
	}
	return nil
}

// Why a security-context field is refused.
const (
	whyVM     = "a box is a virtual machine: the guest's own kernel and users apply, not the host's"
	whyGroups = "a command runs with its user's groups in the guest"
)

// refusal is one field of a security context, whether it is set, and why
// it is refused then.
type refusal struct {
	set   bool
	field string
	why   string
}

// firstRefused refuses the first field of rs that is set, in their order.
func firstRefused(no refuse, rs ...refusal) error {
	for _, r := range rs {
		if r.set {
			return no("securityContext."+r.field, r.why)
		}
	}
	return nil
}

// checkPodSecurity refuses the pod's security-context fields a virtual
// machine does not map.
func checkPodSecurity(sc *corev1.PodSecurityContext, no refuse) error {
	if sc == nil {
		return nil
	}
	return firstRefused(no,
		refusal{sc.SELinuxOptions != nil, "seLinuxOptions", whyVM},
		refusal{sc.WindowsOptions != nil, "windowsOptions", whyVM},
		refusal{sc.RunAsGroup != nil, "runAsGroup", whyGroups},
		refusal{len(sc.SupplementalGroups) > 0 || sc.SupplementalGroupsPolicy != nil, "supplementalGroups", whyGroups},
		refusal{sc.FSGroup != nil || sc.FSGroupChangePolicy != nil, "fsGroup", "a box mounts no volume"},
		refusal{len(sc.Sysctls) > 0, "sysctls", "set them in the snapshot's guest"},
		refusal{sc.SeccompProfile != nil, "seccompProfile", whyVM},
		refusal{sc.AppArmorProfile != nil, "appArmorProfile", whyVM},
		refusal{sc.SELinuxChangePolicy != nil, "seLinuxChangePolicy", whyVM})
}

// checkContainerSecurity refuses the container's security-context fields
// a virtual machine does not map.
func checkContainerSecurity(sc *corev1.SecurityContext, no refuse) error {
	if sc == nil {
		return nil
	}
	return firstRefused(no,
		refusal{sc.Privileged != nil && *sc.Privileged, "privileged", whyVM},
		refusal{sc.Capabilities != nil, "capabilities", whyVM},
		refusal{sc.SELinuxOptions != nil, "seLinuxOptions", whyVM},
		refusal{sc.WindowsOptions != nil, "windowsOptions", whyVM},
		refusal{sc.RunAsGroup != nil, "runAsGroup", whyGroups},
		refusal{sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem, "readOnlyRootFilesystem", "a box's disk is its own overlay of the snapshot's"},
		refusal{sc.AllowPrivilegeEscalation != nil, "allowPrivilegeEscalation", whyVM},
		refusal{sc.ProcMount != nil, "procMount", whyVM},
		refusal{sc.SeccompProfile != nil, "seccompProfile", whyVM},
		refusal{sc.AppArmorProfile != nil, "appArmorProfile", whyVM})
}

// RunAsUser is the uid the pod's command and kubectl exec run as in the
// guest: the container's runAsUser, else the pod's; ok is false for none
// (the agent's user, root).
func RunAsUser(p *corev1.Pod) (uid int64, ok bool) {
	if c := p.Spec.Containers[0].SecurityContext; c != nil && c.RunAsUser != nil {
		return *c.RunAsUser, true
	}
	if s := p.Spec.SecurityContext; s != nil && s.RunAsUser != nil {
		return *s.RunAsUser, true
	}
	return 0, false
}

// CheckFits refuses a pod whose container asks for less than the
// snapshot's box: a clone has the snapshot's vCPUs, RAM and disk, and
// cannot honour less. Its requests of cpu and memory must be at least the
// snapshot's vCPUs and RAM (a pod without requests asks for nothing, and
// is refused: the scheduler would count it as nothing); a limit, and a
// request of ephemeral-storage, given below the snapshot's size is
// refused too. The line says what the snapshot needs.
func CheckFits(p *corev1.Pod, s Snapshot) error {
	res := p.Spec.Containers[0].Resources
	for _, x := range []struct {
		name     corev1.ResourceName
		has      *resource.Quantity
		what     string
		required bool // as a request
	}{
		{corev1.ResourceCPU, resource.NewQuantity(int64(s.CPUs), resource.DecimalSI), "vCPUs", true},
		{corev1.ResourceMemory, resource.NewQuantity(s.Memory, resource.BinarySI), "RAM", true},
		{corev1.ResourceEphemeralStorage, resource.NewQuantity(s.Disk, resource.BinarySI), "disk", false},
	} {
		if x.has.IsZero() {
			continue
		}
		for _, l := range []struct {
			kind string
			list corev1.ResourceList
		}{{"requests", res.Requests}, {"limits", res.Limits}} {
			q, ok := l.list[x.name]
			switch {
			case !ok && l.kind == "requests" && x.required:
				return fmt.Errorf("pod %s/%s: no requests.%s: the pod asks for none, and its snapshot's box has %s %s (a clone has its snapshot's size); give %s",
					p.Namespace, p.Name, x.name, x.has.String(), x.what, needs(s))
			case ok && q.Cmp(*x.has) < 0:
				return fmt.Errorf("pod %s/%s: %s.%s %s is less than the snapshot's %s (%s): a clone has its snapshot's size; give at least %s",
					p.Namespace, p.Name, l.kind, x.name, q.String(), x.what, x.has.String(), needs(s))
			}
		}
	}
	return nil
}
