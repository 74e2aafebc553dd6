package opmon

import (
	"encoding/json"
	"fmt"
	"strings"
	"time"
)

// The wire types of client/openrpc/opmon.json (components.schemas), one struct per
// schema with the same JSON names; openrpc_test.go fails when they drift apart.
//
// Enumerations are strings: a value a newer agent adds decodes as itself, and unknown
// fields are ignored, so an older client keeps working against a newer agent.

// Duration is a Go duration on the wire ("4h0m0s", "90s", "1.5h"), as the agent's
// GoDuration schema says.
type Duration time.Duration

// D converts a time.Duration for a params field: opmon.D(4 * time.Hour).
func D(d time.Duration) *Duration {
	v := Duration(d)
	return &v
}

// Std is the duration as a time.Duration.
func (d Duration) Std() time.Duration { return time.Duration(d) }

func (d Duration) String() string { return time.Duration(d).String() }

// MarshalJSON writes the Go duration string.
func (d Duration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

// UnmarshalJSON reads a Go duration string.
func (d *Duration) UnmarshalJSON(b []byte) error {
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		return fmt.Errorf("a duration must be a string such as \"90s\": %w", err)
	}
	v, err := time.ParseDuration(strings.TrimPrefix(s, "+"))
	if err != nil {
		return err
	}
	*d = Duration(v)
	return nil
}

// OwnerKind is "backup" or "restore".
type OwnerKind string

const (
	Backup  OwnerKind = "backup"
	Restore OwnerKind = "restore"
)

// OwnerPhase is a backup's or restore's phase (Velero's names).
type OwnerPhase string

const (
	PhaseNew                                       OwnerPhase = "New"
	PhaseFailedValidation                          OwnerPhase = "FailedValidation"
	PhaseInProgress                                OwnerPhase = "InProgress"
	PhaseWaitingForPluginOperations                OwnerPhase = "WaitingForPluginOperations"
	PhaseWaitingForPluginOperationsPartiallyFailed OwnerPhase = "WaitingForPluginOperationsPartiallyFailed"
	PhaseFinalizing                                OwnerPhase = "Finalizing"
	PhaseFinalizingPartiallyFailed                 OwnerPhase = "FinalizingPartiallyFailed"
	PhaseCompleted                                 OwnerPhase = "Completed"
	PhasePartiallyFailed                           OwnerPhase = "PartiallyFailed"
	PhaseFailed                                    OwnerPhase = "Failed"
)

// Terminal reports whether the phase is final (Completed, PartiallyFailed, Failed,
// FailedValidation).
func (p OwnerPhase) Terminal() bool {
	switch p {
	case PhaseCompleted, PhasePartiallyFailed, PhaseFailed, PhaseFailedValidation:
		return true
	}
	return false
}

// Finalizing reports whether the owner waits for finalize.
func (p OwnerPhase) Finalizing() bool {
	return p == PhaseFinalizing || p == PhaseFinalizingPartiallyFailed
}

// OperationPhase is an operation's phase.
type OperationPhase string

const (
	OperationNew        OperationPhase = "New"
	OperationInProgress OperationPhase = "InProgress"
	OperationCompleted  OperationPhase = "Completed"
	OperationFailed     OperationPhase = "Failed"
	OperationCanceled   OperationPhase = "Canceled"
)

// Finished reports whether the operation will not change any more. A phase this
// client does not know counts as unfinished.
func (p OperationPhase) Finished() bool {
	switch p {
	case OperationCompleted, OperationFailed, OperationCanceled, "Cancelled":
		return true
	}
	return false
}

// WaitUntil is what wait waits for.
type WaitUntil string

const (
	// UntilReadyToFinalize: a Finalizing phase, or a terminal one.
	UntilReadyToFinalize WaitUntil = "readyToFinalize"
	// UntilTerminal: Completed, PartiallyFailed or Failed.
	UntilTerminal WaitUntil = "terminal"
)

// PluginKind is the kind of Velero plugin that returned an operation.
type PluginKind string

const (
	BackupItemAction  PluginKind = "BackupItemAction"
	RestoreItemAction PluginKind = "RestoreItemAction"
	VolumeSnapshotter PluginKind = "VolumeSnapshotter"
)

