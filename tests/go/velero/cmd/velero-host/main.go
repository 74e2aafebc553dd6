// A stand-in for Velero's server in opmon's tests: it runs a plugin binary the way
// Velero's plugin manager does (pkg/plugin/clientmgmt: hashicorp go-plugin, Velero's
// handshake, gRPC, the plugin lister, a BackupItemAction v2 or RestoreItemAction v2
// dispensed by kind and called with the plugin's name) and follows one item operation
// the way Velero's backup operations controller does (Progress every interval until
// completed; a Progress error fails the operation; Cancel once the Backup's
// itemOperationTimeout has passed since the operation was created).
//
// With -delete it does what Velero's backup deletion controller does instead
// (pkg/controller/backup_deletion_controller.go, internal/delete): it dispenses every
// DeleteItemAction listed, asks each its AppliesTo, and calls Execute with the item and
// the Backup (phase Deleting) for every item of the backup a selector matches, logging
// an error and going on.
//
// It prints one JSON object per line on stdout: what it listed, AppliesTo, Execute,
// each Progress, and the operation's end as Velero records it.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"time"

	hclog "github.com/hashicorp/go-hclog"
	plugin "github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
	"google.golang.org/grpc/status"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/vmware-tanzu/velero/pkg/plugin/generated"
	biav2 "github.com/vmware-tanzu/velero/pkg/plugin/generated/backupitemaction/v2"
	riav2 "github.com/vmware-tanzu/velero/pkg/plugin/generated/restoreitemaction/v2"
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

