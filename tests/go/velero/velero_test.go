package velero

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"encoding/json"
	"io"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	corev1api "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	clocks "k8s.io/utils/clock"
	ctrl "sigs.k8s.io/controller-runtime"
	kbclient "sigs.k8s.io/controller-runtime/pkg/client"
	"sigs.k8s.io/controller-runtime/pkg/controller/controllertest"

	velerov1api "github.com/vmware-tanzu/velero/pkg/apis/velero/v1"
	pkgbackup "github.com/vmware-tanzu/velero/pkg/backup"
	"github.com/vmware-tanzu/velero/pkg/builder"
	veleroclient "github.com/vmware-tanzu/velero/pkg/client"
	"github.com/vmware-tanzu/velero/pkg/controller"
	"github.com/vmware-tanzu/velero/pkg/discovery"
	"github.com/vmware-tanzu/velero/pkg/itemoperation"
	"github.com/vmware-tanzu/velero/pkg/itemoperationmap"
	"github.com/vmware-tanzu/velero/pkg/kuberesource"
	"github.com/vmware-tanzu/velero/pkg/metrics"
	"github.com/vmware-tanzu/velero/pkg/persistence"
	"github.com/vmware-tanzu/velero/pkg/plugin/clientmgmt"
	"github.com/vmware-tanzu/velero/pkg/plugin/framework/common"
	"github.com/vmware-tanzu/velero/pkg/plugin/velero"
	"github.com/vmware-tanzu/velero/pkg/podvolume"
	"github.com/vmware-tanzu/velero/pkg/repository"
	velerotest "github.com/vmware-tanzu/velero/pkg/test"
	"github.com/vmware-tanzu/velero/pkg/util/logging"
)

// The stand-in's own DeleteItemAction, named after its file name in the plugin directory.
const forget = "opmon.io/forget-velero-plugin-example"

// Velero's discovery over the plugin directory: each name the original serves, and the
// stand-in's own DeleteItemAction, resolves once, to the stand-in.
func TestVeleroDiscoversEachNameOnceAtTheStandIn(t *testing.T) {
	w := newWorld(t, "")
	registry := w.registry()
	want := map[common.PluginKind][]string{
		common.PluginKindBackupItemActionV2:  {backupA, "example.io/backup-b"},
		common.PluginKindRestoreItemActionV2: {restoreA},
		common.PluginKindDeleteItemAction:    {deleteA, forget},
		common.PluginKindObjectStore:         {store},
	}
	for kind, names := range want {
		var listed []string
		for _, id := range registry.List(kind) {
			listed = append(listed, id.Name)
			if id.Command != w.standIn {
				t.Errorf("%s %s is served by %s, not the stand-in", kind, id.Name, id.Command)
			}
		}
		if strings.Join(listed, ",") != strings.Join(names, ",") {
			t.Errorf("%s: Velero registered %v, want %v", kind, listed, names)
		}
	}
	manager := w.newPluginManager()(w.log)
	defer manager.CleanupClients()
	action, err := manager.GetBackupItemActionV2(backupA)
	if err != nil {
		t.Fatalf("Velero's manager: %v", err)
	}
	selector, err := action.AppliesTo()
	if err != nil || strings.Join(selector.IncludedResources, ",") != "persistentvolumeclaims" {
		t.Fatalf("AppliesTo through the stand-in: %v %v", selector, err)
	}
}

// velero is one Velero server's controllers and clients over a world: the fake API
// server and controller-runtime client Velero's own tests use, a backup storage
// location served by the test plugin's ObjectStore (through the stand-in), and Velero's
// reconcilers.
type veleroServer struct {
	w                *world
	api              *velerotest.APIServer
	client           kbclient.Client
	discovery        discovery.Helper
	newPluginManager func(logrus.FieldLogger) clientmgmt.Manager
	storeGetter      persistence.ObjectBackupStoreGetter
	location         *velerov1api.BackupStorageLocation
	backupOps        *itemoperationmap.BackupItemOperationsMap
	restoreOps       *itemoperationmap.RestoreItemOperationsMap
	tracker          controller.BackupTracker
	backupper        pkgbackup.Backupper
	metrics          *metrics.ServerMetrics
}

