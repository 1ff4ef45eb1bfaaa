// Command etcd is upstream's etcd server, built from the pinned go.etcd.io/etcd/server/v3
// module. It mirrors etcd's own main.go; nothing of ours runs here.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