func timeOf(t *timestamppb.Timestamp) interface{} {
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
	deleteItems := flag.String("delete", "", "delete the backup instead: its items, resource/namespace/name separated by commas")
	againUID := flag.String("again-uid", "", "then back up again under the same name with this uid, in the same process (the object deleted and made again)")
	againItem := flag.String("again-item", "done-1", "the PVC of that second backup")
	object := flag.String("object", "", "store this text as an object instead, in chunks of 5 bytes, and read it and a missing object back (the ObjectStore -name)")
	flag.Parse()

	kind, ownerKind := "BackupItemActionV2", "Backup"
	if *restore {
		kind, ownerKind = "RestoreItemActionV2", "Restore"
	}
	plugins := map[string]plugin.Plugin{
		"PluginLister": clientPlugin{dial: func(c *grpc.ClientConn) interface{} { return generated.NewPluginListerClient(c) }},
		"BackupItemActionV2": clientPlugin{dial: func(c *grpc.ClientConn) interface{} {
			return biav2.NewBackupItemActionClient(c)
		}},
		"RestoreItemActionV2": clientPlugin{dial: func(c *grpc.ClientConn) interface{} {
			return riav2.NewRestoreItemActionClient(c)
		}},
		"DeleteItemAction": clientPlugin{dial: func(c *grpc.ClientConn) interface{} {
			return generated.NewDeleteItemActionClient(c)
		}},
		"ObjectStore": clientPlugin{dial: func(c *grpc.ClientConn) interface{} {
			return generated.NewObjectStoreClient(c)
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
	if *object != "" {
		storeObject(rpc, *name, *object)
		return
	}
	if *deleteItems != "" {
		deleteBackup(rpc, listed.Plugins, *owner, *uid, *timeout, strings.Split(*deleteItems, ","))
		return
	}
	raw, err = rpc.Dispense(kind)
	if err != nil {
		fail("dispensing %s: %v", kind, err)
	}

	// One backup (restore) of Velero's, of the object with uid `uid`.
	backUp := func(uid, item string, executeOnly bool) {
		ownerJSON, _ := json.Marshal(map[string]interface{}{
			"apiVersion": "velero.io/v1", "kind": ownerKind,
			"metadata": map[string]interface{}{"name": *owner, "namespace": "velero", "uid": uid},
			"spec":     map[string]interface{}{"itemOperationTimeout": timeout.String()},
		})
		itemJSON, _ := json.Marshal(map[string]interface{}{
			"apiVersion": "v1", "kind": "PersistentVolumeClaim",
			"metadata": map[string]interface{}{"name": item, "namespace": "app"},
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
			c := raw.(riav2.RestoreItemActionClient)
			progress = func(id string) (*generated.OperationProgress, error) {
				r, err := c.Progress(ctx, &riav2.RestoreItemActionProgressRequest{Plugin: *name, OperationID: id, Restore: ownerJSON})
				if err != nil {
					return nil, err
				}
				return r.Progress, nil
			}
			cancel = func(id string) error {
				_, err := c.Cancel(ctx, &riav2.RestoreItemActionCancelRequest{Plugin: *name, OperationID: id, Restore: ownerJSON})
				return err
			}
			if *resume == "" {
				a, err := c.AppliesTo(ctx, &riav2.RestoreItemActionAppliesToRequest{Plugin: *name})
				if err != nil {
					fail("AppliesTo: %s", message(err))
				}
				emit("appliesTo", map[string]interface{}{"includedResources": a.ResourceSelector.IncludedResources})
				r, err := c.Execute(ctx, &riav2.RestoreItemActionExecuteRequest{Plugin: *name, Item: itemJSON, Restore: ownerJSON, ItemFromBackup: itemJSON})
				if err != nil {
					emit("executeFailed", map[string]interface{}{"error": message(err)})
					return
				}
				operationID = r.OperationID
				emit("executed", map[string]interface{}{"operationID": r.OperationID, "item": string(r.Item)})
			}
		} else {
			c := raw.(biav2.BackupItemActionClient)
			progress = func(id string) (*generated.OperationProgress, error) {
				r, err := c.Progress(ctx, &biav2.BackupItemActionProgressRequest{Plugin: *name, OperationID: id, Backup: ownerJSON})
				if err != nil {
					return nil, err
				}
				return r.Progress, nil
			}
			cancel = func(id string) error {
				_, err := c.Cancel(ctx, &biav2.BackupItemActionCancelRequest{Plugin: *name, OperationID: id, Backup: ownerJSON})
				return err
			}
			if *resume == "" {
				a, err := c.AppliesTo(ctx, &biav2.BackupItemActionAppliesToRequest{Plugin: *name})
				if err != nil {
					fail("AppliesTo: %s", message(err))
				}
				emit("appliesTo", map[string]interface{}{"includedResources": a.ResourceSelector.IncludedResources})
				r, err := c.Execute(ctx, &biav2.ExecuteRequest{Plugin: *name, Item: itemJSON, Backup: ownerJSON})
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
		if executeOnly {
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
				// Velero: the operation is Failed with the error's text, err.Error()
				// (backup_operations_controller.go).
				emit("failed", map[string]interface{}{"operationID": operationID, "error": err.Error(), "by": "progressError"})
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
	backUp(*uid, *item, *executeOnly)
	if *againUID != "" {
		// The object was deleted and made again under its name: a new uid, in the same
		// Velero process (the stand-in's same instance).
		emit("again", map[string]interface{}{"uid": *againUID})
		backUp(*againUID, *againItem, false)
	}
}

// The kinds of the resources the tests' backups hold.
var kinds = map[string]string{"persistentvolumeclaims": "PersistentVolumeClaim", "pods": "Pod", "configmaps": "ConfigMap"}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s || x == "*" {
			return true
		}
	}
	return false
}

// deleteBackup: the DeleteItemAction part of Velero's backup deletion.
func deleteBackup(rpc plugin.ClientProtocol, listed []*generated.PluginIdentifier, name, uid string, timeout time.Duration, items []string) {
	backupJSON, _ := json.Marshal(map[string]interface{}{
		"apiVersion": "velero.io/v1", "kind": "Backup",
		"metadata": map[string]interface{}{"name": name, "namespace": "velero", "uid": uid},
		"spec":     map[string]interface{}{"itemOperationTimeout": timeout.String()},
		"status":   map[string]interface{}{"phase": "Deleting"},
	})
	ctx := context.Background()
	raw, err := rpc.Dispense("DeleteItemAction")
	if err != nil {
		fail("dispensing DeleteItemAction: %v", err)
	}
	c := raw.(generated.DeleteItemActionClient)
	for _, p := range listed {
		if p.Kind != "DeleteItemAction" {
			continue
		}
		a, err := c.AppliesTo(ctx, &generated.DeleteItemActionAppliesToRequest{Plugin: p.Name})
		if err != nil {
			fail("AppliesTo of %s: %s", p.Name, message(err))
		}
		selector := a.ResourceSelector
		if selector == nil {
			selector = &generated.ResourceSelector{}
		}
		emit("deleteAppliesTo", map[string]interface{}{"name": p.Name, "includedResources": selector.IncludedResources})
		for _, item := range items {
			parts := strings.SplitN(item, "/", 3)
			if len(parts) != 3 {
				fail("an item is resource/namespace/name: %q", item)
			}
			if len(selector.IncludedResources) > 0 && !contains(selector.IncludedResources, parts[0]) {
				continue
			}
			if len(selector.IncludedNamespaces) > 0 && !contains(selector.IncludedNamespaces, parts[1]) {
				continue
			}
			itemJSON, _ := json.Marshal(map[string]interface{}{
				"apiVersion": "v1", "kind": kinds[parts[0]],
				"metadata": map[string]interface{}{"name": parts[2], "namespace": parts[1]},
			})
			fields := map[string]interface{}{"name": p.Name, "item": item}
			if _, err := c.Execute(ctx, &generated.DeleteItemActionExecuteRequest{Plugin: p.Name, Item: itemJSON, Backup: backupJSON}); err != nil {
				// Velero logs a plugin's error and goes on with the deletion.
				fields["error"] = message(err)
			}
			emit("deleteExecuted", fields)
		}
	}
}

// storeObject: what Velero's backup store does with an ObjectStore: Init, PutObject
// (the body streamed in chunks), GetObject (read back as streamed).
func storeObject(rpc plugin.ClientProtocol, name, text string) {
	ctx := context.Background()
	raw, err := rpc.Dispense("ObjectStore")
	if err != nil {
		fail("dispensing ObjectStore: %v", err)
	}
	c := raw.(generated.ObjectStoreClient)
	if _, err := c.Init(ctx, &generated.ObjectStoreInitRequest{Plugin: name, Config: map[string]string{"bucket": "b"}}); err != nil {
		fail("Init: %s", message(err))
	}
	put, err := c.PutObject(ctx)
	if err != nil {
		fail("PutObject: %s", message(err))
	}
	body := []byte(text)
	for len(body) > 0 {
		n := 5
		if n > len(body) {
			n = len(body)
		}
		if err := put.Send(&generated.PutObjectRequest{Plugin: name, Bucket: "b", Key: "k/1", Body: body[:n]}); err != nil {
			fail("PutObject: %s", message(err))
		}
		body = body[n:]
	}
	if _, err := put.CloseAndRecv(); err != nil {
		fail("PutObject: %s", message(err))
	}
	for _, key := range []string{"k/1", "k/missing"} {
		get, err := c.GetObject(ctx, &generated.GetObjectRequest{Plugin: name, Bucket: "b", Key: key})
		if err != nil {
			fail("GetObject: %s", message(err))
		}
		var data []byte
		chunks := 0
		fields := map[string]interface{}{"key": key}
		for {
			b, err := get.Recv()
			if err == io.EOF {
				break
			}
			if err != nil {
				fields["error"] = message(err)
				break
			}
			data = append(data, b.Data...)
			chunks++
		}
		fields["data"], fields["chunks"] = string(data), chunks
		emit("object", fields)
	}
}
