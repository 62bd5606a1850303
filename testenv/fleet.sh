#!/usr/bin/env bash
# A local Kubernetes control plane on this machine, for kvbox-node's tests and for users to try
# kvbox on Kubernetes: etcd, kube-apiserver, kube-scheduler and kube-controller-manager, all on
# 127.0.0.1 inside the test namespace, with a certificate authority made fresh for each run; and
# kubernetes-sigs/agent-sandbox's controller and CRDs (warm pools of pods, claimed from them).
#
#   testenv/fleet.sh build                  # build the binaries once (cached by version)
#   testenv/fleet.sh build --background     # the same detached at the lowest priority, then
#                                           # kvbox-node's module built and vetted; a later
#                                           # build waits for it (log: $FLEET_CACHE/background-build.log)
#   testenv/fleet.sh up                     # start the control plane; writes $FLEET_STATE/env
#   testenv/fleet.sh node-credentials NAME ADDRESS
#                                           # a node's kubeconfig and kubelet serving certificate
#   testenv/fleet.sh nodes                  # two kvbox nodes, kvbox-a and kvbox-b, to try it
#   testenv/fleet.sh status                 # what runs, where
#   testenv/fleet.sh down                   # stop everything and remove the run's files
#                                           # (the nodes' boxes, snapshots and bridges too)
#
# The build compiles kube-apiserver, kube-scheduler, kube-controller-manager and kubectl from
# k8s.io/kubernetes through a wrapper module that points its staging modules at their published
# releases, etcd from go.etcd.io/etcd/server and agent-sandbox's controller from
# sigs.k8s.io/agent-sandbox, with the Go module proxy (root namespace, niced). Nothing of those
# repositories is kept outside the Go module cache and the binaries (and agent-sandbox's CRDs
# beside them).
#
# Environment: KVBOX_FLEET_K8S_VERSION (default v1.37.2), KVBOX_FLEET_ETCD_VERSION (v3.7.3),
# KVBOX_FLEET_AGENT_SANDBOX_VERSION (v1.0.1), KVBOX_FLEET_CACHE (/var/lib/kvbox-testenv/k8s), KVBOX_FLEET_STATE
# (/var/lib/kvbox-testenv/fleet), KVBOX_FLEET_GRACE (the node-monitor grace period, 20s),
# KVBOX_FLEET_EVICTION_SECONDS (pods' default toleration of a NotReady node, 30),
# KVBOX_FLEET_CLUSTER_CIDR (172.31.0.0/23: a /24 per node, two nodes), KVBOX_TESTENV_NS (kvbox-test); for `nodes`:
# KVBOX_FLEET_NODE_STATE (the nodes' state dirs are this followed by a and b, /var/lib/kvbox-fleet-).
set -uo pipefail
_log_prefix=fleet
. "$(dirname "$0")/lib.sh"

K8S_VERSION=${KVBOX_FLEET_K8S_VERSION:-v1.37.2}
ETCD_VERSION=${KVBOX_FLEET_ETCD_VERSION:-v3.7.3}
# kubernetes-sigs/agent-sandbox: its controller (Sandbox, SandboxTemplate, SandboxWarmPool,
# SandboxClaim) and CRDs, for warm pools of kvbox pods claimed in an API round trip.
AGENT_SANDBOX_VERSION=${KVBOX_FLEET_AGENT_SANDBOX_VERSION:-v1.0.1}
FLEET_CACHE=${KVBOX_FLEET_CACHE:-/var/lib/kvbox-testenv/k8s}
FLEET_STATE=${KVBOX_FLEET_STATE:-/var/lib/kvbox-testenv/fleet}
GRACE=${KVBOX_FLEET_GRACE:-20s}
# How long a pod stays bound to a NotReady or unreachable node before it is evicted.
EVICTION=${KVBOX_FLEET_EVICTION_SECONDS:-30}
# The nodes' podCIDRs come from it: the subnets of their bridges, which must not overlap another
# link's route in the namespace (kvbox refuses such a subnet). Kept small, clear of kvbox's default
# 172.30.0.0/16 and of the e2e tests' extra networks (172.31.128.0/17).
CLUSTER_CIDR=${KVBOX_FLEET_CLUSTER_CIDR:-172.31.0.0/23}
# An allocation only: no packet goes there (no kube-proxy, no service traffic).
SERVICE_CIDR=${KVBOX_FLEET_SERVICE_CIDR:-10.96.0.0/24}

