#!/usr/bin/env bash
# The kind quickstart, end to end: a kind cluster, the tokenfair image built and loaded into it,
# the chart installed with the demo pool, and the lesson's noisy-neighbor workload sent through
# the demo's sidecar with `tokenfair loadgen`, whose report is printed.
#
#   hack/kind-demo.sh            (or: make kind-demo)
#
# Needs docker, kind, kubectl, helm and the `tokenfair` command (.venv/bin). Environment:
#   KIND_CLUSTER (tokenfair-demo)  KEEP_CLUSTER=1 to leave the cluster running afterwards
#   IMAGE (tokenfair/tokenfair:dev)   LOCAL_PORT (18080)
set -euo pipefail

cd "$(dirname "$0")/.."
CLUSTER=${KIND_CLUSTER:-tokenfair-demo}
IMAGE=${IMAGE:-tokenfair/tokenfair:dev}
NAMESPACE=tokenfair-system
LOCAL_PORT=${LOCAL_PORT:-18080}
TOKENFAIR=${TOKENFAIR:-$( [ -x .venv/bin/tokenfair ] && echo .venv/bin/tokenfair || echo tokenfair )}

for tool in docker kind kubectl helm; do
  command -v "$tool" >/dev/null || { echo "kind-demo: needs $tool on PATH" >&2; exit 2; }
done

cleanup() {
  [ -n "${FORWARD_PID:-}" ] && kill "$FORWARD_PID" 2>/dev/null || true
  [ "${KEEP_CLUSTER:-0}" = 1 ] || kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
}
trap cleanup EXIT

echo "==> kind cluster $CLUSTER"
kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
kubectl config use-context "kind-$CLUSTER" >/dev/null

echo "==> image $IMAGE"
docker build --tag "$IMAGE" .
kind load docker-image "$IMAGE" --name "$CLUSTER"

echo "==> chart (operator + demo pool) in $NAMESPACE"
helm upgrade --install tokenfair charts/tokenfair --namespace "$NAMESPACE" --create-namespace \
  --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
  --set image.pullPolicy=Never --set demo.enabled=true --wait --timeout 180s
# The model server starts once the operator has published its Secret; wait for it to be Ready.
kubectl -n "$NAMESPACE" rollout status deployment/tokenfair-demo --timeout=180s
kubectl -n "$NAMESPACE" get tsp,tq
helm test tokenfair --namespace "$NAMESPACE"

echo "==> noisy-neighbor workload through the sidecar (127.0.0.1:$LOCAL_PORT)"
kubectl -n "$NAMESPACE" port-forward svc/tokenfair-demo "$LOCAL_PORT:8080" >/dev/null &
FORWARD_PID=$!
for _ in $(seq 50); do
  (exec 3<>"/dev/tcp/127.0.0.1/$LOCAL_PORT") 2>/dev/null && break
  sleep 0.2
done
"$TOKENFAIR" loadgen --target "http://127.0.0.1:$LOCAL_PORT" --scenario noisy-neighbor --stream \
  --key tenant_chat_pro=sk-local-chat-pro \
  --key tenant_ide_assist=sk-local-ide-assist \
  --key tenant_batch_rag=sk-local-batch-rag
