// Command backupserver is a small backup server on the opmon Go client: it starts a
// backup, adds the operations its plugins returned, ends InProgress, waits for the
// operations to finish and finalizes.
//
//	backupserver [-socket PATH] [-plugin NAME] [-plugin-kind KIND] [-connect-timeout 5s] [-timeout 1h]
//	    BACKUP RESOURCE/NAMESPACE/NAME=OPERATION_ID...
//
// Each argument after the backup's name is an item and the operation ID the plugin
// returned for it (NAMESPACE empty for a cluster-scoped item: pv//pv-1=op-7). A restart
// of the agent in the middle changes nothing: the client repeats what is safe to
// repeat, and reads back after an endInProgress whose answer was lost.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	opmon "opmon/client"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "backupserver:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string, out io.Writer) error {
	flags := flag.NewFlagSet("backupserver", flag.ContinueOnError)
	socket := flags.String("socket", opmon.DefaultSocketPath(), "the agent's socket")
	plugin := flags.String("plugin", "example.io/qemu-img", "the plugin that returned the operations")
	kind := flags.String("plugin-kind", string(opmon.VolumeSnapshotter), "BackupItemAction, RestoreItemAction or VolumeSnapshotter")
	connectTimeout := flags.Duration("connect-timeout", 5*time.Second, "how long the agent may take to answer the first call")
	timeout := flags.Duration("timeout", time.Hour, "how long to wait for the operations")
	if err := flags.Parse(args); err != nil {
		return err
	}
	if flags.NArg() < 1 {
		return errors.New("usage: backupserver [flags] BACKUP RESOURCE/NAMESPACE/NAME=OPERATION_ID...")
	}
	name := flags.Arg(0)
	var operations []opmon.NewOperation
	for _, arg := range flags.Args()[1:] {
		item, id, ok := strings.Cut(arg, "=")
		parts := strings.Split(item, "/")
		if !ok || len(parts) != 3 || id == "" {
			return fmt.Errorf("%q: want RESOURCE/NAMESPACE/NAME=OPERATION_ID", arg)
		}
		operations = append(operations, opmon.NewOperation{
			Plugin:      opmon.PluginRef{Kind: opmon.PluginKind(*kind), Name: *plugin},
			Resource:    opmon.ResourceIdentifier{Resource: parts[0], Namespace: parts[1], Name: parts[2]},
			OperationID: id,
		})
	}

	client, err := opmon.Connect(ctx, *socket, opmon.WithConnectTimeout(*connectTimeout))
	if err != nil {
		return err
	}
	defer client.Close()
	backups := client.Backups()

	// A backup server names itself and its instance, so that after its own restart
	// server.started fails what the previous instance left InProgress.
	server := opmon.ServerRef{Name: "example-backup-server", Instance: fmt.Sprintf("pid-%d", os.Getpid())}
	if _, err := client.ServerStarted(ctx, opmon.ServerStartedParams{Name: server.Name, Instance: server.Instance}); err != nil {
		return err
	}
	uid := fmt.Sprintf("%s-%d", name, time.Now().UnixNano())
	if _, err := backups.Start(ctx, opmon.StartParams{Name: name, UID: uid, Server: &server}); err != nil {
		return err
	}
	added, err := backups.AddOperations(ctx, opmon.AddOperationsParams{Name: name, Operations: operations})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "backup %s: %d operations added\n", name, added.Added)

	owner, err := backups.EndInProgress(ctx, opmon.EndInProgressParams{Name: name})
	if errors.Is(err, opmon.ErrOutcomeUnknown) {
		// The agent went away with the call: read back, and end it if it was not.
		if owner, err = backups.Get(ctx, opmon.OwnerParams{Name: name}); err == nil && owner.Phase == opmon.PhaseInProgress {
			owner, err = backups.EndInProgress(ctx, opmon.EndInProgressParams{Name: name})
		}
	}
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "backup %s: %s\n", name, owner.Phase)

	waited, err := backups.Wait(ctx, opmon.WaitParams{Name: name, Until: opmon.UntilReadyToFinalize, Timeout: opmon.D(*timeout)})
	if err != nil {
		return err
	}
	if waited.TimedOut {
		return fmt.Errorf("backup %s is still %s after %v", name, waited.Owner.Phase, *timeout)
	}
	if !waited.Owner.Phase.Finalizing() {
		return fmt.Errorf("backup %s ended %s: %s", name, waited.Owner.Phase, waited.Owner.FailureReason)
	}
	final, err := backups.Finalize(ctx, opmon.FinalizeParams{Name: name})
	if err != nil {
		return err
	}
	fmt.Fprintf(out, "backup %s: %s, %d of %d operations completed; item operations in %s\n",
		name, final.Owner.Phase, final.Owner.OperationsCompleted, final.Owner.OperationsAttempted, final.ItemOperationsFile)
	return nil
}
