package image

import (
	"bytes"
	"context"
	"crypto/sha256"
	"debug/elf"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"kvbox.dev/kvbox/base"
	"kvbox.dev/kvbox/overlay"
	"kvbox.dev/kvbox/progress"
)

// DefaultImage is the image `kvbox new` uses unless told otherwise.
const DefaultImage = "debian"

// DebianPackages are installed on top of debootstrap's minbase variant.
// linux-image-amd64 is the plain flavour: -cloud-amd64 lacks VMGENID.
// python-is-python3 gives the image a `python` command, as E2B's base
// template has one (code written for E2B runs `python script.py`).
var DebianPackages = []string{
	"linux-image-amd64", "systemd", "systemd-sysv", "udev", "dbus", "zstd",
	"apt", "iproute2", "iputils-ping", "ca-certificates", "curl", "git", "python3", "python-is-python3",
	"procps", "kmod", "less", "sudo",
}

// DebianUser is the image's unprivileged account, as E2B's sandboxes have
// it (code written for them assumes /home/user and passwordless sudo):
// uid and gid 1000, /bin/bash.
const DebianUser = "user"

// debianUserSudoers lets DebianUser run anything as root without a
// password (a box's code runs as root anyway: the box is the boundary).
const debianUserSudoers = "# kvbox images build: the image's user, as E2B's sandboxes have it.\n" + DebianUser + " ALL=(ALL:ALL) NOPASSWD: ALL\n"

// debianRecipeVersion changes when the build does something new that the
// recipe's data (DebianRecipe) does not show.
const debianRecipeVersion = 2

// DebianCmdline is the kernel command line of the Debian image.
//
// net.ifnames=0: the NIC is eth0 on every boot; with predictable names
// udev renames it or not depending on whether the agent brought it up
// first.
//
// init_on_alloc=0: Debian's kernel zeroes every page it allocates, and
// the balloon driver allocates the guest's free memory to name it to
// QEMU while a snapshot copies RAM (free page hinting): zeroing it would
// write every free page, which QEMU then copies as dirty. Userspace
// memory is zeroed either way; what goes is a hardening of the guest
// kernel against its own uninitialised-memory bugs, not a boundary
// between boxes or between a box and the host.
const DebianCmdline = "console=ttyS0 root=/dev/vda rw quiet net.ifnames=0 init_on_alloc=0"

// DebianOptions says how to build the Debian image.
type DebianOptions struct {
	Name     string // image name; DefaultImage when empty
	Agent    string // kvbox-agent binary; FindAgent("") when empty
	Force    bool   // rebuild even if the image exists
	Suite    string // Debian suite, "bookworm" when empty
	Mirror   string // "http://deb.debian.org/debian" when empty
	CacheDir string // downloaded .debs kept for the next build; "/var/cache/kvbox/debootstrap" when empty, "-" for none
	DiskSize int64  // virtual size of the disk, 8 GiB when 0
	SSH      bool   // include openssh-server, with no host keys (debian_ssh.go)
	// CodeInterpreter adds Jupyter's Python kernel, the data stack and
	// kvbox's code-interpreter server (debian_codeinterp.go).
	CodeInterpreter bool
	Progress        progress.Reporter // told the build's stages and lines; nil for no one
}

func (o *DebianOptions) defaults() {
	if o.Name == "" {
		o.Name = DefaultImage
	}
	if o.Suite == "" {
		o.Suite = "bookworm"
	}
	if o.Mirror == "" {
		o.Mirror = "http://deb.debian.org/debian"
	}
	if o.CacheDir == "" {
		o.CacheDir = "/var/cache/kvbox/debootstrap"
	}
	if o.DiskSize == 0 {
		o.DiskSize = 8 << 30
	}
	o.Progress = progress.Of(o.Progress)
}

// EnsureDebian returns the Debian image, building it first when it is
// missing (and saying so through o.Progress).
func EnsureDebian(ctx context.Context, s Store, o DebianOptions) (Image, error) {
	o.defaults()
	if im, err := s.Get(o.Name); err == nil {
		return im, nil
	} else if !errors.Is(err, base.ErrNotFound) {
		return Image{}, err
	}
	o.Progress.Log(fmt.Sprintf("image %s is missing: building it from Debian's packages (once; a few minutes)", o.Name))
	im, _, err := BuildDebian(ctx, s, o)
	return im, err
}

