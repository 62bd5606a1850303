#!/usr/bin/env bash
# kvbox test bench setup. Run as root on Debian 12 (bookworm) or 13 (trixie), with or
# without systemd (CI containers have none). Idempotent: a second run only checks.
#
#   sudo testenv/setup.sh            # everything
#   sudo testenv/setup.sh images     # only the Debian images (waits for a build under way)
#   sudo testenv/setup.sh demo       # only what make demo uses (packages, namespace, libvirtd, build)
#   KVBOX_TESTENV_SKIP_IMAGE=1 ...   # skip the tiny image stage
#
# Environment: KVBOX_TESTENV_NS (default kvbox-test), KVBOX_TESTENV_CACHE
# (default /var/cache/kvbox-testenv), KVBOX_TESTENV_DAEMON_TIMEOUT (s, default 30).
set -uo pipefail
_log_prefix=setup
. "$(dirname "$0")/lib.sh"

require_root

# Packages. Backports ones need a minimum version: Debian 12's own QEMU 7.2 / libvirt 9.0
# are too old for kvbox (the mapped-ram migration it saves RAM with came in QEMU 9.0), so
# "installed" is not enough for them.
# kvbox's port filter is nftables over netlink, no package (libvirt's nwfilter is not used).
BPO_PKGS="qemu-system-x86 qemu-utils libvirt-daemon libvirt-daemon-driver-qemu libvirt-clients libvirt-dev"
BASE_PKGS="tini nftables busybox-static e2fsprogs cpio xz-utils binutils iptables iproute2 iputils-ping curl kmod tcpdump openssh-client zstd gcc libc6-dev make pkg-config gzip ca-certificates dnsmasq-base debootstrap protobuf-compiler libprotobuf-dev xxd python3 python3-venv"
declare -A MIN_VERSION=(
	[qemu-system-x86]=1:10.0 [qemu-utils]=1:10.0
	[libvirt-daemon]=11.0 [libvirt-daemon-driver-qemu]=11.0 [libvirt-clients]=11.0 [libvirt-dev]=11.0
)

pkg_ok() { # pkg_ok PKG: installed (and new enough if it has a minimum)
	local v
	v=$(dpkg-query -W -f='${db:Status-Abbrev} ${Version}' "$1" 2>/dev/null) || return 1
	case "$v" in ii*) ;; *) return 1 ;; esac
	v=${v#* }; v=${v# }
	if [ -n "${MIN_VERSION[$1]:-}" ]; then
		dpkg --compare-versions "$v" ge "${MIN_VERSION[$1]}" || return 1
	fi
	return 0
}

stage_packages() {
	local missing_bpo="" missing_base="" p codename
	for p in $BPO_PKGS; do pkg_ok "$p" || missing_bpo="$missing_bpo $p"; done
	for p in $BASE_PKGS; do pkg_ok "$p" || missing_base="$missing_base $p"; done
	if [ -z "$missing_bpo$missing_base" ]; then
		log "all packages present, skipping apt"
		return 0
	fi
	log "missing or too old:${missing_bpo}${missing_base}"
	export DEBIAN_FRONTEND=noninteractive
	codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
	local target=()
	if [ -n "$missing_bpo" ] && [ "$codename" = bookworm ]; then
		if ! grep -rqs '^[^#]*bookworm-backports' /etc/apt/sources.list /etc/apt/sources.list.d/; then
			log "adding bookworm-backports to /etc/apt/sources.list.d/backports.list"
			echo 'deb http://deb.debian.org/debian bookworm-backports main' >/etc/apt/sources.list.d/backports.list || return 1
		fi
		target=(-t bookworm-backports)
	fi
	apt-get update -q || { warn "apt-get update failed"; return 1; }
	if [ -n "$missing_base" ]; then
		# shellcheck disable=SC2086
		apt-get install -y -q --no-install-recommends $missing_base || return 1
	fi
	if [ -n "$missing_bpo" ]; then
		# With their recommends, as a user's install has them: libvirt-daemon only recommends its
		# drivers (storage, network, secret, ...), and a libvirtd without them is not what users run.
		# shellcheck disable=SC2086
		apt-get install -y -q "${target[@]}" $missing_bpo || return 1
	fi
	for p in $BPO_PKGS $BASE_PKGS; do
		pkg_ok "$p" || { warn "$p still missing or older than ${MIN_VERSION[$p]:-any} after apt"; return 1; }
	done
}

