// Package layout runs Velero's own plugin discovery and manager (v1.18.1) over a plugin
// directory laid out as the Kubernetes examples' init containers leave it: the plugin's
// image copies its binary into the `plugins` volume, then `opmon-velero-plugin install`
// puts the stand-in in its place and the original in opmon's own volume. And it runs
// the same plugin under Velero and under the opmon agent, to compare what it sees.
//
// The binaries: $OPMON_VELERO_STANDIN (opmon-velero-plugin) and $OPMON_AGENT, else the
// workspace's target/debug ones; the test fails when they are missing.
package layout_test

import (
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/vmware-tanzu/velero/pkg/builder"
	"github.com/vmware-tanzu/velero/pkg/plugin/clientmgmt"
	"github.com/vmware-tanzu/velero/pkg/plugin/clientmgmt/process"
	"github.com/vmware-tanzu/velero/pkg/plugin/framework"
	"github.com/vmware-tanzu/velero/pkg/plugin/framework/common"

	opmon "opmon/client"
)

// The plugin's names: its file name as the AWS plugin's image copies it, and the
// BackupItemAction v2 the test plugin (cmd/env-plugin) serves.
const (
	pluginFile = "velero-plugin-for-aws"
	actionName = "opmon.test/env-report"
	annotation = "opmon.test/report"
)

func TestMain(m *testing.M) {
	// Velero's discovery starts its own binary first, as `velero run-plugins`, for its
	// built-in plugins: this test binary serves a plugin server with none (Velero's own
	// pkg/cmd/server/plugin needs modules the proxy here does not have).
	if len(os.Args) > 1 && os.Args[1] == "run-plugins" {
		flags := pflag.NewFlagSet("run-plugins", pflag.ContinueOnError)
		framework.NewServer().BindFlags(flags).Serve()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// repoRoot is the workspace root, four levels up from this package.
func repoRoot(t *testing.T) string {
	root, err := filepath.Abs("../../../..")
	if err != nil {
		t.Fatal(err)
	}
	return root
}

// binary is $env, else target/debug/name in the workspace; missing, the test fails.
func binary(t *testing.T, env, name string) string {
	path := os.Getenv(env)
	if path == "" {
		path = filepath.Join(repoRoot(t), "target", "debug", name)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("%s: %v (set %s, or cargo build -p opmon-agent --bins)", name, err, env)
	}
	return path
}

var (
	envPluginOnce sync.Once
	envPlugin     string
	envPluginErr  error
)

// buildEnvPlugin builds cmd/env-plugin once, statically (CGO off), as plugin images ship.
func buildEnvPlugin(t *testing.T) string {
	envPluginOnce.Do(func() {
		dir, err := os.MkdirTemp("", "env-plugin")
		if err != nil {
			envPluginErr = err
			return
		}
		envPlugin = filepath.Join(dir, "env-plugin")
		cmd := exec.Command("go", "build", "-o", envPlugin, "opmon.test/velero/cmd/env-plugin")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			envPluginErr = fmt.Errorf("go build cmd/env-plugin: %v\n%s", err, out)
		}
	})
	if envPluginErr != nil {
		t.Fatal(envPluginErr)
	}
	return envPlugin
}

func copyFile(t *testing.T, from, to string) {
	data, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, data, 0o755); err != nil {
		t.Fatal(err)
	}
	// WriteFile keeps the mode of a file it truncates: as `cp` into the volume.
	if err := os.Chmod(to, 0o755); err != nil {
		t.Fatal(err)
	}
}

func run(t *testing.T, name string, args ...string) string {
	t.Helper()
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %v: %v\n%s", name, args, err, out)
	}
	return string(out)
}

// pod is the two volumes of Velero's pod that the examples' init containers write.
type pod struct {
	plugins   string // `plugins`: /target in the init containers, /plugins in Velero
	originals string // `opmon-plugins`: /opmon/plugins
}

// initContainers lays out the volumes as the examples' init containers do, in their
// order: the plugin image copies its binary, then opmon's installer runs. Twice, as
// a restarted pod runs them again over what the first run left.
func initContainers(t *testing.T, original, standin string) pod {
	dir := t.TempDir()
	p := pod{plugins: filepath.Join(dir, "plugins"), originals: filepath.Join(dir, "opmon", "plugins")}
	for _, d := range []string{p.plugins, p.originals} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	target := filepath.Join(p.plugins, pluginFile)
	for range 2 {
		copyFile(t, original, target)
		run(t, standin, "install", target, p.originals)
	}
	return p
}

// velero is Velero's plugin registry, discovered over dir, and its manager.
type velero struct {
	registry process.Registry
	manager  clientmgmt.Manager
	log      *bytes.Buffer
}

