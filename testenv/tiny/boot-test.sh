#!/usr/bin/env bash
# Boot the tiny image with plain QEMU (no libvirt) and measure it.
#
#   testenv/tiny/boot-test.sh IMAGEDIR [kvm|tcg]      (default: kvm if /dev/kvm is usable)
#
# Boots on a throw-away qcow2 overlay, with the agent's virtio-serial port
# (org.kvbox.agent.0 on a unix socket), waits for init's "starting kvbox-agent" line on
# the serial console, then presses the ACPI power button (HMP system_powerdown, what
# `virsh shutdown` does) and waits for QEMU to exit. Prints both times; exits non-zero
# if either step times out. No network device, so no guest traffic at all.
set -euo pipefail
_log_prefix=boot-test
. "$(dirname "$0")/../lib.sh"

IMG=${1:?usage: $0 IMAGEDIR [kvm|tcg]}
ACCEL=${2:-}
if [ -z "$ACCEL" ]; then
	if [ -w /dev/kvm ]; then ACCEL=kvm; else ACCEL=tcg; fi
fi
case "$ACCEL" in kvm) CPU=host ;; tcg) CPU=max ;; *) die "accel must be kvm or tcg" ;; esac
BOOT_TIMEOUT=${BOOT_TIMEOUT:-60}
# KERNEL=vmlinuz boots the compressed bzImage instead of the PVH vmlinux.
KERNEL=${KERNEL:-vmlinux}; [ -f "$IMG/$KERNEL" ] || KERNEL=vmlinuz
for f in disk.qcow2 vmlinuz initrd.img cmdline; do [ -f "$IMG/$f" ] || die "$IMG/$f missing"; done

T=$(mktemp -d /tmp/kvbox-boot.XXXXXX)
QPID=
cleanup() {
	[ -n "$QPID" ] && kill "$QPID" 2>/dev/null || true
	[ -n "${MONPID:-}" ] && kill "$MONPID" 2>/dev/null || true
	[ -n "${KEEP:-}" ] || rm -rf "$T"
}
trap cleanup EXIT
qemu-img create -q -f qcow2 -F qcow2 -b "$(realpath "$IMG/disk.qcow2")" "$T/disk.qcow2"
mkfifo "$T/mon.in" "$T/mon.out"
cat "$T/mon.out" >"$T/mon.log" &
MONPID=$!

t0=$(now_ms)
qemu-system-x86_64 -machine q35,accel="$ACCEL" -cpu "$CPU" -m 512 -smp 1 \
	-nodefaults -no-user-config -display none \
	-chardev file,id=con,path="$T/console.log" -serial chardev:con \
	-chardev pipe,id=mon,path="$T/mon" -mon chardev=mon,mode=readline \
	-kernel "$IMG/$KERNEL" -initrd "$IMG/initrd.img" -append "$(cat "$IMG/cmdline") ${EXTRA_CMDLINE:-}" \
	-drive file="$T/disk.qcow2",if=virtio,format=qcow2 \
	-device virtio-serial \
	-chardev socket,id=a0,path="$T/agent.sock",server=on,wait=off \
	-device virtserialport,chardev=a0,name=org.kvbox.agent.0 \
	-device virtio-rng-pci &
QPID=$!

while ! grep -q 'kvbox-init: starting kvbox-agent' "$T/console.log" 2>/dev/null; do
	kill -0 "$QPID" 2>/dev/null || { cat "$T/console.log" >&2; die "QEMU exited before the agent started"; }
	if [ $(($(now_ms) - t0)) -gt $((BOOT_TIMEOUT * 1000)) ]; then
		cat "$T/console.log" >&2
		[ "$ACCEL" = kvm ] && [ -d /sys/module/kvm_pvm ] &&
			warn "this host's /dev/kvm is kvm_pvm (nested PVM): it only runs PVM-enabled guest kernels, use tcg"
		die "no 'starting kvbox-agent' within ${BOOT_TIMEOUT}s"
	fi
	sleep 0.01
done
t1=$(now_ms)
log "$ACCEL ($KERNEL): QEMU start -> 'starting kvbox-agent': $(fmt_ms $((t1 - t0)))"
sleep "${SETTLE:-3}"   # let the agent run a little before pressing the button

t2=$(now_ms)
echo system_powerdown >"$T/mon.in"
for _ in $(seq 1 200); do kill -0 "$QPID" 2>/dev/null || break; sleep 0.05; done
if kill -0 "$QPID" 2>/dev/null; then
	cat "$T/console.log" >&2; die "QEMU still running 10s after system_powerdown (ACPI power button not handled)"
fi
wait "$QPID" || true; QPID=
log "$ACCEL: ACPI power button -> QEMU exit: $(fmt_ms $(($(now_ms) - t2)))"
echo "----- console -----" >&2
cat "$T/console.log" >&2
