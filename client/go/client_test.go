package opmon_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptrace"
	"os"
	"strings"
	"testing"
	"time"

	opmon "opmon/client"
	"opmon/client/internal/agenttest"
)

// A whole backup through every owner method, against the real agent.
func TestABackupFromStartToFinalize(t *testing.T) {
	f := newFixture(t)
	backups := f.client.Backups()
	object, err := opmon.Object(map[string]any{"kind": "Backup", "metadata": map[string]any{"name": "nightly"}})
	if err != nil {
		t.Fatal(err)
	}
	owner, err := backups.Start(ctx(t), opmon.StartParams{
		Name: "nightly", UID: "u-1", ItemOperationTimeout: opmon.D(time.Hour), Object: object,
		Server: &opmon.ServerRef{Name: "velero", Instance: "pod-1"},
	})
	if err != nil {
		t.Fatal(err)
	}
	if owner.Phase != opmon.PhaseInProgress || owner.ItemOperationTimeout.Std() != time.Hour || owner.Server.Instance != "pod-1" {
		t.Fatalf("started: %+v", owner)
	}
	created := time.Now().Add(-time.Minute).UTC().Truncate(time.Second)
	ops := []opmon.NewOperation{op("gate-a", "a"), op("done-b", "b")}
	ops[0].Created = &created
	added, err := backups.AddOperations(ctx(t), opmon.AddOperationsParams{Name: "nightly", Operations: ops})
	if err != nil || added.Added != 2 || added.AlreadyKnown != 0 {
		t.Fatalf("addOperations: %+v, %v", added, err)
	}
	// The same operations again: idempotent.
	again, err := backups.AddOperations(ctx(t), opmon.AddOperationsParams{Name: "nightly", Operations: ops})
	if err != nil || again.Added != 0 || again.AlreadyKnown != 2 {
		t.Fatalf("addOperations again: %+v, %v", again, err)
	}
	owner, err = backups.EndInProgress(ctx(t), opmon.EndInProgressParams{Name: "nightly", Warnings: 1})
	if err != nil || owner.Phase != opmon.PhaseWaitingForPluginOperations || owner.Warnings != 1 {
		t.Fatalf("endInProgress: %+v, %v", owner, err)
	}
	unfinished, err := backups.Operations(ctx(t), opmon.OperationsParams{Name: "nightly", Phases: []opmon.OperationPhase{opmon.OperationNew, opmon.OperationInProgress}})
	if err != nil || len(unfinished) != 1 || unfinished[0].OperationID != "gate-a" || !unfinished[0].Created.Equal(created) {
		t.Fatalf("operations: %+v, %v", unfinished, err)
	}
	// A short wait times out with the owner as it is.
	waited, err := backups.Wait(ctx(t), opmon.WaitParams{Name: "nightly", Until: opmon.UntilReadyToFinalize, Timeout: opmon.D(0)})
	if err != nil || !waited.TimedOut || waited.Owner.Phase != opmon.PhaseWaitingForPluginOperations {
		t.Fatalf("wait 0s: %+v, %v", waited, err)
	}
	f.snapshotter.Open("gate-a")
	waited, err = backups.Wait(ctx(t), opmon.WaitParams{Name: "nightly", Until: opmon.UntilReadyToFinalize, Timeout: opmon.D(time.Minute)})
	if err != nil || waited.TimedOut || waited.Owner.Phase != opmon.PhaseFinalizing {
		t.Fatalf("wait: %+v, %v", waited, err)
	}
	records, err := backups.ItemOperations(ctx(t), opmon.OwnerParams{Name: "nightly"})
	if err != nil || len(records) != 2 || records[0].Spec.BackupName != "nightly" || records[0].Status.Phase != opmon.OperationCompleted {
		t.Fatalf("itemOperations: %+v, %v", records, err)
	}
	result, err := backups.Finalize(ctx(t), opmon.FinalizeParams{Name: "nightly"})
	if err != nil || result.Owner.Phase != opmon.PhaseCompleted || result.ItemOperationsFile == "" {
		t.Fatalf("finalize: %+v, %v", result, err)
	}
	if _, err := os.Stat(result.ItemOperationsFile); err != nil {
		t.Fatalf("the item-operations file: %v", err)
	}
	// A repeated finalize answers the first result.
	repeat, err := backups.Finalize(ctx(t), opmon.FinalizeParams{Name: "nightly"})
	if err != nil || repeat.ItemOperationsFile != result.ItemOperationsFile {
		t.Fatalf("finalize again: %+v, %v", repeat, err)
	}
	page, err := backups.List(ctx(t), opmon.ListParams{Phases: []opmon.OwnerPhase{opmon.PhaseCompleted}})
	if err != nil || len(page.Items) != 1 || page.Items[0].Name != "nightly" || page.Next != nil {
		t.Fatalf("list: %+v, %v", page, err)
	}
	events, err := backups.Events(ctx(t), opmon.EventsParams{Name: "nightly"})
	if err != nil || len(events.Items) == 0 || events.Items[0].Reason != "Started" || events.Items[0].Caller == nil {
		t.Fatalf("events: %+v, %v", events, err)
	}
	status, err := f.client.AgentStatus(ctx(t))
	if err != nil || status.Owners["Completed"] != 1 || !status.HasFeature("cancel") || status.APIVersion == "" {
		t.Fatalf("agent.status: %+v, %v", status, err)
	}
	deleted, err := backups.Delete(ctx(t), opmon.OwnerParams{Name: "nightly"})
	if err != nil || deleted.Count() != 0 {
		t.Fatalf("delete: %+v, %v", deleted, err)
	}
}

