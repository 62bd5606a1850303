package agent

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"kvbox.dev/kvbox/testenv/gate"
)

func TestSSHHostKeys(t *testing.T) {
	gate.Tools(t, "ssh-keygen")
	keygen, _ := exec.LookPath("ssh-keygen")
	root := t.TempDir()
	for _, d := range []string{"usr/sbin", "usr/bin", "etc/ssh"} {
		os.MkdirAll(filepath.Join(root, d), 0o755)
	}
	s := &LinuxSystem{Root: root}
	if has, err := s.SSHHostKeys(false); has || err != nil {
		t.Fatalf("without sshd: %v, %v", has, err)
	}
	os.WriteFile(filepath.Join(root, "usr/sbin/sshd"), nil, 0o755)
	os.Symlink(keygen, filepath.Join(root, "usr/bin/ssh-keygen"))
	key := filepath.Join(root, "etc/ssh/ssh_host_ed25519_key")
	if has, err := s.SSHHostKeys(false); !has || err != nil {
		t.Fatalf("first boot: %v, %v", has, err)
	}
	k1, err := os.ReadFile(key + ".pub")
	if err != nil {
		t.Fatal(err)
	}
	if st, _ := os.Stat(key); st.Mode().Perm() != 0o600 {
		t.Errorf("private key mode %v", st.Mode())
	}
	s.SSHHostKeys(false)
	if k, _ := os.ReadFile(key + ".pub"); !bytes.Equal(k, k1) {
		t.Error("a second boot changed the key")
	}
	old := filepath.Join(root, "etc/ssh/ssh_host_rsa_key")
	os.WriteFile(old, []byte("source's key"), 0o600)
	if _, err := s.SSHHostKeys(true); err != nil {
		t.Fatal(err)
	}
	if k, _ := os.ReadFile(key + ".pub"); bytes.Equal(k, k1) || len(k) == 0 {
		t.Error("renew kept the key")
	}
	if _, err := os.Stat(old); err == nil {
		t.Error("renew kept a key of another type")
	}
	if m, _ := filepath.Glob(filepath.Join(root, "etc/ssh/*.kvbox-new*")); len(m) > 0 {
		t.Errorf("left %v", m)
	}
}
