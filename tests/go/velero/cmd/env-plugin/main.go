// Command env-plugin is a Velero plugin, written on Velero's plugin framework as plugin
// authors write theirs, that reports what it sees: the environment variables named in
// ENV_REPORT_NAMES (comma-separated), the contents of the files named in
// ENV_REPORT_FILES (comma-separated), and the path it was started as. Execute puts
// the report in the item's annotation opmon.test/report (and starts no operation);
// Progress answers it as the operation's description, completed. So the tests compare
// what a plugin sees under Velero (through opmon's stand-in) with what it sees under the
// opmon agent.
package main

import (
	"encoding/json"
	"os"
	"strings"

	"github.com/sirupsen/logrus"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"

	api "github.com/vmware-tanzu/velero/pkg/apis/velero/v1"
	"github.com/vmware-tanzu/velero/pkg/plugin/framework"
	"github.com/vmware-tanzu/velero/pkg/plugin/velero"
)

// Name is the BackupItemAction v2 this plugin serves.
const Name = "opmon.test/env-report"

// Annotation is where Execute puts the report on the item.
const Annotation = "opmon.test/report"

// Report is what the plugin saw.
type Report struct {
	Executable string            `json:"executable"`
	Env        map[string]string `json:"env"`
	Files      map[string]string `json:"files"`
}

func report() string {
	r := Report{Executable: os.Args[0], Env: map[string]string{}, Files: map[string]string{}}
	for _, name := range strings.Split(os.Getenv("ENV_REPORT_NAMES"), ",") {
		if value, ok := os.LookupEnv(name); ok && name != "" {
			r.Env[name] = value
		}
	}
	for _, path := range strings.Split(os.Getenv("ENV_REPORT_FILES"), ",") {
		if path == "" {
			continue
		}
		if text, err := os.ReadFile(path); err == nil {
			r.Files[path] = string(text)
		} else {
			r.Files[path] = "error: " + err.Error()
		}
	}
	text, _ := json.Marshal(r)
	return string(text)
}

type action struct{}

func (action) Name() string { return Name }

func (action) AppliesTo() (velero.ResourceSelector, error) {
	return velero.ResourceSelector{IncludedResources: []string{"persistentvolumeclaims"}}, nil
}

func (action) Execute(item runtime.Unstructured, _ *api.Backup) (runtime.Unstructured, []velero.ResourceIdentifier, string, []velero.ResourceIdentifier, error) {
	u := &unstructured.Unstructured{Object: item.UnstructuredContent()}
	annotations := u.GetAnnotations()
	if annotations == nil {
		annotations = map[string]string{}
	}
	annotations[Annotation] = report()
	u.SetAnnotations(annotations)
	return u, nil, "", nil, nil
}

func (action) Progress(string, *api.Backup) (velero.OperationProgress, error) {
	return velero.OperationProgress{Completed: true, Description: report()}, nil
}

func (action) Cancel(string, *api.Backup) error { return nil }

func main() {
	framework.NewServer().
		RegisterBackupItemActionV2(Name, func(logrus.FieldLogger) (any, error) { return action{}, nil }).
		Serve()
}