stage_netns() {
	if ! ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$KVBOX_TESTENV_NS"; then
		log "creating network namespace $KVBOX_TESTENV_NS"
		ip netns add "$KVBOX_TESTENV_NS" || return 1
	fi
	in_ns ip link set lo up || return 1
	# Forwarding inside the namespace only (kvbox NATs between its bridges there).
	in_ns sysctl -qw net.ipv4.ip_forward=1 >/dev/null 2>&1 || true
	log "netns $KVBOX_TESTENV_NS ready ($(in_ns ip -brief link | tr -s ' ' | paste -sd';'))"
}

# ensure_daemon NAME: NAME running inside the namespace; refuse one running elsewhere.
ensure_daemon() {
	local name=$1 pid ns inns="" other="" why
	for pid in $(pids_by_comm "$name"); do
		ns=$(netns_of "$pid")
		if [ "$ns" = "$KVBOX_TESTENV_NS" ]; then inns="$inns $pid"; else other="$other $pid(${ns:-root or unnamed netns})"; fi
	done
	if [ -n "$other" ]; then
		log "$name is already running outside $KVBOX_TESTENV_NS:$other"
		log "its taps and bridges would land in that namespace, and the tests' guest traffic with them."
		log "stop it first (e.g. 'systemctl stop $name ${name}.socket ${name}-ro.socket ${name}-admin.socket' or kill PID), then rerun."
		return 1
	fi
	if [ -n "$inns" ]; then
		# QEMU (and virtlogd, which writes the consoles) must see the small filesystem too: a
		# daemon started before it was mounted has its own copy of the mount table without it.
		# Restarting libvirtd leaves running domains alone.
		for pid in $inns; do
			why=""
			if ! grep -q " $SMALL_FS " "/proc/$pid/mountinfo" 2>/dev/null; then
				why="was started before $SMALL_FS was mounted"
			elif [ "$name" = libvirtd ] && [ "$(parent_comm "$pid")" != tini ]; then
				# QEMU must be reaped as a host's init would: see libvirtd.sh.
				why="does not run under tini -s (its QEMUs would wait on this machine's PID 1 to be reaped)"
			fi
			if [ -n "$why" ]; then
				log "$name (pid $pid) $why: restarting it"
				kill "$pid"
				for _ in $(seq 600); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
				kill -0 "$pid" 2>/dev/null && { warn "$name (pid $pid) did not exit within 60s"; return 1; }
				inns=""
			fi
		done
	fi
	if [ -n "$inns" ]; then
		log "$name already running in $KVBOX_TESTENV_NS (pid$inns)"
		return 0
	fi
	# No such daemon anywhere: pid files left over from a previous run are stale.
	# (libvirt locks its pid files, so they would not block it; clean up anyway.)
	rm -f "/run/$name.pid"
	log "starting $name in $KVBOX_TESTENV_NS"
	if [ "$name" = libvirtd ]; then
		in_ns "$TESTENV_DIR/libvirtd.sh" || return 1
	else
		in_ns "$name" -d || return 1
	fi
}