func discover(t *testing.T, dir string) (*velero, error) {
	log := &bytes.Buffer{}
	logger := logrus.New()
	logger.Out = log
	registry := process.NewRegistry(dir, logger, logrus.InfoLevel)
	if err := registry.DiscoverPlugins(); err != nil {
		return &velero{log: log}, err
	}
	manager := clientmgmt.NewManager(logger, logrus.InfoLevel, registry)
	t.Cleanup(manager.CleanupClients)
	return &velero{registry: registry, manager: manager, log: log}, nil
}

// report is what cmd/env-plugin saw.
type report struct {
	Executable string            `json:"executable"`
	Env        map[string]string `json:"env"`
	Files      map[string]string `json:"files"`
}

// executeThroughVelero backs up a PVC with the action through Velero's manager and
// returns what the plugin that answered saw.
func executeThroughVelero(t *testing.T, v *velero) report {
	t.Helper()
	action, err := v.manager.GetBackupItemActionV2(actionName)
	if err != nil {
		t.Fatalf("Velero's manager: %v\n%s", err, v.log)
	}
	pvc := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "v1", "kind": "PersistentVolumeClaim",
		"metadata": map[string]any{"namespace": "app", "name": "data"},
	}}
	backup := builder.ForBackup("velero", "nightly").Result()
	item, _, operationID, _, err := action.Execute(pvc, backup)
	if err != nil {
		t.Fatalf("Execute through Velero's manager: %v\n%s", err, v.log)
	}
	if operationID != "" {
		t.Fatalf("an operation ID from a plugin that starts none: %q", operationID)
	}
	u := unstructured.Unstructured{Object: item.UnstructuredContent()}
	var r report
	if err := json.Unmarshal([]byte(u.GetAnnotations()[annotation]), &r); err != nil {
		t.Fatalf("the item Velero got back has no report: %v (%v)", err, u.GetAnnotations())
	}
	return r
}

