# The test node (docs/node.md): tokenfair's image built from the Dockerfile with no registry, and
# everything the `node` tests (tests/kubenode.py, tests/deploy/test_node_e2e.py) need to run Pods on a
# kubelet joined to the test control plane. Included by the root Makefile after controlplane.mk
# (uses its CONTROLPLANE_DIR, PYTHON and BIN).

# Debian packages: the container runtime and CNI plugins the node runs, debootstrap and Docker
# for `make image`. `.ci/run` installs them; `make node-packages` does the same by hand.
NODE_PACKAGES := containerd runc containernetworking-plugins iptables conntrack debootstrap docker.io

.PHONY: image node node-packages

image: ## build tokenfair's image from the Dockerfile, and the node's pause image (root; cached by content)
	$(PYTHON) hack/node/image.py build

# Debian's containerd/docker.io conflict with Docker CE's containerd.io/docker-ce: `apt-get -y`
# would remove those, so stop instead and let the owner of the machine decide.
node-packages: ## apt-get install the Debian packages the node and `make image` need (root)
	@if dpkg-query -W -f='$${Status}\n' containerd.io docker-ce 2>/dev/null | grep -q 'ok installed'; then \
		echo "node-packages: Docker CE (containerd.io/docker-ce) is installed; installing Debian's" \
			"$(NODE_PACKAGES) would remove it. Nothing installed: see docs/node.md" >&2; exit 1; fi
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $(NODE_PACKAGES)

# The kubelet file, not `controlplane`: KUBEBUILDER_ASSETS may stand in for the API server, but
# the node programs always come from the build (one `go build` with the API server).
node: $(CONTROLPLANE_DIR)/kubelet tools image $(STAMP) ## everything the `node` tests need; says what is missing
	@$(BIN)/python -c 'import sys; sys.path.insert(0, "tests"); import kubenode; \
		found = kubenode.find_requirements(); \
		print("node: " + (found if isinstance(found, str) else "ready (pytest -m node)")); \
		sys.exit(isinstance(found, str))'