wait_libvirt() {
	local timeout=${KVBOX_TESTENV_DAEMON_TIMEOUT:-30} t0 out
	t0=$(date +%s)
	while :; do
		if out=$(virsh -c qemu:///system version 2>&1); then
			log "libvirt answers: $(echo "$out" | grep -i 'running hypervisor' | sed 's/^ *//')"
			return 0
		fi
		if [ $(($(date +%s) - t0)) -ge "$timeout" ]; then
			warn "libvirtd did not answer 'virsh -c qemu:///system version' within ${timeout}s; last error:"
			echo "$out" >&2
			warn "check /var/log/libvirt/libvirtd.log, or run it in the foreground: ip netns exec $KVBOX_TESTENV_NS libvirtd -v"
			return 1
		fi
		sleep 0.2
	done
}

# refuse_foreign NAME...: no NAME may run outside the namespace (virsh would reach it, and its
# taps would land in the root namespace). Modular daemons count: when virtqemud's socket
# exists, qemu:///system goes to it instead of libvirtd.
refuse_foreign() {
	local name pid ns bad=0 units
	for name in "$@"; do
		for pid in $(pids_by_comm "$name"); do
			ns=$(netns_of "$pid")
			[ "$ns" = "$KVBOX_TESTENV_NS" ] && continue
			log "$name (pid $pid) runs outside $KVBOX_TESTENV_NS (${ns:-root or unnamed netns})"
			bad=1
		done
	done
	if [ -d /run/systemd/system ] && command -v systemctl >/dev/null; then
		# socket activation would start a root-namespace daemon on the first virsh call
		units=$(systemctl list-units --no-legend --plain --state=active 'libvirtd*' 'virtqemud*' 'virtlogd*' 'virtnetworkd*' 'virtproxyd*' 2>/dev/null | awk '{print $1}' | paste -sd' ')
		if [ -n "$units" ]; then
			log "systemd has libvirt units active in the root namespace: $units"
			log "stop and mask them for the test run: systemctl stop $units && systemctl mask $units"
			bad=1
		fi
	fi
	if [ "$bad" = 1 ]; then
		log "refusing to continue: taps and bridges of a root-namespace libvirtd would put guest traffic in the root namespace."
		log "stop those daemons (kill PID / systemctl stop ...), then rerun."
		return 1
	fi
}

stage_daemons() {
	refuse_foreign libvirtd virtqemud virtnetworkd virtlogd || return 1
	ensure_daemon virtlogd || return 1
	ensure_daemon libvirtd || return 1
	wait_libvirt
}

stage_build() {
	cd "$REPO_DIR" || return 1
	command -v go >/dev/null || { warn "go not found (expected /usr/local/go/bin/go)"; return 1; }
	if [ -f Makefile ] && make -n build >/dev/null 2>&1; then
		log "make build"
		make build || return 1
	elif [ -d cmd/kvbox-agent ] && ls cmd/kvbox-agent/*.go >/dev/null 2>&1; then
		log "no Makefile 'build' target: building only the agent"
		mkdir -p bin
		CGO_ENABLED=0 go build -o bin/kvbox-agent ./cmd/kvbox-agent || return 1
	else
		log "no Makefile 'build' target and no ./cmd/kvbox-agent package yet: nothing to build"
	fi
	ls -l bin/ 2>/dev/null | sed 's/^/    /' >&2
	return 0
}

TINY_OUT=$KVBOX_TESTENV_CACHE/images/tiny

stage_image() {
	if [ ! -x "$REPO_DIR/bin/kvbox-agent" ]; then
		warn "bin/kvbox-agent does not exist: cannot build the tiny image (it embeds the agent)"
		return 1
	fi
	"$TESTENV_DIR/tiny/build.sh" "$TINY_OUT"
}

stage_import() {
	local kvbox=$REPO_DIR/bin/kvbox help out
	if [ ! -x "$kvbox" ]; then
		log "bin/kvbox not built yet: skipping image registration"
		return 0
	fi
	help=$("$kvbox" images import --help 2>&1) || true
	if ! grep -q 'images import' <<<"$help" || ! grep -q -- '--kernel' <<<"$help"; then
		log "bin/kvbox has no 'images import ... --kernel' yet: skipping image registration"
		return 0
	fi
	local kfile=${KVBOX_TINY_KERNEL_FILE:-vmlinux} state=${KVBOX_STATE_DIR:-/var/lib/kvbox} marker want extra=()
	# One marker a state dir: make e2e imports it into the fleet test's state dir too.
	marker=$TINY_OUT/.imported$(echo "$state" | tr / _)
	want="$(cat "$TINY_OUT/.stamp") $kfile $state"
	if [ -z "${KVBOX_TESTENV_REIMPORT:-}" ] && [ "$(cat "$marker" 2>/dev/null)" = "$want" ]; then
		log "image tiny already registered from this build (KVBOX_TESTENV_REIMPORT=1 to force)"
		return 0
	fi
	# --replace makes a new version of the image: boxes and snapshots built on the old one keep it.
	grep -q -- '--replace' <<<"$help" && extra+=(--replace)
	grep -q -- '--agent' <<<"$help" && extra+=(--agent yes)
	# vmlinux (PVH ELF) boots ~2.5x faster than vmlinuz under TCG; KVBOX_TINY_KERNEL_FILE=vmlinuz for the bzImage.
	if out=$("$kvbox" images import tiny "$TINY_OUT/disk.qcow2" --kernel "$TINY_OUT/$kfile" \
		--initrd "$TINY_OUT/initrd.img" --cmdline "$(cat "$TINY_OUT/cmdline")" "${extra[@]}" 2>&1); then
		log "registered image tiny (${extra[*]})"; [ -n "$out" ] && echo "$out" | sed 's/^/    /' >&2
		echo "$want" >"$marker"
		return 0
	fi
	warn "kvbox images import failed:"; echo "$out" >&2
	return 1
}

# The default image. Built here, in the root namespace: debootstrap downloads from
# deb.debian.org and the test namespace has no uplink. A no-op while the image exists and was
# built from this kvbox's recipe (kvbox images build builds one of an older recipe again).
stage_debian() {
	local kvbox=$REPO_DIR/bin/kvbox
	if [ ! -x "$kvbox" ] || ! "$kvbox" images --help 2>&1 | grep -q '^  build'; then
		log "bin/kvbox has no 'images build' yet: skipping the Debian image"
		return 0
	fi
	"$kvbox" images build debian --agent "$REPO_DIR/bin/kvbox-agent" || return 1
	# The same with openssh-server, for TestSSHProxy (a no-op while it exists).
	if "$kvbox" images build --help 2>&1 | grep -q -- '--ssh'; then
		"$kvbox" images build debian --ssh --name debian-ssh --agent "$REPO_DIR/bin/kvbox-agent"
	fi
	# The code interpreter's, for TestCodeInterpreter: the same base tree plus Jupyter and the
	# data stack with apt (a no-op while it exists).
	if "$kvbox" images build --help 2>&1 | grep -q 'code-interpreter'; then
		"$kvbox" images build code-interpreter --agent "$REPO_DIR/bin/kvbox-agent"
	fi
}

# stage_debian_background: stage_debian detached, so that make test's checks, unit tests and
# fuzzing run beside debootstrap; make e2e runs `setup.sh images` first, whose kvbox images
# build waits for the one under way (each image's build lock) and then finds the image built,
# or, if the background build failed, builds it again where its error shows. Normal priority:
# the end-to-end tests wait for it. Its own session, so its own autogroup beside the tests'.
DEBIAN_LOG=$KVBOX_TESTENV_CACHE/debian-images.log
stage_debian_background() {
	mkdir -p "$KVBOX_TESTENV_CACHE" || return 1
	log "building the Debian images detached, log $DEBIAN_LOG; setup.sh images (make e2e) waits for them"
	setsid bash "$TESTENV_DIR/setup.sh" images >"$DEBIAN_LOG" 2>&1 </dev/null &
}

# The E2B JS SDK, pinned (testenv/e2b/VERSION/package-lock.json), for envd's conformance test
# (guest-agent/envd TestSDKConformance). npm ci runs here, in the root namespace (it downloads
# from the npm registry); the tests run node in namespaces of their own. Each install is
# redone only when its lock file or node changes (a stamp in node_modules).
E2B_NODE_MIN=20.18.1
stage_e2b_sdk() {
	local dir v stamp
	command -v node >/dev/null && command -v npm >/dev/null || {
		warn "node and npm not found: the E2B SDK's tests need node >= $E2B_NODE_MIN"; return 1; }
	v=$(node --version); v=${v#v}
	if ! dpkg --compare-versions "$v" ge "$E2B_NODE_MIN"; then
		warn "node $v is older than $E2B_NODE_MIN, which e2b@2.51.0 needs"; return 1
	fi
	for dir in "$TESTENV_DIR"/e2b/*/; do
		dir=${dir%/}
		[ -f "$dir/package-lock.json" ] || continue
		stamp="$(sha256sum "$dir/package-lock.json" | cut -d' ' -f1) node $v"
		if [ "$(cat "$dir/node_modules/.kvbox-stamp" 2>/dev/null)" = "$stamp" ]; then
			log "${dir##*/}: installed"
			continue
		fi
		log "${dir##*/}: npm ci"
		(cd "$dir" && npm ci --no-audit --no-fund --loglevel=error) || return 1
		echo "$stamp" >"$dir/node_modules/.kvbox-stamp"
	done
}

# The E2B Python SDK, pinned with hashes (testenv/e2b-py/VERSION/requirements.txt: e2b, its
# dependencies and pytest), for TestServePython; and E2B's code-interpreter SDK the same way
# (testenv/e2b-py-code-interpreter/VERSION/requirements.txt, venv code-interpreter-VERSION), for
# TestCodeInterpreter. Each version gets a virtualenv of its own under
# the test env's cache, made from Debian's python3 (python3-venv; KVBOX_TESTENV_PYTHON names
# another), never the system Python's packages. pip runs here, in the root namespace (it
# downloads from PyPI), with no configuration file and its cache in the test env's; the tests
# run the venv's pytest in the namespace. A venv that already has exactly the pinned versions
# is left alone.
E2B_PY_VENVS=$KVBOX_TESTENV_CACHE/e2b-py
# e2b_py_exact PYTHON REQ: the venv of PYTHON has exactly the packages and versions REQ pins
# (pip, setuptools and wheel aside).
e2b_py_exact() {
	"$1" -I - "$2" 2>/dev/null <<-'PY'
	import re, sys, importlib.metadata as md
	norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
	want = {}
	for line in open(sys.argv[1]):
	    m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
	    if m:
	        want[norm(m[1])] = m[2]
	have = {norm(d.metadata["Name"]): d.version for d in md.distributions()}
	for k in ("pip", "setuptools", "wheel"):
	    have.pop(k, None)
	sys.exit(have != want)
	PY
}

stage_e2b_py() {
	local py req dir v venv
	py=${KVBOX_TESTENV_PYTHON:-}
	if [ -z "$py" ]; then
		if [ -x /usr/bin/python3 ]; then py=/usr/bin/python3; else py=$(command -v python3) || {
			warn "python3 not found (Debian: apt-get install python3 python3-venv)"; return 1; }; fi
	fi
	"$py" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || {
		warn "$py is older than 3.10 or has no venv/ensurepip (Debian: python3-venv), which the E2B SDK needs"; return 1; }
	# pip as configured nowhere else: no pip.conf, no find-links, its cache here.
	local pipenv=(env -u PIP_FIND_LINKS -u PIP_INDEX_URL -u PIP_EXTRA_INDEX_URL -u PIP_REQUIRE_VIRTUALENV
		PIP_CONFIG_FILE=/dev/null PIP_CACHE_DIR="$KVBOX_TESTENV_CACHE/pip" PIP_DISABLE_PIP_VERSION_CHECK=1
		PIP_NO_INPUT=1 PYTHONNOUSERSITE=1)
	for req in "$TESTENV_DIR"/e2b-py/*/requirements.txt "$TESTENV_DIR"/e2b-py-code-interpreter/*/requirements.txt; do
		[ -f "$req" ] || continue
		dir=${req%/requirements.txt}; v=${dir##*/}
		case $dir in */e2b-py-code-interpreter/*) v=code-interpreter-$v ;; esac
		venv=$E2B_PY_VENVS/$v
		if [ -x "$venv/bin/python" ] && e2b_py_exact "$venv/bin/python" "$req"; then
			log "e2b $v: installed in $venv"
			continue
		fi
		log "e2b $v: installing into $venv (pip install --require-hashes --no-deps)"
		rm -rf "$venv" && mkdir -p "$E2B_PY_VENVS" || return 1
		"$py" -m venv "$venv" || return 1
		"${pipenv[@]}" "$venv/bin/python" -m pip install -q --require-hashes --no-deps --only-binary :all: -r "$req" || {
			warn "e2b $v: pip install failed"; rm -rf "$venv"; return 1; }
		"$venv/bin/python" -c 'import e2b, pytest' || { rm -rf "$venv"; return 1; }
	done
}

# What the guests can use here. kvbox's --domain-type auto picks kvm whenever libvirt offers it,
# but a kvm_pvm /dev/kvm (nested PVM, no vmx/svm) only runs PVM-enabled guest kernels: the tiny
# image's stock Debian kernel triple-faults in firmware there and never prints a line.
stage_host() {
	if [ ! -e /dev/kvm ]; then
		log "no /dev/kvm: guests run under TCG (domain type qemu)"
	elif [ -d /sys/module/kvm_pvm ] || ! grep -qwE 'vmx|svm' /proc/cpuinfo; then
		warn "/dev/kvm here is $([ -d /sys/module/kvm_pvm ] && echo kvm_pvm || echo 'KVM without vmx/svm') (nested PVM?):"
		warn "stock guest kernels hang under it. Use TCG: export KVBOX_DOMAIN_TYPE=qemu (tiny/boot-test.sh IMAGEDIR tcg)"
	else
		log "/dev/kvm present: guests can use KVM"
	fi
	[ -e /dev/vhost-vsock ] || log "no /dev/vhost-vsock: host-to-guest vsock unavailable, use the virtio-serial ports"
	return 0
}

# A small filesystem for the tests that fill a disk. It is mounted before libvirtd starts:
# `ip netns exec` gives libvirtd (and so QEMU) and the tests each a copy of the mount table
# taken at that moment, and the copies share this tmpfs, so both sides see the same files.
SMALL_FS=${KVBOX_TESTENV_SMALL_FS:-/var/lib/kvbox-small}
stage_small_fs() {
	mkdir -p "$SMALL_FS" || return 1
	if ! mountpoint -q "$SMALL_FS"; then
		mount -t tmpfs -o size=1g,mode=0755 kvbox-small "$SMALL_FS" || return 1
	fi
	log "$SMALL_FS: $(df -h --output=size,used "$SMALL_FS" | tail -1 | tr -s ' ')"
}

# The OCI registry the snapshot push/pull tests use: Debian's docker-registry (the CNCF
# distribution registry), on the namespace's own loopback 127.0.0.1:5000, plain HTTP, no
# auth, its blobs under $REGISTRY_DIR. Started by hand (no systemd), once: a second run
# finds it answering and leaves it alone.
REGISTRY_DIR=${KVBOX_TESTENV_REGISTRY_DIR:-/var/lib/kvbox-testenv/registry}
stage_registry() {
	pkg_ok docker-registry || { DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker-registry >/dev/null || return 1; }
	if in_ns curl -fsS -o /dev/null http://127.0.0.1:5000/v2/; then
		log "registry already answering on 127.0.0.1:5000 in $KVBOX_TESTENV_NS"
		return 0
	fi
	mkdir -p "$REGISTRY_DIR/data"
	cat >"$REGISTRY_DIR/config.yml" <<-CONF
	version: 0.1
	log:
	  level: warn
	storage:
	  filesystem:
	    rootdirectory: $REGISTRY_DIR/data
	  delete:
	    enabled: true
	http:
	  addr: 127.0.0.1:5000
	CONF
	log "starting docker-registry on 127.0.0.1:5000 in $KVBOX_TESTENV_NS (log $REGISTRY_DIR/registry.log)"
	in_ns setsid docker-registry serve "$REGISTRY_DIR/config.yml" >>"$REGISTRY_DIR/registry.log" 2>&1 </dev/null &
	for _ in $(seq 100); do
		in_ns curl -fsS -o /dev/null http://127.0.0.1:5000/v2/ && return 0
		sleep 0.1
	done
	warn "docker-registry did not answer within 10s: see $REGISTRY_DIR/registry.log"
	return 1
}

profile=all
if [ "${1:-}" = demo ]; then
	# make demo: what the demo uses and no more. No registry, SDKs, tiny image or
	# second Debian image; the demo builds the Debian image itself, as a step it shows.
	profile=demo
elif [ "${1:-}" = images ]; then
	if [ -n "${KVBOX_TESTENV_SKIP_DEBIAN:-}" ]; then
		log "KVBOX_TESTENV_SKIP_DEBIAN set: skipping the Debian image"
	else
		stage "Debian images (kvbox images build debian)" stage_debian
	fi
	exit 0
elif [ "${1:-}" = import-tiny ]; then
	# The tiny image, built before, registered in KVBOX_STATE_DIR's kvbox (make e2e, for a
	# state dir of its own beside the default one).
	[ -f "$TINY_OUT/.stamp" ] || die "the tiny image is not built: run testenv/setup.sh first"
	[ -x "$REPO_DIR/bin/kvbox" ] || die "bin/kvbox is not built: make build"
	stage "register image tiny in ${KVBOX_STATE_DIR:-/var/lib/kvbox}" stage_import
	exit 0
elif [ -n "${1:-}" ]; then
	die "unknown argument $1 (setup.sh [images|demo|import-tiny])"
fi

T0=$(now_ms)
stage "host" stage_host
stage "packages" stage_packages
stage "network namespace $KVBOX_TESTENV_NS" stage_netns
stage "small filesystem $SMALL_FS" stage_small_fs
stage "virtlogd + libvirtd in $KVBOX_TESTENV_NS" stage_daemons
stage "build" stage_build
if [ "$profile" = demo ]; then
	log "done in $(fmt_ms $(($(now_ms) - T0))) (what the demo needs)"
	exit 0
fi
stage "OCI registry on 127.0.0.1:5000 in $KVBOX_TESTENV_NS" stage_registry
stage "E2B JS SDK (testenv/e2b)" stage_e2b_sdk
stage "E2B Python SDKs (testenv/e2b-py, testenv/e2b-py-code-interpreter; venvs in $E2B_PY_VENVS)" stage_e2b_py
if [ -n "${KVBOX_TESTENV_SKIP_IMAGE:-}" ]; then
	log "KVBOX_TESTENV_SKIP_IMAGE set: skipping the tiny image"
else
	stage "tiny image ($TINY_OUT)" stage_image
	stage "register image tiny" stage_import
fi
if [ -n "${KVBOX_TESTENV_SKIP_DEBIAN:-}" ]; then
	log "KVBOX_TESTENV_SKIP_DEBIAN set: skipping the Debian image"
elif [ "${KVBOX_TESTENV_IMAGES:-}" = background ]; then
	stage "Debian images, in the background" stage_debian_background
else
	stage "Debian image (kvbox images build debian)" stage_debian
fi
# The Kubernetes control plane kvbox-node's tests run against; built once per version, in the
# root namespace (Go module proxy). KVBOX_TESTENV_SKIP_FLEET=1 skips it;
# KVBOX_TESTENV_FLEET=background (make test) builds it behind the tests. Started after the
# images when they are built here: a compile beside debootstrap makes it take up to twice as
# long, niced or not.
if [ -n "${KVBOX_TESTENV_SKIP_FLEET:-}" ]; then
	log "KVBOX_TESTENV_SKIP_FLEET set: skipping the control plane build"
elif [ "${KVBOX_TESTENV_FLEET:-}" = background ]; then
	stage "control plane for the fleet tests, in the background" bash "$TESTENV_DIR/fleet.sh" build --background
else
	stage "control plane for the fleet tests (testenv/fleet.sh build, cached)" bash "$TESTENV_DIR/fleet.sh" build
fi
log "done in $(fmt_ms $(($(now_ms) - T0))). Run tests inside the namespace: ip netns exec $KVBOX_TESTENV_NS go test ..."
