package opmon_test

import (
	"context"
	"testing"
	"time"

	opmon "opmon/client"
	"opmon/client/internal/agenttest"
)

// fixture is a real agent, a real socket snapshotter registered for
// agenttest.Plugin, and a client.
type fixture struct {
	agent       *agenttest.Agent
	snapshotter *agenttest.Snapshotter
	client      *opmon.Client
}

func newFixture(t *testing.T, extra ...string) *fixture {
	t.Helper()
	agent := agenttest.Start(t, extra...)
	snapshotter := agenttest.StartSnapshotter(t)
	client, err := opmon.Connect(context.Background(), agent.Socket, opmon.WithConnectTimeout(agenttest.ConnectTimeout))
	if err != nil {
		t.Fatalf("connecting: %v\n%s", err, agent.LogText())
	}
	t.Cleanup(client.Close)
	socket := snapshotter.Socket
	if _, err := client.SnapshotterRegister(context.Background(), opmon.Snapshotter{
		Name: agenttest.Plugin, APIVersion: opmon.APIv2, Socket: &socket,
	}); err != nil {
		t.Fatalf("registering the snapshotter: %v", err)
	}
	return &fixture{agent: agent, snapshotter: snapshotter, client: client}
}

// ctx is a context for one test step; its deadline only bounds a broken run.
func ctx(t *testing.T) context.Context {
	c, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return c
}

// op is an operation of agenttest.Plugin on PVC app/<item>.
func op(id, item string) opmon.NewOperation {
	return opmon.NewOperation{
		Plugin:      opmon.PluginRef{Kind: opmon.BackupItemAction, Name: agenttest.Plugin},
		Resource:    opmon.ResourceIdentifier{Resource: "persistentvolumeclaims", Namespace: "app", Name: item},
		OperationID: id,
	}
}

// startWith starts backup name and adds ops.
func startWith(t *testing.T, f *fixture, name string, ops ...opmon.NewOperation) {
	t.Helper()
	backups := f.client.Backups()
	if _, err := backups.Start(ctx(t), opmon.StartParams{Name: name, UID: "uid-" + name}); err != nil {
		t.Fatal(err)
	}
	if len(ops) > 0 {
		if _, err := backups.AddOperations(ctx(t), opmon.AddOperationsParams{Name: name, Operations: ops}); err != nil {
			t.Fatal(err)
		}
	}
}
