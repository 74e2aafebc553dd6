// Package opmon is a client of the opmon agent for backup servers written in Go, on
// the standard library alone.
//
// It speaks JSON-RPC 2.0 over HTTP/1.1 on the agent's Unix socket, with every method
// of the API (client/REFERENCE.md, client/openrpc/opmon.json) as a typed call. Calls
// outlive agent restarts: a call that could not be sent is tried again until its
// timeout, and one whose answer was lost is sent again only when the method is safe to
// repeat (RetryOf); otherwise its error matches ErrOutcomeUnknown and the caller reads
// back. The agent's error answers are *RPCError, with the JSON-RPC code and data.
//
// Waiting is Owners.Wait, a long poll of the agent's wait method. The agent's
// WebSocket subscriptions (backup.subscribe) are not offered: the standard library has
// no WebSocket client, and a backup server needs the phase, which wait gives.
package opmon
