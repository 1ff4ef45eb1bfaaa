// The test node's pod-sandbox ("pause") program: standard library only, built by `make image`.
module github.com/tokenfair/tokenfair/hack/node/pause

go 1.26.0
