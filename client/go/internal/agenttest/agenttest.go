// Package agenttest runs the real opmon agent binary, and a real socket snapshotter
// served by the test process, for the Go client's tests and example.
//
// The agent is $OPMON_AGENT, else the workspace's target/release/opmon-agent, else
// target/debug/opmon-agent. Readiness is a condition (the socket accepts a
// connection), checked in a bounded loop; never a sleep standing in for it.
package agenttest

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// readyWithin bounds how long a broken run takes to fail; it is no synchronisation.
const readyWithin = 60 * time.Second

// ConnectTimeout is the connect timeout of the tests' clients: on a loaded machine a
// freshly started agent may take longer than the default 5 s to answer its first call.
const ConnectTimeout = readyWithin

// Plugin is the plugin the test snapshotter is registered for.
const Plugin = "example.io/copier"

// RepoRoot is the opmon workspace this package is in.
func RepoRoot(t testing.TB) string {
	_, file, _, ok := runtime.Caller(0)
	if !ok {
		t.Fatal("cannot locate the agenttest package's source")
	}
	return filepath.Clean(filepath.Join(filepath.Dir(file), "..", "..", "..", ".."))
}

// AgentBinary is the agent the tests run: $OPMON_AGENT, else the workspace's
// target/release then target/debug build. Missing, the test fails (it never skips).
func AgentBinary(t testing.TB) string {
	if bin := os.Getenv("OPMON_AGENT"); bin != "" {
		return bin
	}
	root := RepoRoot(t)
	for _, profile := range []string{"release", "debug"} {
		bin := filepath.Join(root, "target", profile, "opmon-agent")
		if _, err := os.Stat(bin); err == nil {
			return bin
		}
	}
	t.Fatalf("no opmon-agent: set OPMON_AGENT, or build it (cargo build -p opmon-agent) under %s/target", root)
	return ""
}

// Agent is a running opmon-agent in a temporary directory.
type Agent struct {
	t        testing.TB
	bin      string
	Dir      string
	Socket   string
	StateDir string
	Log      string
	args     []string

	mu     sync.Mutex // guards cmd and exited: a test may kill from a callback
	cmd    *exec.Cmd
	exited chan struct{}
}

// Start runs the agent (socket Dir/run/agent.sock, state Dir/state, polling every
// 100ms) with extra flags, and stops it when the test ends.
func Start(t testing.TB, extra ...string) *Agent {
	t.Helper()
	dir := t.TempDir()
	a := &Agent{
		t:        t,
		bin:      AgentBinary(t),
		Dir:      dir,
		Socket:   filepath.Join(dir, "run", "agent.sock"),
		StateDir: filepath.Join(dir, "state"),
		Log:      filepath.Join(dir, "agent.log"),
		args:     extra,
	}
	a.launch()
	t.Cleanup(a.Kill)
	return a
}

func (a *Agent) launch() {
	a.t.Helper()
	log, err := os.OpenFile(a.Log, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		a.t.Fatal(err)
	}
	defer log.Close()
	args := append([]string{"--socket", a.Socket, "--state-dir", a.StateDir, "--poll-interval", "100ms"}, a.args...)
	cmd := exec.Command(a.bin, args...)
	// The agent refuses OPMON_* variables that are not its settings (OPMON_AGENT is
	// this harness's); systemd's hand-overs belong to whatever runs the tests.
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "OPMON_") || strings.HasPrefix(kv, "LISTEN_") ||
			strings.HasPrefix(kv, "NOTIFY_SOCKET=") || strings.HasPrefix(kv, "WATCHDOG_") {
			continue
		}
		cmd.Env = append(cmd.Env, kv)
	}
	cmd.Env = append(cmd.Env, "OPMON_CONFIG=/dev/null")
	cmd.Stdout = log
	cmd.Stderr = log
	if err := cmd.Start(); err != nil {
		a.t.Fatalf("starting %s: %v", a.bin, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	a.mu.Lock()
	a.cmd, a.exited = cmd, exited
	a.mu.Unlock()
	a.waitForSocket(exited)
}

func (a *Agent) waitForSocket(exited chan struct{}) {
	a.t.Helper()
	ok := Eventually(readyWithin, func() bool {
		select {
		case <-exited:
			a.t.Fatalf("the agent exited before serving %s:\n%s", a.Socket, a.LogText())
		default:
		}
		conn, err := net.Dial("unix", a.Socket)
		if err != nil {
			return false
		}
		conn.Close()
		return true
	})
	if !ok {
		a.t.Fatalf("the agent did not serve %s within %v:\n%s", a.Socket, readyWithin, a.LogText())
	}
}

// LogText is the agent's log so far.
func (a *Agent) LogText() string {
	b, _ := os.ReadFile(a.Log)
	return string(b)
}

// Kill sends SIGKILL and waits for the process to be gone.
func (a *Agent) Kill() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.cmd == nil {
		return
	}
	_ = a.cmd.Process.Kill()
	<-a.exited
	a.cmd = nil
}

