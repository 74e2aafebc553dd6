package opmon_test

import (
	"context"
	"errors"
	"fmt"

	opmon "opmon/client"
)

// The README's snippets are the bodies of these functions (readme_test.go checks it),
// so they compile. Without an Output comment they are built, not run.

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
