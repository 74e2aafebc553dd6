// The Velero plugin opmon's tests run, written on Velero's plugin framework as plugin
// authors write one: one binary serving BackupItemAction v2, RestoreItemAction v2, a
// DeleteItemAction and an ObjectStore under the names below.
//
// What an operation does is named by its ID's first word (see progress); Execute starts
// the operation named by the item's name. State lives in files under $OPMON_TEST_STATE,
// so it outlives a crash of the plugin or a restart of the agent; every call is appended
// to $OPMON_TEST_STATE/journal.
package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/pkg/errors"
	"github.com/sirupsen/logrus"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"

	api "github.com/vmware-tanzu/velero/pkg/apis/velero/v1"
	"github.com/vmware-tanzu/velero/pkg/plugin/framework"
	"github.com/vmware-tanzu/velero/pkg/plugin/velero"
)

const (
	backupA  = "example.io/backup-a"
	backupB  = "example.io/backup-b"
	restoreA = "example.io/restore-a"
	deleteA  = "example.io/delete-a"
	store    = "example.io/store"
)

var journalLock sync.Mutex

// The process's own stdout and stderr, kept before go-plugin's Serve swaps os.Stdout
// and os.Stderr for pipes it forwards only to a host that asks for its stdio stream.
var stdout, stderr = os.Stdout, os.Stderr

func state(name string) string { return filepath.Join(os.Getenv("OPMON_TEST_STATE"), name) }

