package kvboxnode

import (
	"context"
	"errors"
	"io"

	dto "github.com/prometheus/client_model/go"
	"github.com/virtual-kubelet/virtual-kubelet/node/api"
	corev1 "k8s.io/api/core/v1"
	statsv1alpha1 "k8s.io/kubelet/pkg/apis/stats/v1alpha1"
)

// ErrPodsNotImplemented is what every pod operation returns until kvbox-node
// turns Pods into warm clones: a Pod scheduled here is reported as failing
// with this line, never as running.
var ErrPodsNotImplemented = errors.New("kvbox-node does not run pods yet: warm clones from a pod's snapshot are not implemented in this build")

// pods is the provider's pod side: Pods as kvbox boxes. Not implemented yet.
type pods struct{}

func (pods) CreatePod(context.Context, *corev1.Pod) error { return ErrPodsNotImplemented }
func (pods) UpdatePod(context.Context, *corev1.Pod) error { return ErrPodsNotImplemented }
func (pods) DeletePod(context.Context, *corev1.Pod) error { return ErrPodsNotImplemented }

func (pods) GetPod(context.Context, string, string) (*corev1.Pod, error) {
	return nil, ErrPodsNotImplemented
}

func (pods) GetPodStatus(context.Context, string, string) (*corev1.PodStatus, error) {
	return nil, ErrPodsNotImplemented
}

func (pods) GetPods(context.Context) ([]*corev1.Pod, error) { return nil, ErrPodsNotImplemented }

func (pods) GetContainerLogs(context.Context, string, string, string, api.ContainerLogOpts) (io.ReadCloser, error) {
	return nil, ErrPodsNotImplemented
}

func (pods) RunInContainer(context.Context, string, string, string, []string, api.AttachIO) error {
	return ErrPodsNotImplemented
}

func (pods) AttachToContainer(context.Context, string, string, string, api.AttachIO) error {
	return ErrPodsNotImplemented
}

func (pods) GetStatsSummary(context.Context) (*statsv1alpha1.Summary, error) {
	return nil, ErrPodsNotImplemented
}

func (pods) GetMetricsResource(context.Context) ([]*dto.MetricFamily, error) {
	return nil, ErrPodsNotImplemented
}

func (pods) PortForward(context.Context, string, string, int32, io.ReadWriteCloser) error {
	return ErrPodsNotImplemented
}
