package opmon

import (
	"encoding/json"
	"errors"
	"fmt"
)

// JSON-RPC error codes the agent answers (client/REFERENCE.md, "Errors").
const (
	CodeParseError             = -32700
	CodeInvalidRequest         = -32600
	CodeMethodNotFound         = -32601
	CodeInvalidParams          = -32602
	CodeInternalError          = -32603
	CodeRefused                = -32003
	CodeTooManySubscriptions   = -32006
	CodeOversizedRequest       = -32007
	CodeOversizedResponse      = -32008
	CodeOversizedBatchResponse = -32011
	CodeNotFound               = 1001
	CodeAlreadyExists          = 1002
	CodeWrongPhase             = 1003
	CodeStorageFailure         = 1004
	CodeFinalizeFailed         = 1005
)

// ErrOutcomeUnknown is matched (errors.Is) by the error of a call that reached the agent
// and whose answer was lost, when the method is not safe to send again (endInProgress,
// delete, cancel, snapshotter.unregister): the agent may or may not have applied it.
// Read the owner back to see.
var ErrOutcomeUnknown = errors.New("the call may or may not have been applied")

// RPCError is the agent's JSON-RPC error answer.
type RPCError struct {
	Method  string
	Code    int
	Message string
	// The error's data member as sent, nil when absent.
	Data json.RawMessage
	// The HTTP status the answer came with: 200 for an answered call; 403 or 429 for
	// a connection the agent did not admit (Code -32003), 413, 415, 400, 408.
	HTTPStatus int
}

func (e *RPCError) Error() string {
	if len(e.Data) > 0 {
		return fmt.Sprintf("%s: %s (code %d, data %s)", e.Method, e.Message, e.Code, e.Data)
	}
	return fmt.Sprintf("%s: %s (code %d)", e.Method, e.Message, e.Code)
}

// Code is the JSON-RPC code of err if it is (or wraps) an RPCError, else 0.
func Code(err error) int {
	var rpc *RPCError
	if errors.As(err, &rpc) {
		return rpc.Code
	}
	return 0
}

// InterruptedError: the connection broke, or the context ended, after Method was sent,
// and Method is not safe to send again. errors.Is(err, ErrOutcomeUnknown) holds;
// Unwrap gives the cause (an I/O error, context.Canceled, context.DeadlineExceeded).
type InterruptedError struct {
	Method string
	Err    error
}

func (e *InterruptedError) Error() string {
	return fmt.Sprintf("%s was sent to the opmon agent and its answer was lost, so it may or may not have been applied (read back to see): %v", e.Method, e.Err)
}

func (e *InterruptedError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, ErrOutcomeUnknown) hold.
func (e *InterruptedError) Is(target error) bool { return target == ErrOutcomeUnknown }

// TransportError: the agent could not be reached, or broke the exchange, and the
// call was not (or, for a safe method, no longer) retried because its time was up.
type TransportError struct {
	Method string
	Socket string
	// Whether the request was sent (on the last attempt).
	Sent bool
	// Why the call ended: the I/O error, or the context's when the call's time ran out
	// or its context was cancelled while it was tried again.
	Err error
	// The failure of the last attempt before the context ended, if there was one.
	Last error
}

func (e *TransportError) Error() string {
	what := "cannot reach the opmon agent"
	if e.Sent {
		what = "talking to the opmon agent"
	}
	if e.Last != nil {
		return fmt.Sprintf("%s: %s at %s: %v; the last attempt: %v", e.Method, what, e.Socket, e.Err, e.Last)
	}
	return fmt.Sprintf("%s: %s at %s: %v", e.Method, what, e.Socket, e.Err)
}

func (e *TransportError) Unwrap() error { return e.Err }

// ProtocolError: the agent's answer was not what the protocol says (not JSON-RPC, an
// HTTP error without a JSON-RPC body, a result of another type, too large).
type ProtocolError struct {
	Method string
	What   string
	Err    error
}

func (e *ProtocolError) Error() string {
	if e.Err != nil {
		return fmt.Sprintf("%s: the opmon agent answered %s: %v", e.Method, e.What, e.Err)
	}
	return fmt.Sprintf("%s: the opmon agent answered %s", e.Method, e.What)
}

func (e *ProtocolError) Unwrap() error { return e.Err }