// BuildDebian builds a Debian image with debootstrap and registers it in
// the store. It reports built=false when the image already exists and
// o.Force is not set. Everything happens in a temporary folder under the
// store's folder; the image is registered last, so a failed or interrupted
// build registers nothing.
func BuildDebian(ctx context.Context, s Store, o DebianOptions) (im Image, built bool, err error) {
	o.defaults()
	agent, im, have, err := checkBuild(s, o)
	if err != nil || have {
		return im, false, err
	}
	if err := os.MkdirAll(s.Dir, 0o755); err != nil {
		return Image{}, false, err
	}
	unlock, err := lockBuild(ctx, s, o.Name, o.Progress)
	if err != nil {
		return Image{}, false, err
	}
	defer unlock()
	if !o.Force { // another kvbox may have built it while we waited
		if im, err := s.Get(o.Name); err == nil && !recipeChanged(s, im, DebianRecipe(o)) && !agentChanged(s, im, agent) {
			return im, false, nil
		}
	}
	removeStaleBuilds(s, o.Name)
	work, err := os.MkdirTemp(s.Dir, ".build-"+o.Name+"-")
	if err != nil {
		return Image{}, false, err
	}
	defer func() {
		if rerr := removeBuildDir(work); rerr != nil && err == nil {
			err = rerr
		}
	}()
	start := time.Now()
	p := o.Progress
	root := filepath.Join(work, "root")

	// 1. debootstrap
	p.Log(fmt.Sprintf("building image %s: Debian %s from %s, kvbox-agent %s", o.Name, o.Suite, o.Mirror, agent))
	if err := debootstrap(ctx, p, root, o); err != nil {
		return Image{}, false, err
	}

	// 2. configure the guest
	st := startStage(p, "configure: agent service, modules, network to the agent")
	kver, err := configureDebian(ctx, st, root, agent, o)
	if err := st.End(err); err != nil {
		return Image{}, false, fmt.Errorf("configure: %w", err)
	}

	// 3. kernel and initrd out of /boot
	st = startStage(p, "kernel "+kver+" and initrd")
	kernel, initrd, err := extractBoot(ctx, root, work, kver)
	if err := st.End(err); err != nil {
		return Image{}, false, err
	}

	// 4. the disk
	st = startStage(p, fmt.Sprintf("disk: ext4 (mkfs.ext4 -d), %s qcow2", base.FormatSize(o.DiskSize)))
	disk := filepath.Join(work, "disk.qcow2")
	raw := filepath.Join(work, "disk.raw")
	if err := st.End(makeExt4Qcow2(ctx, st, root, raw, disk, "kvbox-root", o.DiskSize)); err != nil {
		return Image{}, false, fmt.Errorf("disk: %w", err)
	}
	os.Remove(raw)
	if err := ctx.Err(); err != nil {
		return Image{}, false, err
	}

	// 5. register
	st = startStage(p, "register image "+o.Name)
	im, err = s.Import(o.Name, ImportOptions{Disk: disk, Kernel: kernel, Initrd: initrd, Cmdline: DebianCmdline, Agent: "yes", Replace: true})
	if err := st.End(err); err != nil {
		return Image{}, false, err
	}
	writeBuildStamp(s, im, agent, DebianRecipe(o))
	used, _ := overlay.Du(filepath.Dir(im.Disk)) // this version; older ones may stay for boxes on them
	p.Log(fmt.Sprintf("✓ image %s built in %s: Debian %s, kernel %s, %s disk, %s on disk", im.Name, fmtDur(time.Since(start)),
		o.Suite, kver, base.FormatSize(im.VirtualSize), base.FormatSize(used)))
	return im, true, nil
}

// checkBuild checks the options and the host before a build, and returns
// the agent to put in the image, or the image when it is built already
// (have) and no --force asks for another.
func checkBuild(s Store, o DebianOptions) (agent string, im Image, have bool, err error) {
	if err := base.ValidName(o.Name); err != nil {
		return "", Image{}, false, err
	}
	if os.Geteuid() != 0 {
		return "", Image{}, false, base.Errorf(base.Unavailable, "building an image needs root (debootstrap, chroot, root-owned files)")
	}
	if !o.Force {
		if im, err := s.Get(o.Name); err == nil {
			agent, aerr := FindAgent(o.Agent)
			switch {
			case recipeChanged(s, im, DebianRecipe(o)):
				o.Progress.Log(fmt.Sprintf("image %s was built from another recipe than this kvbox's: building it again", im.Name))
			case aerr == nil && agentChanged(s, im, agent):
				// The agent is an input of the build like the recipe: an
				// image with an older agent gives its boxes the older
				// agent's behaviour (and its holes).
				o.Progress.Log(fmt.Sprintf("image %s holds another kvbox-agent than %s: building it again", im.Name, agent))
			default:
				return "", im, true, nil
			}
		}
	}
	if err := requireTools(map[string]string{
		"debootstrap": "debootstrap", "unshare": "util-linux", "mkfs.ext4": "e2fsprogs",
		"qemu-img": "qemu-utils", "xz": "xz-utils", "chroot": "coreutils", "tar": "tar", "zstd": "zstd",
	}); err != nil {
		return "", Image{}, false, base.Errorf(base.Unavailable, "%v", err)
	}
	if agent, err = FindAgent(o.Agent); err != nil {
		return "", Image{}, false, base.Errorf(base.Invalid, "%v", err)
	}
	return agent, Image{}, false, nil
}

