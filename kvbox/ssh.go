package kvbox

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	agent "kvbox.dev/kvbox/guest-agent"
)

// SSHKey is kvbox's SSH key of this state dir: the private key's path and
// the public key, made on first use.
func (h *Host) SSHKey() (path, pub string, err error) {
	k := h.layout.SSHKey()
	if _, err := os.Stat(k + ".pub"); err != nil {
		if err := os.MkdirAll(filepath.Dir(k), 0o700); err != nil {
			return k, "", err
		}
		out, err := exec.Command("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "kvbox", "-f", k).CombinedOutput()
		if err != nil {
			return k, "", fmt.Errorf("make kvbox's SSH key %s: %v: %s", k, err, strings.TrimSpace(string(out)))
		}
	}
	b, err := os.ReadFile(k + ".pub")
	return k, strings.TrimSpace(string(b)), err
}

// authorizeKeyScript adds $1 to root's authorized_keys once, in a box with
// sshd.
const authorizeKeyScript = `[ -x /usr/sbin/sshd ] || exit 0
umask 077; mkdir -p /root/.ssh; touch /root/.ssh/authorized_keys
grep -qxF "$1" /root/.ssh/authorized_keys || printf '%s\n' "$1" >>/root/.ssh/authorized_keys`

// AuthorizeSSHKey adds kvbox's SSH key (SSHKey) to root's authorized_keys
// in box name, if it has sshd.
func (h *Host) AuthorizeSSHKey(ctx context.Context, name string) error {
	_, pub, err := h.SSHKey()
	if err != nil {
		return err
	}
	var stderr strings.Builder
	code, err := h.Exec(ctx, name, agent.ExecRequest{Argv: []string{"/bin/sh", "-c", authorizeKeyScript, "sh", pub}}, nil, nil, &stderr, nil)
	if err == nil && code != 0 {
		err = fmt.Errorf("exit %d: %s", code, strings.TrimSpace(stderr.String()))
	}
	if err != nil {
		return fmt.Errorf("box %q: add kvbox's SSH key to root's authorized_keys: %w", name, err)
	}
	return nil
}
