package opmon

import (
	"context"
	"encoding/json"
	"time"
)

// AgentStatus calls agent.status: version, API version, features, counts.
func (c *Client) AgentStatus(ctx context.Context) (*AgentStatus, error) {
	var r AgentStatus
	return &r, c.Call(ctx, "agent.status", nil, &r)
}

// ServerStarted calls server.started: the backup server Name now runs as Instance. The
// agent fails the InProgress owners earlier instances of Name started, and answers
// which; a repeat fails nothing more.
func (c *Client) ServerStarted(ctx context.Context, p ServerStartedParams) (*ServerStartedResult, error) {
	var r ServerStartedResult
	return &r, c.Call(ctx, "server.started", p, &r)
}

// SnapshotterRegister calls snapshotter.register: persisted, it replaces an earlier
// registration of the name.
func (c *Client) SnapshotterRegister(ctx context.Context, s Snapshotter) (*Snapshotter, error) {
	var r Snapshotter
	return &r, c.Call(ctx, "snapshotter.register", s, &r)
}

// SnapshotterList calls snapshotter.list.
func (c *Client) SnapshotterList(ctx context.Context) ([]Snapshotter, error) {
	var r []Snapshotter
	return r, c.Call(ctx, "snapshotter.list", nil, &r)
}

// SnapshotterUnregister calls snapshotter.unregister (not repeated after a lost
// answer).
func (c *Client) SnapshotterUnregister(ctx context.Context, name string) (*Snapshotter, error) {
	var r Snapshotter
	return &r, c.Call(ctx, "snapshotter.unregister", nameParams{name}, &r)
}

// SnapshotterChanged calls snapshotter.changed: a snapshotter's hint that makes the
// agent poll those operations now.
func (c *Client) SnapshotterChanged(ctx context.Context, p SnapshotterChangedParams) error {
	return c.Call(ctx, "snapshotter.changed", p, nil)
}

// RPCDiscover calls rpc.discover: the agent's OpenRPC document.
func (c *Client) RPCDiscover(ctx context.Context) (map[string]any, error) {
	var r map[string]any
	return r, c.Call(ctx, "rpc.discover", nil, &r)
}

// Backups are the backup.* methods.
func (c *Client) Backups() Owners { return Owners{c, Backup} }

// Restores are the restore.* methods.
func (c *Client) Restores() Owners { return Owners{c, Restore} }

// Owners are the methods of backups or restores (one implementation for both kinds).
type Owners struct {
	client *Client
	kind   OwnerKind
}

// Kind is the kind of owner these methods are for.
func (o Owners) Kind() OwnerKind { return o.kind }

type nameParams struct {
	Name string `json:"name"`
}

func (o Owners) call(ctx context.Context, verb string, params, result any) error {
	return o.client.Call(ctx, string(o.kind)+"."+verb, params, result)
}

// Start creates the owner in InProgress; the same name and uid again returns it.
func (o Owners) Start(ctx context.Context, p StartParams) (*Owner, error) {
	var r Owner
	return &r, o.call(ctx, "start", p, &r)
}

// AddOperations adds the operations plugins returned; idempotent on (plugin,
// operationId, item): repeats count as AlreadyKnown.
func (o Owners) AddOperations(ctx context.Context, p AddOperationsParams) (*AddOperationsResult, error) {
	var r AddOperationsResult
	return &r, o.call(ctx, "addOperations", p, &r)
}

// EndInProgress ends InProgress and answers the owner in its new phase. Not repeated
// after a lost answer: the error then matches ErrOutcomeUnknown; Get tells.
func (o Owners) EndInProgress(ctx context.Context, p EndInProgressParams) (*Owner, error) {
	var r Owner
	return &r, o.call(ctx, "endInProgress", p, &r)
}

// Get answers the owner: the name's current one, or with p.UID the one of that uid,
// current or retired.
func (o Owners) Get(ctx context.Context, p OwnerParams) (*Owner, error) {
	var r Owner
	return &r, o.call(ctx, "get", p, &r)
}

// History answers every owner that had the name: the current one first, then the
// retired ones (start gave their name to a new uid), latest retired first.
func (o Owners) History(ctx context.Context, name string) ([]Owner, error) {
	var r []Owner
	return r, o.call(ctx, "history", nameParams{name}, &r)
}

// List answers one page of owners.
func (o Owners) List(ctx context.Context, p ListParams) (*OwnerList, error) {
	var r OwnerList
	return &r, o.call(ctx, "list", p, &r)
}

// Operations answers the owner's operations, or those in p.Phases.
func (o Owners) Operations(ctx context.Context, p OperationsParams) ([]Operation, error) {
	var r []Operation
	return r, o.call(ctx, "operations", p, &r)
}

// Wait long-polls until the owner reaches p.Until or p.Timeout (default 30s) passes,
// then answers the owner and whether the time ran out. A long timeout is asked for a
// minute at a time, and after a reconnect the request is sent again with the time
// that is left, so the answer is that of one wait however long it is. The context
// bounds the call: when it ends first, Wait fails with its error.
func (o Owners) Wait(ctx context.Context, p WaitParams) (*WaitResult, error) {
	total := 30 * time.Second
	if p.Timeout != nil {
		total = p.Timeout.Std()
	}
	deadline := time.Now().Add(total)
	method := string(o.kind) + ".wait"
	for {
		var r WaitResult
		var final bool
		slice := func() any {
			left := time.Until(deadline).Round(time.Millisecond)
			if left < 0 {
				left = 0
			}
			final = left <= waitSlice
			if !final {
				left = waitSlice
			}
			return WaitParams{Name: p.Name, Until: p.Until, Timeout: D(left)}
		}
		if err := o.client.call(ctx, method, slice, &r, waitSlice+o.client.callTimeout); err != nil {
			return nil, err
		}
		if !r.TimedOut || final {
			return &r, nil
		}
	}
}

// ItemOperations answers the records of the owner's -itemoperations.json.gz file.
func (o Owners) ItemOperations(ctx context.Context, p OwnerParams) ([]ItemOperation, error) {
	var r []ItemOperation
	return r, o.call(ctx, "itemOperations", p, &r)
}

// Events answers one page of the owner's history, oldest first.
func (o Owners) Events(ctx context.Context, p EventsParams) (*EventList, error) {
	var r EventList
	return &r, o.call(ctx, "events", p, &r)
}

// Finalize finalizes an owner in a Finalizing phase: rewrites the tarball if
// p.Contents is set, writes the item-operations file, moves the owner to its terminal
// phase. A repeat answers the first result. Bounded by the finalize timeout.
func (o Owners) Finalize(ctx context.Context, p FinalizeParams) (*FinalizeResult, error) {
	var r FinalizeResult
	method := string(o.kind) + ".finalize"
	return &r, o.client.call(ctx, method, func() any { return p }, &r, o.client.finalizeTimeout)
}

// Delete removes the owner, cancelling its unfinished operations. Not repeated after a
// lost answer (it could delete an owner re-created under the same name meanwhile).
func (o Owners) Delete(ctx context.Context, p OwnerParams) (*DeleteResult, error) {
	var r DeleteResult
	return &r, o.call(ctx, "delete", p, &r)
}

// Cancel cancels the whole owner (no p.Operations: it ends Failed) or the chosen
// operations (they end Canceled). Not repeated after a lost answer: read back.
func (o Owners) Cancel(ctx context.Context, p CancelParams) (*CancelResult, error) {
	var r CancelResult
	return &r, o.call(ctx, "cancel", p, &r)
}

// Object is a helper for StartParams.Object: v encoded as JSON.
func Object(v any) (json.RawMessage, error) { return json.Marshal(v) }
