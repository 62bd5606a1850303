//go:build e2e

package testenv

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"kvbox.dev/kvbox/domain"
	agent "kvbox.dev/kvbox/guest-agent"
)

// TestAgentServesHotPluggedPort: an agent port that appears while the agent
// runs (a distro guest's udev loads virtio_console after the agent started;
// here the port is hot-plugged) is served: the agent looks for ports again
// when the kernel announces one (its uevents), and no longer on a clock.
func TestAgentServesHotPluggedPort(t *testing.T) {
	b := newBox(t, name(t, "hotport"))
	token, err := domain.ReadAgentToken(b.Dir)
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(b.Dir, "hot.sock")
	xml := filepath.Join(t.TempDir(), "channel.xml")
	if err := os.WriteFile(xml, []byte(fmt.Sprintf(`<channel type='unix'>
  <source mode='bind' path='%s'/>
  <target type='virtio' name='%shot'/>
</channel>`, sock, agent.SerialPortPrefix)), 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := virsh("attach-device", b.Name, xml, "--live"); err != nil {
		t.Fatalf("hot-plug a port: %v: %s", err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := agent.DialSerialToken(ctx, []string{sock}, token)
	if err != nil {
		t.Fatalf("the agent does not answer on the hot-plugged port: %v", err)
	}
	defer c.Close()
	if _, err := c.Ping(ctx); err != nil {
		t.Errorf("ping on the hot-plugged port: %v", err)
	}
	if err := agentExec(c); err != nil {
		t.Errorf("exec on the hot-plugged port: %v", err)
	}
}
