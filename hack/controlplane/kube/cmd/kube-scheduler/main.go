// Command kube-scheduler is upstream's scheduler for the test node (make node), built from the
// pinned k8s.io/kubernetes module in the same `go build` as the API server. It mirrors
// kubernetes' cmd/kube-scheduler/scheduler.go line for line.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	_ "k8s.io/component-base/logs/json/register" // for JSON log format registration
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version" // for version metric registration
	"k8s.io/kubernetes/cmd/kube-scheduler/app"
)

func main() {
	command := app.NewSchedulerCommand()
	code := cli.Run(command)
	os.Exit(code)
}
