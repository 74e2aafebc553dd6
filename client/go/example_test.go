package opmon_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"time"

	opmon "opmon/client"
)

// The README's snippets are the bodies of these functions (readme_test.go checks it),
// so they compile. Without an Output comment they are built, not run.

func Example() {
	ctx := context.Background()
	client, err := opmon.Connect(ctx, opmon.DefaultSocketPath(), opmon.WithCallTimeout(2*time.Minute))
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close()
	backups := client.Backups()

	_, err = backups.Start(ctx, opmon.StartParams{Name: "nightly-1", UID: "3f5c9a1e"})
	if err != nil {
		log.Fatal(err)
	}
	_, err = backups.AddOperations(ctx, opmon.AddOperationsParams{Name: "nightly-1", Operations: []opmon.NewOperation{{
		Plugin:      opmon.PluginRef{Kind: opmon.BackupItemAction, Name: "example.io/copier"},
		Resource:    opmon.ResourceIdentifier{Resource: "persistentvolumeclaims", Namespace: "app", Name: "data"},
		OperationID: "copy-42",
	}}})
	if err != nil {
		log.Fatal(err)
	}
	owner, err := backups.EndInProgress(ctx, opmon.EndInProgressParams{Name: "nightly-1"})
	if errors.Is(err, opmon.ErrOutcomeUnknown) {
		owner, err = backups.Get(ctx, opmon.OwnerParams{Name: "nightly-1"}) // the agent restarted: read back
	}
	if err != nil {
		log.Fatal(err)
	}
	waited, err := backups.Wait(ctx, opmon.WaitParams{Name: owner.Name, Until: opmon.UntilReadyToFinalize, Timeout: opmon.D(time.Hour)})
	if err != nil {
		log.Fatal(err)
	}
	if waited.Owner.Phase.Finalizing() {
		result, err := backups.Finalize(ctx, opmon.FinalizeParams{Name: "nightly-1"})
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(result.Owner.Phase, result.ItemOperationsFile)
	}
}

func ExampleRPCError() {
	ctx := context.Background()
	client := opmon.New(opmon.DefaultSocketPath())
	_, err := client.Backups().Get(ctx, opmon.OwnerParams{Name: "nightly-1"})
	var rpc *opmon.RPCError
	switch {
	case opmon.Code(err) == opmon.CodeNotFound:
		fmt.Println("no such backup")
	case errors.As(err, &rpc):
		fmt.Println(rpc.Code, rpc.Message, string(rpc.Data))
	case err != nil:
		fmt.Println("the agent could not be reached:", err)
	}
}

// startABackup is the snippet of the repository's README.md.
func startABackup(ctx context.Context, uid string, ops []opmon.NewOperation) error {
	client, err := opmon.Connect(ctx, opmon.DefaultSocketPath())
	if err != nil {
		return err
	}
	backups := client.Backups()
	if _, err := backups.Start(ctx, opmon.StartParams{Name: "nightly-1", UID: uid}); err != nil {
		return err
	}
	if _, err := backups.AddOperations(ctx, opmon.AddOperationsParams{Name: "nightly-1", Operations: ops}); err != nil {
		return err
	}
	_, err = backups.EndInProgress(ctx, opmon.EndInProgressParams{Name: "nightly-1"})
	return err
}

var _ = startABackup
