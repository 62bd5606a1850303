package agent

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"kvbox.dev/kvbox/base"
)

// SSH host keys. An image built with ssh (kvbox images build debian --ssh)
// carries no host keys: a box gets its own on first boot (ssh.service runs
// `kvbox-agent -ssh-host-keys` before sshd), and a clone gets new ones when
// the host re-identifies it, before the clone is reported ready: a clone
// must never present its source's host keys.

// sshHostKeyTypes are the keys made. ed25519 alone: quick to make even
// under TCG (RSA takes seconds there) and every current client takes it;
// the image's sshd_config names only this key.
var sshHostKeyTypes = []string{"ed25519"}

// hostKeyRotator is a System that can renew SSH host keys; only the real
// one is, so tests never touch the test host's /etc/ssh.
type hostKeyRotator interface {
	SSHInstalled() bool
	SSHHostKeys(renew bool) (bool, error)
}

// SSHInstalled reports whether the guest has sshd.
func (s *LinuxSystem) SSHInstalled() bool {
	_, err := os.Stat(s.path("usr/sbin/sshd"))
	return err == nil
}

// SSHHostKeys makes the guest's SSH host keys when sshd is installed: the
// missing ones, or with renew every one anew, and then tells a running
// sshd to load them (SIGHUP: it re-executes itself). It reports whether
// sshd is installed.
func (s *LinuxSystem) SSHHostKeys(renew bool) (bool, error) {
	if !s.SSHInstalled() {
		return false, nil
	}
	keygen := s.path("usr/bin/ssh-keygen")
	if _, err := os.Stat(keygen); err != nil {
		return true, fmt.Errorf("sshd is installed but not ssh-keygen: %w", err)
	}
	dir := s.path("etc/ssh")
	// ssh.service's first-boot run and an identify may race: one at a time.
	lock, err := base.Lock(filepath.Join(dir, ".kvbox-hostkeys.lock"), true)
	if err != nil {
		return true, err
	}
	defer lock.Unlock()
	made := false
	for _, t := range sshHostKeyTypes {
		key := filepath.Join(dir, "ssh_host_"+t+"_key")
		if _, err := os.Stat(key); err == nil && !renew {
			continue
		}
		// Made under a temporary name and renamed: sshd never reads half a key.
		tmp := key + ".kvbox-new"
		os.Remove(tmp)
		os.Remove(tmp + ".pub")
		out, err := exec.Command(keygen, "-q", "-t", t, "-N", "", "-C", "", "-f", tmp).CombinedOutput()
		if err != nil {
			return true, fmt.Errorf("ssh-keygen -t %s: %v: %s", t, err, strings.TrimSpace(string(out)))
		}
		if err := os.Rename(tmp+".pub", key+".pub"); err != nil {
			return true, err
		}
		if err := os.Rename(tmp, key); err != nil {
			return true, err
		}
		made = true
	}
	if renew {
		// Keys of other types (from an image built elsewhere) go: they
		// would be the source's.
		old, _ := filepath.Glob(filepath.Join(dir, "ssh_host_*_key*"))
		for _, f := range old {
			keep := false
			for _, t := range sshHostKeyTypes {
				keep = keep || strings.HasPrefix(filepath.Base(f), "ssh_host_"+t+"_key")
			}
			if !keep {
				os.Remove(f)
			}
		}
	}
	if made && s.Root == "/" {
		if err := reloadSSHD(); err != nil {
			return true, err
		}
	}
	return true, nil
}

// reloadSSHD makes a running sshd serve the new keys. Before OpenSSH 9.8
// (Debian 12 has 9.2) sshd re-executes itself for every connection and the
// new process reads the host keys from disk: nothing to do, and a SIGHUP
// would only close the port for as long as sshd takes to start again
// (tens of seconds under TCG). From 9.8 the listener hands its keys to
// sshd-session: it must reload them, and the port is back before the
// clone is reported ready.
func reloadSSHD() error {
	if _, err := os.Stat("/usr/lib/openssh/sshd-session"); err != nil {
		return nil
	}
	if err := hupSSHD(); err != nil {
		return err
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", "127.0.0.1:22", time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("sshd did not come back after reloading its host keys: %w", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// hupSSHD makes a running sshd listener reload its host keys.
func hupSSHD() error {
	b, err := os.ReadFile("/run/sshd.pid")
	if errors.Is(err, os.ErrNotExist) {
		return nil // not running yet: it will read the new keys
	}
	if err != nil {
		return err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 {
		return fmt.Errorf("/run/sshd.pid: %q", b)
	}
	if err := unix.Kill(pid, unix.SIGHUP); err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("reload sshd: %w", err)
	}
	return nil
}

// renewHostKeys gives the guest new SSH host keys when its identity
// changes (a clone being re-identified), and makes missing ones otherwise.
func (s *Server) renewHostKeys(id Identity) error {
	r, ok := s.sys().(hostKeyRotator)
	if !ok || !r.SSHInstalled() {
		return nil
	}
	renew := true
	if s.StateDir != "" {
		if old, ok, err := LoadIdentity(s.StateDir); err == nil && ok && old.MachineID == id.MachineID && old.Hostname == id.Hostname && old.MAC == id.MAC {
			renew = false // the same box told its identity again
		}
	}
	has, err := r.SSHHostKeys(renew)
	if err != nil {
		return fmt.Errorf("ssh host keys: %w", err)
	}
	if has && renew {
		s.logf("ssh host keys renewed for %q", id.Hostname)
	}
	return nil
}
