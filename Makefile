# kvbox. Everything here runs as root on a Debian 12 host.
SHELL  := /bin/bash
GO      ?= go
NS      ?= kvbox-test
export PATH := /usr/local/go/bin:$(PATH)

.PHONY: build testenv test unit fuzz e2e test-kubernetes check bench demo docs clean

# guarded CMD: runs CMD between two readings of the host's own state
# (testenv/hostguard.sh: hostname, links, addresses, routes, sysctls,
# rulesets, /etc files, mounts) and fails, naming what changed, if CMD
# changed any of it. Tests never touch the machine they run on.
guarded = g=$$(mktemp) && bash testenv/hostguard.sh record $$g && { $(1); rc=$$?; bash testenv/hostguard.sh check $$g || rc=1; rm -f $$g; exit $$rc; }

build:
	mkdir -p bin
	$(GO) build -o bin/kvbox ./cmd/kvbox
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags='-s -w' -o bin/kvbox-agent ./cmd/kvbox-agent

# Prepares this machine for end-to-end tests (idempotent): packages, the
# network namespace $(NS) with virtlogd and libvirtd in it, the tiny image.
testenv:
	bash testenv/setup.sh

check:
	test -z "$$(gofmt -l $$(git ls-files --cached --others --exclude-standard '*.go'))" || { gofmt -l $$(git ls-files --cached --others --exclude-standard '*.go'); exit 1; }
	$(GO) vet ./...

unit:
	$(call guarded,$(GO) test ./...)

# Fuzz targets, PACKAGE:TARGET, one a line: each decoder of bytes from a
# guest or a pulled artifact. make fuzz runs each for FUZZTIME (testenv/fuzz.sh: go test -fuzz
# takes one target a run); their seeds already run in make unit. Inputs
# that find new code are minimized for at most a second, so that the time
# goes to fuzzing; a failing input is kept in PACKAGE/testdata/fuzz.
FUZZTIME ?= 20s
FUZZ_TARGETS = \
	./guest-agent:FuzzExtractFromBox \
	./registry:FuzzManifest \
	./registry:FuzzSnapshotJSON \
	./registry:FuzzImageJSON \
	./registry:FuzzDecodeSparse \
	./snapshot:FuzzPulledXML \
	./overlay:FuzzQCOW2Header

fuzz:
	$(call guarded,GO=$(GO) bash testenv/fuzz.sh $(FUZZTIME) $(FUZZ_TARGETS))

# End-to-end tests boot real guests; they and libvirtd run inside $(NS), so
# every packet to a guest stays in that namespace. Most boot the Debian image:
# setup.sh images builds it, or waits for make test's background build.
# testenv/e2e.sh: make test runs the fuzzing and kvbox-node's tests beside the suite
# (KVBOX_E2E_BESIDE), where they take the CPU its guests leave idle.
e2e:
	$(call guarded,GO=$(GO) KVBOX_TESTENV_NS=$(NS) FUZZTIME=$(FUZZTIME) FUZZ_TARGETS='$(FUZZ_TARGETS)' bash testenv/e2e.sh)

# kvbox-node, its own Go module (the kvbox CLI does not carry the Kubernetes
# libraries): vet, unit tests, then its end-to-end test against the local
# control plane (testenv/fleet.sh: built once per version and cached, then
# started and stopped by the test inside $(NS)).
K8S_MODULE := integrations/kubernetes
test-kubernetes:
	bash testenv/fleet.sh build
	cd $(K8S_MODULE) && test -z "$$(gofmt -l .)" && $(GO) vet ./... && $(GO) vet -tags e2e ./...
	$(call guarded,(cd $(K8S_MODULE) && $(GO) test -count=1 ./... && ip netns exec $(NS) $(GO) test -tags e2e -count=1 -timeout 20m -v ./e2e))

# Under make test a test whose host requirement is missing fails instead of
# skipping (testenv/gate); only vsock, which this test machine lacks, skips.
test: export KVBOX_TEST_STRICT := 1
test: export KVBOX_TESTENV_FLEET := background
test: export KVBOX_TESTENV_IMAGES := background
test: export KVBOX_E2E_BESIDE := fuzz fleet
# Beside the suite the fuzzing has only the CPU the guests leave: longer, for as many inputs.
test: FUZZTIME = 60s
test: testenv check unit e2e

# The README's main job: set-up of what it uses alone (setup.sh demo: packages,
# the namespace with libvirtd, the build; the demo builds the Debian image as a
# step), then the warm-pool story on it, all inside the kvbox-test namespace.
demo:
	bash testenv/setup.sh demo
	$(call guarded,bash testenv/demo.sh)

# Benchmarks are programs, not timed assertions in tests: one run, medians
# and ratios (cold boot, snapshot pause, warm clone step by step; then the
# fleet: a pod created to Running and a Deployment scaled 0 -> 10 on a local
# control plane, against kvbox new --from on the same host). BENCH takes
# testenv/bench's flags; its -only also knows the section fleet
# (BENCH='-only fleet' runs that alone), whose own flags are BENCH_FLEET
# (integrations/kubernetes/cmd/fleet-bench). testenv/bench.sh runs both
# inside $(NS).
bench: testenv build
	$(call guarded,KVBOX_TESTENV_NS=$(NS) BENCH_FLEET='$(BENCH_FLEET)' bash testenv/bench.sh $(BENCH))

# The command reference in docs/reference, from the commands themselves
# (TestDocsMatchCommands, part of make unit, fails when it is out of date).
docs:
	KVBOX_UPDATE_DOCS=1 $(GO) test ./cmd/kvbox -run TestDocsMatchCommands -count=1

clean:
	rm -rf bin e2e.log