func newVelero(t *testing.T, w *world) *veleroServer {
	t.Helper()
	api := velerotest.NewAPIServer(t)
	// The API server serves CRDs, which Velero's backup asks about.
	api.DiscoveryClient.WithAPIResource(velerotest.CRDs())
	helper, err := discovery.NewHelper(api.DiscoveryClient, w.log)
	if err != nil {
		t.Fatal(err)
	}
	location := builder.ForBackupStorageLocation(velerov1api.DefaultNamespace, "default").
		Provider(store).Bucket("bucket").Phase(velerov1api.BackupStorageLocationPhaseAvailable).Result()
	v := &veleroServer{
		w:                w,
		api:              api,
		client:           velerotest.NewFakeControllerRuntimeClient(t, location),
		discovery:        helper,
		newPluginManager: w.newPluginManager(),
		storeGetter:      persistence.NewObjectBackupStoreGetter(velerotest.NewFakeCredentialsFileStore("", nil)),
		location:         location,
		backupOps:        itemoperationmap.NewBackupItemOperationsMap(),
		restoreOps:       itemoperationmap.NewRestoreItemOperationsMap(),
		tracker:          controller.NewBackupTracker(),
		metrics:          metrics.NewServerMetrics(),
	}
	// Velero's pod volume backupper; its PodVolumeBackup informer stands still, as these
	// tests' namespaces have no pods.
	podVolumes := podvolume.NewBackupperFactory(repository.NewRepoLocker(), nil, v.client,
		&controllertest.FakeInformer{Synced: true}, w.log)
	v.backupper, err = pkgbackup.NewKubernetesBackupper(v.client, helper, veleroclient.NewDynamicFactory(api.DynamicClient),
		nil, podVolumes, time.Minute, false, 100, "kopia", v.newPluginManager, v.storeGetter)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// addPVCs puts PVCs app/<name> in the API server.
func (v *veleroServer) addPVCs(t *testing.T, names ...string) {
	t.Helper()
	var items []metav1.Object
	for _, name := range names {
		items = append(items, builder.ForPersistentVolumeClaim("app", name).Result())
	}
	resource := velerotest.PVCs(items...)
	v.api.DiscoveryClient.WithAPIResource(resource)
	if err := v.discovery.Refresh(); err != nil {
		t.Fatal(err)
	}
	namespace := &corev1api.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "app"}}
	if err := v.client.Create(context.Background(), namespace); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	for _, item := range items {
		object, err := runtime.DefaultUnstructuredConverter.ToUnstructured(item)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := v.api.DynamicClient.Resource(resource.GVR()).Namespace("app").
			Create(context.Background(), &unstructured.Unstructured{Object: object}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

func (v *veleroServer) backup(t *testing.T, name string) *velerov1api.Backup {
	t.Helper()
	backup := &velerov1api.Backup{}
	if err := v.client.Get(context.Background(), types.NamespacedName{Namespace: velerov1api.DefaultNamespace, Name: name}, backup); err != nil {
		t.Fatalf("backup %s: %v", name, err)
	}
	return backup
}

func (v *veleroServer) backupStore(t *testing.T, manager clientmgmt.Manager) persistence.BackupStore {
	t.Helper()
	backupStore, err := v.storeGetter.Get(v.location, manager, v.w.log)
	if err != nil {
		t.Fatalf("the backup store: %v", err)
	}
	return backupStore
}

// backUp runs Velero's backup controller on a new Backup `name` (uid uid-<name>) of
// namespace app, its item operation timeout `timeout`: Velero's backupper calls the
// stand-in's Execute for each PVC, and the controller uploads the backup and its item
// operations through the stand-in's ObjectStore.
func (v *veleroServer) backUp(t *testing.T, name string, timeout time.Duration) *velerov1api.Backup {
	t.Helper()
	return v.backUpAs(t, name, "uid-"+name, timeout)
}

// backUpAs is backUp of a Backup with uid `uid` (one made again under a name).
func (v *veleroServer) backUpAs(t *testing.T, name, uid string, timeout time.Duration) *velerov1api.Backup {
	t.Helper()
	backup := builder.ForBackup(velerov1api.DefaultNamespace, name).
		ObjectMeta(builder.WithUID(uid)).
		IncludedNamespaces("app").StorageLocation("default").
		ItemOperationTimeout(timeout).Phase(velerov1api.BackupPhaseReadyToStart).Result()
	if err := v.client.Create(context.Background(), backup); err != nil {
		t.Fatal(err)
	}
	reconciler := controller.NewBackupReconciler(context.Background(), v.discovery, v.backupper, v.w.log, logrus.InfoLevel,
		v.newPluginManager, v.tracker, v.client, "default", false, time.Hour, "", time.Minute, time.Minute, time.Hour,
		nil, v.metrics, v.storeGetter, logging.FormatText, velerotest.NewFakeCredentialsFileStore("", nil), 10, false, 1, 1, v.client)
	if _, err := reconciler.Reconcile(context.Background(), request(name)); err != nil {
		t.Fatalf("Velero's backup controller: %v", err)
	}
	return v.backup(t, name)
}

func request(name string) ctrl.Request {
	return ctrl.Request{NamespacedName: types.NamespacedName{Namespace: velerov1api.DefaultNamespace, Name: name}}
}

// waitForOperations runs Velero's backup operations controller, as its periodic
// enqueue does, until the backup no longer waits for its plugins' operations.
func (v *veleroServer) waitForOperations(t *testing.T, name string) *velerov1api.Backup {
	t.Helper()
	reconciler := controller.NewBackupOperationsReconciler(v.w.log, v.client, time.Second, v.newPluginManager,
		v.storeGetter, v.metrics, v.backupOps)
	var backup *velerov1api.Backup
	eventually(t, "backup "+name+" leaves WaitingForPluginOperations", func() bool {
		if _, err := reconciler.Reconcile(context.Background(), request(name)); err != nil {
			t.Fatalf("Velero's backup operations controller: %v", err)
		}
		backup = v.backup(t, name)
		return backup.Status.Phase != velerov1api.BackupPhaseWaitingForPluginOperations &&
			backup.Status.Phase != velerov1api.BackupPhaseWaitingForPluginOperationsPartiallyFailed
	})
	return backup
}

// recorded is the backup's item operations as Velero uploaded them, by operation ID.
func (v *veleroServer) recorded(t *testing.T, name string) map[string]*itemoperation.BackupOperation {
	t.Helper()
	manager := v.newPluginManager(v.w.log)
	defer manager.CleanupClients()
	ops, err := v.backupStore(t, manager).GetBackupItemOperations(name)
	if err != nil {
		t.Fatalf("the backup's item operations: %v", err)
	}
	byID := map[string]*itemoperation.BackupOperation{}
	for _, op := range ops {
		byID[op.Spec.OperationID] = op
	}
	return byID
}

// Velero's own backup path calls Execute through the stand-in for each PVC: the
// backup waits for its plugins with the item operations the original started, and its
// tarball holds the item as the original returned it.
func TestVelerosBackupExecutesThroughTheStandIn(t *testing.T) {
	w := newWorld(t, "")
	v := newVelero(t, w)
	v.addPVCs(t, "steps-40-x", "sync-1")
	backup := v.backUp(t, "b1", time.Hour)
	if backup.Status.Phase != velerov1api.BackupPhaseWaitingForPluginOperations {
		t.Fatalf("the backup is %s (%d errors), want WaitingForPluginOperations", backup.Status.Phase, backup.Status.Errors)
	}
	if backup.Status.BackupItemOperationsAttempted != 1 {
		t.Errorf("%d item operations attempted, want 1", backup.Status.BackupItemOperationsAttempted)
	}
	ops := v.recorded(t, "b1")
	op := ops["steps-40-x"]
	if len(ops) != 1 || op == nil {
		t.Fatalf("Velero recorded %v", ops)
	}
	// Velero asks Progress once at the end of InProgress, before it waits for plugins.
	if op.Spec.BackupItemAction != backupA || op.Spec.BackupUID != "uid-b1" ||
		op.Spec.ResourceIdentifier != (velero.ResourceIdentifier{GroupResource: kuberesource.PersistentVolumeClaims, Namespace: "app", Name: "steps-40-x"}) ||
		op.Status.Phase != itemoperation.OperationPhaseInProgress || op.Status.NCompleted != 1 || op.Status.Description != "step 1 of 40" {
		t.Errorf("the operation Velero recorded: %+v", op)
	}
	if len(op.Spec.PostOperationItems) != 1 || op.Spec.PostOperationItems[0].Name != "snap-steps-40-x" {
		t.Errorf("post-operation items: %+v", op.Spec.PostOperationItems)
	}
	// The item in the tarball is the original's answer.
	manager := v.newPluginManager(w.log)
	defer manager.CleanupClients()
	contents, err := v.backupStore(t, manager).GetBackupContents("b1")
	if err != nil {
		t.Fatal(err)
	}
	defer contents.Close()
	if !tarballHas(t, contents, "resources/persistentvolumeclaims/namespaces/app/steps-40-x.json", `"example.io/executed":"example.io/backup-a"`) {
		t.Error("the tarball's PVC is not the original's answer")
	}
}

// Velero's backup operations controller polls Progress through the stand-in until
// every operation ends: the progress, the completions and the original's own failures
// (an error it completes with, an error it returns) are what Velero records; a
// transient error the agent retries never reaches Velero (which fails an operation at
// the first Progress error).
func TestVelerosOperationsControllerSeesProgressCompletionAndFailure(t *testing.T) {
	w := newWorld(t, `retry_backoff = "100ms"`)
	v := newVelero(t, w)
	v.addPVCs(t, "steps-3-a", "done-a", "flaky-2-f")
	v.backUp(t, "b2", time.Hour)
	backup := v.waitForOperations(t, "b2")
	if backup.Status.Phase != velerov1api.BackupPhaseFinalizing {
		t.Fatalf("the backup is %s, want Finalizing", backup.Status.Phase)
	}
	if backup.Status.BackupItemOperationsCompleted != 3 || backup.Status.BackupItemOperationsFailed != 0 {
		t.Errorf("completed %d, failed %d", backup.Status.BackupItemOperationsCompleted, backup.Status.BackupItemOperationsFailed)
	}
	ops := v.recorded(t, "b2")
	steps := ops["steps-3-a"]
	if steps.Status.Phase != itemoperation.OperationPhaseCompleted || steps.Status.NCompleted != 3 ||
		steps.Status.NTotal != 3 || steps.Status.OperationUnits != "steps" || steps.Status.Description != "step 3 of 3" ||
		steps.Status.Started == nil || steps.Status.Updated == nil {
		t.Errorf("steps-3-a: %+v", steps.Status)
	}
	if flaky := ops["flaky-2-f"]; flaky.Status.Phase != itemoperation.OperationPhaseCompleted || flaky.Status.OperationUnits != "GB" {
		t.Errorf("flaky-2-f: %+v", flaky.Status)
	}
	if done := ops["done-a"]; done.Status.Phase != itemoperation.OperationPhaseCompleted || done.Status.Started != nil {
		t.Errorf("done-a (started unset, as Go's zero time): %+v", done.Status)
	}

	v.addPVCs(t, "fail-b", "error-b", "steps-2-b")
	v.backUp(t, "b3", time.Hour)
	backup = v.waitForOperations(t, "b3")
	if backup.Status.Phase != velerov1api.BackupPhaseFinalizingPartiallyFailed {
		t.Fatalf("the backup is %s, want FinalizingPartiallyFailed", backup.Status.Phase)
	}
	ops = v.recorded(t, "b3")
	if ops["fail-b"].Status.Phase != itemoperation.OperationPhaseFailed || ops["fail-b"].Status.Error != "the copy failed: disk full" {
		t.Errorf("fail-b: %+v", ops["fail-b"].Status)
	}
	// A plugin's own error reaches Velero as the original's text.
	if ops["error-b"].Status.Phase != itemoperation.OperationPhaseFailed || !strings.HasSuffix(ops["error-b"].Status.Error, "no snapshot named error-b") {
		t.Errorf("error-b: %+v", ops["error-b"].Status)
	}
	if ops["steps-2-b"].Status.Phase != itemoperation.OperationPhaseCompleted {
		t.Errorf("steps-2-b: %+v", ops["steps-2-b"].Status)
	}
}

// Past the Backup's item operation timeout Velero cancels the operation itself: the
// stand-in cancels through the agent, which sends Cancel to the original.
func TestVelerosTimeoutCancelsThroughTheAgent(t *testing.T) {
	w := newWorld(t, "")
	v := newVelero(t, w)
	v.addPVCs(t, "stall-t")
	v.backUp(t, "b4", time.Second)
	backup := v.waitForOperations(t, "b4")
	if backup.Status.Phase != velerov1api.BackupPhaseFinalizingPartiallyFailed {
		t.Fatalf("the backup is %s, want FinalizingPartiallyFailed", backup.Status.Phase)
	}
	op := v.recorded(t, "b4")["stall-t"]
	if op.Status.Phase != itemoperation.OperationPhaseFailed || op.Status.Error != "Asynchronous action timed out" {
		t.Errorf("stall-t: %+v", op.Status)
	}
	eventually(t, "the original gets Cancel", func() bool {
		return w.journalHas("cancel BackupItemActionV2 example.io/backup-a stall-t")
	})
}

// An operator's `opmon backup cancel` while Velero waits: Velero's next Progress shows
// the operation failed with the reason given.
func TestAnOperatorsCancelReachesVelero(t *testing.T) {
	w := newWorld(t, "")
	v := newVelero(t, w)
	v.addPVCs(t, "stall-k")
	v.backUp(t, "b5", time.Hour)
	reconciler := controller.NewBackupOperationsReconciler(w.log, v.client, time.Second, v.newPluginManager,
		v.storeGetter, v.metrics, v.backupOps)
	if _, err := reconciler.Reconcile(context.Background(), request("b5")); err != nil {
		t.Fatal(err)
	}
	if phase := v.backup(t, "b5").Status.Phase; phase != velerov1api.BackupPhaseWaitingForPluginOperations {
		t.Fatalf("the backup is %s before the cancel", phase)
	}
	out := w.opmon("backup", "cancel", "b5", "--operation", "stall-k", "--reason", "the storage is full")
	if !strings.HasPrefix(out, "backup b5: 1 operation canceled") {
		t.Fatalf("opmon backup cancel: %s", out)
	}
	backup := v.waitForOperations(t, "b5")
	if backup.Status.Phase != velerov1api.BackupPhaseFinalizingPartiallyFailed {
		t.Fatalf("the backup is %s, want FinalizingPartiallyFailed", backup.Status.Phase)
	}
	op := v.recorded(t, "b5")["stall-k"]
	if op.Status.Phase != itemoperation.OperationPhaseFailed || op.Status.Error != "canceled: the storage is full" {
		t.Errorf("stall-k: %+v", op.Status)
	}
	eventually(t, "the original gets Cancel", func() bool {
		return w.journalHas("cancel BackupItemActionV2 example.io/backup-a stall-k")
	})
}

// Velero's restore operations controller polls RestoreItemAction v2 Progress through
// the stand-in to completion.
func TestVelerosRestoreOperationsControllerCompletes(t *testing.T) {
	w := newWorld(t, "")
	v := newVelero(t, w)
	v.addPVCs(t, "sync-r")
	v.backUp(t, "b6", time.Hour)
	restore := builder.ForRestore(velerov1api.DefaultNamespace, "r1").Backup("b6").
		ObjectMeta(builder.WithUID("uid-r1")).ItemOperationTimeout(time.Hour).
		Phase(velerov1api.RestorePhaseInProgress).Result()
	if err := v.client.Create(context.Background(), restore); err != nil {
		t.Fatal(err)
	}
	// Velero's restore calls Execute for the item, as its restore does, and records the
	// operation the original started.
	manager := v.newPluginManager(w.log)
	action, err := manager.GetRestoreItemActionV2(restoreA)
	if err != nil {
		t.Fatal(err)
	}
	pvc, err := runtime.DefaultUnstructuredConverter.ToUnstructured(builder.ForPersistentVolumeClaim("app", "steps-2-r").Result())
	if err != nil {
		t.Fatal(err)
	}
	item := &unstructured.Unstructured{Object: pvc}
	out, err := action.Execute(&velero.RestoreItemActionExecuteInput{Item: item, ItemFromBackup: item, Restore: restore})
	if err != nil || out.OperationID != "steps-2-r" {
		t.Fatalf("Execute through the stand-in: %+v %v", out, err)
	}
	now := metav1.Now()
	ops := []*itemoperation.RestoreOperation{{
		Spec: itemoperation.RestoreOperationSpec{RestoreName: "r1", RestoreUID: "uid-r1", RestoreItemAction: restoreA,
			ResourceIdentifier: velero.ResourceIdentifier{GroupResource: kuberesource.PersistentVolumeClaims, Namespace: "app", Name: "steps-2-r"},
			OperationID:        out.OperationID},
		Status: itemoperation.OperationStatus{Phase: itemoperation.OperationPhaseNew, Created: &now},
	}}
	v.restoreOps.PutOperationsForRestore(&itemoperationmap.OperationsForRestore{Operations: ops}, "r1")
	manager.CleanupClients()
	restore.Status.Phase = velerov1api.RestorePhaseWaitingForPluginOperations
	if err := v.client.Update(context.Background(), restore); err != nil {
		t.Fatal(err)
	}

	reconciler := controller.NewRestoreOperationsReconciler(w.log, velerov1api.DefaultNamespace, v.client, time.Second,
		v.newPluginManager, v.storeGetter, v.metrics, v.restoreOps)
	got := &velerov1api.Restore{}
	eventually(t, "restore r1 leaves WaitingForPluginOperations", func() bool {
		if _, err := reconciler.Reconcile(context.Background(), request("r1")); err != nil {
			t.Fatalf("Velero's restore operations controller: %v", err)
		}
		if err := v.client.Get(context.Background(), request("r1").NamespacedName, got); err != nil {
			t.Fatal(err)
		}
		return got.Status.Phase != velerov1api.RestorePhaseWaitingForPluginOperations
	})
	if got.Status.Phase != velerov1api.RestorePhaseFinalizing || got.Status.RestoreItemOperationsCompleted != 1 {
		t.Fatalf("the restore is %s, %d operations completed", got.Status.Phase, got.Status.RestoreItemOperationsCompleted)
	}
	manager = v.newPluginManager(w.log)
	defer manager.CleanupClients()
	recorded, err := v.backupStore(t, manager).GetRestoreItemOperations("r1")
	if err != nil || len(recorded) != 1 || recorded[0].Status.Phase != itemoperation.OperationPhaseCompleted || recorded[0].Status.NCompleted != 2 {
		t.Fatalf("the restore's operations as Velero uploaded them: %+v %v", recorded, err)
	}
	// The agent's owner ended with its operation. (Velero's restore finalizer, which
	// takes the restore on to Completed without any plugin, needs a tracker of
	// Velero's internal/hook that no code outside Velero's module can make.)
	result, rpcErr := w.call("restore.get", map[string]string{"name": "r1"})
	var owner struct {
		UID   string `json:"uid"`
		Phase string `json:"phase"`
	}
	if rpcErr != nil || json.Unmarshal(result, &owner) != nil || owner.UID != "uid-r1" || owner.Phase != "Completed" {
		t.Fatalf("the agent's owner r1: %s %+v", result, rpcErr)
	}
}

// Velero's backup deletion calls the stand-in's own DeleteItemAction with the Backup:
// the agent's owner of that Backup goes; the original's DeleteItemAction gets its call.
func TestVelerosBackupDeletionRemovesTheAgentsOwner(t *testing.T) {
	w := newWorld(t, "")
	v := newVelero(t, w)
	v.addPVCs(t, "steps-2-d")
	v.backUp(t, "b7", time.Hour)
	if backup := v.waitForOperations(t, "b7"); backup.Status.Phase != velerov1api.BackupPhaseFinalizing {
		t.Fatalf("the backup is %s", backup.Status.Phase)
	}
	finalizer := controller.NewBackupFinalizerReconciler(v.client, v.client, clocks.RealClock{}, v.backupper,
		v.newPluginManager, v.tracker, v.storeGetter, w.log, v.metrics, time.Minute)
	if _, err := finalizer.Reconcile(context.Background(), request("b7")); err != nil {
		t.Fatalf("Velero's backup finalizer: %v", err)
	}
	if phase := v.backup(t, "b7").Status.Phase; phase != velerov1api.BackupPhaseCompleted {
		t.Fatalf("the backup is %s after Velero's finalizer, want Completed", phase)
	}
	// The agent's owner is the Backup as Velero sent it; it ended with its operations,
	// with no finalize of its own (Velero writes its own files).
	result, rpcErr := w.call("backup.get", map[string]string{"name": "b7"})
	if rpcErr != nil {
		t.Fatalf("the agent has no owner b7: %+v", rpcErr)
	}
	var owner struct {
		UID      string `json:"uid"`
		Phase    string `json:"phase"`
		Finalize bool   `json:"finalize"`
	}
	if err := json.Unmarshal(result, &owner); err != nil || owner.UID != "uid-b7" || owner.Phase != "Completed" || owner.Finalize {
		t.Fatalf("the agent's owner b7: %s %v", result, err)
	}
	request := builder.ForDeleteBackupRequest(velerov1api.DefaultNamespace, "delete-b7").BackupName("b7").Result()
	if err := v.client.Create(context.Background(), request); err != nil {
		t.Fatal(err)
	}
	helper, err := discovery.NewHelper(v.api.DiscoveryClient, w.log)
	if err != nil {
		t.Fatal(err)
	}
	reconciler := controller.NewBackupDeletionReconciler(w.log, v.client, v.tracker, nil, v.metrics, helper,
		v.newPluginManager, v.storeGetter, velerotest.NewFakeCredentialsFileStore("", nil), nil)
	if _, err := reconciler.Reconcile(context.Background(), ctrl.Request{NamespacedName: types.NamespacedName{
		Namespace: velerov1api.DefaultNamespace, Name: "delete-b7"}}); err != nil {
		t.Fatalf("Velero's backup deletion: %v", err)
	}
	done := &velerov1api.DeleteBackupRequest{}
	err = v.client.Get(context.Background(), types.NamespacedName{Namespace: velerov1api.DefaultNamespace, Name: "delete-b7"}, done)
	if err == nil && (done.Status.Phase != velerov1api.DeleteBackupRequestPhaseProcessed || len(done.Status.Errors) > 0) {
		t.Fatalf("the deletion: %s %v", done.Status.Phase, done.Status.Errors)
	}
	if err := v.client.Get(context.Background(), types.NamespacedName{Namespace: velerov1api.DefaultNamespace, Name: "b7"}, &velerov1api.Backup{}); !apierrors.IsNotFound(err) {
		t.Fatalf("Velero did not delete the Backup: %v", err)
	}
	if _, err := w.call("backup.get", map[string]string{"name": "b7"}); err == nil || err.Code != 1001 {
		t.Fatalf("the agent's owner b7 is still there: %+v", err)
	}
	if !w.journalHas("delete DeleteItemAction example.io/delete-a steps-2-d Backup/b7") {
		t.Errorf("the original's DeleteItemAction was not called: %v", w.journal())
	}
	// The name made again, as Kubernetes makes it: a new uid. Velero backs it up and
	// waits for its operations as for any other.
	// (The original remembers the operation done: Velero may find it completed at once.)
	again := v.backUpAs(t, "b7", "uid-b7-again", time.Hour)
	if again.Status.Errors != 0 || again.Status.BackupItemOperationsAttempted != 1 {
		t.Fatalf("the Backup made again is %s with %d errors, %d item operations", again.Status.Phase,
			again.Status.Errors, again.Status.BackupItemOperationsAttempted)
	}
	if again.Status.Phase == velerov1api.BackupPhaseWaitingForPluginOperations {
		again = v.waitForOperations(t, "b7")
	}
	if again.Status.Phase != velerov1api.BackupPhaseFinalizing {
		t.Fatalf("the Backup made again is %s after its operations", again.Status.Phase)
	}
	result, rpcErr = w.call("backup.get", map[string]string{"name": "b7"})
	if rpcErr != nil {
		t.Fatalf("the agent has no owner b7 made again: %+v", rpcErr)
	}
	if err := json.Unmarshal(result, &owner); err != nil || owner.UID != "uid-b7-again" || owner.Phase != "Completed" {
		t.Fatalf("the agent's owner b7 made again: %s %v", result, err)
	}
}

// tarballHas is whether the backup tarball holds `file` with `text` in it.
func tarballHas(t *testing.T, contents io.Reader, file, text string) bool {
	t.Helper()
	gz, err := gzip.NewReader(contents)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	for {
		header, err := tr.Next()
		if err == io.EOF {
			return false
		}
		if err != nil {
			t.Fatal(err)
		}
		if header.Name == file {
			data, err := io.ReadAll(tr)
			if err != nil {
				t.Fatal(err)
			}
			return strings.Contains(string(data), text)
		}
	}
}
