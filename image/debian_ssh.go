package image

import (
	"fmt"
	"os"
	"path/filepath"
)

// SSHPackages are added to the Debian image by --ssh.
var SSHPackages = []string{"openssh-server"}

// sshdConfig is the image's sshd drop-in: the one host key the agent makes,
// keys only (root has no password in a kvbox image).
const sshdConfig = `# kvbox images build --ssh. Host keys are made in each box by kvbox-agent
# (first boot, and again when a clone is re-identified): none is in the image.
HostKey /etc/ssh/ssh_host_ed25519_key
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
`

// sshUnitDropIn makes sshd's first start wait for the box's own host keys.
const sshUnitDropIn = `# kvbox images build --ssh: the box's host keys, made on its first boot.
[Unit]
After=kvbox-agent.service
[Service]
ExecStartPre=
ExecStartPre=/usr/local/bin/kvbox-agent -ssh-host-keys
ExecStartPre=/usr/sbin/sshd -t
`

// configureSSH removes the host keys openssh-server's postinst made (every
// box built on the image would share them) and installs the drop-ins.
func configureSSH(root string) error {
	if _, err := os.Stat(filepath.Join(root, "usr/sbin/sshd")); err != nil {
		return fmt.Errorf("openssh-server did not install: %w", err)
	}
	keys, _ := filepath.Glob(filepath.Join(root, "etc/ssh/ssh_host_*"))
	for _, k := range keys {
		if err := os.Remove(k); err != nil {
			return err
		}
	}
	if left, _ := filepath.Glob(filepath.Join(root, "etc/ssh/ssh_host_*")); len(left) > 0 {
		return fmt.Errorf("host keys left in the image: %v", left)
	}
	return writeFiles(root, map[string]string{
		"etc/ssh/sshd_config.d/kvbox.conf":            sshdConfig,
		"etc/systemd/system/ssh.service.d/kvbox.conf": sshUnitDropIn,
	})
}
