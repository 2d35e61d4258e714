// Command kube-multicall is one binary holding the Kubernetes control plane
// the tests run against: etcd, kube-apiserver, kube-controller-manager,
// kube-scheduler and kubectl, all from one pinned release (go.mod).
//
// Why one binary: the components share most of their code, so linking them
// together costs a fraction of five separate builds on a 2-core CI machine,
// and kubectl is guaranteed to match the server's version (Debian's kubectl
// is outside the supported skew).
//
// Why one component per process: the components keep global registries
// (feature gates, metrics, component versions) that assume they are alone
// in the process, so this binary only dispatches and never runs two.
//
// Usage: kube-multicall COMPONENT [ARGS...], or a symlink named after the
// component (e.g. kubectl -> kube-multicall) run with ARGS alone.
package main

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	_ "time/tzdata" // CronJob time zones, as upstream's binaries embed them

	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"          // --logging-format=json, as upstream
	_ "k8s.io/component-base/metrics/prometheus/clientgo" // client-go metrics, as upstream
	_ "k8s.io/component-base/metrics/prometheus/version"  // version metric, as upstream
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
)

// components maps a component name to its upstream main, run with os.Args
// already rewritten to [name, args...] so each sees the argv it expects.
var components = map[string]func(){
	"etcd": func() {
		etcdmain.Main(os.Args)
	},
	"kube-apiserver": func() {
		os.Exit(cli.Run(apiserver.NewAPIServerCommand()))
	},
	"kube-controller-manager": func() {
		os.Exit(cli.Run(controllermanager.NewControllerManagerCommand()))
	},
	"kube-scheduler": func() {
		os.Exit(cli.Run(scheduler.NewSchedulerCommand()))
	},
	"kubectl": func() {
		// As upstream's kubectl main: verbosity is parsed before the
		// command is built so plugin and kuberc handling can log.
		logs.GlogSetter(kubectlcmd.GetLogVerbosity(os.Args)) // nolint:errcheck
		if err := cli.RunNoErrOutput(kubectlcmd.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
	},
}

func usage() {
	names := make([]string, 0, len(components))
	for name := range components {
		names = append(names, name)
	}
	sort.Strings(names)
	fmt.Fprintf(os.Stderr, "usage: %s COMPONENT [ARGS...]\ncomponents: %s\n",
		filepath.Base(os.Args[0]), strings.Join(names, ", "))
	os.Exit(2)
}

func main() {
	if run, ok := components[filepath.Base(os.Args[0])]; ok {
		run()
		return
	}
	if len(os.Args) < 2 {
		usage()
	}
	run, ok := components[os.Args[1]]
	if !ok {
		fmt.Fprintf(os.Stderr, "unknown component %q\n", os.Args[1])
		usage()
	}
	os.Args = os.Args[1:]
	run()
}
