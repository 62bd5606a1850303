#!/usr/bin/env bash
# Build the kvbox "tiny" guest image into OUTDIR:
#   disk.qcow2 (ext4 root, 512 MiB virtual, sparse), vmlinuz, initrd.img, cmdline, image.json
#   and vmlinux: the same kernel uncompressed (an ELF with a PVH entry note). QEMU boots it
#   directly in 32-bit mode, skipping real-mode setup and the in-guest xz decompression:
#   under TCG that is ~2.5x faster to init (~5-7 s instead of ~13-20 s on a loaded 2-core box).
#
#   sudo testenv/tiny/build.sh OUTDIR
#
# Guest kernel: Debian's linux-image-6.1.0-N-amd64 (the plain -amd64 flavour), taken from
# apt (`apt-get download`, `dpkg-deb -x`) into $KVBOX_TESTENV_CACHE/kernel; nothing is
# installed on the host. Userland: busybox-static, the kernel modules kvbox needs and the
# agent from bin/kvbox-agent (required: the build fails without it).
# Rebuilds only when the inputs change (content hash in OUTDIR/.stamp).
#
# Environment:
#   KVBOX_AGENT             agent binary to embed (default: REPO/bin/kvbox-agent)
#   KVBOX_TINY_KERNEL_PKG   kernel package (default: linux-image-amd64's 6.1 dependency)
#   KVBOX_TESTENV_CACHE     cache dir (default /var/cache/kvbox-testenv)
#   KVBOX_TINY_FORCE=1      rebuild even if the stamp matches
set -euo pipefail
_log_prefix=tiny
. "$(dirname "$0")/../lib.sh"
TINY_DIR=$TESTENV_DIR/tiny