// The agent-wide methods, and cancel and server.started on restores.
func TestSnapshottersServersAndCancel(t *testing.T) {
	f := newFixture(t)
	list, err := f.client.SnapshotterList(ctx(t))
	if err != nil || len(list) != 1 || list[0].Name != agenttest.Plugin || list[0].Socket == nil {
		t.Fatalf("snapshotter.list: %+v, %v", list, err)
	}
	if err := f.client.SnapshotterChanged(ctx(t), opmon.SnapshotterChangedParams{Plugin: agenttest.Plugin, Operations: []string{"x"}}); err != nil {
		t.Fatalf("snapshotter.changed: %v", err)
	}
	restores := f.client.Restores()
	if _, err := restores.Start(ctx(t), opmon.StartParams{Name: "r", UID: "u", Server: &opmon.ServerRef{Name: "velero", Instance: "old"}}); err != nil {
		t.Fatal(err)
	}
	restarted, err := f.client.ServerStarted(ctx(t), opmon.ServerStartedParams{Name: "velero", Instance: "new"})
	if err != nil || len(restarted.Failed) != 1 || restarted.Failed[0].Kind != opmon.Restore || restarted.Failed[0].Name != "r" {
		t.Fatalf("server.started: %+v, %v", restarted, err)
	}
	if _, err := restores.Start(ctx(t), opmon.StartParams{Name: "r2", UID: "u"}); err != nil {
		t.Fatal(err)
	}
	ops := []opmon.NewOperation{op("gate-1", "a"), op("gate-2", "b")}
	for i := range ops {
		ops[i].Plugin.Kind = opmon.RestoreItemAction
	}
	if _, err := restores.AddOperations(ctx(t), opmon.AddOperationsParams{Name: "r2", Operations: ops}); err != nil {
		t.Fatal(err)
	}
	reason := "the user asked"
	canceled, err := restores.Cancel(ctx(t), opmon.CancelParams{Name: "r2", Operations: []opmon.OperationSelector{opmon.ByID("gate-1")}, Reason: &reason})
	if err != nil || canceled.Canceled != 1 || canceled.Owner.Phase != opmon.PhaseInProgress {
		t.Fatalf("cancel one: %+v, %v", canceled, err)
	}
	// A repeated cancel of the same operation is refused with 1003 (not InProgress).
	_, err = restores.Cancel(ctx(t), opmon.CancelParams{Name: "r2", Operations: []opmon.OperationSelector{opmon.ByItem("gate-1", ops[0].Resource)}})
	var wrong *opmon.RPCError
	if !errors.As(err, &wrong) || wrong.Code != opmon.CodeWrongPhase {
		t.Fatalf("cancel again: %v", err)
	}
	// The agent's data says which operation is in which phase.
	var data struct {
		Operation struct {
			OperationID string               `json:"operationId"`
			Phase       opmon.OperationPhase `json:"phase"`
		} `json:"operation"`
	}
	if err := json.Unmarshal(wrong.Data, &data); err != nil || data.Operation.OperationID != "gate-1" || data.Operation.Phase != opmon.OperationCanceled {
		t.Fatalf("the data of %v: %+v, %v", wrong, data, err)
	}
	operations, err := restores.Operations(ctx(t), opmon.OperationsParams{Name: "r2"})
	if err != nil || len(operations) != 2 {
		t.Fatalf("operations: %+v, %v", operations, err)
	}
	for _, o := range operations {
		if o.OperationID == "gate-1" && (o.Phase != opmon.OperationCanceled || !o.Phase.Finished() || !strings.Contains(o.Error, reason)) {
			t.Fatalf("the canceled operation: %+v", o)
		}
	}
	whole, err := restores.Cancel(ctx(t), opmon.CancelParams{Name: "r2"})
	if err != nil || whole.Owner.Phase != opmon.PhaseFailed || !whole.Owner.Phase.Terminal() {
		t.Fatalf("cancel the restore: %+v, %v", whole, err)
	}
	// Pages: owners by name, events by seq.
	one := uint32(1)
	first, err := restores.List(ctx(t), opmon.ListParams{Limit: &one})
	if err != nil || len(first.Items) != 1 || first.Items[0].Name != "r" || first.Next == nil {
		t.Fatalf("list, first page: %+v, %v", first, err)
	}
	second, err := restores.List(ctx(t), opmon.ListParams{Limit: &one, After: first.Next})
	if err != nil || len(second.Items) != 1 || second.Items[0].Name != "r2" {
		t.Fatalf("list, second page: %+v, %v", second, err)
	}
	events, err := restores.Events(ctx(t), opmon.EventsParams{Name: "r2", Limit: &one})
	if err != nil || len(events.Items) != 1 || events.Next == nil {
		t.Fatalf("events, first page: %+v, %v", events, err)
	}
	more, err := restores.Events(ctx(t), opmon.EventsParams{Name: "r2", After: events.Next})
	if err != nil || len(more.Items) == 0 || more.Items[0].Seq <= events.Items[0].Seq {
		t.Fatalf("events, next page: %+v, %v", more, err)
	}
	// delete cancels what is unfinished, and says how many under both spellings.
	startWith(t, f, "doomed", op("gate-d", "d"))
	deleted, err := f.client.Backups().Delete(ctx(t), opmon.OwnerParams{Name: "doomed"})
	if err != nil || deleted.Canceled != 1 || deleted.Cancelled != 1 || deleted.Count() != 1 {
		t.Fatalf("delete: %+v, %v", deleted, err)
	}
	removed, err := f.client.SnapshotterUnregister(ctx(t), agenttest.Plugin)
	if err != nil || removed.Name != agenttest.Plugin {
		t.Fatalf("snapshotter.unregister: %+v, %v", removed, err)
	}
	doc, err := f.client.RPCDiscover(ctx(t))
	if err != nil || doc["openrpc"] == nil {
		t.Fatalf("rpc.discover: %v", err)
	}
}

