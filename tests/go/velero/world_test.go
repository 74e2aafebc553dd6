package velero

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"

	"github.com/vmware-tanzu/velero/pkg/plugin/clientmgmt"
	"github.com/vmware-tanzu/velero/pkg/plugin/clientmgmt/process"
	"github.com/vmware-tanzu/velero/pkg/plugin/framework"
)

// The test plugin's names (cmd/test-plugin).
const (
	backupA  = "example.io/backup-a"
	restoreA = "example.io/restore-a"
	deleteA  = "example.io/delete-a"
	store    = "example.io/store"
)

// What the tests run, named by the environment (tests/src/velero.rs and .ci/run set
// them): missing, a test fails under CI and skips elsewhere.
const (
	envAgent      = "OPMON_AGENT"             // opmon-agent
	envStandIn    = "OPMON_VELERO_STANDIN"    // opmon-velero-plugin
	envTestPlugin = "OPMON_VELERO_TESTPLUGIN" // cmd/test-plugin, built
	envCLI        = "OPMON_CLI"               // opmon
)

// waitWithin bounds how long a broken run takes to fail; it is no synchronisation.
const waitWithin = 60 * time.Second

func TestMain(m *testing.M) {
	// Velero runs its own executable with `run-plugins` for its built-in plugins, and
	// here this test binary is Velero: it serves none, so that only the plugin
	// directory's names are registered.
	if len(os.Args) > 1 && os.Args[1] == "run-plugins" {
		framework.NewServer().Serve()
		return
	}
	os.Exit(m.Run())
}

// need is the path the environment names in `name`.
func need(t *testing.T, name string) string {
	t.Helper()
	path := os.Getenv(name)
	if path == "" {
		if os.Getenv("CI") != "" {
			t.Fatalf("%s is not set: run these tests through cargo test -p opmon-tests --test velero_go", name)
		}
		t.Skipf("%s is not set: run these tests through cargo test -p opmon-tests --test velero_go", name)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("%s: %v", name, err)
	}
	return path
}

// eventually probes cond until it holds, failing the test past waitWithin.
func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(waitWithin)
	pause := 5 * time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, waitWithin)
		}
		time.Sleep(pause)
		if pause *= 2; pause > 100*time.Millisecond {
			pause = 100 * time.Millisecond
		}
	}
}

// world is the real agent with a [[snapshotter]] table for each of the test plugin's
// asynchronous actions, and a Velero plugin directory holding the stand-in under the
// test plugin's file name, the original beside it where the stand-in finds it.
type world struct {
	t         *testing.T
	dir       string
	state     string // the test plugin's OPMON_TEST_STATE
	socket    string
	pluginDir string
	standIn   string // the stand-in as Velero finds it
	agentLog  string
	agent     *exec.Cmd
	exited    chan struct{}
	args      []string
	log       logrus.FieldLogger
}