[ $# -eq 1 ] || die "usage: $0 OUTDIR"
OUTDIR=$1
require_root   # root-owned files in the ext4 image, apt-get download into the cache

# init_on_alloc=0: as in the Debian image (image/debian.go), so free page hints write nothing
CMDLINE="console=ttyS0 root=/dev/vda rw quiet panic=-1 init_on_alloc=0"
DISK_SIZE=512M
INITRD_MODS="virtio_pci virtio_blk ext4"
ROOT_MODS="virtio_pci virtio_blk ext4 virtio_net vsock vmw_vsock_virtio_transport virtio_console virtio-rng virtio_balloon button evdev"

for t in busybox cpio gzip xz mkfs.ext4 qemu-img depmod modprobe dpkg-deb apt-get sha256sum readelf; do
	command -v "$t" >/dev/null || die "missing tool: $t (run testenv/setup.sh, or apt-get install busybox-static cpio e2fsprogs qemu-utils kmod binutils)"
done
BUSYBOX=/bin/busybox
busybox_static=$(readelf -l "$BUSYBOX" 2>/dev/null | grep -c 'program interpreter' || true)
[ "$busybox_static" = 0 ] || die "$BUSYBOX is dynamically linked: install busybox-static"

# --- the agent (required) ---
AGENT=${KVBOX_AGENT:-$REPO_DIR/bin/kvbox-agent}
[ -f "$AGENT" ] || die "agent binary $AGENT not found: build it first (make build, or CGO_ENABLED=0 go build -o bin/kvbox-agent ./cmd/kvbox-agent)"
if head -c 4 "$AGENT" | grep -q 'ELF'; then
	if readelf -l "$AGENT" | grep -q 'program interpreter'; then
		die "$AGENT is dynamically linked; the guest has no libc: build it with CGO_ENABLED=0"
	fi
else
	warn "$AGENT is not an ELF binary (a placeholder script?); embedding it anyway"
fi

# --- the kernel ---
KDIR=$KVBOX_TESTENV_CACHE/kernel
mkdir -p "$KDIR"
pick_kernel_pkg() {
	local p
	if [ -n "${KVBOX_TINY_KERNEL_PKG:-}" ]; then echo "$KVBOX_TINY_KERNEL_PKG"; return; fi
	p=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-6\.1\.0-[0-9]+-amd64$/ {print $2; exit}')
	if [ -z "$p" ]; then
		p=$(apt-cache pkgnames linux-image-6.1.0- 2>/dev/null | grep -E '^linux-image-6\.1\.0-[0-9]+-amd64$' | sort -t- -k5,5n | tail -1)
	fi
	if [ -z "$p" ]; then   # offline, no apt lists: newest kernel already in the cache
		p=$(ls "$KDIR" 2>/dev/null | sed -n 's/^\(linux-image-6\.1\.0-[0-9]*-amd64\)_.*\.deb$/\1/p' | sort -t- -k5,5n | tail -1)
	fi
	echo "$p"
}
KPKG=$(pick_kernel_pkg)
if [ -z "$KPKG" ]; then   # e.g. a CI image with emptied /var/lib/apt/lists
	log "no kernel package known to apt: apt-get update"
	apt-get update -q >/dev/null || die "apt-get update failed"
	KPKG=$(pick_kernel_pkg)
fi
[ -n "$KPKG" ] || die "no linux-image-6.1.0-N-amd64 package found (apt-get update? bookworm sources?)"
KVER=${KPKG#linux-image-}
DEB=$(ls "$KDIR/${KPKG}"_*.deb 2>/dev/null | sort -V | tail -1 || true)
if [ -z "$DEB" ]; then
	log "downloading $KPKG"
	(cd "$KDIR" && apt-get download -q -o APT::Sandbox::User=root "$KPKG") || die "apt-get download $KPKG failed"
	DEB=$(ls "$KDIR/${KPKG}"_*.deb | sort -V | tail -1)
fi
KROOT=$KDIR/$KVER
if [ ! -e "$KROOT/.extracted" ] || [ "$(cat "$KROOT/.extracted")" != "${DEB##*/}" ]; then
	log "extracting ${DEB##*/}"
	rm -rf "$KROOT"; mkdir -p "$KROOT"
	dpkg-deb -x "$DEB" "$KROOT"
	depmod -b "$KROOT" "$KVER"
	echo "${DEB##*/}" >"$KROOT/.extracted"
fi
KMODDIR=$KROOT/lib/modules/$KVER
[ -f "$KROOT/boot/vmlinuz-$KVER" ] || die "no vmlinuz in $DEB"

# --- up to date? ---
STAMP=$( {
	echo "kernel ${DEB##*/}"
	echo "cmdline $CMDLINE size $DISK_SIZE mods $INITRD_MODS / $ROOT_MODS"
	sha256sum "$AGENT" "$BUSYBOX" "$TINY_DIR/build.sh" "$TINY_DIR/initramfs-init" "$TINY_DIR/sbin-init" "$TINY_DIR/acpi-power" | awk '{print $1}'
} | sha256sum | awk '{print $1}')
if [ -z "${KVBOX_TINY_FORCE:-}" ] && [ -f "$OUTDIR/.stamp" ] && [ "$(cat "$OUTDIR/.stamp")" = "$STAMP" ] &&
	[ -f "$OUTDIR/disk.qcow2" ] && [ -f "$OUTDIR/vmlinuz" ] && [ -f "$OUTDIR/vmlinux" ] && [ -f "$OUTDIR/initrd.img" ] && [ -f "$OUTDIR/cmdline" ]; then
	log "up to date: $OUTDIR (kernel $KVER, stamp ${STAMP:0:12})"
	exit 0
fi

# mod_order "MOD..." -> module paths relative to the kernel's module dir, dependencies first
mod_order() {
	local m
	for m in $1; do
		modprobe -d "$KROOT" -S "$KVER" --show-depends "$m" || die "module $m not found for $KVER"
	done | awk '$1 == "insmod" {print $2}' | sed "s|^$KMODDIR/||" | awk '!seen[$0]++'
}
# CPU-specific accelerations (crc32c-intel needs SSE4.2, absent from TCG's default qemu64
# CPU) may fail with ENODEV: mark them optional ("?PATH"), init loads them quietly.
mark_optional() { sed -E 's|^(.*/[^/]*-intel\.ko)$|?\1|'; }
strip_mark() { sed 's|^?||'; }

mkdir -p "$OUTDIR"
WORK=$(mktemp -d "$KVBOX_TESTENV_CACHE/build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

add_busybox() { # add_busybox ROOT: busybox + applet symlinks in the FHS places it lists
	local root=$1 a
	mkdir -p "$root/bin" "$root/sbin" "$root/usr/bin" "$root/usr/sbin"
	cp "$BUSYBOX" "$root/bin/busybox"
	for a in $("$BUSYBOX" --list-full); do
		[ -e "$root/$a" ] || ln -s /bin/busybox "$root/$a"
	done
}

# --- initramfs ---
t0=$(now_ms)
IR=$WORK/initramfs
mkdir -p "$IR"/{bin,dev,proc,sys,newroot,etc,lib/modules}
cp "$BUSYBOX" "$IR/bin/busybox"
for a in sh mount umount mkdir insmod usleep switch_root setsid cttyhack cat echo ls; do ln -s busybox "$IR/bin/$a"; done
mod_order "$INITRD_MODS" | mark_optional >"$IR/etc/modules.list"
strip_mark <"$IR/etc/modules.list" | while read -r m; do
	mkdir -p "$IR/lib/modules/$(dirname "$m")"
	cp "$KMODDIR/$m" "$IR/lib/modules/$m"
done
install -m 0755 "$TINY_DIR/initramfs-init" "$IR/init"
(cd "$IR" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc -R 0:0 --quiet | gzip -6 -n) >"$WORK/initrd.img"
log "initramfs: $(du -k "$WORK/initrd.img" | cut -f1) KiB, modules: $(sed 's|.*/||; s|\.ko$||' "$IR/etc/modules.list" | tr '\n' ' ')($(fmt_ms $(($(now_ms) - t0))))"

# --- root filesystem ---
t0=$(now_ms)
R=$WORK/root
mkdir -p "$R"/{dev,proc,sys,run,tmp,root,etc/kvbox,etc/acpi/PWRF,var/log,var/lib/kvbox-agent,usr/local/bin,lib/modules/"$KVER"}
chmod 1777 "$R/tmp"; chmod 0700 "$R/root"
add_busybox "$R"
mod_order "$ROOT_MODS" | mark_optional >"$R/etc/kvbox/modules.list"
strip_mark <"$R/etc/kvbox/modules.list" | while read -r m; do
	mkdir -p "$R/lib/modules/$KVER/$(dirname "$m")"
	cp "$KMODDIR/$m" "$R/lib/modules/$KVER/$m"
done
cp "$KMODDIR"/modules.builtin "$KMODDIR"/modules.builtin.modinfo "$KMODDIR"/modules.order "$R/lib/modules/$KVER/"
depmod -b "$R" "$KVER"   # so modprobe works inside the guest too
install -m 0755 "$TINY_DIR/sbin-init" "$R/sbin/init.kvbox"
ln -sf init.kvbox "$R/sbin/init.tmp" && mv -f "$R/sbin/init.tmp" "$R/sbin/init"   # replace busybox's applet link
install -m 0755 "$TINY_DIR/acpi-power" "$R/etc/acpi/PWRF/00000080"
install -m 0755 "$AGENT" "$R/usr/local/bin/kvbox-agent"
# /bin/bash and a user "user" (uid 1000, /home/user), which E2B's SDKs assume: they run
# every command as /bin/bash -l -c CMD. busybox sh takes -l and -c.
printf '#!/bin/sh\n# kvbox tiny image: E2B code runs /bin/bash -l -c CMD; busybox sh does.\nexec /bin/busybox sh "$@"\n' >"$R/bin/bash"
chmod 0755 "$R/bin/bash"
printf 'root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n' >"$R/etc/passwd"
printf 'root:*:0:0:99999:7:::\nuser:*:0:0:99999:7:::\n' >"$R/etc/shadow"; chmod 0600 "$R/etc/shadow"
printf 'root:x:0:\ntty:x:5:\nuser:x:1000:\n' >"$R/etc/group"
mkdir -p "$R/home/user"; chown 1000:1000 "$R/home/user"; chmod 0755 "$R/home/user"
echo tiny >"$R/etc/hostname"
printf '127.0.0.1\tlocalhost\n127.0.1.1\ttiny\n::1\tlocalhost ip6-localhost ip6-loopback\n' >"$R/etc/hosts"
: >"$R/etc/resolv.conf"
printf 'tiny kvbox image\nkernel %s\nbuilt %s\n' "$KVER" "$(date -u +%FT%TZ)" >"$R/etc/kvbox/image-release"
truncate -s "$DISK_SIZE" "$WORK/root.raw"
mkfs.ext4 -q -F -L tiny-root -E root_owner=0:0 -d "$R" "$WORK/root.raw"
qemu-img convert -f raw -O qcow2 "$WORK/root.raw" "$WORK/disk.qcow2"
log "root disk: $(du -k "$WORK/disk.qcow2" | cut -f1) KiB used of $DISK_SIZE ($(fmt_ms $(($(now_ms) - t0))))"

cp "$KROOT/boot/vmlinuz-$KVER" "$WORK/vmlinuz"
# vmlinux: the xz payload of the bzImage, kept only if it carries the PVH (Xen ELF) note.
off=$(LC_ALL=C grep -abo $'\xfd7zXZ' "$WORK/vmlinuz" | head -1 | cut -d: -f1 || true)
[ -n "$off" ] || die "no xz payload in vmlinuz-$KVER (not an xz-compressed bzImage?)"
tail -c +$((off + 1)) "$WORK/vmlinuz" | xz -dc --single-stream >"$WORK/vmlinux" 2>/dev/null || true
readelf -n "$WORK/vmlinux" 2>/dev/null | grep -q 'Xen' || die "extracted vmlinux has no PVH note (CONFIG_PVH off?)"
echo "$CMDLINE" >"$WORK/cmdline"
cat >"$WORK/image.json" <<JSON
{
  "name": "tiny",
  "kernel_version": "$KVER",
  "kernel_package": "${DEB##*/}",
  "kernel": "vmlinuz",
  "kernel_pvh": "vmlinux",
  "cmdline": "$CMDLINE",
  "agent_sha256": "$(sha256sum "$AGENT" | awk '{print $1}')",
  "stamp": "$STAMP",
  "created": "$(date -u +%FT%TZ)"
}
JSON
chmod 0644 "$WORK"/{disk.qcow2,vmlinuz,vmlinux,initrd.img,cmdline,image.json}
for f in disk.qcow2 vmlinuz vmlinux initrd.img cmdline image.json; do mv -f "$WORK/$f" "$OUTDIR/$f"; done
echo "$STAMP" >"$OUTDIR/.stamp"
log "built $OUTDIR (kernel $KVER)"