// debootstrap makes the image's root filesystem in root: Debian's minbase
// with kvbox's packages, in a private mount namespace, so whatever
// debootstrap mounts in the target (proc, sys, devpts) goes away with it,
// even if it is killed.
func debootstrap(ctx context.Context, p progress.Reporter, root string, o DebianOptions) error {
	extra := extraPackages(o)
	tree := baseTreePath(o)
	if tree != "" {
		if _, err := os.Stat(tree); err == nil {
			st := startStage(p, "Debian "+o.Suite+" base tree, cached ("+filepath.Base(tree)+")")
			if err := os.MkdirAll(root, 0o755); err != nil {
				return st.End(err)
			}
			err := runTool(ctx, st, nil, "tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-I", "zstd -d", "-xpf", tree, "-C", root)
			if err = st.End(err); err == nil {
				return installExtras(ctx, p, root, o, extra)
			}
			// A cache that does not unpack is made again.
			os.Remove(tree)
			if err := os.RemoveAll(root); err != nil {
				return err
			}
			if err := os.MkdirAll(root, 0o755); err != nil {
				return err
			}
		}
	}
	pkgs := DebianPackages
	st := startStage(p, fmt.Sprintf("debootstrap %s (minbase + %d packages)", o.Suite, len(pkgs)))
	args := []string{"--mount", "--propagation", "private", "debootstrap", "--variant=minbase",
		"--include=" + strings.Join(pkgs, ","), "--components=main"}
	if err := preseedInitramfs(root); err != nil {
		return st.End(err)
	}
	if err := writeFiles(root, map[string]string{"etc/dpkg/dpkg.cfg.d/kvbox-slim": dpkgSlim, dpkgUnsafeIOFile: dpkgUnsafeIO}); err != nil {
		return st.End(err)
	}
	if o.CacheDir != "-" {
		if err := os.MkdirAll(o.CacheDir, 0o755); err != nil {
			return st.End(err)
		}
		args = append(args, "--cache-dir="+o.CacheDir)
	}
	args = append(args, o.Suite, root, o.Mirror)
	if err := st.End(runTool(ctx, st, nil, "unshare", args...)); err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("build of image %s interrupted; nothing registered: %w", o.Name, err)
		}
		if strings.Contains(err.Error(), "Failed getting release file") {
			return base.Errorf(base.Unavailable, "cannot download from %s: building an image needs that mirror (run kvbox images build outside a network namespace without an uplink): %v", o.Mirror, err)
		}
		return fmt.Errorf("debootstrap: %w", err)
	}
	if tree != "" {
		// Kept with dpkg's unsafe-io setting, which installExtras needs
		// too and removes. A cache that cannot be written costs the next
		// build a debootstrap, nothing more.
		st := startStage(p, "keep the base tree for derived builds ("+filepath.Base(tree)+")")
		if err := st.End(saveTree(ctx, st, root, tree)); err != nil {
			p.Log(fmt.Sprintf("note: the base tree was not kept: %v", err))
		}
	}
	return installExtras(ctx, p, root, o, extra)
}

// The base tree: what debootstrap makes of DebianPackages, before kvbox
// configures anything. Every Debian image starts from it, so an image
// with more packages (--ssh; the code interpreter's) is the base tree
// plus those, installed with apt, not a second debootstrap of
// everything. It is cached in the build's cache folder by what makes it.
const baseTreeVersion = 1

// baseTreePath is where o's base tree is cached, "" with no cache folder.
func baseTreePath(o DebianOptions) string {
	if o.CacheDir == "-" || o.CacheDir == "" {
		return ""
	}
	h := sha256.New()
	fmt.Fprintf(h, "v%d\n%s\n%s %s\n", baseTreeVersion, strings.Join(DebianPackages, ","), o.Suite, o.Mirror)
	for _, part := range []string{dpkgSlim, dpkgUnsafeIO, initramfsConf, initramfsModules} {
		fmt.Fprintf(h, "%d:%s", len(part), part)
	}
	return filepath.Join(o.CacheDir, "trees", o.Suite+"-"+hex.EncodeToString(h.Sum(nil))[:16]+".tar.zst")
}