# The staging modules of k8s.io/kubernetes v1.Y.Z are published as v0.Y.Z.
STAGING_VERSION=v0.${K8S_VERSION#v1.}
BIN=$FLEET_CACHE/$K8S_VERSION/bin
# Bumped when the way the binaries are built changes, so a cache built the old way is rebuilt.
RECIPE=1
K8S_KEY="kubernetes $K8S_VERSION staging $STAGING_VERSION recipe $RECIPE"
ETCD_KEY="etcd $ETCD_VERSION recipe $RECIPE"
AGENT_SANDBOX_KEY="agent-sandbox $AGENT_SANDBOX_VERSION recipe $RECIPE"
K8S_BINARIES="kube-apiserver kube-scheduler kube-controller-manager kubectl"
BACKGROUND_LOG=$FLEET_CACHE/background-build.log

ETCD_CLIENT=127.0.0.1:2379
ETCD_PEER=127.0.0.1:2380
APISERVER_PORT=6443
SCHEDULER_PORT=10259
CONTROLLER_MANAGER_PORT=10257
COMPONENTS="etcd kube-apiserver kube-scheduler kube-controller-manager agent-sandbox-controller"

usage() {
	sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//' >&2
	exit 2
}

# cached KEYFILE KEY BINARIES...: the binaries exist and were built under KEY.
cached() {
	local keyfile=$1 key=$2 b
	shift 2
	[ "$(cat "$keyfile" 2>/dev/null)" = "$key" ] || return 1
	for b in "$@"; do [ -x "$BIN/$b" ] || return 1; done
}

# go_in WORKDIR ARGS...: the niced go command for the wrapper module in WORKDIR, with a build cache
# of its own (removed once the build succeeded: it is gigabytes, and only this version uses it).
go_in() {
	local dir=$1
	shift
	(cd "$dir" && GOCACHE=$FLEET_CACHE/$K8S_VERSION/build/gocache GOFLAGS=-mod=mod GOTOOLCHAIN=local \
		nice -n 10 go "$@")
}

build_kubernetes() {
	local work=$FLEET_CACHE/$K8S_VERSION/build/kubernetes gomod goline godebug staging m ldflags pkgs=() b
	mkdir -p "$work" "$BIN" || return 1
	gomod=$(GOFLAGS= go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^\t"GoMod": "\(.*\)",$/\1/p')
	[ -f "$gomod" ] || { warn "go mod download k8s.io/kubernetes@$K8S_VERSION gave no go.mod"; return 1; }
	goline=$(grep -m1 '^go ' "$gomod")
	godebug=$(grep -m1 '^godebug ' "$gomod")
	# Its go.mod replaces every staging module with ./staging/src/..., which its module zip does
	# not hold: the wrapper replaces them with their published releases instead.
	staging=$(sed -n 's#^[[:space:]]*\(k8s\.io/[^[:space:]]*\) => ./staging/src/.*#\1#p' "$gomod")
	[ -n "$staging" ] || { warn "no staging modules found in $gomod"; return 1; }
	{
		echo "// Written by testenv/fleet.sh build: builds the control plane of k8s.io/kubernetes."
		echo "module kvbox.dev/testenv/kubernetes-build"
		echo
		echo "$goline"
		echo
		[ -n "$godebug" ] && echo "$godebug" && echo
		echo "require k8s.io/kubernetes $K8S_VERSION"
		echo
		echo "replace ("
		for m in $staging; do printf '\t%s => %s %s\n' "$m" "$m" "$STAGING_VERSION"; done
		echo ")"
	} >"$work/go.mod.new" || return 1
	if ! cmp -s "$work/go.mod.new" "$work/go.mod"; then
		mv "$work/go.mod.new" "$work/go.mod" && rm -f "$work/go.sum"
	else
		rm -f "$work/go.mod.new"
	fi
	log "wrapper module $work/go.mod: k8s.io/kubernetes $K8S_VERSION, $(echo "$staging" | wc -l) staging modules at $STAGING_VERSION"
	for b in $K8S_BINARIES; do pkgs+=("k8s.io/kubernetes/cmd/$b"); done
	go_in "$work" get "${pkgs[@]/%/@$K8S_VERSION}" || return 1
	# As the project's own release build: static, trimmed, stripped, with its version stamped.
	local major=${K8S_VERSION#v} minor
	minor=${major#*.}; minor=${minor%%.*}; major=${major%%.*}
	ldflags="-s -w"
	for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
		ldflags="$ldflags -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=$major -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
	done
	mkdir -p "$work/out" || return 1
	CGO_ENABLED=0 go_in "$work" build -trimpath -tags selinux,notest,grpcnotrace -ldflags "$ldflags" -o "$work/out/" "${pkgs[@]}" || return 1
	for b in $K8S_BINARIES; do mv -f "$work/out/$b" "$BIN/$b" || return 1; done
	echo "$K8S_KEY" >"$BIN/.kubernetes.key"
}

# wrapper_module DIR WHAT NAME MODULE VERSION: DIR (with DIR/out) holds a module that only
# requires MODULE at VERSION, so MODULE's main packages build against the published releases of
# what it needs.
wrapper_module() {
	local dir=$1 what=$2 name=$3 module=$4 version=$5
	mkdir -p "$dir/out" "$BIN" || return 1
	{
		echo "// Written by testenv/fleet.sh build: builds $what."
		echo "module kvbox.dev/testenv/$name"
		echo
		echo "go 1.26.0"
		echo
		echo "require $module $version"
	} >"$dir/go.mod" || return 1
	rm -f "$dir/go.sum"
	go_in "$dir" get "$module@$version"
}

build_etcd() {
	local work=$FLEET_CACHE/$K8S_VERSION/build/etcd
	# etcd's server module is its main package; its own replaces (to sibling folders) do not
	# apply to a module that requires it, which gets the siblings' published releases.
	wrapper_module "$work" "the etcd server" etcd-build go.etcd.io/etcd/server/v3 "$ETCD_VERSION" || return 1
	CGO_ENABLED=0 go_in "$work" build -trimpath -ldflags "-s -w" -o "$work/out/etcd" go.etcd.io/etcd/server/v3 || return 1
	mv -f "$work/out/etcd" "$BIN/etcd" || return 1
	echo "$ETCD_KEY" >"$BIN/.etcd.key"
}

# build_agent_sandbox: agent-sandbox's controller, and its CRDs out of the same module release
# (copied next to the binaries: kubectl applies them at up).
build_agent_sandbox() {
	local work=$FLEET_CACHE/$K8S_VERSION/build/agent-sandbox dir
	wrapper_module "$work" "agent-sandbox's controller" agent-sandbox-build sigs.k8s.io/agent-sandbox "$AGENT_SANDBOX_VERSION" || return 1
	dir=$(go_in "$work" list -m -f '{{.Dir}}' sigs.k8s.io/agent-sandbox) && [ -d "$dir/k8s/crds" ] ||
		{ warn "sigs.k8s.io/agent-sandbox@$AGENT_SANDBOX_VERSION has no k8s/crds"; return 1; }
	CGO_ENABLED=0 go_in "$work" build -trimpath -ldflags "-s -w" -o "$work/out/agent-sandbox-controller" \
		sigs.k8s.io/agent-sandbox/cmd/agent-sandbox-controller || return 1
	rm -rf "$BIN/agent-sandbox-crds" && mkdir -p "$BIN/agent-sandbox-crds" &&
		cp "$dir"/k8s/crds/*.yaml "$BIN/agent-sandbox-crds/" && chmod 644 "$BIN"/agent-sandbox-crds/*.yaml || return 1
	mv -f "$work/out/agent-sandbox-controller" "$BIN/agent-sandbox-controller" || return 1
	echo "$AGENT_SANDBOX_KEY" >"$BIN/.agent-sandbox.key"
}

# built: the whole control plane is in the cache.
built() {
	cached "$BIN/.kubernetes.key" "$K8S_KEY" $K8S_BINARIES && cached "$BIN/.etcd.key" "$ETCD_KEY" etcd &&
		cached "$BIN/.agent-sandbox.key" "$AGENT_SANDBOX_KEY" agent-sandbox-controller
}

cmd_build() {
	local t0 lock
	command -v go >/dev/null || die "go not found (expected /usr/local/go/bin/go)"
	mkdir -p "$FLEET_CACHE" || die "cannot create $FLEET_CACHE"
	# One build at a time on this machine (two set-ups, or a set-up and a test). The background
	# build takes the lock itself, for the control plane and kvbox-node's module both, and says so.
	exec {lock}>"$FLEET_CACHE/.lock"
	if [ -z "${KVBOX_FLEET_BUILD_LOCKED:-}" ] && ! flock -n "$lock"; then
		log "waiting for the build that holds $FLEET_CACHE/.lock (one started with build --background logs to $BACKGROUND_LOG)"
		flock "$lock"
	fi
	if built; then
		log "control plane $K8S_VERSION, etcd $ETCD_VERSION and agent-sandbox $AGENT_SANDBOX_VERSION already built in $BIN"
		return 0
	fi
	t0=$(now_ms)
	if ! cached "$BIN/.kubernetes.key" "$K8S_KEY" $K8S_BINARIES; then
		log "building $K8S_BINARIES from k8s.io/kubernetes $K8S_VERSION (niced; several minutes the first time)"
		build_kubernetes || die "building Kubernetes $K8S_VERSION failed; the Go build cache in $FLEET_CACHE/$K8S_VERSION/build makes a retry faster"
	fi
	if ! cached "$BIN/.etcd.key" "$ETCD_KEY" etcd; then
		log "building etcd $ETCD_VERSION"
		build_etcd || die "building etcd $ETCD_VERSION failed"
	fi
	if ! cached "$BIN/.agent-sandbox.key" "$AGENT_SANDBOX_KEY" agent-sandbox-controller; then
		log "building agent-sandbox $AGENT_SANDBOX_VERSION's controller"
		build_agent_sandbox || die "building agent-sandbox $AGENT_SANDBOX_VERSION failed"
	fi
	rm -rf "$FLEET_CACHE/$K8S_VERSION/build"
	log "built in $(fmt_ms $(($(now_ms) - t0))) into $BIN ($(du -sh "$BIN" | cut -f1)); CPU of the build (user, system):"
	times >&2
}

# ---- certificates: a CA made fresh at every up, and what it signs ----

PKI=$FLEET_STATE/pki

# issue NAME SUBJECT EKU [SAN]: an EC P-256 key and a certificate from the fleet's CA.
issue() {
	local name=$1 subj=$2 eku=$3 san=${4:-} ext
	ext=$(mktemp) || return 1
	{
		echo "basicConstraints=critical,CA:FALSE"
		echo "keyUsage=critical,digitalSignature,keyEncipherment"
		echo "extendedKeyUsage=$eku"
		[ -n "$san" ] && echo "subjectAltName=$san"
	} >"$ext"
	openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "$subj" \
		-keyout "$PKI/$name.key" -out "$PKI/$name.csr" 2>/dev/null &&
		openssl x509 -req -in "$PKI/$name.csr" -CA "$PKI/ca.crt" -CAkey "$PKI/ca.key" -CAcreateserial \
			-days 7 -extfile "$ext" -out "$PKI/$name.crt" 2>/dev/null
	local rc=$?
	rm -f "$ext" "$PKI/$name.csr"
	chmod 600 "$PKI/$name.key" 2>/dev/null
	[ "$rc" = 0 ] || warn "could not issue the certificate $name ($subj)"
	return $rc
}

make_pki() {
	rm -rf "$PKI" && mkdir -p "$PKI" && chmod 700 "$PKI" || return 1
	openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 7 -subj "/CN=kvbox-fleet-ca" \
		-addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" \
		-keyout "$PKI/ca.key" -out "$PKI/ca.crt" 2>/dev/null || { warn "could not make the fleet's CA"; return 1; }
	chmod 600 "$PKI/ca.key"
	issue etcd "/CN=etcd" serverAuth,clientAuth "IP:127.0.0.1,DNS:localhost" &&
		issue apiserver-etcd-client "/CN=kube-apiserver-etcd-client" clientAuth &&
		issue apiserver "/CN=kube-apiserver" serverAuth \
			"IP:127.0.0.1,IP:${SERVICE_CIDR%.*}.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local" &&
		issue apiserver-kubelet-client "/CN=kube-apiserver-kubelet-client" clientAuth &&
		issue admin "/O=system:masters/CN=kubernetes-admin" clientAuth &&
		issue scheduler "/CN=system:kube-scheduler" clientAuth &&
		issue controller-manager "/CN=system:kube-controller-manager" clientAuth || return 1
	openssl ecparam -name prime256v1 -genkey -noout -out "$PKI/sa.key" 2>/dev/null &&
		openssl ec -in "$PKI/sa.key" -pubout -out "$PKI/sa.pub" 2>/dev/null || { warn "could not make the service-account key"; return 1; }
	chmod 600 "$PKI/sa.key"
}

# kubeconfig FILE USER CERT KEY: a kubeconfig for the API server on loopback.
kubeconfig() {
	cat >"$1" <<-KC
	apiVersion: v1
	kind: Config
	clusters:
	- name: kvbox-fleet
	  cluster:
	    server: https://127.0.0.1:$APISERVER_PORT
	    certificate-authority: $PKI/ca.crt
	users:
	- name: $2
	  user:
	    client-certificate: $3
	    client-key: $4
	contexts:
	- name: $2@kvbox-fleet
	  context:
	    cluster: kvbox-fleet
	    user: $2
	current-context: $2@kvbox-fleet
	KC
	chmod 600 "$1"
}

# ---- processes ----

RUN=$FLEET_STATE/run
LOGS=$FLEET_STATE/logs

# pid_of NAME: the pid of the fleet's NAME if it runs (its pid file names a live process whose
# executable is the fleet's binary).
pid_of() {
	local pid exe
	pid=$(cat "$RUN/$1.pid" 2>/dev/null) || return 1
	exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
	[ "$exe" = "$BIN/$1" ] || return 1
	echo "$pid"
}

# start NAME ARGS...: NAME from the cache, inside the namespace, niced, in a session of its own
# (so a terminal's Ctrl-C does not reach it), logging to logs/NAME.log.
start() {
	local name=$1 pid
	shift
	# A simple command, not a function: the background child execs it, so $! is its pid.
	ip netns exec "$KVBOX_TESTENV_NS" setsid nice -n 10 "$BIN/$name" "$@" >>"$LOGS/$name.log" 2>&1 </dev/null &
	pid=$!
	echo "$pid" >"$RUN/$name.pid"
	# ip netns exec, setsid and nice each exec the next: the pid becomes the binary's.
	for _ in $(seq 50); do
		pid_of "$name" >/dev/null && return 0
		kill -0 "$pid" 2>/dev/null || break
		sleep 0.1
	done
	warn "$name did not start:"
	tail -n 20 "$LOGS/$name.log" >&2
	return 1
}

# stray_pids: processes of the fleet's binaries that run on this state folder, whatever the
# pid files say (a pid file lost, a process started by an earlier, killed up).
stray_pids() {
	local d exe
	for d in /proc/[0-9]*; do
		exe=$(readlink "$d/exe" 2>/dev/null) || continue
		case "$exe" in "$BIN"/*) ;; *) continue ;; esac
		tr '\0' ' ' <"$d/cmdline" 2>/dev/null | grep -qF "$FLEET_STATE/" && echo "${d#/proc/}"
	done
	return 0
}

# wait_for WHAT SECONDS COMMAND...: until COMMAND succeeds.
wait_for() {
	local what=$1 secs=$2 t0
	shift 2
	t0=$(now_ms)
	until "$@" >/dev/null 2>&1; do
		if [ $(($(now_ms) - t0)) -ge $((secs * 1000)) ]; then
			warn "$what: not ready within ${secs}s"
			return 1
		fi
		sleep 0.2
	done
}

# kubectl keeps its discovery cache in the fleet's state (as the env file says), not in ~/.kube.
kubectl_admin() {
	in_ns "$BIN/kubectl" --kubeconfig "$FLEET_STATE/admin.kubeconfig" --cache-dir "$FLEET_STATE/kubectl-cache" "$@"
}

healthy() { in_ns curl -fsS --max-time 2 --cacert "$PKI/ca.crt" "$@"; }

# Who may do what beyond Kubernetes' defaults: the API server's kubelet client may use every kubelet
# API (exec, logs, port-forward) of the nodes. kvbox nodes get no more than a kubelet: the Node
# authorizer lets each read the Secrets and ConfigMaps of the pods bound to it, and kvbox-node reads
# those one by one (it watches none cluster-wide). The RuntimeClass kvbox puts a pod on kvbox nodes:
# its scheduling adds their toleration and node selector.
RBAC='apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "kvbox:kubelet-api-admin"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:kubelet-api-admin"}
subjects:
- {apiGroup: rbac.authorization.k8s.io, kind: User, name: kube-apiserver-kubelet-client}
---
apiVersion: node.k8s.io/v1
kind: RuntimeClass
metadata: {name: kvbox}
handler: kvbox
scheduling:
  nodeSelector: {kvbox.dev/node: "true"}
  tolerations: [{key: kvbox.dev/vm, operator: Equal, value: "true", effect: NoSchedule}]'

all_running() {
	local c
	for c in $COMPONENTS; do pid_of "$c" >/dev/null || return 1; done
}

write_env() {
	{
		echo "# The local fleet (testenv/fleet.sh up); its processes run in the network namespace $KVBOX_TESTENV_NS."
		echo "KUBECONFIG=$FLEET_STATE/admin.kubeconfig"
		echo "KUBECTL=$BIN/kubectl"
		echo "KUBECACHEDIR=$FLEET_STATE/kubectl-cache"
	} >"$FLEET_STATE/env.new" && mv "$FLEET_STATE/env.new" "$FLEET_STATE/env"
}

cmd_up() {
	local t0 c port busy
	built ||
		die "the control plane is not built: run testenv/fleet.sh build (or make testenv) first"
	ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$KVBOX_TESTENV_NS" ||
		die "network namespace $KVBOX_TESTENV_NS does not exist: run testenv/setup.sh (make testenv) first"
	if all_running && kubectl_admin get --raw /readyz >/dev/null 2>&1; then
		write_env
		log "already up (KUBECONFIG=$FLEET_STATE/admin.kubeconfig); testenv/fleet.sh down stops it"
		return 0
	fi
	# Half up (a component died, an up was killed): start again from nothing.
	if [ -n "$(stray_pids)" ] || ls "$RUN"/*.pid >/dev/null 2>&1; then
		log "a previous fleet is partly running: stopping it first"
		cmd_down || return 1
	fi
	for port in ${ETCD_CLIENT##*:} ${ETCD_PEER##*:} $APISERVER_PORT $SCHEDULER_PORT $CONTROLLER_MANAGER_PORT; do
		busy=$(in_ns ss -Hltn "sport = :$port" 2>/dev/null)
		[ -z "$busy" ] || die "port $port is taken in $KVBOX_TESTENV_NS (ip netns exec $KVBOX_TESTENV_NS ss -ltnp): another fleet or another program"
	done
	t0=$(now_ms)
	mkdir -p "$FLEET_STATE" "$RUN" "$LOGS" && chmod 700 "$FLEET_STATE" || die "cannot create $FLEET_STATE"
	rm -rf "$FLEET_STATE/etcd" "$FLEET_STATE/nodes" "$RUN/apiserver-certs"
	for c in $COMPONENTS; do : >"$LOGS/$c.log"; done
	make_pki || die "making the fleet's certificates failed"
	kubeconfig "$FLEET_STATE/admin.kubeconfig" kubernetes-admin "$PKI/admin.crt" "$PKI/admin.key"
	kubeconfig "$FLEET_STATE/scheduler.kubeconfig" system:kube-scheduler "$PKI/scheduler.crt" "$PKI/scheduler.key"
	kubeconfig "$FLEET_STATE/controller-manager.kubeconfig" system:kube-controller-manager "$PKI/controller-manager.crt" "$PKI/controller-manager.key"

	# The data is thrown away at down: no fsync.
	start etcd --name fleet --data-dir "$FLEET_STATE/etcd" --log-level warn --unsafe-no-fsync \
		--listen-client-urls "https://$ETCD_CLIENT" --advertise-client-urls "https://$ETCD_CLIENT" \
		--listen-peer-urls "https://$ETCD_PEER" --initial-advertise-peer-urls "https://$ETCD_PEER" \
		--initial-cluster "fleet=https://$ETCD_PEER" --listen-metrics-urls "" \
		--cert-file "$PKI/etcd.crt" --key-file "$PKI/etcd.key" --client-cert-auth --trusted-ca-file "$PKI/ca.crt" \
		--peer-cert-file "$PKI/etcd.crt" --peer-key-file "$PKI/etcd.key" --peer-client-cert-auth --peer-trusted-ca-file "$PKI/ca.crt" ||
		{ cmd_down; die "etcd did not start (see $LOGS/etcd.log)"; }
	wait_for etcd 60 healthy --cert "$PKI/apiserver-etcd-client.crt" --key "$PKI/apiserver-etcd-client.key" "https://$ETCD_CLIENT/health" ||
		{ tail -n 20 "$LOGS/etcd.log" >&2; cmd_down; die "etcd did not become healthy (see $LOGS/etcd.log)"; }

	# --endpoint-reconciler-type=none: the API server refuses to advertise a loopback address
	# in the kubernetes Service's endpoints otherwise; nothing here uses that Service.
	start kube-apiserver --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port "$APISERVER_PORT" \
		--endpoint-reconciler-type none --cert-dir "$RUN/apiserver-certs" --profiling=false \
		--etcd-servers "https://$ETCD_CLIENT" --etcd-cafile "$PKI/ca.crt" \
		--etcd-certfile "$PKI/apiserver-etcd-client.crt" --etcd-keyfile "$PKI/apiserver-etcd-client.key" \
		--client-ca-file "$PKI/ca.crt" --tls-cert-file "$PKI/apiserver.crt" --tls-private-key-file "$PKI/apiserver.key" \
		--kubelet-client-certificate "$PKI/apiserver-kubelet-client.crt" --kubelet-client-key "$PKI/apiserver-kubelet-client.key" \
		--kubelet-certificate-authority "$PKI/ca.crt" --kubelet-preferred-address-types InternalIP \
		--service-account-issuer https://kubernetes.default.svc.cluster.local \
		--service-account-key-file "$PKI/sa.pub" --service-account-signing-key-file "$PKI/sa.key" \
		--service-cluster-ip-range "$SERVICE_CIDR" --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
		--default-not-ready-toleration-seconds "$EVICTION" --default-unreachable-toleration-seconds "$EVICTION" ||
		{ cmd_down; die "kube-apiserver did not start (see $LOGS/kube-apiserver.log)"; }
	wait_for kube-apiserver 120 kubectl_admin get --raw /readyz ||
		{ tail -n 20 "$LOGS/kube-apiserver.log" >&2; cmd_down; die "kube-apiserver did not become ready (see $LOGS/kube-apiserver.log)"; }
	log "kube-apiserver ready $(fmt_ms $(($(now_ms) - t0))) after the start"

	start kube-scheduler --kubeconfig "$FLEET_STATE/scheduler.kubeconfig" \
		--authentication-kubeconfig "$FLEET_STATE/scheduler.kubeconfig" --authorization-kubeconfig "$FLEET_STATE/scheduler.kubeconfig" \
		--bind-address 127.0.0.1 --secure-port "$SCHEDULER_PORT" --leader-elect=false --profiling=false ||
		{ cmd_down; die "kube-scheduler did not start (see $LOGS/kube-scheduler.log)"; }
	# Node IPAM gives each node a podCIDR from the cluster CIDR; a node that stops renewing its lease
	# for the grace period is NotReady.
	start kube-controller-manager --kubeconfig "$FLEET_STATE/controller-manager.kubeconfig" \
		--authentication-kubeconfig "$FLEET_STATE/controller-manager.kubeconfig" \
		--authorization-kubeconfig "$FLEET_STATE/controller-manager.kubeconfig" \
		--bind-address 127.0.0.1 --secure-port "$CONTROLLER_MANAGER_PORT" --leader-elect=false --profiling=false \
		--allocate-node-cidrs --cluster-cidr "$CLUSTER_CIDR" --node-cidr-mask-size 24 --service-cluster-ip-range "$SERVICE_CIDR" \
		--node-monitor-grace-period "$GRACE" --node-monitor-period 2s \
		--root-ca-file "$PKI/ca.crt" --service-account-private-key-file "$PKI/sa.key" --use-service-account-credentials ||
		{ cmd_down; die "kube-controller-manager did not start (see $LOGS/kube-controller-manager.log)"; }
	wait_for kube-scheduler 60 in_ns curl -fsSk --max-time 2 "https://127.0.0.1:$SCHEDULER_PORT/healthz" ||
		{ tail -n 20 "$LOGS/kube-scheduler.log" >&2; cmd_down; die "kube-scheduler did not become healthy (see $LOGS/kube-scheduler.log)"; }
	wait_for kube-controller-manager 60 in_ns curl -fsSk --max-time 2 "https://127.0.0.1:$CONTROLLER_MANAGER_PORT/healthz" ||
		{ tail -n 20 "$LOGS/kube-controller-manager.log" >&2; cmd_down; die "kube-controller-manager did not become healthy (see $LOGS/kube-controller-manager.log)"; }
	# The controllers work once they made the default namespace's service account.
	wait_for "the controllers" 60 kubectl_admin get serviceaccount default -n default ||
		{ tail -n 20 "$LOGS/kube-controller-manager.log" >&2; cmd_down; die "the controller manager made no service account (see $LOGS/kube-controller-manager.log)"; }
	echo "$RBAC" | kubectl_admin apply -f - >/dev/null || { cmd_down; die "applying the fleet's RBAC failed"; }
	start_agent_sandbox || { cmd_down; die "agent-sandbox's controller did not start (see $LOGS/agent-sandbox-controller.log)"; }
	write_env
	log "up in $(fmt_ms $(($(now_ms) - t0))): $(mem_summary)"
	log "KUBECONFIG=$FLEET_STATE/admin.kubeconfig KUBECTL=$BIN/kubectl (in $FLEET_STATE/env); run kubectl inside $KVBOX_TESTENV_NS"
}

# start_agent_sandbox: agent-sandbox's CRDs, then its controller with the extensions (templates,
# warm pools, claims), as the fleet's admin (a local fleet for tests: one identity), its metrics
# and health endpoints off (nothing here scrapes them; they would listen on every address).
start_agent_sandbox() {
	kubectl_admin apply --server-side -f "$BIN/agent-sandbox-crds" >/dev/null || return 1
	kubectl_admin wait --for condition=Established --timeout 60s -f "$BIN/agent-sandbox-crds" >/dev/null || return 1
	start agent-sandbox-controller --kubeconfig "$FLEET_STATE/admin.kubeconfig" --extensions --leader-elect=false \
		--metrics-bind-address 0 --health-probe-bind-address 0
}

# mem_summary: the resident memory of each component and in all.
mem_summary() {
	local c pid rss total=0 parts=()
	for c in $COMPONENTS; do
		pid=$(pid_of "$c") || continue
		rss=$(awk '/^VmRSS:/{print $2}' "/proc/$pid/status" 2>/dev/null)
		parts+=("$c $((rss / 1024)) MB")
		total=$((total + rss))
	done
	local IFS=,
	echo "resident: ${parts[*]} ($((total / 1024)) MB in all)" | sed 's/,/, /g'
}

cmd_node_credentials() {
	local name=${1:-} addr=${2:-} dir
	[ -n "$name" ] && [ -n "$addr" ] || die "usage: testenv/fleet.sh node-credentials NAME ADDRESS"
	[[ $name =~ ^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$ ]] || die "node name $name: give lower-case letters, digits, '-' and '.'"
	[[ $addr =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "node address $addr: give an IPv4 address"
	[ -f "$PKI/ca.key" ] || die "the fleet is not up (no CA in $PKI): run testenv/fleet.sh up first"
	dir=$FLEET_STATE/nodes/$name
	mkdir -p "$dir" && chmod 700 "$dir" || die "cannot create $dir"
	# The node's identity for the Node authorizer and NodeRestriction.
	issue "node-$name-client" "/O=system:nodes/CN=system:node:$name" clientAuth &&
		issue "node-$name-kubelet" "/CN=$name" serverAuth "IP:$addr,DNS:$name" || die "issuing $name's certificates failed"
	mv -f "$PKI/node-$name-client.crt" "$dir/client.crt" && mv -f "$PKI/node-$name-client.key" "$dir/client.key" &&
		mv -f "$PKI/node-$name-kubelet.crt" "$dir/kubelet.crt" && mv -f "$PKI/node-$name-kubelet.key" "$dir/kubelet.key" &&
		cp "$PKI/ca.crt" "$dir/ca.crt" || die "cannot write $dir"
	kubeconfig "$dir/kubeconfig" "system:node:$name" "$dir/client.crt" "$dir/client.key"
	log "credentials of node $name ($addr) in $dir: kubeconfig, kubelet.crt, kubelet.key, ca.crt"
	echo "$dir"
}

# ---- two kvbox nodes on this machine, for people to try the fleet ----

REPO=$(cd "$(dirname "$0")/.." && pwd)
NODE_NAMES="kvbox-a kvbox-b"
NODE_STATE_PREFIX=${KVBOX_FLEET_NODE_STATE:-/var/lib/kvbox-fleet-}
NODE_BIN=$FLEET_STATE/bin/kvbox-node
KVBOX_BIN=$FLEET_STATE/bin/kvbox
# The state dirs `nodes` made, one a line: down empties and removes these only.
NODE_DIRS=$FLEET_STATE/node-dirs

node_addr() { case $1 in kvbox-a) echo 127.0.0.2 ;; kvbox-b) echo 127.0.0.3 ;; esac; }
node_bridge() { echo "kvf${1#kvbox-}0"; }
node_state() { echo "$NODE_STATE_PREFIX${1#kvbox-}"; }

# node_pid NAME: the pid of the fleet's kvbox-node NAME if it runs.
node_pid() {
	local pid exe
	pid=$(cat "$RUN/$1.pid" 2>/dev/null) || return 1
	exe=$(readlink "/proc/$pid/exe" 2>/dev/null) || return 1
	case "$exe" in "$NODE_BIN" | "$NODE_BIN (deleted)") echo "$pid" ;; *) return 1 ;; esac
}

# node_strays: processes of the fleet's kvbox-node binary, whatever the pid files say.
node_strays() {
	local d exe
	for d in /proc/[0-9]*; do
		exe=$(readlink "$d/exe" 2>/dev/null) || continue
		case "$exe" in "$NODE_BIN" | "$NODE_BIN (deleted)") echo "${d#/proc/}" ;; esac
	done
	return 0
}

node_ready() {
	[ "$(kubectl_admin get node "$1" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

cmd_nodes() {
	local n dir pid t
	all_running && kubectl_admin get --raw /readyz >/dev/null 2>&1 || die "the fleet is not up: run testenv/fleet.sh up first"
	mkdir -p "$FLEET_STATE/bin" || die "cannot create $FLEET_STATE/bin"
	# Built from this checkout, niced; KVBOX_FLEET_NODE_BUILD=0 starts the ones built before (a node
	# started again at once, before its lease runs out).
	if [ "${KVBOX_FLEET_NODE_BUILD:-1}" = 0 ] && [ -x "$NODE_BIN" ] && [ -x "$KVBOX_BIN" ]; then
		log "starting kvbox-node as built before ($NODE_BIN)"
	else
		log "building kvbox-node and kvbox from $REPO"
		(cd "$REPO/integrations/kubernetes" && nice -n 10 go build -o "$NODE_BIN.new" ./cmd/kvbox-node) &&
			(cd "$REPO" && nice -n 10 go build -o "$KVBOX_BIN.new" ./cmd/kvbox) || die "building kvbox-node failed"
		mv -f "$NODE_BIN.new" "$NODE_BIN" && mv -f "$KVBOX_BIN.new" "$KVBOX_BIN" || die "cannot write $FLEET_STATE/bin"
	fi
	for n in $NODE_NAMES; do
		if pid=$(node_pid "$n"); then
			log "$n already runs (pid $pid)"
			continue
		fi
		dir=$(node_state "$n")
		cmd_node_credentials "$n" "$(node_addr "$n")" >/dev/null
		# QEMU (libvirt's user) reads the snapshots in it.
		mkdir -p "$dir" && chmod 0751 "$dir" || die "cannot create $dir"
		grep -qxF "$dir" "$NODE_DIRS" 2>/dev/null || echo "$dir" >>"$NODE_DIRS"
		: >>"$LOGS/$n.log"
		# A simple command, not the in_ns function: ip netns exec and setsid each exec the next, so
		# $! is kvbox-node's own pid (a function would run in a subshell whose pid $! is).
		ip netns exec "$KVBOX_TESTENV_NS" setsid "$NODE_BIN" --name "$n" --node-address "$(node_addr "$n")" \
			--kubeconfig "$FLEET_STATE/nodes/$n/kubeconfig" --tls-cert-file "$FLEET_STATE/nodes/$n/kubelet.crt" \
			--tls-private-key-file "$FLEET_STATE/nodes/$n/kubelet.key" --client-ca-file "$FLEET_STATE/nodes/$n/ca.crt" \
			--state-dir "$dir" --bridge "$(node_bridge "$n")" --insecure-registry 127.0.0.1:5000 \
			>>"$LOGS/$n.log" 2>&1 </dev/null &
		echo $! >"$RUN/$n.pid"
		for t in $(seq 50); do node_pid "$n" >/dev/null && break; sleep 0.1; done
		node_pid "$n" >/dev/null || { tail -n 20 "$LOGS/$n.log" >&2; die "$n did not start (see $LOGS/$n.log)"; }
		log "$n: state dir $dir, bridge $(node_bridge "$n"), kubelet API on $(node_addr "$n"):10250, log $LOGS/$n.log"
	done
	for n in $NODE_NAMES; do
		wait_for "node $n Ready" 120 node_ready "$n" || { tail -n 20 "$LOGS/$n.log" >&2; die "node $n did not become Ready (see $LOGS/$n.log)"; }
	done
	kubectl_admin get nodes -o wide >&2
	cat >&2 <<-HOWTO
	[fleet] both nodes are Ready. Pods whose image is a kvbox snapshot's reference run as warm clones:
	[fleet]   kvbox snapshots push --insecure SNAPSHOT 127.0.0.1:5000/REPO:TAG
	[fleet]   kubectl create deployment web --image 127.0.0.1:5000/REPO:TAG --replicas 3, with
	[fleet]   runtimeClassName: kvbox in its pod spec (docs/kubernetes.md); kubectl inside $KVBOX_TESTENV_NS:
	[fleet]   . $FLEET_STATE/env; ip netns exec $KVBOX_TESTENV_NS \$KUBECTL --kubeconfig \$KUBECONFIG --cache-dir \$KUBECACHEDIR get pods -o wide
	HOWTO
}

# stop_nodes: the fleet's kvbox-nodes stopped, and every box, snapshot and bridge of the state dirs
# `nodes` made removed with the dirs.
stop_nodes() {
	local n pid dir b t kv subnet
	declare -A subnets
	for n in $NODE_NAMES; do
		# The podCIDR the node's bridge has (its NAT rule names it).
		subnets[$n]=$(kubectl_admin get node "$n" -o jsonpath='{.spec.podCIDR}' 2>/dev/null)
		pid=$(node_pid "$n") || continue
		kill -TERM "$pid" 2>/dev/null
		for t in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
		kill -0 "$pid" 2>/dev/null && { warn "killing $n (pid $pid): it did not stop within 10s"; kill -KILL "$pid"; }
	done
	for pid in $(node_strays); do
		warn "stopping a kvbox-node of this fleet its pid file does not name (pid $pid)"
		kill -KILL "$pid" 2>/dev/null
	done
	[ -f "$NODE_DIRS" ] || return 0
	# Every node's boxes first: kvbox keeps a snapshot that a box of the libvirtd is cloned from,
	# and the nodes' caches hold the same snapshots under the same names.
	while read -r dir; do
		[ -d "$dir" ] || continue
		kv=(in_ns "$KVBOX_BIN" --state-dir "$dir")
		# kvbox ls lists every box of the libvirtd: those whose folder is in dir only.
		for b in $("${kv[@]}" ls --json 2>/dev/null | awk -v d="\"$dir/boxes/" '
			/^    "name": / { n = $2; gsub(/[",]/, "", n) }
			/^    "dir": / && index($2, d) == 1 { print n }'); do
			"${kv[@]}" rm --force "$b" >/dev/null || warn "could not remove box $b of $dir"
		done
	done <"$NODE_DIRS"
	while read -r dir; do
		[ -d "$dir" ] || continue
		kv=(in_ns "$KVBOX_BIN" --state-dir "$dir")
		for b in $("${kv[@]}" snapshots ls --json 2>/dev/null | sed -n 's/^ *"name": "\([^"]*\)",$/\1/p'); do
			"${kv[@]}" snapshots rm "$b" >/dev/null || warn "could not remove snapshot $b of $dir"
		done
		for n in $NODE_NAMES; do
			[ "$dir" = "$(node_state "$n")" ] || continue
			subnet=()
			[ -n "${subnets[$n]}" ] && subnet=(--subnet "${subnets[$n]}")
			"${kv[@]}" --bridge "$(node_bridge "$n")" "${subnet[@]}" network rm >/dev/null 2>&1
		done
		rm -rf "$dir"
	done <"$NODE_DIRS"
	rm -f "$NODE_DIRS"
}

cmd_status() {
	local c pid
	for c in $COMPONENTS; do
		if pid=$(pid_of "$c"); then
			echo "$c: running, pid $pid, $(($(awk '/^VmRSS:/{print $2}' "/proc/$pid/status") / 1024)) MB resident"
		else
			echo "$c: not running"
		fi
	done
	for c in $NODE_NAMES; do
		pid=$(node_pid "$c") && echo "$c: running, pid $pid, state dir $(node_state "$c"), log $LOGS/$c.log"
	done
	[ -f "$FLEET_STATE/env" ] && cat "$FLEET_STATE/env"
	all_running
}

# stop_pids PID...: each sent TERM, and KILL if it has not ended after 15 s.
stop_pids() {
	local pid pids="$*" left t
	[ -n "$pids" ] || return 0
	for pid in $pids; do kill -TERM "$pid" 2>/dev/null; done
	for t in $(seq 150); do
		left=""
		for pid in $pids; do kill -0 "$pid" 2>/dev/null && left="$left $pid"; done
		[ -z "$left" ] && return 0
		if [ "$t" = 150 ]; then
			for pid in $left; do warn "killing $(cat "/proc/$pid/comm" 2>/dev/null) (pid $pid): it did not stop within 15s"; done
			kill -KILL $left 2>/dev/null
			sleep 0.5
		fi
		sleep 0.1
	done
}

# down: every process of the fleet stopped (the API server's clients, the API server, etcd: TERM,
# then KILL after 15 s each), its listeners gone, and everything of the run but its logs removed
# from the state folder.
cmd_down() {
	local c pid
	stop_nodes
	# The clients of the API server first, etcd last: an API server whose etcd went at the same
	# time hung in its shutdown until it was killed.
	for c in kube-controller-manager kube-scheduler kube-apiserver etcd; do
		pid=$(pid_of "$c") && stop_pids "$pid"
	done
	stop_pids $(stray_pids)
	[ -z "$(stray_pids)" ] || { warn "processes of the fleet still run: $(stray_pids)"; return 1; }
	if [ -d "$FLEET_STATE" ]; then
		find "$FLEET_STATE" -mindepth 1 -maxdepth 1 ! -name logs -exec rm -rf {} + || return 1
	fi
	log "down (logs of the last run kept in $LOGS)"
}

# cmd_build_background: cmd_build, then a build and vet of kvbox-node's module (its
# dependencies into the module and build caches), detached at the lowest priority, so that the
# guests of the tests that run meanwhile keep the CPU they want. It holds the build lock to the
# end: fleet.sh build (make test-kubernetes) waits for the vet too, which would otherwise compile
# the same packages a second time beside it. Its own session is its own autogroup where the
# kernel groups by session (sched_autogroup_enabled): the group gets the lowest priority too, or
# it would take half the CPU whatever its nice.
cmd_build_background() {
	mkdir -p "$FLEET_CACHE" || die "cannot create $FLEET_CACHE"
	log "building the control plane and kvbox-node's module detached (nice 19), log $BACKGROUND_LOG; fleet.sh build waits for it"
	setsid nice -n 19 bash -c '{ echo 19 >/proc/self/autogroup; } 2>/dev/null
		exec {lock}>"$3" && flock "$lock" || exit 1
		KVBOX_FLEET_BUILD_LOCKED=1 bash "$1" build && cd "$2" && go build ./... && go vet ./... && go vet -tags e2e ./...' \
		fleet-build "$TESTENV_DIR/fleet.sh" "$REPO_DIR/integrations/kubernetes" "$FLEET_CACHE/.lock" \
		>"$BACKGROUND_LOG" 2>&1 </dev/null &
}

case "${1:-}" in
build)
	case "${2:-}" in
	"") cmd_build ;;
	--background) cmd_build_background ;;
	*) usage ;;
	esac
	;;
up) require_root; cmd_up ;;
down) require_root; cmd_down ;;
status) cmd_status ;;
nodes) require_root; cmd_nodes ;;
node-credentials) require_root; shift; cmd_node_credentials "$@" ;;
*) usage ;;
esac
