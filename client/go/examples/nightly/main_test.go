package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	opmon "opmon/client"
	"opmon/client/internal/agenttest"
)

// The line of ../../README.md that runs this example beside the quick start.
const readmeLine = `(cd client/go && go run ./examples/nightly "$op")`

// The example, run as the README says against the real agent and a socket snapshotter
// registered for the plugin it names: it prints what the README says it prints, and a
// second run (its backup already finalized) says what went wrong in one plain line.
func TestTheReadmesExampleRunsAsPrinted(t *testing.T) {
	root := agenttest.RepoRoot(t)
	readme, err := os.ReadFile(filepath.Join(root, "client", "go", "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), "\n"+readmeLine+"\n") {
		t.Fatalf("README.md no longer runs the example with %s", readmeLine)
	}
	agent := agenttest.Start(t)
	snapshotter := agenttest.StartSnapshotter(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	client, err := opmon.Connect(ctx, agent.Socket, opmon.WithConnectTimeout(agenttest.ConnectTimeout))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	socket := snapshotter.Socket
	if _, err := client.SnapshotterRegister(ctx, opmon.Snapshotter{Name: "example.io/qemu-img", APIVersion: opmon.APIv2, Socket: &socket}); err != nil {
		t.Fatal(err)
	}
	run := func(op string) (string, string, error) {
		cmd := exec.CommandContext(ctx, "go", "run", "./examples/nightly", op)
		cmd.Dir = filepath.Join(root, "client", "go")
		cmd.Env = append(os.Environ(), "OPMON_SOCKET="+agent.Socket)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		return stdout.String(), stderr.String(), err
	}
	stdout, stderr, err := run("done-disk")
	if err != nil || stdout != "nightly-go is Completed\n" {
		t.Fatalf("first run: %v\nstdout: %q\nstderr: %s\nagent log:\n%s", err, stdout, stderr, agent.LogText())
	}
	stdout, stderr, err = run("done-disk-2")
	if err == nil {
		t.Fatalf("a second run succeeded: %q", stdout)
	}
	// `go run` adds its own "exit status 1" line.
	message := strings.TrimSuffix(stderr, "exit status 1\n")
	want := "backup nightly-go: backup.addOperations: backup nightly-go is Completed; " +
		"addOperations is allowed only while InProgress (code 1003, data {\"phase\":\"Completed\"})\n"
	if message != want {
		t.Errorf("a second run says\n%s\nnot\n%s", stderr, want)
	}
}
