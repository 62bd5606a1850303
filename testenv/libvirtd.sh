#!/usr/bin/env bash
# Starts libvirtd in the current network namespace, in the foreground of
# tini acting as a child subreaper (tini -s), detached from the caller.
#
# Why: libvirtd daemonizes each QEMU, which is then reparented to the
# nearest subreaper, normally PID 1. A host's init (systemd) reaps at once;
# this test machine's PID 1 reaps exited processes 1.5-1.8 s late, and
# libvirt's destroy polls until the QEMU it killed is gone (a zombie still
# counts), so every kvbox rm here waited on the machine's init. Under tini
# the QEMUs of this libvirtd are reaped as soon as they exit, as on a host.
set -u
log=${KVBOX_TESTENV_LIBVIRTD_LOG:-/var/log/kvbox-testenv-libvirtd.log}
setsid tini -s -- libvirtd </dev/null >>"$log" 2>&1 &