// newWorld starts the agent; `extra` are lines for each table (deadlines, retries).
func newWorld(t *testing.T, extra string) *world {
	t.Helper()
	agent := need(t, envAgent)
	standIn := need(t, envStandIn)
	original := need(t, envTestPlugin)
	// Short: go-plugin's Unix sockets go under it, within the kernel's bound on a path.
	dir, err := os.MkdirTemp("", "opmon-velero-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	w := &world{
		t:         t,
		dir:       dir,
		state:     filepath.Join(dir, "plugin-state"),
		socket:    filepath.Join(dir, "agent.sock"),
		pluginDir: filepath.Join(dir, "plugins"),
		agentLog:  filepath.Join(dir, "agent.log"),
	}
	for _, d := range []string{w.state, w.pluginDir, filepath.Join(dir, "original"), filepath.Join(dir, "tmp")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	var tables []string
	for _, name := range []string{backupA, restoreA} {
		tables = append(tables, fmt.Sprintf("[[snapshotter]]\nname = %q\nvelero_plugin = %q\nenv = { OPMON_TEST_STATE = %q }\n%s\n",
			name, original, w.state, extra))
	}
	config := filepath.Join(dir, "agent.toml")
	if err := os.WriteFile(config, []byte(strings.Join(tables, "\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	w.args = []string{agent, "--socket", w.socket, "--state-dir", filepath.Join(dir, "state"),
		"--poll-interval", "100ms", "--config", config}
	w.start()
	t.Cleanup(w.kill)

	// The plugin directory as Velero's Deployment has it: the stand-in under the
	// original's file name; the original where OPMON_VELERO_ORIGINAL says, outside it.
	w.standIn = filepath.Join(w.pluginDir, "velero-plugin-example")
	copyFile(t, standIn, w.standIn)
	moved := filepath.Join(dir, "original", "velero-plugin-example")
	copyFile(t, original, moved)
	// Velero's plugins inherit Velero's environment: the Deployment sets these.
	t.Setenv("OPMON_SOCKET", w.socket)
	t.Setenv("OPMON_VELERO_ORIGINAL", moved)
	t.Setenv("OPMON_TEST_STATE", w.state)
	t.Setenv("TMPDIR", filepath.Join(dir, "tmp"))

	logger := logrus.New()
	logger.SetOutput(&testWriter{t: t})
	logger.SetLevel(logrus.InfoLevel)
	w.log = logger
	return w
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	data, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, data, 0o755); err != nil {
		t.Fatal(err)
	}
}

// testWriter sends Velero's log to the test's log, shown when a test fails.
type testWriter struct{ t *testing.T }

func (w *testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func (w *world) start() {
	w.t.Helper()
	log, err := os.OpenFile(w.agentLog, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		w.t.Fatal(err)
	}
	defer log.Close()
	cmd := exec.Command(w.args[0], w.args[1:]...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OPMON_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "OPMON_CONFIG=/dev/null")
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		w.t.Fatalf("starting the agent: %v", err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	w.agent, w.exited = cmd, exited
	eventually(w.t, "the agent serves its socket", func() bool {
		select {
		case <-exited:
			w.t.Fatalf("the agent exited:\n%s", w.agentLogText())
		default:
		}
		conn, err := net.Dial("unix", w.socket)
		if err == nil {
			conn.Close()
		}
		return err == nil
	})
}

func (w *world) kill() {
	if w.agent == nil {
		return
	}
	_ = w.agent.Process.Kill()
	<-w.exited
	w.agent = nil
	if w.t.Failed() {
		w.t.Logf("the agent's log:\n%s", w.agentLogText())
		w.t.Logf("the test plugin's journal:\n%s", strings.Join(w.journal(), "\n"))
	}
}

func (w *world) agentLogText() string {
	b, _ := os.ReadFile(w.agentLog)
	return string(b)
}

// journal is every call the test plugin got, a line each.
func (w *world) journal() []string {
	f, err := os.Open(filepath.Join(w.state, "journal"))
	if err != nil {
		return nil
	}
	defer f.Close()
	var lines []string
	s := bufio.NewScanner(f)
	for s.Scan() {
		lines = append(lines, s.Text())
	}
	return lines
}

func (w *world) journalHas(line string) bool {
	for _, l := range w.journal() {
		if l == line {
			return true
		}
	}
	return false
}

// registry is Velero's plugin registry over the plugin directory, discovered as
// `velero server` does at its start.
func (w *world) registry() process.Registry {
	w.t.Helper()
	registry := process.NewRegistry(w.pluginDir, w.log, logrus.InfoLevel)
	if err := registry.DiscoverPlugins(); err != nil {
		w.t.Fatalf("Velero's plugin discovery: %v", err)
	}
	return registry
}

// newPluginManager is what Velero's server gives its controllers: a manager over the
// registry, a new one each reconcile.
func (w *world) newPluginManager() func(logrus.FieldLogger) clientmgmt.Manager {
	registry := w.registry()
	return func(log logrus.FieldLogger) clientmgmt.Manager {
		return clientmgmt.NewManager(log, logrus.InfoLevel, registry)
	}
}

// call is one JSON-RPC call to the agent; its result, or the error it answered.
func (w *world) call(method string, params any) (json.RawMessage, *rpcError) {
	w.t.Helper()
	body, err := json.Marshal(map[string]any{"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
	if err != nil {
		w.t.Fatal(err)
	}
	client := http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", w.socket)
	}}}
	defer client.CloseIdleConnections()
	resp, err := client.Post("http://opmon/", "application/json", bytes.NewReader(body))
	if err != nil {
		w.t.Fatalf("%s: %v", method, err)
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		w.t.Fatalf("%s: %v", method, err)
	}
	var answer struct {
		Result json.RawMessage `json:"result"`
		Error  *rpcError       `json:"error"`
	}
	if err := json.Unmarshal(data, &answer); err != nil {
		w.t.Fatalf("%s: %v: %s", method, err, data)
	}
	return answer.Result, answer.Error
}

type rpcError struct {
	Code    int    `json:"code"`
	Message string `json:"message"`
}

// opmon runs the opmon CLI as an operator does, against this world's agent.
func (w *world) opmon(args ...string) string {
	w.t.Helper()
	cmd := exec.Command(need(w.t, envCLI), args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OPMON_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	cmd.Env = append(cmd.Env, "OPMON_SOCKET="+w.socket)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		// Its exit status tells the owner's phase; what it did is on stdout.
		if _, ok := err.(*exec.ExitError); !ok {
			w.t.Fatalf("opmon %v: %v", args, err)
		}
	}
	return string(out) + stderr.String()
}