// The agent's error answers keep their code and message; the HTTP status comes along.
func TestErrorsCarryTheCodeAndMessage(t *testing.T) {
	f := newFixture(t)
	_, err := f.client.Backups().Get(ctx(t), opmon.OwnerParams{Name: "missing"})
	var rpc *opmon.RPCError
	if !errors.As(err, &rpc) || rpc.Code != opmon.CodeNotFound || rpc.Message != "backup missing not found" || rpc.HTTPStatus != 200 {
		t.Fatalf("get of a missing backup: %#v", err)
	}
	if _, err := f.client.Backups().Start(ctx(t), opmon.StartParams{Name: "b", UID: "one"}); err != nil {
		t.Fatal(err)
	}
	_, err = f.client.Backups().Start(ctx(t), opmon.StartParams{Name: "b", UID: "two"})
	if opmon.Code(err) != opmon.CodeAlreadyExists {
		t.Fatalf("start with another uid: %v", err)
	}
	_, err = f.client.Backups().AddOperations(ctx(t), opmon.AddOperationsParams{Name: "b", Operations: []opmon.NewOperation{op("x", "a/b")}})
	if !errors.As(err, &rpc) || rpc.Code != opmon.CodeInvalidParams || !strings.HasPrefix(rpc.Message, "operations[0].resource.name: ") {
		t.Fatalf("an item name with '/': %v", err)
	}
	// Data, as the agent sends it: a request over max_request_size.
	small := newFixture(t, "--max-request-size", "1024")
	_, err = small.client.Backups().Start(ctx(t), opmon.StartParams{Name: "b", UID: strings.Repeat("u", 2048)})
	if !errors.As(err, &rpc) || rpc.Code != opmon.CodeOversizedRequest || rpc.HTTPStatus != 413 {
		t.Fatalf("an oversized request: %#v", err)
	}
	t.Logf("oversized: %v", err)
}

