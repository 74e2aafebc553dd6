// Command nightly is the README's example: a backup server's part of the quick start.
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	opmon "opmon/client"
)

// name is this example's backup; the Rust client's example makes nightly-rust.
const name = "nightly-go"

func main() {
	log.SetFlags(0)
	log.SetPrefix("backup " + name + ": ")
	if len(os.Args) != 2 {
		log.Fatal("usage: nightly OPERATION_ID (what qemu-img-snapshotter start printed)")
	}
	ctx := context.Background()
	client, err := opmon.Connect(ctx, opmon.DefaultSocketPath(), opmon.WithCallTimeout(2*time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	backups := client.Backups()

	_, err = backups.Start(ctx, opmon.StartParams{Name: name, UID: "5d7a0c3e"})
	if err != nil {
		log.Fatal(err)
	}
	// The operation a plugin started, which the snapshotter registered for the plugin's
	// name (the quick start's qemu-img-snapshotter) reports on.
	_, err = backups.AddOperations(ctx, opmon.AddOperationsParams{Name: name, Operations: []opmon.NewOperation{{
		Plugin:      opmon.PluginRef{Kind: opmon.VolumeSnapshotter, Name: "example.io/qemu-img"},
		Resource:    opmon.ResourceIdentifier{Resource: "persistentvolumeclaims", Namespace: "vms", Name: "vm-3-disk"},
		OperationID: os.Args[1],
	}}})
	if err != nil {
		log.Fatal(err)
	}
	owner, err := backups.EndInProgress(ctx, opmon.EndInProgressParams{Name: name})
	if errors.Is(err, opmon.ErrOutcomeUnknown) {
		owner, err = backups.Get(ctx, opmon.OwnerParams{Name: name}) // the agent restarted: read back
	}
	if err != nil {
		log.Fatal(err)
	}
	waited, err := backups.Wait(ctx, opmon.WaitParams{Name: owner.Name, Until: opmon.UntilReadyToFinalize, Timeout: opmon.D(time.Hour)})
	if err != nil {
		log.Fatal(err)
	}
	if !waited.Owner.Phase.Finalizing() {
		log.Fatalf("not ready to finalize: %s %s", waited.Owner.Phase, waited.Owner.FailureReason)
	}
	result, err := backups.Finalize(ctx, opmon.FinalizeParams{Name: name})
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println(result.Owner.Name, "is", result.Owner.Phase)
}