// Stop sends SIGSTOP: the agent keeps its socket but answers nothing.
func (a *Agent) Stop() {
	a.t.Helper()
	a.mu.Lock()
	defer a.mu.Unlock()
	if err := a.cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		a.t.Fatal(err)
	}
}

// Restart starts the agent again on the same socket and state (after Kill).
func (a *Agent) Restart() {
	a.t.Helper()
	a.Kill()
	a.launch()
}

// Eventually probes cond until it holds or within passes, pausing 5ms growing to
// 100ms between probes.
func Eventually(within time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	pause := 5 * time.Millisecond
	for {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(pause)
		if pause *= 2; pause > 100*time.Millisecond {
			pause = 100 * time.Millisecond
		}
	}
}

// Snapshotter is a socket snapshotter (the snapshotter protocol: JSON-RPC over HTTP
// on a Unix socket) served by the test process. Operation IDs say what it answers:
// done-* complete; gate-* complete once Open(id) was called; hold-* block until
// Release(id), after sending their id on Held.
type Snapshotter struct {
	Socket string
	// Held receives the id of each hold-* operation whose Progress call is blocked.
	Held chan string

	mu       sync.Mutex
	open     map[string]bool
	released map[string]chan struct{}
	server   *http.Server
}

// StartSnapshotter serves a snapshotter on a socket in a new temporary directory.
func StartSnapshotter(t testing.TB) *Snapshotter {
	t.Helper()
	s := &Snapshotter{
		Socket:   filepath.Join(t.TempDir(), "copier.sock"),
		Held:     make(chan string, 16),
		open:     map[string]bool{},
		released: map[string]chan struct{}{},
	}
	listener, err := net.Listen("unix", s.Socket)
	if err != nil {
		t.Fatal(err)
	}
	s.server = &http.Server{Handler: http.HandlerFunc(s.serve)}
	go func() { _ = s.server.Serve(listener) }()
	t.Cleanup(func() {
		s.mu.Lock()
		for id, ch := range s.released {
			close(ch)
			delete(s.released, id)
		}
		s.mu.Unlock()
		_ = s.server.Close()
	})
	return s
}

// Open lets gate-* operation id complete from now on.
func (s *Snapshotter) Open(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.open[id] = true
}

// Release completes hold-* operation id: calls blocked on it answer, later ones too.
func (s *Snapshotter) Release(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.open[id] = true
	if ch, ok := s.released[id]; ok {
		close(ch)
		delete(s.released, id)
	}
}

type snapshotterRequest struct {
	ID     json.RawMessage `json:"id"`
	Method string          `json:"method"`
	Params struct {
		OperationID string `json:"operationId"`
	} `json:"params"`
}

func (s *Snapshotter) serve(w http.ResponseWriter, r *http.Request) {
	var body bytes.Buffer
	if _, err := body.ReadFrom(r.Body); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	raw := bytes.TrimSpace(body.Bytes())
	batch := len(raw) > 0 && raw[0] == '['
	var requests []snapshotterRequest
	if batch {
		if err := json.Unmarshal(raw, &requests); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
	} else {
		var one snapshotterRequest
		if err := json.Unmarshal(raw, &one); err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		requests = []snapshotterRequest{one}
	}
	answers := make([]map[string]any, 0, len(requests))
	for _, req := range requests {
		answer := map[string]any{"jsonrpc": "2.0", "id": req.ID}
		switch req.Method {
		case "operation.cancel":
			answer["result"] = nil
		case "operation.progress":
			if result, ok := s.progress(req.Params.OperationID); ok {
				answer["result"] = result
			} else {
				answer["error"] = map[string]any{"code": 2002, "message": fmt.Sprintf("unknown operation %q", req.Params.OperationID)}
			}
		default:
			answer["error"] = map[string]any{"code": -32601, "message": "Method not found"}
		}
		answers = append(answers, answer)
	}
	w.Header().Set("Content-Type", "application/json")
	if batch {
		_ = json.NewEncoder(w).Encode(answers)
	} else {
		_ = json.NewEncoder(w).Encode(answers[0])
	}
}

var (
	completed  = map[string]any{"completed": true, "nCompleted": 7, "nTotal": 7, "operationUnits": "file"}
	inProgress = map[string]any{"completed": false, "nCompleted": 2, "nTotal": 7, "operationUnits": "file", "started": "2026-01-01T00:00:00Z"}
)

func (s *Snapshotter) progress(id string) (map[string]any, bool) {
	switch {
	case strings.HasPrefix(id, "done-"):
		return completed, true
	case strings.HasPrefix(id, "gate-"):
		s.mu.Lock()
		defer s.mu.Unlock()
		if s.open[id] {
			return completed, true
		}
		return inProgress, true
	case strings.HasPrefix(id, "hold-"):
		s.mu.Lock()
		if s.open[id] {
			s.mu.Unlock()
			return completed, true
		}
		ch, ok := s.released[id]
		if !ok {
			ch = make(chan struct{})
			s.released[id] = ch
		}
		s.mu.Unlock()
		select {
		case s.Held <- id:
		default: // nobody is listening for it
		}
		<-ch
		return completed, true
	}
	return nil, false
}
