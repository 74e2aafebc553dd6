// A Velero-style plugin binary for opmon's tests, served by hashicorp go-plugin over
// gRPC as Velero's plugin framework serves one: the same handshake config, the same
// gRPC service names, one binary serving several plugin names picked by the request's
// `plugin`, errors as gRPC Unknown with a generated.Stack detail, and Go's zero time for
// an unknown `started`.
//
// What an operation does is named by its ID's first word (see progress). State lives
// in files under $OPMON_TEST_STATE, so it outlives a crash of the plugin or a restart
// of the agent; every call is appended to $OPMON_TEST_STATE/journal.
package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	plugin "github.com/hashicorp/go-plugin"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"opmontest/generated"
	v2 "opmontest/v2"
)

// Velero's framework.Handshake().
var handshake = plugin.HandshakeConfig{
	ProtocolVersion:  2,
	MagicCookieKey:   "VELERO_PLUGIN",
	MagicCookieValue: "hello",
}

// The plugins this binary serves, by kind, as Velero's plugin lister names them.
var served = []*generated.PluginIdentifier{
	{Command: os.Args[0], Kind: "BackupItemActionV2", Name: "example.io/backup-a"},
	{Command: os.Args[0], Kind: "BackupItemActionV2", Name: "example.io/backup-b"},
	{Command: os.Args[0], Kind: "RestoreItemActionV2", Name: "example.io/restore-a"},
	{Command: os.Args[0], Kind: "DeleteItemAction", Name: "example.io/delete-a"},
	{Command: os.Args[0], Kind: "ObjectStore", Name: "example.io/store"},
}

var journalLock sync.Mutex

// The process's own stdout and stderr, kept before plugin.Serve swaps os.Stdout and
// os.Stderr for pipes: a logger made before serving (as Velero's framework makes its
// logrus logger) writes here. go-plugin 1.0.1 never reads the pipes it swaps in, in any
// host, so the noise goes where a plugin's logger writes.
var stdout, stderr = os.Stdout, os.Stderr

func state(name string) string { return filepath.Join(os.Getenv("OPMON_TEST_STATE"), name) }

// record appends one line to the journal.
func record(format string, args ...interface{}) {
	journalLock.Lock()
	defer journalLock.Unlock()
	f, err := os.OpenFile(state("journal"), os.O_APPEND|os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		return
	}
	defer f.Close()
	fmt.Fprintf(f, format+"\n", args...)
}

