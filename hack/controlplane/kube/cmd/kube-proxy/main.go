// Command kube-proxy is upstream's Service proxy for the test node (make node, iptables mode),
// built from the pinned k8s.io/kubernetes module in the same `go build` as the API server. It
// mirrors kubernetes' cmd/kube-proxy/proxy.go line for line.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // for client metric registration
	_ "k8s.io/component-base/metrics/prometheus/version"  // for version metric registration
	"k8s.io/kubernetes/cmd/kube-proxy/app"
)

func main() {
	command := app.NewProxyCommand()
	code := cli.Run(command)
	os.Exit(code)
}
