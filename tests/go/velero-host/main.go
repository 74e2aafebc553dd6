// A stand-in for Velero's server in opmon's tests: it runs a plugin binary the way
// Velero's plugin manager does (pkg/plugin/clientmgmt: hashicorp go-plugin, Velero's
// handshake, gRPC, the plugin lister, a BackupItemAction v2 or RestoreItemAction v2
// dispensed by kind and called with the plugin's name) and follows one item operation
// the way Velero's backup operations controller does (Progress every interval until
// completed; a Progress error fails the operation; Cancel once the Backup's
// itemOperationTimeout has passed since the operation was created).
//
// It prints one JSON object per line on stdout: what it listed, AppliesTo, Execute,
// each Progress, and the operation's end as Velero records it.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"time"

	hclog "github.com/hashicorp/go-hclog"
	plugin "github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"opmontest/generated"
	v2 "opmontest/v2"
)

var out = json.NewEncoder(os.Stdout)

func emit(event string, fields map[string]interface{}) {
	if fields == nil {
		fields = map[string]interface{}{}
	}
	fields["event"] = event
	_ = out.Encode(fields)
}

func fail(format string, args ...interface{}) {
	emit("hostError", map[string]interface{}{"error": fmt.Sprintf(format, args...)})
	os.Exit(2)
}

// A go-plugin plugin for one of Velero's kinds, client side only.
type clientPlugin struct {
	plugin.NetRPCUnsupportedPlugin
	dial func(*grpc.ClientConn) interface{}
}

func (p clientPlugin) GRPCServer(*plugin.GRPCBroker, *grpc.Server) error {
	return fmt.Errorf("client only")
}

func (p clientPlugin) GRPCClient(_ context.Context, _ *plugin.GRPCBroker, c *grpc.ClientConn) (interface{}, error) {
	return p.dial(c), nil
}

// The error Velero records: the status's message (Velero's fromGRPCError).
func message(err error) string {
	if s, ok := status.FromError(err); ok {
		return s.Message()
	}
	return err.Error()
}

func timeOf(t *generated.Timestamp) interface{} {
	if t == nil || t.Seconds == -62135596800 {
		return nil // Go's zero time: Velero leaves the field unset
	}
	return time.Unix(t.Seconds, int64(t.Nanos)).UTC().Format(time.RFC3339Nano)
}