// saveTree writes root as a tar (zstd) at path, atomically.
func saveTree(ctx context.Context, st *stage, root, path string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	tmp := path + ".part"
	if err := runTool(ctx, st, nil, "tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-I", "zstd -T0 -3", "-cpf", tmp, "-C", root, "."); err != nil {
		os.Remove(tmp)
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// installExtras installs pkgs into the base tree at root with apt in a
// chroot (no service started), from the same mirror and the same package
// cache as debootstrap, then takes dpkg's build-time unsafe-io setting
// out: what users install in a box later syncs as dpkg always does.
func installExtras(ctx context.Context, p progress.Reporter, root string, o DebianOptions, pkgs []string) error {
	unsafe := filepath.Join(root, dpkgUnsafeIOFile)
	if len(pkgs) > 0 {
		st := startStage(p, "apt-get install "+strings.Join(pkgs, " "))
		err := st.End(aptInstall(ctx, st, root, o, pkgs))
		if err != nil {
			if ctx.Err() != nil {
				return fmt.Errorf("build of image %s interrupted; nothing registered: %w", o.Name, err)
			}
			return fmt.Errorf("apt-get install %s: %w", strings.Join(pkgs, " "), err)
		}
	}
	if err := os.Remove(unsafe); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("debootstrap: %w", err)
	}
	return nil
}

// policyRCD keeps maintainer scripts from starting services in the build's
// chroot.
const policyRCD = "#!/bin/sh\n# kvbox images build: no service starts while packages install.\nexit 101\n"

func aptInstall(ctx context.Context, st *stage, root string, o DebianOptions, pkgs []string) error {
	if err := writeFiles(root, map[string]string{"usr/sbin/policy-rc.d": policyRCD}); err != nil {
		return err
	}
	if err := os.Chmod(filepath.Join(root, "usr/sbin/policy-rc.d"), 0o755); err != nil {
		return err
	}
	defer os.Remove(filepath.Join(root, "usr/sbin/policy-rc.d"))
	// The host's resolver for the mirror, as debootstrap had it.
	if b, err := os.ReadFile("/etc/resolv.conf"); err == nil {
		os.WriteFile(filepath.Join(root, "etc/resolv.conf"), b, 0o644)
	}
	archives := ""
	if o.CacheDir != "-" && o.CacheDir != "" {
		archives = o.CacheDir
	}
	script := `set -e
r=$1; shift
mount -t proc proc "$r/proc"; mount -t sysfs sysfs "$r/sys"; mount --bind /dev "$r/dev"; mount --bind /dev/pts "$r/dev/pts"
if [ -n "$ARCHIVES" ]; then mount --bind "$ARCHIVES" "$r/var/cache/apt/archives"; fi
chroot "$r" apt-get -q update
chroot "$r" apt-get -q -y --no-install-recommends install "$@"`
	args := append([]string{"--mount", "--propagation", "private", "sh", "-ec", script, "sh", root}, pkgs...)
	return runTool(ctx, st, []string{"ARCHIVES=" + archives}, "unshare", args...)
}

// dpkgUnsafeIO stops dpkg syncing every file it unpacks while debootstrap
// fills the build's tree: the tree only becomes an image once the whole
// build succeeded, so a crash midway loses nothing the syncs would have
// saved, and on a host busy writing (a compile beside the build) those
// syncs wait behind everyone else's data. Removed once debootstrap is done.
const (
	dpkgUnsafeIOFile = "etc/dpkg/dpkg.cfg.d/kvbox-build-unsafe-io"
	dpkgUnsafeIO     = "# kvbox images build: removed when debootstrap is done.\nforce-unsafe-io\n"
)

// The kvbox-agent unit: early (a box is ready when the agent answers), no
// network dependency (the agent configures the network itself).
const agentUnit = `# Installed by kvbox images build.
[Unit]
Description=kvbox guest agent
DefaultDependencies=no
Wants=systemd-modules-load.service
After=local-fs.target systemd-modules-load.service
Before=sysinit.target network-pre.target shutdown.target
Conflicts=shutdown.target

[Service]
ExecStart=/usr/local/bin/kvbox-agent
# No asynchronous preemption: see cmd/kvbox-agent/kvbox-agent.service.
Environment=GODEBUG=asyncpreemptoff=1
Restart=always
RestartSec=500ms
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=sysinit.target
`

// Modules the agent needs that udev would not load by itself, or not
// early: virtio-serial ports, vsock, the NIC and the host's RNG; and the
// balloon, whose free page hints a snapshot taken as soon as the agent
// answers needs as much as a later one.
const agentModules = `# Loaded early for kvbox-agent (kvbox images build).
virtio_console
vsock
vmw_vsock_virtio_transport
virtio_net
virtio_rng
virtio_balloon
`

// Units that would configure the network behind the agent's back.
var maskedUnits = []string{
	"systemd-networkd.service", "systemd-networkd.socket", "systemd-networkd-wait-online.service",
	"networking.service", "ifup@.service", "NetworkManager.service", "dhcpcd.service",
	"systemd-resolved.service", "systemd-timesyncd.service",
	// First-boot prompts on the console would hold up boot: the image
	// ships an empty machine-id the agent fills.
	"systemd-firstboot.service",
}

// preseedInitramfs makes initramfs-tools build a small initrd: only what
// mounting root on a virtio disk needs (a small initrd boots faster,
// markedly so under TCG). Written before debootstrap, so the kernel's
// postinst builds the initrd once, with these settings (neither file is a
// conffile: dpkg leaves them alone).
func preseedInitramfs(root string) error {
	return writeFiles(root, map[string]string{
		"etc/initramfs-tools/conf.d/kvbox.conf": initramfsConf,
		"etc/initramfs-tools/modules":           initramfsModules,
	})
}

const (
	initramfsConf    = "# kvbox images build: only the modules listed in ../modules\nMODULES=list\nCOMPRESS=zstd\n"
	initramfsModules = "# kvbox: root on a virtio disk\nvirtio_pci\nvirtio_blk\next4\ncrc32c_generic\n"
)

// dpkgSlim keeps out of the image what a box does not use: documentation,
// translations, and the kernel drivers for hardware a virtual machine does
// not have (~230 MB together). Written before debootstrap, so dpkg never
// unpacks them; also applies to what users install later. Kernel packages
// ship /lib/modules (merged into /usr/lib by usrmerge): both are listed.
const dpkgSlim = `# kvbox images build: leave out what a box does not use. Delete this file
# to get man pages, docs, translations and these drivers back on the next install.
path-exclude=/usr/share/man/*
path-exclude=/usr/share/doc/*
path-include=/usr/share/doc/*/copyright
path-exclude=/usr/share/locale/*
path-include=/usr/share/locale/locale.alias
path-exclude=/lib/modules/*/kernel/sound/*
path-exclude=/usr/lib/modules/*/kernel/sound/*
path-exclude=/lib/modules/*/kernel/drivers/media/*
path-exclude=/usr/lib/modules/*/kernel/drivers/media/*
path-exclude=/lib/modules/*/kernel/drivers/net/wireless/*
path-exclude=/usr/lib/modules/*/kernel/drivers/net/wireless/*
path-exclude=/lib/modules/*/kernel/drivers/gpu/drm/amd/*
path-exclude=/usr/lib/modules/*/kernel/drivers/gpu/drm/amd/*
path-exclude=/lib/modules/*/kernel/drivers/gpu/drm/i915/*
path-exclude=/usr/lib/modules/*/kernel/drivers/gpu/drm/i915/*
path-exclude=/lib/modules/*/kernel/drivers/gpu/drm/nouveau/*
path-exclude=/usr/lib/modules/*/kernel/drivers/gpu/drm/nouveau/*
path-exclude=/lib/modules/*/kernel/drivers/gpu/drm/radeon/*
path-exclude=/usr/lib/modules/*/kernel/drivers/gpu/drm/radeon/*
path-exclude=/lib/modules/*/kernel/drivers/infiniband/*
path-exclude=/usr/lib/modules/*/kernel/drivers/infiniband/*
path-exclude=/lib/modules/*/kernel/drivers/iio/*
path-exclude=/usr/lib/modules/*/kernel/drivers/iio/*
path-exclude=/lib/modules/*/kernel/drivers/bluetooth/*
path-exclude=/usr/lib/modules/*/kernel/drivers/bluetooth/*
path-exclude=/lib/modules/*/kernel/net/bluetooth/*
path-exclude=/usr/lib/modules/*/kernel/net/bluetooth/*
`

func writeFiles(root string, files map[string]string) error {
	for name, content := range files {
		p := filepath.Join(root, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// writeGuestConfig puts the agent, its unit and the guest's configuration
// files in root: the network and the identity belong to the agent.
func writeGuestConfig(root, agent string, o DebianOptions) (err error) {
	p := func(name string) string { return filepath.Join(root, name) }
	write := func(name, content string, mode os.FileMode) {
		if err != nil {
			return
		}
		if err = os.MkdirAll(filepath.Dir(p(name)), 0o755); err != nil {
			return
		}
		os.Remove(p(name)) // a symlink (resolv.conf) must not be followed
		err = os.WriteFile(p(name), []byte(content), mode)
		if err == nil {
			err = os.Chmod(p(name), mode)
		}
	}
	symlink := func(target, name string) {
		if err != nil {
			return
		}
		if err = os.MkdirAll(filepath.Dir(p(name)), 0o755); err != nil {
			return
		}
		os.Remove(p(name))
		err = os.Symlink(target, p(name))
	}

	// The agent and its unit.
	if err := os.MkdirAll(p("usr/local/bin"), 0o755); err != nil {
		return err
	}
	if err := copyFile(p("usr/local/bin/kvbox-agent"), agent, 0o755); err != nil {
		return err
	}
	if err := os.MkdirAll(p("var/lib/kvbox-agent"), 0o700); err != nil {
		return err
	}
	write("etc/systemd/system/kvbox-agent.service", agentUnit, 0o644)
	symlink("/etc/systemd/system/kvbox-agent.service", "etc/systemd/system/sysinit.target.wants/kvbox-agent.service")
	write("etc/modules-load.d/kvbox.conf", agentModules, 0o644)

	// The network belongs to the agent.
	for _, u := range maskedUnits {
		symlink("/dev/null", "etc/systemd/system/"+u)
	}
	// No unattended downloads: a box (and every clone of it) updates when
	// its user says so.
	for _, t := range []string{"apt-daily.timer", "apt-daily-upgrade.timer"} {
		os.Remove(p("etc/systemd/system/timers.target.wants/" + t))
	}
	write("etc/network/interfaces", "# The kvbox agent configures the network; nothing else should.\nauto lo\niface lo inet loopback\n", 0o644)
	write("etc/resolv.conf", "", 0o644) // debootstrap copied the build host's; the agent writes the box's

	// Identity: the agent sets hostname, hosts and machine-id when the host
	// identifies the box.
	write("etc/hostname", o.Name+"\n", 0o644)
	write("etc/hosts", fmt.Sprintf("127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n", o.Name), 0o644)
	write("etc/machine-id", "", 0o444)
	if fi, lerr := os.Lstat(p("var/lib/dbus/machine-id")); lerr == nil && fi.Mode().IsRegular() {
		symlink("/etc/machine-id", "var/lib/dbus/machine-id")
	}
	write("etc/fstab", "# kvbox: the root disk is the box's virtio disk\n/dev/vda\t/\text4\trw,errors=remount-ro\t0\t1\n", 0o644)
	write("etc/apt/sources.list", fmt.Sprintf("deb %[1]s %[2]s main\ndeb %[1]s %[2]s-updates main\ndeb http://deb.debian.org/debian-security %[2]s-security main\n", o.Mirror, o.Suite), 0o644)
	write("etc/kvbox/image-release", fmt.Sprintf("kvbox image %s\nDebian %s from %s\nbuilt %s\n", o.Name, o.Suite, o.Mirror, time.Now().UTC().Format(time.RFC3339)), 0o644)
	return err
}

func configureDebian(ctx context.Context, st *stage, root, agent string, o DebianOptions) (kver string, err error) {
	p := func(name string) string { return filepath.Join(root, name) }
	st.Status("kvbox-agent")
	if err := writeGuestConfig(root, agent, o); err != nil {
		return "", err
	}
	// root keeps debootstrap's locked password ("*"): kvbox exec and
	// connect go through the agent, and no user in the box can su to root
	// without one.
	kver, err = kernelVersion(root)
	if err != nil {
		return "", err
	}
	// The initramfs was made during debootstrap with preseedInitramfs's
	// settings; make it again only if it cannot mount root.
	if ok, _ := initrdHas(ctx, root, kver, "virtio_blk.ko", "ext4.ko"); !ok {
		st.Status("update-initramfs")
		if err := preseedInitramfs(root); err != nil {
			return "", err
		}
		if err := runTool(ctx, st, nil, "unshare", "--mount", "--propagation", "private", "sh", "-ec",
			`mount -t proc proc "$1/proc"; mount -t sysfs sysfs "$1/sys"
chroot "$1" update-initramfs -u -k "$2"`, "sh", root, kver); err != nil {
			return "", fmt.Errorf("update-initramfs: %w", err)
		}
	}

	st.Status("user " + DebianUser)
	if err := addDebianUser(ctx, st, root); err != nil {
		return "", fmt.Errorf("user %s: %w", DebianUser, err)
	}

	if o.CodeInterpreter {
		st.Status("code-interpreter server and kernels")
		if err := configureCodeInterp(root); err != nil {
			return "", fmt.Errorf("code interpreter: %w", err)
		}
	}

	if o.SSH {
		st.Status("openssh-server without host keys")
		if err := configureSSH(root); err != nil {
			return "", fmt.Errorf("ssh: %w", err)
		}
	}

	// Leave no downloads, indexes or logs of the build in the image.
	st.Status("clean up")
	for _, g := range []string{"usr/share/man/*", "usr/share/locale/*/LC_MESSAGES", "var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*_*", "var/log/*.log", "var/log/apt/*", "var/cache/debconf/*-old", "var/lib/dpkg/*-old", "root/.bash_history"} {
		m, _ := filepath.Glob(p(g))
		for _, f := range m {
			os.RemoveAll(f)
		}
	}
	return kver, nil
}

// addDebianUser makes DebianUser in root (uid and gid 1000, its home,
// /bin/bash) and lets it sudo without a password.
func addDebianUser(ctx context.Context, st *stage, root string) error {
	if err := runTool(ctx, st, nil, "chroot", root, "useradd", "--create-home", "--uid", "1000", "--user-group",
		"--shell", "/bin/bash", "--comment", "kvbox image user", DebianUser); err != nil {
		return err
	}
	p := filepath.Join(root, "etc/sudoers.d/kvbox-user")
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	return os.WriteFile(p, []byte(debianUserSudoers), 0o440)
}

// DebianRecipe is a digest of what makes the Debian image of o: its
// packages, the files and units kvbox writes into it, its kernel command
// line, suite, mirror and size (not the agent, which has its own stamp).
// An image built from another recipe is built again (BuildDebian).
func DebianRecipe(o DebianOptions) string {
	o.defaults()
	h := sha256.New()
	pkgs := append(DebianPackages[:len(DebianPackages):len(DebianPackages)], extraPackages(o)...)
	fmt.Fprintf(h, "v%d\n%s\n%s %s %d\n", debianRecipeVersion, strings.Join(pkgs, ","), o.Suite, o.Mirror, o.DiskSize)
	for _, part := range []string{DebianCmdline, agentUnit, agentModules, strings.Join(maskedUnits, ","), dpkgSlim, debianUserSudoers, DebianUser} {
		fmt.Fprintf(h, "%d:%s", len(part), part)
	}
	if o.SSH {
		fmt.Fprintf(h, "%d:%s%d:%s", len(sshdConfig), sshdConfig, len(sshUnitDropIn), sshUnitDropIn)
	}
	if o.CodeInterpreter {
		for _, part := range codeInterpRecipe() {
			fmt.Fprintf(h, "ci%d:%s", len(part), part)
		}
	}
	return hex.EncodeToString(h.Sum(nil))
}

// extraPackages are the packages o's image has on top of the base tree.
func extraPackages(o DebianOptions) []string {
	var extra []string
	if o.SSH {
		extra = append(extra, SSHPackages...)
	}
	if o.CodeInterpreter {
		extra = append(extra, CodeInterpreterPackages...)
	}
	return extra
}

// kernelVersion is the version of the one kernel in root's /boot.
func kernelVersion(root string) (string, error) {
	m, _ := filepath.Glob(filepath.Join(root, "boot", "vmlinuz-*"))
	if len(m) == 0 {
		return "", errors.New("no /boot/vmlinuz-* in the image: did linux-image-amd64 install?")
	}
	sort.Strings(m)
	return strings.TrimPrefix(filepath.Base(m[len(m)-1]), "vmlinuz-"), nil
}

// extractBoot copies the kernel and initrd out of root/boot into work. The
// kernel is the uncompressed vmlinux when it has a PVH entry (QEMU boots it
// directly, ~2.5x faster to init under TCG), else the bzImage.
func extractBoot(ctx context.Context, root, work, kver string) (kernel, initrd string, err error) {
	vmlinuz := filepath.Join(root, "boot", "vmlinuz-"+kver)
	initrd = filepath.Join(work, "initrd.img")
	if err := copyFile(initrd, filepath.Join(root, "boot", "initrd.img-"+kver), 0o644); err != nil {
		return "", "", fmt.Errorf("initrd: %w", err)
	}
	if ok, err := initrdHas(ctx, root, kver, "virtio_blk.ko", "ext4.ko"); !ok {
		return "", "", fmt.Errorf("initrd lacks virtio_blk or ext4: root on /dev/vda would not mount (%v)", err)
	}
	kernel = filepath.Join(work, "vmlinuz")
	if err := copyFile(kernel, vmlinuz, 0o644); err != nil {
		return "", "", fmt.Errorf("kernel: %w", err)
	}
	if pvh := filepath.Join(work, "vmlinux"); extractVmlinux(ctx, kernel, pvh) == nil {
		kernel = pvh
	}
	return kernel, initrd, nil
}

// initrdHas lists the image's initramfs with the image's own lsinitramfs
// and reports whether every module is in it.
func initrdHas(ctx context.Context, root, kver string, mods ...string) (bool, error) {
	out, err := exec.CommandContext(ctx, "chroot", root, "lsinitramfs", "/boot/initrd.img-"+kver).Output()
	if err != nil {
		return false, fmt.Errorf("lsinitramfs: %w", err)
	}
	for _, m := range mods {
		if !bytes.Contains(out, []byte("/"+m)) {
			return false, nil
		}
	}
	return true, nil
}

// extractVmlinux writes the ELF inside an xz-compressed bzImage to out and
// keeps it only if it has a PVH entry note (Xen ELF note 18).
func extractVmlinux(ctx context.Context, bzImage, out string) error {
	b, err := os.ReadFile(bzImage)
	if err != nil {
		return err
	}
	off := bytes.Index(b, []byte("\xfd7zXZ\x00"))
	if off < 0 {
		return errors.New("no xz payload")
	}
	f, err := os.Create(out)
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "xz", "-dc", "--single-stream")
	cmd.Stdin = bytes.NewReader(b[off:])
	cmd.Stdout = f
	err = cmd.Run()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil && !hasPVHNote(out) {
		err = errors.New("no PVH entry note")
	}
	if err != nil {
		os.Remove(out)
	}
	return err
}

func hasPVHNote(path string) bool {
	f, err := elf.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type != elf.PT_NOTE {
			continue
		}
		b := make([]byte, p.Filesz)
		if _, err := p.ReadAt(b, 0); err != nil {
			continue
		}
		for len(b) >= 12 {
			nsz, dsz, typ := binary.LittleEndian.Uint32(b), binary.LittleEndian.Uint32(b[4:]), binary.LittleEndian.Uint32(b[8:])
			n := (12 + int(nsz) + 3) &^ 3
			end := n + (int(dsz)+3)&^3
			if end > len(b) || n > len(b) {
				break
			}
			if string(bytes.TrimRight(b[12:12+nsz], "\x00")) == "Xen" && typ == 18 {
				return true
			}
			b = b[end:]
		}
	}
	return false
}

// lockBuild makes builds of one image take turns.
func lockBuild(ctx context.Context, s Store, name string, p progress.Reporter) (func(), error) {
	l, err := base.Wait(filepath.Join(s.Dir, ".build-"+name+".lock"), ctx.Done(), func() {
		p.Log(fmt.Sprintf("another kvbox is building image %s: waiting for it", name))
	})
	if err != nil {
		return nil, err
	}
	return l.Unlock, nil
}

// removeStaleBuilds deletes what killed builds left (the caller holds the
// build lock).
func removeStaleBuilds(s Store, name string) {
	m, _ := filepath.Glob(filepath.Join(s.Dir, ".build-"+name+"-*"))
	for _, d := range m {
		// os.MkdirTemp's suffix is digits: .build-debian-ssh.agent.json
		// (and a build of debian-ssh under its own lock) are not debian's.
		rest := strings.TrimPrefix(filepath.Base(d), ".build-"+name+"-")
		if fi, err := os.Lstat(d); err != nil || !fi.IsDir() || rest == "" || strings.Trim(rest, "0123456789") != "" {
			continue
		}
		removeBuildDir(d)
	}
}

// removeBuildDir deletes a build folder, but never through a mount point:
// a bind-mounted /dev or /proc left inside would take the host's with it.
func removeBuildDir(dir string) error {
	if mounts := mountsUnder(dir); len(mounts) > 0 {
		return fmt.Errorf("build folder %s still has mounts (%s): unmount them, then delete it", dir, strings.Join(mounts, ", "))
	}
	return os.RemoveAll(dir)
}

func mountsUnder(dir string) []string {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil
	}
	var out []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMount(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	return out
}

func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			var v int
			if _, err := fmt.Sscanf(s[i+1:i+4], "%o", &v); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// The build stamp records which agent and which recipe went into which
// build of an image (by the image's creation time), so a cached build can
// say it is stale, and be built again when its recipe is.
type agentStamp struct {
	Created time.Time `json:"created"`
	SHA256  string    `json:"agent_sha256"`
	// Recipe is DebianRecipe's digest; builds before it have none.
	Recipe string `json:"recipe,omitempty"`
}

func agentStampPath(s Store, name string) string {
	return filepath.Join(s.Dir, ".build-"+name+".agent.json")
}

func fileSHA256(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return ""
	}
	return hex.EncodeToString(h.Sum(nil))
}

func writeBuildStamp(s Store, im Image, agent, recipe string) {
	b, _ := json.Marshal(agentStamp{Created: im.Created, SHA256: fileSHA256(agent), Recipe: recipe})
	os.WriteFile(agentStampPath(s, im.Name), b, 0o644)
}

// recipeChanged says whether im was built by kvbox images build from
// another recipe than recipe (or before recipes were recorded); an image
// that was not built here (imported, or its stamp is another build's) has
// not.
func recipeChanged(s Store, im Image, recipe string) bool {
	b, err := os.ReadFile(agentStampPath(s, im.Name))
	if err != nil {
		return false
	}
	var st agentStamp
	if json.Unmarshal(b, &st) != nil || !st.Created.Equal(im.Created) {
		return false
	}
	return st.Recipe != recipe
}

// agentChanged says whether agent differs from the one built into im;
// false when that is not known.
func agentChanged(s Store, im Image, agent string) bool {
	b, err := os.ReadFile(agentStampPath(s, im.Name))
	if err != nil {
		return false
	}
	var st agentStamp
	if json.Unmarshal(b, &st) != nil || !st.Created.Equal(im.Created) || st.SHA256 == "" {
		return false
	}
	return fileSHA256(agent) != st.SHA256
}