// record appends one line to the journal.
func record(format string, args ...any) {
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
	journalLock.Lock()
	defer journalLock.Unlock()
	n := 0
	if b, err := os.ReadFile(state(name)); err == nil {
		n, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	n++
	_ = os.WriteFile(state(name), []byte(strconv.Itoa(n)), 0o644)
	return n
}

// progress answers for operation `id` of plugin `name`, owner `owner` ("Backup/b1").
//
//	done-…       completed at once, `started` left at Go's zero time
//	steps-N-…    N polls to complete, nCompleted counting up
//	fail-…       completed with an error of its own (`err`)
//	error-…      an error, as a plugin returns one (gRPC Unknown, with its stack)
//	code-…       a gRPC error of code FailedPrecondition
//	stall-…      in progress, never changing (a stall timeout cancels it)
//	block-…      never answers (the caller's deadline ends the call)
//	crash-…      the plugin exits at its first poll, completes after its restart
//	noisy-N-…    N KiB written to stdout and stderr each poll, then complete
//	flaky-N-…    gRPC Aborted (transient) for N polls, then complete
func progress(kind, name, id, owner string) (velero.OperationProgress, error) {
	record("progress %s %s %s %s", kind, name, id, owner)
	words := strings.Split(id, "-")
	polls := count("polls-" + id)
	now := time.Now()
	switch words[0] {
	case "done":
		return velero.OperationProgress{Completed: true, NCompleted: 1, NTotal: 1, Updated: now}, nil
	case "steps":
		n, _ := strconv.Atoi(words[1])
		return velero.OperationProgress{
			Completed: polls >= n, NCompleted: int64(polls), NTotal: int64(n),
			OperationUnits: "steps", Description: fmt.Sprintf("step %d of %d", polls, n),
			Started: now, Updated: now,
		}, nil
	case "fail":
		return velero.OperationProgress{Completed: true, Err: "the copy failed: disk full", Started: now}, nil
	case "error":
		return velero.OperationProgress{}, errors.New("no snapshot named " + id)
	case "code":
		return velero.OperationProgress{}, status.Error(codes.FailedPrecondition, "not ready for "+id)
	case "flaky":
		n, _ := strconv.Atoi(words[1])
		if polls <= n {
			return velero.OperationProgress{}, status.Error(codes.Aborted, id+": snapshot busy, try again")
		}
		return velero.OperationProgress{Completed: true, NCompleted: 5, NTotal: 5, OperationUnits: "GB", Started: now, Updated: now}, nil
	case "stall":
		return velero.OperationProgress{NCompleted: 1, NTotal: 10, Started: time.Unix(1000, 0)}, nil
	case "block":
		// The framework gives a plugin no context: the call is never answered.
		select {}
	case "crash":
		if count("crashes-"+id) == 1 {
			record("crashing %s", id)
			os.Exit(3)
		}
		return velero.OperationProgress{Completed: true, Started: now}, nil
	case "noisy":
		n, _ := strconv.Atoi(words[1])
		line := strings.Repeat("x", 1023) + "\n"
		for i := 0; i < n; i++ {
			fmt.Fprint(stdout, line)
			fmt.Fprint(stderr, line)
		}
		return velero.OperationProgress{Completed: true, Started: now}, nil
	}
	return velero.OperationProgress{}, errors.New("unknown operation " + id)
}

// Every action applies to PVCs but backup-b, which applies to config maps: one
// BackupItemAction starts each PVC's operation.
func appliesTo(kind, name string) (velero.ResourceSelector, error) {
	record("appliesTo %s %s", kind, name)
	if name == backupB {
		return velero.ResourceSelector{IncludedResources: []string{"configmaps"}}, nil
	}
	return velero.ResourceSelector{IncludedResources: []string{"persistentvolumeclaims"}}, nil
}

// execute annotates the item and returns the operation its name names, or none when
// the name begins with "sync-".
func execute(kind, name string, item runtime.Unstructured) (runtime.Unstructured, string) {
	content := item.UnstructuredContent()
	meta, _ := content["metadata"].(map[string]any)
	itemName, _ := meta["name"].(string)
	record("execute %s %s %s", kind, name, itemName)
	if meta != nil {
		meta["annotations"] = map[string]any{"example.io/executed": name}
	}
	if strings.HasPrefix(itemName, "sync-") {
		return item, ""
	}
	return item, itemName
}

type backupAction struct{ name string }

func (a backupAction) Name() string { return a.name }

func (a backupAction) AppliesTo() (velero.ResourceSelector, error) {
	return appliesTo("BackupItemActionV2", a.name)
}

func (a backupAction) Execute(item runtime.Unstructured, backup *api.Backup) (runtime.Unstructured, []velero.ResourceIdentifier, string, []velero.ResourceIdentifier, error) {
	out, id := execute("BackupItemActionV2", a.name, item)
	var post []velero.ResourceIdentifier
	if id != "" {
		meta, _ := out.UnstructuredContent()["metadata"].(map[string]any)
		namespace, _ := meta["namespace"].(string)
		post = []velero.ResourceIdentifier{{
			GroupResource: schema.GroupResource{Group: "snapshot.storage.k8s.io", Resource: "volumesnapshots"},
			Namespace:     namespace,
			Name:          "snap-" + id,
		}}
	}
	return out, nil, id, post, nil
}

func (a backupAction) Progress(id string, backup *api.Backup) (velero.OperationProgress, error) {
	return progress("BackupItemActionV2", a.name, id, "Backup/"+backup.Name)
}

func (a backupAction) Cancel(id string, backup *api.Backup) error {
	record("cancel BackupItemActionV2 %s %s", a.name, id)
	return nil
}

type restoreAction struct{ name string }

func (a restoreAction) Name() string { return a.name }

func (a restoreAction) AppliesTo() (velero.ResourceSelector, error) {
	return appliesTo("RestoreItemActionV2", a.name)
}

func (a restoreAction) Execute(input *velero.RestoreItemActionExecuteInput) (*velero.RestoreItemActionExecuteOutput, error) {
	out, id := execute("RestoreItemActionV2", a.name, input.Item)
	return velero.NewRestoreItemActionExecuteOutput(out).WithOperationID(id), nil
}

func (a restoreAction) Progress(id string, restore *api.Restore) (velero.OperationProgress, error) {
	return progress("RestoreItemActionV2", a.name, id, "Restore/"+restore.Name)
}

func (a restoreAction) Cancel(id string, restore *api.Restore) error {
	record("cancel RestoreItemActionV2 %s %s", a.name, id)
	return nil
}

func (a restoreAction) AreAdditionalItemsReady([]velero.ResourceIdentifier, *api.Restore) (bool, error) {
	return true, nil
}

// A DeleteItemAction of the original's own, which the stand-in passes on: it records
// each item and Backup it is called with.
type deleteAction struct{ name string }

func (a deleteAction) AppliesTo() (velero.ResourceSelector, error) {
	return appliesTo("DeleteItemAction", a.name)
}

func (a deleteAction) Execute(input *velero.DeleteItemActionExecuteInput) error {
	meta, _ := input.Item.UnstructuredContent()["metadata"].(map[string]any)
	record("delete DeleteItemAction %s %v Backup/%s", a.name, meta["name"], input.Backup.Name)
	return nil
}

// An ObjectStore, the kind whose calls stream: objects are files in the state
// directory; GetObject's reader gives 4 bytes a read, so the framework sends the body
// in chunks of 4.
type objectStore struct{ name string }

func objectPath(bucket, key string) string {
	return filepath.Join(state("objects"), bucket, filepath.FromSlash(key))
}

func (s objectStore) Init(config map[string]string) error {
	record("init ObjectStore %s bucket=%s", s.name, config["bucket"])
	return nil
}

func (s objectStore) PutObject(bucket, key string, body io.Reader) error {
	data, err := io.ReadAll(body)
	if err != nil {
		return err
	}
	record("put ObjectStore %s/%s %d bytes", bucket, key, len(data))
	if err := os.MkdirAll(filepath.Dir(objectPath(bucket, key)), 0o755); err != nil {
		return err
	}
	return os.WriteFile(objectPath(bucket, key), data, 0o644)
}

func (s objectStore) ObjectExists(bucket, key string) (bool, error) {
	_, err := os.Stat(objectPath(bucket, key))
	return err == nil, nil
}

type fourBytes struct{ r io.Reader }

func (f fourBytes) Read(p []byte) (int, error) {
	if len(p) > 4 {
		p = p[:4]
	}
	return f.r.Read(p)
}

func (s objectStore) GetObject(bucket, key string) (io.ReadCloser, error) {
	data, err := os.ReadFile(objectPath(bucket, key))
	if err != nil {
		return nil, fmt.Errorf("no object %s/%s", bucket, key)
	}
	return io.NopCloser(fourBytes{bytes.NewReader(data)}), nil
}

// keys is every object key in the bucket that begins with prefix.
func keys(bucket, prefix string) ([]string, error) {
	root := filepath.Join(state("objects"), bucket)
	var found []string
	err := filepath.WalkDir(root, func(path string, d os.DirEntry, err error) error {
		if err != nil {
			if os.IsNotExist(err) {
				return nil
			}
			return err
		}
		if d.IsDir() {
			return nil
		}
		rel, err := filepath.Rel(root, path)
		if err != nil {
			return err
		}
		if key := filepath.ToSlash(rel); strings.HasPrefix(key, prefix) {
			found = append(found, key)
		}
		return nil
	})
	return found, err
}

func (s objectStore) ListCommonPrefixes(bucket, prefix, delimiter string) ([]string, error) {
	all, err := keys(bucket, prefix)
	if err != nil {
		return nil, err
	}
	seen := map[string]bool{}
	var prefixes []string
	for _, key := range all {
		if i := strings.Index(key[len(prefix):], delimiter); i >= 0 {
			p := key[:len(prefix)+i+len(delimiter)]
			if !seen[p] {
				seen[p] = true
				prefixes = append(prefixes, p)
			}
		}
	}
	return prefixes, nil
}

func (s objectStore) ListObjects(bucket, prefix string) ([]string, error) {
	return keys(bucket, prefix)
}

func (s objectStore) DeleteObject(bucket, key string) error {
	record("deleteObject ObjectStore %s/%s", bucket, key)
	return os.Remove(objectPath(bucket, key))
}

func (s objectStore) CreateSignedURL(bucket, key string, ttl time.Duration) (string, error) {
	return "file://" + objectPath(bucket, key), nil
}

func main() {
	// Velero passes its server flags; a plugin that binds none accepts them all.
	record("started %d %s", os.Getpid(), strings.Join(os.Args[1:], " "))
	if v := os.Getenv("OPMON_TEST_EXPECT"); v != "" {
		record("env OPMON_TEST_EXPECT=%s", v)
	}
	server := framework.NewServer()
	for _, name := range []string{backupA, backupB} {
		server.RegisterBackupItemActionV2(name, func(logrus.FieldLogger) (any, error) { return backupAction{name}, nil })
	}
	server.RegisterRestoreItemActionV2(restoreA, func(logrus.FieldLogger) (any, error) { return restoreAction{restoreA}, nil })
	server.RegisterDeleteItemAction(deleteA, func(logrus.FieldLogger) (any, error) { return deleteAction{deleteA}, nil })
	server.RegisterObjectStore(store, func(logrus.FieldLogger) (any, error) { return objectStore{store}, nil })
	server.Serve()
}