// An unknown field and an unknown enumeration value from a newer agent decode.
func TestANewerAgentsAnswerDecodes(t *testing.T) {
	var op opmon.Operation
	raw := `{"plugin":{"kind":"ItemBlockAction","name":"x/y"},"resource":{"resource":"pods","name":"p"},
		"operationId":"o","postOperationItems":[],"phase":"Cancelled","error":"","nCompleted":1,"nTotal":2,
		"operationUnits":"","description":"","created":"2026-11-22T09:57:45.123Z","shiny":{"new":true}}`
	if err := json.Unmarshal([]byte(raw), &op); err != nil {
		t.Fatal(err)
	}
	if op.Plugin.Kind != "ItemBlockAction" || op.Phase != "Cancelled" || !op.Phase.Finished() {
		t.Fatalf("%+v", op)
	}
}

// delete's count reads from this agent (both spellings) and from an older one (only
// the deprecated cancelled).
func TestDeleteCountReadsEitherSpelling(t *testing.T) {
	for _, raw := range []string{`{"canceled":3,"cancelled":3}`, `{"cancelled":3}`, `{"canceled":3}`} {
		var r opmon.DeleteResult
		if err := json.Unmarshal([]byte(raw), &r); err != nil || r.Count() != 3 {
			t.Errorf("%s: %+v, %v", raw, r, err)
		}
	}
}