// APIVersion is a snapshotter's protocol version: "v1" (no Progress) or "v2".
type APIVersion string

const (
	APIv1 APIVersion = "v1"
	APIv2 APIVersion = "v2"
)

// ResourceIdentifier names a Kubernetes item; Group and Namespace are empty for the
// core group and cluster-scoped items.
type ResourceIdentifier struct {
	Group     string `json:"group"`
	Resource  string `json:"resource"`
	Namespace string `json:"namespace"`
	Name      string `json:"name"`
}

// PluginRef is the plugin that returned an operation.
type PluginRef struct {
	Kind PluginKind `json:"kind"`
	Name string     `json:"name"`
}

// ServerRef names the backup server instance that started an owner.
type ServerRef struct {
	Name     string `json:"name"`
	Instance string `json:"instance"`
}

// Owner is a backup or a restore as the agent keeps it.
type Owner struct {
	Kind                 OwnerKind            `json:"kind"`
	Name                 string               `json:"name"`
	UID                  string               `json:"uid"`
	Server               *ServerRef           `json:"server"`
	Phase                OwnerPhase           `json:"phase"`
	FailureReason        string               `json:"failureReason"`
	ItemOperationTimeout Duration             `json:"itemOperationTimeout"`
	StallTimeout         *Duration            `json:"stallTimeout"`
	StartTimeout         *Duration            `json:"startTimeout"`
	Finalize             bool                 `json:"finalize"`
	Errors               uint32               `json:"errors"`
	Warnings             uint32               `json:"warnings"`
	OperationsAttempted  uint64               `json:"operationsAttempted"`
	OperationsCompleted  uint64               `json:"operationsCompleted"`
	OperationsFailed     uint64               `json:"operationsFailed"`
	PostOperationItems   []ResourceIdentifier `json:"postOperationItems"`
	Progress             *OwnerProgress       `json:"progress"`
	Created              time.Time            `json:"created"`
	Updated              time.Time            `json:"updated"`
	Completed            *time.Time           `json:"completed"`
	// When start gave the name to a new uid (this owner had ended); nil while it is
	// the name's current owner.
	Retired *time.Time `json:"retired,omitempty"`
}

// OwnerProgress sums the owner's unfinished operations per unit.
type OwnerProgress struct {
	Units []UnitsProgress `json:"units"`
	ETA   *time.Time      `json:"eta"`
}

// UnitsProgress is the progress of the unfinished operations that report Units.
type UnitsProgress struct {
	Units      string   `json:"units"`
	Operations uint64   `json:"operations"`
	NCompleted int64    `json:"nCompleted"`
	NTotal     int64    `json:"nTotal"`
	Rate       *float64 `json:"rate"`
}

// Operation is one asynchronous plugin operation of an owner.
type Operation struct {
	Plugin             PluginRef            `json:"plugin"`
	Resource           ResourceIdentifier   `json:"resource"`
	OperationID        string               `json:"operationId"`
	PostOperationItems []ResourceIdentifier `json:"postOperationItems"`
	Phase              OperationPhase       `json:"phase"`
	Error              string               `json:"error"`
	NCompleted         int64                `json:"nCompleted"`
	NTotal             int64                `json:"nTotal"`
	OperationUnits     string               `json:"operationUnits"`
	Description        string               `json:"description"`
	Created            time.Time            `json:"created"`
	Started            *time.Time           `json:"started"`
	Updated            *time.Time           `json:"updated"`
	PluginUpdated      *time.Time           `json:"pluginUpdated"`
	CancelRequested    bool                 `json:"cancelRequested"`
	Attempts           uint32               `json:"attempts"`
	LastError          string               `json:"lastError"`
	NextAttemptAt      *time.Time           `json:"nextAttemptAt"`
	Rate               *float64             `json:"rate"`
	ETA                *time.Time           `json:"eta"`
}

// NewOperation is an operation a plugin returned, for addOperations.
type NewOperation struct {
	Plugin             PluginRef            `json:"plugin"`
	Resource           ResourceIdentifier   `json:"resource"`
	OperationID        string               `json:"operationId"`
	PostOperationItems []ResourceIdentifier `json:"postOperationItems,omitempty"`
	// When the plugin returned it; its timeout counts from then (default: now).
	Created *time.Time `json:"created,omitempty"`
}