// count increments and returns the counter file `name`.
func count(name string) int {
	n := 0
	if b, err := os.ReadFile(state(name)); err == nil {
		n, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	n++
	_ = os.WriteFile(state(name), []byte(strconv.Itoa(n)), 0o644)
	return n
}

// velerError is how Velero's framework returns a plugin's error (common.NewGRPCError).
func veleroError(message string) error {
	st, err := status.New(codes.Unknown, message).WithDetails(&generated.Stack{
		Frames: []*generated.StackFrame{{File: "main.go", Line: 1, Function: "main.progress"}},
	})
	if err != nil {
		return status.Error(codes.Unknown, message)
	}
	return st.Err()
}

func servedAs(name, kind string) bool {
	for _, p := range served {
		if p.Name == name && p.Kind == kind {
			return true
		}
	}
	return false
}

func now() *generated.Timestamp {
	t := time.Now()
	return &generated.Timestamp{Seconds: t.Unix(), Nanos: int32(t.Nanosecond())}
}

// Go's zero time.Time as timestamppb.New encodes it: what Velero sends for "unset".
var goZero = &generated.Timestamp{Seconds: -62135596800}

// progress answers for operation `id` of plugin `name`, owner `owner` (its JSON).
//
//	done-…       completed at once, `started` left at Go's zero time
//	steps-N-…    N polls to complete, nCompleted counting up
//	fail-…       completed with an error of its own (`err`)
//	error-…      a gRPC error, as a plugin's error comes back from Velero's framework
//	code-…       a gRPC error of code FailedPrecondition
//	stall-…      in progress, never changing (a stall timeout cancels it)
//	block-…      never answers (the call's deadline ends it)
//	crash-…      the plugin exits at its first poll, completes after its restart
//	noisy-N-…    N KiB written to stdout and stderr each poll, then complete
//	flaky-N-…    gRPC Aborted (transient) for N polls, then complete
func progress(ctx context.Context, kind, name, id string, owner []byte) (*generated.OperationProgress, error) {
	var object struct {
		Kind     string `json:"kind"`
		Metadata struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(owner, &object); err != nil {
		return nil, veleroError("decoding the owner: " + err.Error())
	}
	record("progress %s %s %s %s/%s", kind, name, id, object.Kind, object.Metadata.Name)
	if !servedAs(name, kind) {
		return nil, veleroError(fmt.Sprintf("%s is not a %s plugin of this binary", name, kind))
	}
	words := strings.Split(id, "-")
	polls := count("polls-" + id)
	switch words[0] {
	case "done":
		return &generated.OperationProgress{Completed: true, NCompleted: 1, NTotal: 1, Started: goZero, Updated: now()}, nil
	case "steps":
		n, _ := strconv.Atoi(words[1])
		return &generated.OperationProgress{
			Completed: polls >= n, NCompleted: int64(polls), NTotal: int64(n),
			OperationUnits: "steps", Description: fmt.Sprintf("step %d of %d", polls, n),
			Started: now(), Updated: now(),
		}, nil
	case "fail":
		return &generated.OperationProgress{Completed: true, Err: "the copy failed: disk full", Started: now()}, nil
	case "error":
		return nil, veleroError("no snapshot named " + id)
	case "code":
		return nil, status.Error(codes.FailedPrecondition, "not ready for "+id)
	case "flaky":
		// Aborted, a transient error, for the first N polls; then complete.
		n, _ := strconv.Atoi(words[1])
		if polls <= n {
			return nil, status.Error(codes.Aborted, fmt.Sprintf("%s: snapshot busy, try again", id))
		}
		return &generated.OperationProgress{Completed: true, NCompleted: 5, NTotal: 5, OperationUnits: "GB", Started: now(), Updated: now()}, nil
	case "stall":
		return &generated.OperationProgress{NCompleted: 1, NTotal: 10, Started: &generated.Timestamp{Seconds: 1000}}, nil
	case "block":
		<-ctx.Done()
		record("deadline %s", id)
		return nil, ctx.Err()
	case "crash":
		if count("crashes-"+id) == 1 {
			record("crashing %s", id)
			os.Exit(3)
		}
		return &generated.OperationProgress{Completed: true, Started: now()}, nil
	case "noisy":
		n, _ := strconv.Atoi(words[1])
		line := strings.Repeat("x", 1023) + "\n"
		for i := 0; i < n; i++ {
			fmt.Fprint(stdout, line)
			fmt.Fprint(stderr, line)
		}
		return &generated.OperationProgress{Completed: true, Started: now()}, nil
	}
	return nil, veleroError("unknown operation " + id)
}

func cancel(kind, name, id string) error {
	record("cancel %s %s %s", kind, name, id)
	return nil
}

type backupServer struct{}

func (backupServer) Progress(ctx context.Context, r *v2.BackupItemActionProgressRequest) (*v2.BackupItemActionProgressResponse, error) {
	p, err := progress(ctx, "BackupItemActionV2", r.Plugin, r.OperationID, r.Backup)
	if err != nil {
		return nil, err
	}
	return &v2.BackupItemActionProgressResponse{Progress: p}, nil
}

func (backupServer) Cancel(ctx context.Context, r *v2.BackupItemActionCancelRequest) (*generated.Empty, error) {
	return &generated.Empty{}, cancel("BackupItemActionV2", r.Plugin, r.OperationID)
}

type restoreServer struct{}

func (restoreServer) Progress(ctx context.Context, r *v2.RestoreItemActionProgressRequest) (*v2.RestoreItemActionProgressResponse, error) {
	p, err := progress(ctx, "RestoreItemActionV2", r.Plugin, r.OperationID, r.Restore)
	if err != nil {
		return nil, err
	}
	return &v2.RestoreItemActionProgressResponse{Progress: p}, nil
}

func (restoreServer) Cancel(ctx context.Context, r *v2.RestoreItemActionCancelRequest) (*generated.Empty, error) {
	return &generated.Empty{}, cancel("RestoreItemActionV2", r.Plugin, r.OperationID)
}

type listerServer struct{}

func (listerServer) ListPlugins(context.Context, *generated.Empty) (*generated.ListPluginsResponse, error) {
	return &generated.ListPluginsResponse{Plugins: served}, nil
}

// grpcPlugin registers one service, as each of Velero's plugin kinds does.
type grpcPlugin struct {
	plugin.NetRPCUnsupportedPlugin
	register func(*grpc.Server)
}

func (p grpcPlugin) GRPCServer(_ *plugin.GRPCBroker, s *grpc.Server) error {
	p.register(s)
	return nil
}

func (grpcPlugin) GRPCClient(context.Context, *plugin.GRPCBroker, *grpc.ClientConn) (interface{}, error) {
	return nil, fmt.Errorf("server only")
}

func main() {
	// Velero passes its server flags; a plugin accepts what it does not know.
	record("started %d %s", os.Getpid(), strings.Join(os.Args[1:], " "))
	if v := os.Getenv("OPMON_TEST_EXPECT"); v != "" {
		record("env OPMON_TEST_EXPECT=%s", v)
	}
	plugin.Serve(&plugin.ServeConfig{
		HandshakeConfig: handshake,
		Plugins: map[string]plugin.Plugin{
			"PluginLister":        grpcPlugin{register: func(s *grpc.Server) { generated.RegisterPluginListerServer(s, listerServer{}) }},
			"BackupItemActionV2":  grpcPlugin{register: func(s *grpc.Server) { v2.RegisterBackupItemActionServer(s, backupServer{}) }},
			"RestoreItemActionV2": grpcPlugin{register: func(s *grpc.Server) { v2.RegisterRestoreItemActionServer(s, restoreServer{}) }},
			"DeleteItemAction":    grpcPlugin{register: func(s *grpc.Server) { generated.RegisterDeleteItemActionServer(s, deleteServer{}) }},
			"ObjectStore":         grpcPlugin{register: func(s *grpc.Server) { generated.RegisterObjectStoreServer(s, objectServer{}) }},
		},
		GRPCServer: plugin.DefaultGRPCServer,
	})
}

// AppliesTo and Execute, for the stand-in's tests: every plugin applies to PVCs, and
// Execute starts the operation named by the item's name (see progress), or none when
// the name begins with "sync-"; the item comes back with an annotation.
func appliesTo(kind, name string) (*generated.ResourceSelector, error) {
	record("appliesTo %s %s", kind, name)
	if !servedAs(name, kind) {
		return nil, veleroError(fmt.Sprintf("%s is not a %s plugin of this binary", name, kind))
	}
	return &generated.ResourceSelector{IncludedResources: []string{"persistentvolumeclaims"}}, nil
}

func execute(kind, name string, item, owner []byte) ([]byte, string, error) {
	var object struct {
		Metadata struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	var parsed map[string]interface{}
	if err := json.Unmarshal(item, &parsed); err != nil {
		return nil, "", veleroError("decoding the item: " + err.Error())
	}
	_ = json.Unmarshal(item, &object)
	record("execute %s %s %s", kind, name, object.Metadata.Name)
	if !servedAs(name, kind) {
		return nil, "", veleroError(fmt.Sprintf("%s is not a %s plugin of this binary", name, kind))
	}
	if meta, ok := parsed["metadata"].(map[string]interface{}); ok {
		meta["annotations"] = map[string]interface{}{"example.io/executed": name}
	}
	out, _ := json.Marshal(parsed)
	if strings.HasPrefix(object.Metadata.Name, "sync-") {
		return out, "", nil
	}
	return out, object.Metadata.Name, nil
}

func (backupServer) AppliesTo(_ context.Context, r *v2.BackupItemActionAppliesToRequest) (*v2.BackupItemActionAppliesToResponse, error) {
	s, err := appliesTo("BackupItemActionV2", r.Plugin)
	if err != nil {
		return nil, err
	}
	return &v2.BackupItemActionAppliesToResponse{ResourceSelector: s}, nil
}

func (backupServer) Execute(_ context.Context, r *v2.ExecuteRequest) (*v2.ExecuteResponse, error) {
	item, id, err := execute("BackupItemActionV2", r.Plugin, r.Item, r.Backup)
	if err != nil {
		return nil, err
	}
	return &v2.ExecuteResponse{Item: item, OperationID: id, PostOperationItems: []*generated.ResourceIdentifier{
		{Resource: "volumesnapshots", Namespace: "app", Name: "snap-" + id},
	}}, nil
}

func (restoreServer) AppliesTo(_ context.Context, r *v2.RestoreItemActionAppliesToRequest) (*v2.RestoreItemActionAppliesToResponse, error) {
	s, err := appliesTo("RestoreItemActionV2", r.Plugin)
	if err != nil {
		return nil, err
	}
	return &v2.RestoreItemActionAppliesToResponse{ResourceSelector: s}, nil
}

func (restoreServer) Execute(_ context.Context, r *v2.RestoreItemActionExecuteRequest) (*v2.RestoreItemActionExecuteResponse, error) {
	item, id, err := execute("RestoreItemActionV2", r.Plugin, r.Item, r.Restore)
	if err != nil {
		return nil, err
	}
	return &v2.RestoreItemActionExecuteResponse{Item: item, OperationID: id}, nil
}

// A DeleteItemAction of the original's own, which the stand-in passes on: it records
// each item and Backup it is called with.
type deleteServer struct{}

func (deleteServer) AppliesTo(_ context.Context, r *generated.DeleteItemActionAppliesToRequest) (*generated.DeleteItemActionAppliesToResponse, error) {
	s, err := appliesTo("DeleteItemAction", r.Plugin)
	if err != nil {
		return nil, err
	}
	return &generated.DeleteItemActionAppliesToResponse{ResourceSelector: s}, nil
}

func (deleteServer) Execute(_ context.Context, r *generated.DeleteItemActionExecuteRequest) (*generated.Empty, error) {
	var item, backup struct {
		Metadata struct {
			Name string `json:"name"`
		} `json:"metadata"`
	}
	if err := json.Unmarshal(r.Item, &item); err != nil {
		return nil, veleroError("decoding the item: " + err.Error())
	}
	if err := json.Unmarshal(r.Backup, &backup); err != nil {
		return nil, veleroError("decoding the backup: " + err.Error())
	}
	record("delete DeleteItemAction %s %s Backup/%s", r.Plugin, item.Metadata.Name, backup.Metadata.Name)
	if !servedAs(r.Plugin, "DeleteItemAction") {
		return nil, veleroError(fmt.Sprintf("%s is not a DeleteItemAction plugin of this binary", r.Plugin))
	}
	return &generated.Empty{}, nil
}

// An ObjectStore, the kind whose calls stream: objects are files in the state
// directory, taken in chunk by chunk and given back in chunks of 4 bytes.
type objectServer struct{}

func objectPath(bucket, key string) string {
	return state("object-" + strings.ReplaceAll(bucket+"-"+key, "/", "_"))
}

func (objectServer) Init(_ context.Context, r *generated.ObjectStoreInitRequest) (*generated.Empty, error) {
	record("init ObjectStore %s bucket=%s", r.Plugin, r.Config["bucket"])
	if !servedAs(r.Plugin, "ObjectStore") {
		return nil, veleroError(fmt.Sprintf("%s is not an ObjectStore plugin of this binary", r.Plugin))
	}
	return &generated.Empty{}, nil
}

func (objectServer) PutObject(stream generated.ObjectStore_PutObjectServer) error {
	var body []byte
	var bucket, key string
	chunks := 0
	for {
		r, err := stream.Recv()
		if err == io.EOF {
			break
		}
		if err != nil {
			return err
		}
		bucket, key = r.Bucket, r.Key
		body = append(body, r.Body...)
		chunks++
	}
	record("put ObjectStore %s/%s %d chunks %d bytes", bucket, key, chunks, len(body))
	if err := os.WriteFile(objectPath(bucket, key), body, 0o644); err != nil {
		return veleroError(err.Error())
	}
	return stream.SendAndClose(&generated.Empty{})
}

func (objectServer) GetObject(r *generated.GetObjectRequest, stream generated.ObjectStore_GetObjectServer) error {
	body, err := os.ReadFile(objectPath(r.Bucket, r.Key))
	if err != nil {
		return veleroError(fmt.Sprintf("no object %s/%s", r.Bucket, r.Key))
	}
	for len(body) > 0 {
		n := 4
		if n > len(body) {
			n = len(body)
		}
		if err := stream.Send(&generated.Bytes{Data: body[:n]}); err != nil {
			return err
		}
		body = body[n:]
	}
	return nil
}
