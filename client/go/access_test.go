package opmon_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	opmon "opmon/client"
	"opmon/client/internal/agenttest"
)

// A peer the agent does not admit (SO_PEERCRED: not its uid, not root, not allowed)
// gets HTTP 403 with a JSON-RPC error: Connect fails with it, code -32003. The peer is
// this test binary run again as nobody (setpriv), which needs root.
func TestAPeerTheAgentDoesNotAdmitGetsItsRefusal(t *testing.T) {
	if os.Geteuid() != 0 {
		if os.Getenv("CI") != "" {
			t.Fatal("this test runs a peer as another uid, which needs root; CI runs as root")
		}
		t.Skip("needs root to run a peer as another uid")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv (util-linux) is needed: %v", err)
	}
	agent := agenttest.Start(t, "--socket-mode", "0666")
	// nobody must reach the socket and the test binary.
	for _, dir := range []string{filepath.Dir(agent.Dir), agent.Dir, filepath.Dir(agent.Socket)} {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	binDir := t.TempDir()
	if err := os.Chmod(filepath.Dir(binDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(binDir, 0o755); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(binDir, "peer.test")
	if err := copyFile(self, bin); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(setpriv, "--reuid", "65534", "--regid", "65534", "--clear-groups", bin, "-test.run", "^TestHelperRefusedPeer$", "-test.v")
	cmd.Env = append(os.Environ(), "OPMON_GO_TEST_PEER_SOCKET="+agent.Socket)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("the peer run as nobody: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}

// TestHelperRefusedPeer is the refused peer's side of the test above; it does nothing
// unless that test runs it.
func TestHelperRefusedPeer(t *testing.T) {
	socket := os.Getenv("OPMON_GO_TEST_PEER_SOCKET")
	if socket == "" {
		return
	}
	_, err := opmon.Connect(context.Background(), socket, opmon.WithConnectTimeout(agenttest.ConnectTimeout))
	var rpc *opmon.RPCError
	if !errors.As(err, &rpc) || rpc.Code != opmon.CodeRefused || rpc.HTTPStatus != 403 {
		t.Fatalf("connect as uid %d: %#v", os.Geteuid(), err)
	}
	fmt.Println("refused:", err)
}

func copyFile(from, to string) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

// An error's data is kept as sent, whatever its shape: here a snapshotter's
// `data: {"retryable": true, …}`, from a real HTTP server on a Unix socket (the agent's
// own data, a wrong-phase error's, is read in TestSnapshottersServersAndCancel).
func TestAnErrorsDataIsKeptAsSent(t *testing.T) {
	socket := filepath.Join(t.TempDir(), "peer.sock")
	listener, err := net.Listen("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	server := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, `{"jsonrpc":"2.0","id":1,"error":{"code":2003,"message":"backend busy","data":{"retryable":true,"after":"1s"}}}`)
	})}
	go func() { _ = server.Serve(listener) }()
	defer server.Close()
	client := opmon.New(socket)
	defer client.Close()
	err = client.Call(context.Background(), "operation.progress", map[string]string{"operationId": "x"}, nil)
	var rpc *opmon.RPCError
	if !errors.As(err, &rpc) || rpc.Code != 2003 || rpc.Message != "backend busy" || string(rpc.Data) != `{"retryable":true,"after":"1s"}` {
		t.Fatalf("%#v", err)
	}
}