// A call that cannot be sent (no agent) is tried again until the agent comes back;
// Connect fails at once when nothing listens.
func TestACallWaitsForTheAgentToComeBack(t *testing.T) {
	f := newFixture(t)
	startWith(t, f, "b")
	f.agent.Kill()
	if _, err := opmon.Connect(ctx(t), f.agent.Socket); err == nil || !errors.Is(err, os.ErrNotExist) && !isRefused(err) {
		t.Fatalf("connect to a killed agent: %v", err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := f.client.Backups().Get(ctx(t), opmon.OwnerParams{Name: "b"})
		done <- err
	}()
	f.agent.Restart()
	if err := <-done; err != nil {
		t.Fatalf("get across the restart: %v", err)
	}
}

func isRefused(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && strings.Contains(op.Err.Error(), "refused")
}

// writtenThen is a context whose trace runs then once the request is written (the
// standard library's httptrace, which the client's own hooks add to).
func writtenThen(parent context.Context, then func()) context.Context {
	fired := false
	return httptrace.WithClientTrace(parent, &httptrace.ClientTrace{
		WroteRequest: func(httptrace.WroteRequestInfo) {
			if !fired {
				fired = true
				then()
			}
		},
	})
}

// A wait, safe to repeat, sent to an agent that dies before answering is sent again
// once the agent is back and answers as one wait.
func TestASafeCallSucceedsAcrossAnAgentRestart(t *testing.T) {
	f := newFixture(t)
	startWith(t, f, "w", op("gate-a", "a"))
	if _, err := f.client.Backups().EndInProgress(ctx(t), opmon.EndInProgressParams{Name: "w"}); err != nil {
		t.Fatal(err)
	}
	// Stopped, the agent cannot answer: the request is certainly in flight when killed.
	f.agent.Stop()
	restarted := make(chan struct{})
	c := writtenThen(ctx(t), func() {
		go func() {
			f.agent.Restart()
			f.snapshotter.Open("gate-a")
			close(restarted)
		}()
	})
	waited, err := f.client.Backups().Wait(c, opmon.WaitParams{Name: "w", Until: opmon.UntilReadyToFinalize, Timeout: opmon.D(5 * time.Minute)})
	<-restarted
	if err != nil || waited.TimedOut || waited.Owner.Phase != opmon.PhaseFinalizing {
		t.Fatalf("wait across the restart: %+v, %v\n%s", waited, err, f.agent.LogText())
	}
}

// endInProgress, not safe to repeat, reports that its outcome is unknown when the agent
// dies in the middle of it (it polls every operation before answering; the snapshotter
// holds the poll); reading back tells, and the call can then be made.
func TestAnUnsafeCallReportsItsOutcomeUnknownAcrossARestart(t *testing.T) {
	f := newFixture(t)
	startWith(t, f, "e", op("hold-a", "a"))
	done := make(chan error, 1)
	go func() {
		_, err := f.client.Backups().EndInProgress(ctx(t), opmon.EndInProgressParams{Name: "e"})
		done <- err
	}()
	<-f.snapshotter.Held // the agent is in the middle of endInProgress
	f.agent.Kill()
	err := <-done
	var interrupted *opmon.InterruptedError
	if !errors.Is(err, opmon.ErrOutcomeUnknown) || !errors.As(err, &interrupted) || interrupted.Method != "backup.endInProgress" {
		t.Fatalf("endInProgress interrupted by a kill: %v", err)
	}
	f.snapshotter.Release("hold-a")
	f.agent.Restart()
	owner, err := f.client.Backups().Get(ctx(t), opmon.OwnerParams{Name: "e"})
	if err != nil || owner.Phase != opmon.PhaseInProgress {
		t.Fatalf("read back: %+v, %v", owner, err)
	}
	owner, err = f.client.Backups().EndInProgress(ctx(t), opmon.EndInProgressParams{Name: "e"})
	if err != nil || owner.Phase != opmon.PhaseFinalizing {
		t.Fatalf("endInProgress after reading back: %+v, %v", owner, err)
	}
	// delete, also unsafe, sent to a stopped agent that is then killed.
	f.agent.Stop()
	c := writtenThen(ctx(t), func() { go f.agent.Kill() })
	if _, err := f.client.Backups().Delete(c, opmon.OwnerParams{Name: "e"}); !errors.Is(err, opmon.ErrOutcomeUnknown) {
		t.Fatalf("delete interrupted by a kill: %v", err)
	}
}

// The context bounds a call: cancelled, a wait ends with its error; an unsafe call
// cancelled after it was sent says its outcome is unknown.
func TestTheContextEndsACall(t *testing.T) {
	f := newFixture(t)
	startWith(t, f, "c", op("gate-a", "a"))
	if _, err := f.client.Backups().EndInProgress(ctx(t), opmon.EndInProgressParams{Name: "c"}); err != nil {
		t.Fatal(err)
	}
	parent, cancel := context.WithCancel(context.Background())
	c := writtenThen(parent, cancel)
	_, err := f.client.Backups().Wait(c, opmon.WaitParams{Name: "c", Until: opmon.UntilTerminal, Timeout: opmon.D(10 * time.Minute)})
	if !errors.Is(err, context.Canceled) || errors.Is(err, opmon.ErrOutcomeUnknown) {
		t.Fatalf("a cancelled wait: %v", err)
	}
	f.agent.Stop()
	parent, cancel = context.WithCancel(context.Background())
	c = writtenThen(parent, cancel)
	_, err = f.client.Backups().Cancel(c, opmon.CancelParams{Name: "c"})
	if !errors.Is(err, context.Canceled) || !errors.Is(err, opmon.ErrOutcomeUnknown) {
		t.Fatalf("a cancelled cancel: %v", err)
	}
}

// Over max_connections_per_uid the agent answers 429 before reading the request: the
// client tries again and the call succeeds once a connection is free.
func TestARefusedConnectionIsTriedAgain(t *testing.T) {
	f := newFixture(t, "--max-connections-per-uid", "1")
	f.client.Close()
	// Answered, the held connection surely has the uid's one slot (the fixture's
	// connections give theirs back as the agent sees them closed).
	var held net.Conn
	if !agenttest.Eventually(time.Minute, func() bool {
		conn, err := net.Dial("unix", f.agent.Socket)
		if err != nil {
			t.Fatal(err)
		}
		body := `{"jsonrpc":"2.0","id":1,"method":"agent.status"}`
		fmt.Fprintf(conn, "POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		answer, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil || answer.StatusCode != 200 {
			conn.Close()
			return false
		}
		held = conn
		return true
	}) {
		t.Fatal("no connection was admitted")
	}
	defer held.Close()
	refused := make(chan struct{})
	released := false
	c := httptrace.WithClientTrace(ctx(t), &httptrace.ClientTrace{
		GotFirstResponseByte: func() {
			if !released {
				released = true
				close(refused)
			}
		},
	})
	go func() { <-refused; held.Close() }()
	if _, err := f.client.AgentStatus(c); err != nil {
		t.Fatalf("agent.status after a 429: %v", err)
	}
}