// AgentStatus is agent.status's answer.
type AgentStatus struct {
	Version              string            `json:"version"`
	APIVersion           string            `json:"apiVersion"`
	Features             []string          `json:"features"`
	Uptime               Duration          `json:"uptime"`
	Owners               map[string]uint64 `json:"owners"`
	UnfinishedOperations uint64            `json:"unfinishedOperations"`
	Snapshotters         uint64            `json:"snapshotters"`
}

// HasFeature reports whether the agent lists feature (client/REFERENCE.md, "Versions
// and features").
func (s *AgentStatus) HasFeature(feature string) bool {
	for _, f := range s.Features {
		if f == feature {
			return true
		}
	}
	return false
}

// AddOperationsResult says how many operations were new.
type AddOperationsResult struct {
	Added        uint64 `json:"added"`
	AlreadyKnown uint64 `json:"alreadyKnown"`
}

// OwnerList is one page of list.
type OwnerList struct {
	Items []Owner `json:"items"`
	// Pass as ListParams.After for the next page; nil at the end.
	Next *string `json:"next"`
}

// WaitResult is wait's answer.
type WaitResult struct {
	Owner    Owner `json:"owner"`
	TimedOut bool  `json:"timedOut"`
}

// Caller is the peer that made a call (its credentials when it connected).
type Caller struct {
	UID uint32 `json:"uid"`
	PID int32  `json:"pid"`
}

// EventOperation names the operation an event is about.
type EventOperation struct {
	Plugin      PluginRef          `json:"plugin"`
	Resource    ResourceIdentifier `json:"resource"`
	OperationID string             `json:"operationId"`
}

// Event is one entry of an owner's history. Reason may be one this client does not
// know.
type Event struct {
	Seq       uint64          `json:"seq"`
	Time      time.Time       `json:"time"`
	Reason    string          `json:"reason"`
	Operation *EventOperation `json:"operation"`
	Caller    *Caller         `json:"caller"`
	Message   string          `json:"message"`
}

// EventList is one page of events.
type EventList struct {
	Items []Event `json:"items"`
	// Pass as EventsParams.After for the next page; nil at the end.
	Next *uint64 `json:"next"`
}

// Contents asks finalize to rewrite a backup tarball: Input is read, Output written.
type Contents struct {
	Input  string `json:"input"`
	Output string `json:"output"`
}

// UpdatedItem replaces an item's object in the tarball at finalize.
type UpdatedItem struct {
	Resource ResourceIdentifier `json:"resource"`
	Object   json.RawMessage    `json:"object"`
}

// FinalizeResult is finalize's answer; a repeat returns the first one.
type FinalizeResult struct {
	Owner              Owner   `json:"owner"`
	ItemOperationsFile string  `json:"itemOperationsFile"`
	ContentsFile       *string `json:"contentsFile"`
	Replaced           uint64  `json:"replaced"`
	Added              uint64  `json:"added"`
}

// DeleteResult says how many unfinished operations delete canceled.
type DeleteResult struct {
	// Older agents send only Cancelled; use Count.
	Canceled uint64 `json:"canceled"`
	// Deprecated: the same number under its old spelling.
	Cancelled uint64 `json:"cancelled"`
}

// Count is the number of operations canceled, from an agent of any version.
func (r *DeleteResult) Count() uint64 {
	if r.Canceled > r.Cancelled {
		return r.Canceled
	}
	return r.Cancelled
}

// OperationSelector picks an operation to cancel: by ID alone, or by ID and item when
// two items share the ID. Build one with ByID or ByItem.
type OperationSelector struct {
	OperationID string              `json:"operationId"`
	Resource    *ResourceIdentifier `json:"resource,omitempty"`
}

// ByID selects the operation with this ID.
func ByID(operationID string) OperationSelector {
	return OperationSelector{OperationID: operationID}
}

// ByItem selects the operation with this ID on this item.
func ByItem(operationID string, resource ResourceIdentifier) OperationSelector {
	return OperationSelector{OperationID: operationID, Resource: &resource}
}