// Velero starts over the layout the examples make: every name the original serves is
// registered once, to the stand-in (the file Velero found), and a call through Velero's
// manager reaches the original.
func TestVeleroDiscoversTheStandInOnceOverTheExamplesLayout(t *testing.T) {
	standin := binary(t, "OPMON_VELERO_STANDIN", "opmon-velero-plugin")
	p := initContainers(t, buildEnvPlugin(t), standin)
	original := filepath.Join(p.originals, pluginFile)
	// In Velero's pod the stand-in finds the original at /opmon/plugins/<its name>;
	// here the volume is elsewhere (TestStaticStandInRunsInAnEmptyRoot runs the default).
	t.Setenv("OPMON_VELERO_ORIGINAL", original)
	// No agent: AppliesTo, and an Execute that starts no operation, do not need it.
	t.Setenv("OPMON_SOCKET", filepath.Join(t.TempDir(), "no-agent.sock"))

	v, err := discover(t, p.plugins)
	if err != nil {
		t.Fatalf("Velero does not start: %v\n%s", err, v.log)
	}
	stoodIn := filepath.Join(p.plugins, pluginFile)
	for _, want := range []struct {
		kind common.PluginKind
		name string
	}{
		{common.PluginKindBackupItemActionV2, actionName},
		{common.PluginKindDeleteItemAction, "opmon.io/forget-" + pluginFile},
	} {
		id, err := v.registry.Get(want.kind, want.name)
		if err != nil {
			t.Fatalf("%s %s: %v", want.kind, want.name, err)
		}
		if id.Command != stoodIn {
			t.Errorf("%s %s is served by %s, not the stand-in %s", want.kind, want.name, id.Command, stoodIn)
		}
		n := 0
		for _, listed := range v.registry.List(want.kind) {
			if listed.Name == want.name {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%s %s is listed %d times", want.kind, want.name, n)
		}
	}
	if got := executeThroughVelero(t, v).Executable; got != original {
		t.Errorf("Execute was answered by %s, not the original %s", got, original)
	}
}

// What the installer before this layout did (the original in opmon/ under the plugin
// directory): Velero's discovery reads subdirectories too, finds both, and refuses to
// start. Kept so that the reason for the layout stays checked against Velero's code.
func TestVeleroRefusesAnOriginalAnywhereUnderItsPluginDirectory(t *testing.T) {
	standin := binary(t, "OPMON_VELERO_STANDIN", "opmon-velero-plugin")
	dir := t.TempDir()
	nested := filepath.Join(dir, "opmon")
	if err := os.MkdirAll(nested, 0o755); err != nil {
		t.Fatal(err)
	}
	copyFile(t, buildEnvPlugin(t), filepath.Join(nested, pluginFile))
	copyFile(t, standin, filepath.Join(dir, pluginFile))
	t.Setenv("OPMON_VELERO_ORIGINAL", filepath.Join(nested, pluginFile))
	t.Setenv("OPMON_SOCKET", filepath.Join(t.TempDir(), "no-agent.sock"))
	_, err := discover(t, dir)
	if err == nil || !strings.Contains(err.Error(), "another plugin is already registered") {
		t.Fatalf("Velero's discovery over an original in a subdirectory: %v", err)
	}
}

// The environment and mounts Velero's container gives its plugins, as the sidecar
// example gives them to the agent's container too.
func veleroEnvironment(t *testing.T) []string {
	credentials := filepath.Join(t.TempDir(), "credentials", "cloud")
	if err := os.MkdirAll(filepath.Dir(credentials), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(credentials, []byte("[default]\naws_access_key_id=AKIDEXAMPLE\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	vars := map[string]string{
		"AWS_SHARED_CREDENTIALS_FILE": credentials,
		"VELERO_NAMESPACE":            "velero",
		"VELERO_SCRATCH_DIR":          "/scratch",
		"LD_LIBRARY_PATH":             "/plugins",
		"KUBERNETES_SERVICE_HOST":     "10.96.0.1",
		"KUBERNETES_SERVICE_PORT":     "443",
		"HTTPS_PROXY":                 "http://proxy.example:3128",
		"NO_PROXY":                    "10.96.0.1,.svc",
	}
	names := []string{"PATH", "HOME"}
	for k, v := range vars {
		t.Setenv(k, v)
		names = append(names, k)
	}
	slices.Sort(names)
	t.Setenv("ENV_REPORT_NAMES", strings.Join(names, ","))
	t.Setenv("ENV_REPORT_FILES", credentials)
	return names
}

// The agent, started with this process's environment (Velero's, above) and a
// velero_plugin table for the original; the process and its socket.
func startAgent(t *testing.T, original string) string {
	dir := t.TempDir()
	socket := filepath.Join(dir, "agent.sock")
	config := filepath.Join(dir, "agent.toml")
	table := fmt.Sprintf("[[snapshotter]]\nname = %q\nvelero_plugin = %q\n", actionName, original)
	if err := os.WriteFile(config, []byte(table), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(binary(t, "OPMON_AGENT", "opmon-agent"),
		"--config", config, "--socket", socket, "--state-dir", filepath.Join(dir, "state"),
		"--poll-interval", "100ms")
	// The agent refuses OPMON_* variables that are not its settings.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OPMON_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	log := &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-exited
		if t.Failed() {
			t.Logf("the agent's log:\n%s", log)
		}
	})
	for {
		if _, err := os.Stat(socket); err == nil {
			return socket
		}
		select {
		case err := <-exited:
			exited <- err
			t.Fatalf("the agent exited: %v\n%s", err, log)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// progressThroughTheAgent has the agent poll the original for one operation and returns
// what the plugin saw, from the progress the agent recorded.
func progressThroughTheAgent(t *testing.T, socket string) report {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	c, err := opmon.Connect(ctx, socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	backups := c.Backups()
	if _, err := backups.Start(ctx, opmon.StartParams{Name: "nightly", UID: "uid-nightly"}); err != nil {
		t.Fatal(err)
	}
	if _, err := backups.AddOperations(ctx, opmon.AddOperationsParams{Name: "nightly", Operations: []opmon.NewOperation{{
		Plugin:      opmon.PluginRef{Kind: opmon.BackupItemAction, Name: actionName},
		Resource:    opmon.ResourceIdentifier{Resource: "persistentvolumeclaims", Namespace: "app", Name: "data"},
		OperationID: "report-1",
	}}}); err != nil {
		t.Fatal(err)
	}
	if _, err := backups.EndInProgress(ctx, opmon.EndInProgressParams{Name: "nightly"}); err != nil {
		t.Fatal(err)
	}
	for {
		ops, err := backups.Operations(ctx, opmon.OperationsParams{Name: "nightly"})
		if err != nil {
			t.Fatal(err)
		}
		if len(ops) == 1 && ops[0].Phase == opmon.OperationCompleted {
			var r report
			if err := json.Unmarshal([]byte(ops[0].Description), &r); err != nil {
				t.Fatalf("the agent recorded no report: %v (%q)", err, ops[0].Description)
			}
			return r
		}
		if len(ops) == 1 && ops[0].Phase == opmon.OperationFailed {
			t.Fatalf("the agent's poll failed: %s", ops[0].Error)
		}
		if _, err := backups.Wait(ctx, opmon.WaitParams{Name: "nightly", Until: opmon.UntilTerminal, Timeout: opmon.D(time.Second)}); err != nil {
			t.Fatal(err)
		}
	}
}

// One plugin, run by Velero (through the stand-in) and by the agent (its own copy, from
// the same path, as in the sidecar example), sees the same environment and the same
// credentials file.
func TestThePluginSeesUnderTheAgentWhatItSeesUnderVelero(t *testing.T) {
	standin := binary(t, "OPMON_VELERO_STANDIN", "opmon-velero-plugin")
	names := veleroEnvironment(t)
	p := initContainers(t, buildEnvPlugin(t), standin)
	original := filepath.Join(p.originals, pluginFile)
	t.Setenv("OPMON_VELERO_ORIGINAL", original)
	t.Setenv("OPMON_SOCKET", filepath.Join(t.TempDir(), "no-agent.sock"))
	v, err := discover(t, p.plugins)
	if err != nil {
		t.Fatalf("Velero does not start: %v\n%s", err, v.log)
	}
	underVelero := executeThroughVelero(t, v)
	underAgent := progressThroughTheAgent(t, startAgent(t, original))

	if len(underVelero.Env) != len(names) {
		t.Fatalf("under Velero the plugin sees %v of %v", underVelero.Env, names)
	}
	for _, name := range names {
		if underAgent.Env[name] != underVelero.Env[name] {
			t.Errorf("%s: %q under the agent, %q under Velero", name, underAgent.Env[name], underVelero.Env[name])
		}
	}
	for path, text := range underVelero.Files {
		if strings.HasPrefix(text, "error: ") || underAgent.Files[path] != text {
			t.Errorf("%s: %q under the agent, %q under Velero", path, underAgent.Files[path], text)
		}
	}
	if underAgent.Executable != underVelero.Executable {
		t.Errorf("the agent runs %s, Velero %s", underAgent.Executable, underVelero.Executable)
	}
}

// The stand-in runs inside Velero's image, which has no Rust runtime libraries: it is
// linked statically (no program interpreter, no shared library), and started in a root
// that holds nothing but it and the original (and the /proc, /dev and /tmp a container
// has),
// it finds the original where the installer puts it by default and serves Velero's
// manager. Needs unshare and chroot (util-linux, coreutils), run as root in CI.
func TestStaticStandInServesVeleroFromAnEmptyRoot(t *testing.T) {
	standin := binary(t, "OPMON_VELERO_STANDIN", "opmon-velero-plugin")
	file, err := elf.Open(standin)
	if err != nil {
		t.Fatal(err)
	}
	libraries, err := file.ImportedLibraries()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range file.Progs {
		if p.Type == elf.PT_INTERP {
			t.Errorf("%s has a program interpreter (build it with cargo rustc … -- -C target-feature=+crt-static)", standin)
		}
	}
	file.Close()
	if len(libraries) > 0 {
		t.Fatalf("%s needs %v", standin, libraries)
	}
	for _, tool := range []string{"unshare", "chroot", "sh"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Fatalf("%s: %v", tool, err)
		}
	}

	// Velero's plugin directory and where go-plugin's sockets go (TMPDIR) have the same
	// paths in the root as outside, as in Velero's container: Velero runs the path a
	// plugin reports, and dials the socket it names.
	root, velero, sockets := t.TempDir(), t.TempDir(), t.TempDir()
	for _, d := range []string{velero, sockets, "opmon/plugins", "proc", "dev"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	inRoot := filepath.Join(root, velero, pluginFile)
	copyFile(t, buildEnvPlugin(t), inRoot)
	run(t, standin, "install", inRoot, filepath.Join(root, "opmon", "plugins"))
	// What Velero starts: a file in its plugin directory that runs the stand-in in the
	// root, in a mount namespace of its own with the host's /proc and /dev (as a
	// container has them) and the sockets' directory.
	wrapper := fmt.Sprintf(`#!/bin/sh
exec unshare --map-root-user --mount sh -c 'mount --rbind /proc "$0/proc" && mount --rbind /dev "$0/dev" && mount --bind %[1]q "$0/%[1]s" && exec chroot "$0" %[2]q "$@"' %[3]q "$@"
`, sockets, filepath.Join(velero, pluginFile), root)
	if err := os.WriteFile(filepath.Join(velero, pluginFile), []byte(wrapper), 0o755); err != nil {
		t.Fatal(err)
	}
	// The default path, not a test's: /opmon/plugins/<its file name> in the root.
	t.Setenv("OPMON_VELERO_ORIGINAL", "")
	os.Unsetenv("OPMON_VELERO_ORIGINAL")
	t.Setenv("TMPDIR", sockets)
	t.Setenv("OPMON_SOCKET", filepath.Join(sockets, "no-agent.sock"))
	v, err := discover(t, velero)
	if err != nil {
		t.Fatalf("Velero does not start: %v\n%s", err, v.log)
	}
	if got := executeThroughVelero(t, v).Executable; got != "/opmon/plugins/"+pluginFile {
		t.Errorf("Execute was answered by %s, not the original at /opmon/plugins/%s", got, pluginFile)
	}
}
