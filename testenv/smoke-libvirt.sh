#!/usr/bin/env bash
# Start a throw-away libvirt domain from the tiny image (no kvbox involved), wait for the
# agent start on its serial console, then `virsh shutdown` it (ACPI) and time both.
# Proves that libvirtd (in the kvbox-test netns) can run domains on this host as-is.
#
#   sudo testenv/smoke-libvirt.sh [IMAGEDIR] [qemu|kvm]
#
# Default type: qemu (TCG). kvm only works where /dev/kvm is a real KVM (not kvm_pvm).
set -euo pipefail
_log_prefix=smoke
. "$(dirname "$0")/lib.sh"
require_root
IMG=${1:-$KVBOX_TESTENV_CACHE/images/tiny}
TYPE=${2:-qemu}
KERNEL=${KERNEL:-vmlinux}; [ -f "$IMG/$KERNEL" ] || KERNEL=vmlinuz
URI=qemu:///system
NAME=kvbox-smoke-$$
D=$(mktemp -d /tmp/kvbox-smoke.XXXXXX)
chmod 0755 "$D"
cleanup() {
	virsh -c "$URI" destroy "$NAME" >/dev/null 2>&1 || true
	[ -n "${KEEP:-}" ] || rm -rf "$D"
}
trap cleanup EXIT
qemu-img create -q -f qcow2 -F qcow2 -b "$(realpath "$IMG/disk.qcow2")" "$D/disk.qcow2"
cat >"$D/domain.xml" <<XML
<domain type='$TYPE'>
  <name>$NAME</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>$(realpath "$IMG/$KERNEL")</kernel>
    <initrd>$(realpath "$IMG/initrd.img")</initrd>
    <cmdline>$(cat "$IMG/cmdline")</cmdline>
  </os>
  <features><acpi/></features>
  <on_poweroff>destroy</on_poweroff>
  <devices>
    <disk type='file' device='disk'>
      <driver name='qemu' type='qcow2'/>
      <source file='$D/disk.qcow2'/>
      <target dev='vda' bus='virtio'/>
    </disk>
    <serial type='file'><source path='$D/console.log'/><target port='0'/></serial>
    <console type='file'><source path='$D/console.log'/><target type='serial' port='0'/></console>
    <channel type='unix'>
      <source mode='bind' path='$D/agent.0.sock'/>
      <target type='virtio' name='org.kvbox.agent.0'/>
    </channel>
    <rng model='virtio'><backend model='random'>/dev/urandom</backend></rng>
  </devices>
</domain>
XML
t0=$(now_ms)
virsh -c "$URI" create "$D/domain.xml" >/dev/null || die "virsh create failed (see /var/log/libvirt/qemu/$NAME.log)"
t1=$(now_ms)
log "$TYPE ($KERNEL): virsh create returned after $(fmt_ms $((t1 - t0)))"
while ! grep -q 'kvbox-init: starting kvbox-agent' "$D/console.log" 2>/dev/null; do
	if [ $(($(now_ms) - t0)) -gt 90000 ]; then cat "$D/console.log" >&2 || true; die "no agent start within 90s"; fi
	sleep 0.05
done
log "$TYPE: virsh create -> 'starting kvbox-agent': $(fmt_ms $(($(now_ms) - t0)))"
sleep "${SETTLE:-2}"
t2=$(now_ms)
virsh -c "$URI" shutdown "$NAME" >/dev/null
while virsh -c "$URI" domstate "$NAME" >/dev/null 2>&1; do
	[ $(($(now_ms) - t2)) -gt 20000 ] && { cat "$D/console.log" >&2; die "still running 20s after virsh shutdown"; }
	sleep 0.05
done
log "$TYPE: virsh shutdown -> domain gone: $(fmt_ms $(($(now_ms) - t2)))"
echo "----- console -----" >&2; cat "$D/console.log" >&2
