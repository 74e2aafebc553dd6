package opmon

import "strings"

// Retry says when the client may send a request again after the connection broke
// before the answer came. It is a fact about the method, the same table as the Rust
// client's (client/src/methods.rs); retry_test.go holds the two together.
type Retry int

const (
	// RetryAlways: a read, or a write the agent makes idempotent (the same request
	// twice has the effect of once and answers alike; a repeated addOperations counts
	// the operations as alreadyKnown).
	RetryAlways Retry = iota
	// RetryIfNotSent: only if the request certainly did not reach the agent. Once
	// sent, a second copy could do harm or mislead: a repeated endInProgress answers
	// "wrong phase" for its own change, a repeated delete could delete an owner
	// re-created under the same name meanwhile, a repeated cancel answers 1003. The
	// caller gets an error matching ErrOutcomeUnknown and reads back.
	RetryIfNotSent
)

func (r Retry) String() string {
	if r == RetryAlways {
		return "Always"
	}
	return "IfNotSent"
}

// ownerVerbs are the methods of owners, the same for backup.* and restore.*, with
// their retry rule.
var ownerVerbs = map[string]Retry{
	"start":          RetryAlways,
	"addOperations":  RetryAlways,
	"endInProgress":  RetryIfNotSent,
	"get":            RetryAlways,
	"history":        RetryAlways,
	"list":           RetryAlways,
	"operations":     RetryAlways,
	"wait":           RetryAlways, // sent again with the time that is left
	"itemOperations": RetryAlways,
	"events":         RetryAlways,
	"finalize":       RetryAlways, // a finalized owner answers the first finalize's result
	"delete":         RetryIfNotSent,
	"cancel":         RetryIfNotSent,
	"subscribe":      RetryAlways,
	"unsubscribe":    RetryAlways,
	"changed":        RetryAlways,
}

// agentMethods that are safe to repeat; every other method outside owners' (including
// snapshotter.unregister and methods of a newer agent) is sent again only if not sent.
var agentMethods = map[string]Retry{
	"agent.status":         RetryAlways,
	"snapshotter.list":     RetryAlways,
	"snapshotter.register": RetryAlways, // replaces the registration with itself
	"server.started":       RetryAlways, // a repeat fails nothing more
	"snapshotter.changed":  RetryAlways, // a hint: a repeat at most polls once more
	"rpc.discover":         RetryAlways,
}

// RetryOf is the retry rule of a method by its full name.
func RetryOf(method string) Retry {
	if r, ok := agentMethods[method]; ok {
		return r
	}
	kind, verb, found := strings.Cut(method, ".")
	if found && (kind == string(Backup) || kind == string(Restore)) {
		if r, ok := ownerVerbs[verb]; ok {
			return r
		}
	}
	return RetryIfNotSent
}
