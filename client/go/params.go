package opmon

import "encoding/json"

// The params of the methods, by name as the agent takes them. Optional fields are
// pointers or omitted when zero, so the agent applies its documented defaults.

// StartParams are start's: Name and UID are required.
type StartParams struct {
	Name string `json:"name"`
	UID  string `json:"uid"`
	// Default 4h0m0s.
	ItemOperationTimeout *Duration `json:"itemOperationTimeout,omitempty"`
	// Override the snapshotters' stall and start deadlines for this owner (0: off).
	StallTimeout *Duration `json:"stallTimeout,omitempty"`
	StartTimeout *Duration `json:"startTimeout,omitempty"`
	// Pass through Finalizing and wait for finalize. Absent: true for a backup, the
	// agent's restore_finalize setting for a restore.
	Finalize *bool `json:"finalize,omitempty"`
	// The backup server's own representation of the owner, passed to snapshotters.
	Object json.RawMessage `json:"object,omitempty"`
	// The backup server instance, for server.started.
	Server *ServerRef `json:"server,omitempty"`
}

// AddOperationsParams are addOperations'.
type AddOperationsParams struct {
	Name       string         `json:"name"`
	Operations []NewOperation `json:"operations"`
}

// EndInProgressParams are endInProgress's.
type EndInProgressParams struct {
	Name     string `json:"name"`
	Errors   uint32 `json:"errors,omitempty"`
	Warnings uint32 `json:"warnings,omitempty"`
	// The backup or restore failed outright: Failed, unfinished operations cancelled.
	Failed bool `json:"failed,omitempty"`
}

// OwnerParams name one owner: the name's current one, or with UID the one of that uid,
// current or retired (Owner.Retired).
type OwnerParams struct {
	Name string  `json:"name"`
	UID  *string `json:"uid,omitempty"`
}

// ListParams are list's: every field optional.
type ListParams struct {
	Phases []OwnerPhase `json:"phases,omitempty"`
	// Page size; default 100, at most 1000.
	Limit *uint32 `json:"limit,omitempty"`
	// The previous page's Next.
	After *string `json:"after,omitempty"`
}

// OperationsParams are operations': all of the owner's, or those in Phases.
type OperationsParams struct {
	Name string `json:"name"`
	// The owner of this uid, current or retired; nil: the name's current owner.
	UID    *string          `json:"uid,omitempty"`
	Phases []OperationPhase `json:"phases,omitempty"`
}

// WaitParams are wait's. Timeout defaults to 30s; the client splits longer waits into
// requests of at most a minute, and a context deadline shortens it.
type WaitParams struct {
	Name    string    `json:"name"`
	Until   WaitUntil `json:"until"`
	Timeout *Duration `json:"timeout,omitempty"`
}

// EventsParams are events'.
type EventsParams struct {
	Name string `json:"name"`
	// The owner of this uid, current or retired; nil: the name's current owner.
	UID *string `json:"uid,omitempty"`
	// The previous page's Next.
	After *uint64 `json:"after,omitempty"`
	// Page size; default 100, at most 1000.
	Limit *uint32 `json:"limit,omitempty"`
}

// FinalizeParams are finalize's.
type FinalizeParams struct {
	Name string `json:"name"`
	// Backups: rewrite the tarball Input into Output with the updated items.
	Contents     *Contents     `json:"contents,omitempty"`
	UpdatedItems []UpdatedItem `json:"updatedItems,omitempty"`
	// Counted by the finalize step; added to the owner's.
	Errors   uint32 `json:"errors,omitempty"`
	Warnings uint32 `json:"warnings,omitempty"`
}

// CancelParams are cancel's: without Operations the whole owner (it ends Failed).
type CancelParams struct {
	Name       string              `json:"name"`
	Operations []OperationSelector `json:"operations,omitempty"`
	// Default "canceled by request".
	Reason *string `json:"reason,omitempty"`
}

// ServerStartedParams are server.started's.
type ServerStartedParams struct {
	// "" addresses the owners started without a server.
	Name     string `json:"name"`
	Instance string `json:"instance"`
}

// SnapshotterChangedParams are snapshotter.changed's.
type SnapshotterChangedParams struct {
	Plugin string `json:"plugin"`
	// At most 1000; nil: any of the plugin's operations.
	Operations []string `json:"operations,omitempty"`
}