func main() {
	binary := flag.String("plugin", "", "the plugin binary, as Velero finds it in /plugins")
	name := flag.String("name", "", "the plugin name to dispense")
	restore := flag.Bool("restore", false, "RestoreItemAction v2 instead of BackupItemAction v2")
	owner := flag.String("owner", "b1", "the Backup's or Restore's name")
	uid := flag.String("uid", "uid-b1", "its uid")
	item := flag.String("item", "", "the PVC's name (the test plugin makes it the operation ID)")
	resume := flag.String("resume", "", "skip Execute and follow this operation ID (Velero restarted)")
	interval := flag.Duration("interval", 100*time.Millisecond, "between Progress calls (Velero: 10s)")
	timeout := flag.Duration("timeout", time.Minute, "the Backup's itemOperationTimeout")
	created := flag.String("created", "", "when the operation was created (RFC 3339), with -resume")
	polls := flag.Int("polls", 0, "stop after this many Progress calls, as a Velero that restarts (0: never)")
	executeOnly := flag.Bool("execute-only", false, "stop after Execute, as a Velero that restarts while the backup is InProgress")
	flag.Parse()

	kind, ownerKind := "BackupItemActionV2", "Backup"
	if *restore {
		kind, ownerKind = "RestoreItemActionV2", "Restore"
	}
	plugins := map[string]plugin.Plugin{
		"PluginLister": clientPlugin{dial: func(c *grpc.ClientConn) interface{} { return generated.NewPluginListerClient(c) }},
		"BackupItemActionV2": clientPlugin{dial: func(c *grpc.ClientConn) interface{} {
			return v2.NewBackupItemActionClient(c)
		}},
		"RestoreItemActionV2": clientPlugin{dial: func(c *grpc.ClientConn) interface{} {
			return v2.NewRestoreItemActionClient(c)
		}},
	}
	// Velero passes its own flags to every plugin.
	cmd := exec.Command(*binary, "--log-level", "info", "--features=")
	client := plugin.NewClient(&plugin.ClientConfig{
		HandshakeConfig: plugin.HandshakeConfig{
			ProtocolVersion:  2,
			MagicCookieKey:   "VELERO_PLUGIN",
			MagicCookieValue: "hello",
		},
		AllowedProtocols: []plugin.Protocol{plugin.ProtocolGRPC},
		Plugins:          plugins,
		Cmd:              cmd,
		Logger:           hclog.New(&hclog.LoggerOptions{Output: os.Stderr, Level: hclog.Debug}),
	})
	defer client.Kill()
	rpc, err := client.Client()
	if err != nil {
		fail("starting the plugin: %v", err)
	}
	raw, err := rpc.Dispense("PluginLister")
	if err != nil {
		fail("dispensing the lister: %v", err)
	}
	listed, err := raw.(generated.PluginListerClient).ListPlugins(context.Background(), &generated.Empty{})
	if err != nil {
		fail("listing plugins: %s", message(err))
	}
	for _, p := range listed.Plugins {
		emit("listed", map[string]interface{}{"kind": p.Kind, "name": p.Name, "command": p.Command})
	}
	raw, err = rpc.Dispense(kind)
	if err != nil {
		fail("dispensing %s: %v", kind, err)
	}

	ownerJSON, _ := json.Marshal(map[string]interface{}{
		"apiVersion": "velero.io/v1", "kind": ownerKind,
		"metadata": map[string]interface{}{"name": *owner, "namespace": "velero", "uid": *uid},
		"spec":     map[string]interface{}{"itemOperationTimeout": timeout.String()},
	})
	itemJSON, _ := json.Marshal(map[string]interface{}{
		"apiVersion": "v1", "kind": "PersistentVolumeClaim",
		"metadata": map[string]interface{}{"name": *item, "namespace": "app"},
	})
	ctx := context.Background()
	var progress func(id string) (*generated.OperationProgress, error)
	var cancel func(id string) error
	var operationID string
	started := time.Now()
	if *created != "" {
		if t, err := time.Parse(time.RFC3339Nano, *created); err == nil {
			started = t
		}
	}
	if *restore {
		c := raw.(v2.RestoreItemActionClient)
		progress = func(id string) (*generated.OperationProgress, error) {
			r, err := c.Progress(ctx, &v2.RestoreItemActionProgressRequest{Plugin: *name, OperationID: id, Restore: ownerJSON})
			if err != nil {
				return nil, err
			}
			return r.Progress, nil
		}
		cancel = func(id string) error {
			_, err := c.Cancel(ctx, &v2.RestoreItemActionCancelRequest{Plugin: *name, OperationID: id, Restore: ownerJSON})
			return err
		}
		if *resume == "" {
			a, err := c.AppliesTo(ctx, &v2.RestoreItemActionAppliesToRequest{Plugin: *name})
			if err != nil {
				fail("AppliesTo: %s", message(err))
			}
			emit("appliesTo", map[string]interface{}{"includedResources": a.ResourceSelector.IncludedResources})
			r, err := c.Execute(ctx, &v2.RestoreItemActionExecuteRequest{Plugin: *name, Item: itemJSON, Restore: ownerJSON, ItemFromBackup: itemJSON})
			if err != nil {
				emit("executeFailed", map[string]interface{}{"error": message(err)})
				return
			}
			operationID = r.OperationID
			emit("executed", map[string]interface{}{"operationID": r.OperationID, "item": string(r.Item)})
		}
	} else {
		c := raw.(v2.BackupItemActionClient)
		progress = func(id string) (*generated.OperationProgress, error) {
			r, err := c.Progress(ctx, &v2.BackupItemActionProgressRequest{Plugin: *name, OperationID: id, Backup: ownerJSON})
			if err != nil {
				return nil, err
			}
			return r.Progress, nil
		}
		cancel = func(id string) error {
			_, err := c.Cancel(ctx, &v2.BackupItemActionCancelRequest{Plugin: *name, OperationID: id, Backup: ownerJSON})
			return err
		}
		if *resume == "" {
			a, err := c.AppliesTo(ctx, &v2.BackupItemActionAppliesToRequest{Plugin: *name})
			if err != nil {
				fail("AppliesTo: %s", message(err))
			}
			emit("appliesTo", map[string]interface{}{"includedResources": a.ResourceSelector.IncludedResources})
			r, err := c.Execute(ctx, &v2.ExecuteRequest{Plugin: *name, Item: itemJSON, Backup: ownerJSON})
			if err != nil {
				emit("executeFailed", map[string]interface{}{"error": message(err)})
				return
			}
			operationID = r.OperationID
			var post []string
			for _, p := range r.PostOperationItems {
				post = append(post, p.Resource+"/"+p.Namespace+"/"+p.Name)
			}
			emit("executed", map[string]interface{}{"operationID": r.OperationID, "item": string(r.Item), "postOperationItems": post})
		}
	}
	if *executeOnly {
		emit("stopped", map[string]interface{}{"operationID": operationID})
		return
	}
	if *resume != "" {
		operationID = *resume
	}
	if operationID == "" {
		return // a synchronous action: Velero has nothing to follow
	}
	for {
		p, err := progress(operationID)
		if err != nil {
			// Velero: the operation is Failed with the error.
			emit("failed", map[string]interface{}{"operationID": operationID, "error": message(err), "by": "progressError"})
			return
		}
		emit("progress", map[string]interface{}{
			"completed": p.Completed, "err": p.Err, "nCompleted": p.NCompleted, "nTotal": p.NTotal,
			"operationUnits": p.OperationUnits, "description": p.Description,
			"started": timeOf(p.Started), "updated": timeOf(p.Updated),
		})
		if p.Completed {
			if p.Err != "" {
				emit("failed", map[string]interface{}{"operationID": operationID, "error": p.Err, "by": "plugin"})
			} else {
				emit("completed", map[string]interface{}{"operationID": operationID})
			}
			return
		}
		if *polls > 0 {
			if *polls--; *polls == 0 {
				emit("stopped", map[string]interface{}{"operationID": operationID, "created": started.UTC().Format(time.RFC3339Nano)})
				return
			}
		}
		if started.Add(*timeout).Before(time.Now()) {
			err := cancel(operationID)
			fields := map[string]interface{}{"operationID": operationID, "error": "Asynchronous action timed out", "by": "timeout"}
			if err != nil {
				fields["cancelError"] = message(err)
			}
			emit("failed", fields)
			return
		}
		time.Sleep(*interval)
	}
}