// MarshalJSON writes a bare ID string, or {operationId, resource}.
func (s OperationSelector) MarshalJSON() ([]byte, error) {
	if s.Resource == nil {
		return json.Marshal(s.OperationID)
	}
	type plain OperationSelector
	return json.Marshal(plain(s))
}

// CancelResult is cancel's answer.
type CancelResult struct {
	Owner       Owner  `json:"owner"`
	Canceled    uint64 `json:"canceled"`
	Unconfirmed uint64 `json:"unconfirmed"`
}

// FailedOwner is an owner server.started failed.
type FailedOwner struct {
	Kind OwnerKind `json:"kind"`
	Name string    `json:"name"`
	UID  string    `json:"uid"`
}

// ServerStartedResult lists the owners server.started failed.
type ServerStartedResult struct {
	Failed []FailedOwner `json:"failed"`
}

// Snapshotter is a registration: the agent reaches it on Socket (JSON-RPC over HTTP)
// or runs Command or VeleroPlugin.
type Snapshotter struct {
	Name       string     `json:"name"`
	APIVersion APIVersion `json:"apiVersion"`
	Socket     *string    `json:"socket,omitempty"`
	Command    []string   `json:"command,omitempty"`
	// VeleroPlugin is a Velero plugin binary the agent runs, with its Args and Env
	// (docs/velero-plugins.md).
	VeleroPlugin  *string           `json:"veleroPlugin,omitempty"`
	Args          []string          `json:"args,omitempty"`
	Env           map[string]string `json:"env,omitempty"`
	StallTimeout  *Duration         `json:"stallTimeout,omitempty"`
	StartTimeout  *Duration         `json:"startTimeout,omitempty"`
	RetryAttempts *uint32           `json:"retryAttempts,omitempty"`
	RetryBackoff  *Duration         `json:"retryBackoff,omitempty"`
	RetryWithin   *Duration         `json:"retryWithin,omitempty"`
}

// VeleroResourceIdentifier is Velero's ResourceIdentifier, as the item-operations
// file spells it.
type VeleroResourceIdentifier struct {
	Group     string `json:"Group"`
	Resource  string `json:"Resource"`
	Namespace string `json:"Namespace"`
	Name      string `json:"Name"`
}

// ItemOperationSpec is the spec of an item-operations record: the backup fields for
// a backup, the restore fields for a restore.
type ItemOperationSpec struct {
	BackupName         string                     `json:"backupName,omitempty"`
	BackupUID          string                     `json:"backupUID,omitempty"`
	BackupItemAction   string                     `json:"backupItemAction,omitempty"`
	RestoreName        string                     `json:"restoreName,omitempty"`
	RestoreUID         string                     `json:"restoreUID,omitempty"`
	RestoreItemAction  string                     `json:"restoreItemAction,omitempty"`
	ResourceIdentifier VeleroResourceIdentifier   `json:"resourceIdentifier"`
	OperationID        string                     `json:"operationID"`
	PostOperationItems []VeleroResourceIdentifier `json:"postOperationItems,omitempty"`
}

// ItemOperationStatus is the status of an item-operations record.
type ItemOperationStatus struct {
	Phase          OperationPhase `json:"phase"`
	Error          string         `json:"error,omitempty"`
	NCompleted     int64          `json:"nCompleted,omitempty"`
	NTotal         int64          `json:"nTotal,omitempty"`
	OperationUnits string         `json:"operationUnits,omitempty"`
	Description    string         `json:"description,omitempty"`
	Created        *time.Time     `json:"created,omitempty"`
	Started        *time.Time     `json:"started,omitempty"`
	Updated        *time.Time     `json:"updated,omitempty"`
}

// ItemOperation is one record of the -itemoperations.json.gz file.
type ItemOperation struct {
	Spec   ItemOperationSpec   `json:"spec"`
	Status ItemOperationStatus `json:"status"`
}

// OwnerUpdate is a subscription notification's result (WebSocket only; this client
// waits with Wait instead, but the type is part of the document).
type OwnerUpdate struct {
	Owner      Owner       `json:"owner"`
	Operations []Operation `json:"operations"`
	Lagged     bool        `json:"lagged"`
}
