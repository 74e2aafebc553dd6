package main

import (
	"bytes"
	"context"
	"strings"
	"testing"
	"time"

	opmon "opmon/client"
	"opmon/client/internal/agenttest"
)

// The example, run against the real agent and a socket snapshotter that finishes the
// copy only once the backup waits for it.
func TestTheBackupServerExample(t *testing.T) {
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
	if _, err := client.SnapshotterRegister(ctx, opmon.Snapshotter{Name: agenttest.Plugin, APIVersion: opmon.APIv2, Socket: &socket}); err != nil {
		t.Fatal(err)
	}
	// The copy of gate-disk ends once the backup is waiting for it.
	go func() {
		agenttest.Eventually(time.Minute, func() bool {
			owner, err := client.Backups().Get(ctx, opmon.OwnerParams{Name: "vm-1"})
			return err == nil && owner.Phase == opmon.PhaseWaitingForPluginOperations
		})
		snapshotter.Open("gate-disk")
	}()
	var out bytes.Buffer
	err = run(ctx, []string{"-socket", agent.Socket, "-connect-timeout", agenttest.ConnectTimeout.String(), "-plugin", agenttest.Plugin,
		"vm-1", "persistentvolumeclaims/vms/vm-1-disk=gate-disk", "persistentvolumes//pv-1=done-pv"}, &out)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	t.Log(out.String())
	for _, line := range []string{
		"backup vm-1: 2 operations added",
		"backup vm-1: WaitingForPluginOperations",
		"backup vm-1: Completed, 2 of 2 operations completed; item operations in ",
	} {
		if !strings.Contains(out.String(), line) {
			t.Errorf("the output lacks %q:\n%s", line, out.String())
		}
	}
	records, err := client.Backups().ItemOperations(ctx, opmon.OwnerParams{Name: "vm-1"})
	if err != nil || len(records) != 2 {
		t.Fatalf("itemOperations: %v, %v", records, err)
	}
}
