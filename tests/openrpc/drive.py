#!/usr/bin/env python3
"""A backup server and a snapshotter written from opmon's OpenRPC documents alone.

Run by tests/tests/openrpc.rs. Two modes:

  drive.py drive --socket S --document opmon.json --snapshotter-document snapshotter.json
           --state DIR
      Talks to a running agent over its Unix socket (HTTP POST / and WebSocket, stdlib
      only), validates every request it sends and every response and notification it
      gets against the documents with the `jsonschema` package (an independent
      validator: nothing here comes from the Rust code), drives a backup and a restore
      to Completed, and prints one summary line of JSON.

  drive.py snapshotter DOCUMENT STATE_DIR (progress|cancel) -- OPERATION_ID
      A command snapshotter: reads the call's params on stdin, validates them and its
      own answer against the snapshotter document, prints the answer. An operation whose
      ID starts with "done-" is complete at once; any other completes once the file
      STATE_DIR/release-<ID> exists (the driver creates it), so no step waits on time.
"""

import argparse
import base64
import http.client
import json
import os
import socket
import struct
import sys

import jsonschema


# ---------------------------------------------------------------- validation


class Document:
    """An OpenRPC document and validators for its methods' params and results."""

    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            self.doc = json.load(f)
        self.methods = {m["name"]: m for m in self.doc["methods"]}
        # Every schema of the document is a valid draft 7 schema.
        schemas = list(self.doc["components"]["schemas"].values())
        for m in self.doc["methods"]:
            schemas += [p["schema"] for p in m["params"]] + [m["result"]["schema"]]
            if "x-notification" in m:
                schemas.append(m["x-notification"]["params"])
        for schema in schemas:
            jsonschema.Draft7Validator.check_schema(schema)
        self.error_codes = {e["code"] for e in self.doc["components"]["errors"].values()}
        self.counts = {"requests": 0, "responses": 0, "notifications": 0, "errors": 0}
        self.called = set()

    def _validator(self, schema):
        # The root carries the components, so "#/components/schemas/X" resolves in it.
        root = {"allOf": [schema], "components": self.doc["components"]}
        cls = jsonschema.validators.validator_for(root, default=jsonschema.Draft7Validator)
        return cls(root, format_checker=cls.FORMAT_CHECKER)

    def check(self, schema, value, what):
        errors = sorted(self._validator(schema).iter_errors(value), key=str)
        if errors:
            raise AssertionError(f"{what} does not match the document: {errors[0].message} "
                                 f"at {list(errors[0].absolute_path)}: {json.dumps(value)[:2000]}")

    def method(self, name):
        if name not in self.methods:
            raise AssertionError(f"method {name} is not in the document")
        return self.methods[name]

    def params_schema(self, method):
        params = method["params"]
        if method.get("paramStructure") == "by-position":
            return {"type": "array", "items": [p["schema"] for p in params],
                    "minItems": sum(1 for p in params if p.get("required")),
                    "maxItems": len(params)}
        return {
            "type": "object",
            "properties": {p["name"]: p["schema"] for p in params},
            "required": [p["name"] for p in params if p.get("required")],
            "additionalProperties": False,
        }

    def check_request(self, request):
        self.check({"type": "object", "required": ["jsonrpc", "method"],
                    "properties": {"jsonrpc": {"const": "2.0"}, "method": {"type": "string"}}},
                   request, "request")
        method = self.method(request["method"])
        self.check(self.params_schema(method), request.get("params", {}),
                   f"params of {request['method']}")
        self.counts["requests"] += 1
        self.called.add(request["method"])

    def check_response(self, method_name, response, request_id):
        """Validates one response; an error must carry a code the method documents."""
        self.check({"type": "object", "required": ["jsonrpc", "id"],
                    "properties": {"jsonrpc": {"const": "2.0"}},
                    "oneOf": [{"required": ["result"]}, {"required": ["error"]}]},
                   response, "response")
        if response["id"] != request_id:
            raise AssertionError(f"response id {response['id']!r} for request {request_id!r}")
        if "error" in response:
            self.check({"type": "object", "required": ["code", "message"],
                        "properties": {"code": {"type": "integer"}, "message": {"type": "string"}}},
                       response["error"], "error")
            code = response["error"]["code"]
            method = self.methods.get(method_name)
            allowed = {e["code"] for e in method["errors"]} if method else {-32601}
            if code not in allowed:
                raise AssertionError(f"{method_name} answered code {code}, which the document "
                                     f"does not list for it ({sorted(allowed)}): {response}")
            self.counts["errors"] += 1
        else:
            method = self.method(method_name)
            self.check(method["result"]["schema"], response["result"], f"result of {method_name}")
        self.counts["responses"] += 1

    def is_valid_request(self, request):
        """Whether the document admits `request` (for requests sent wrong on purpose)."""
        try:
            self.check_request(request)
        except AssertionError:
            return False
        self.counts["requests"] -= 1
        return True

    def check_envelope_error(self, response, code):
        """An error about the request as a whole (not JSON, too big): a code of the
        document's components, id null."""
        self.check({"type": "object", "required": ["jsonrpc", "id", "error"],
                    "properties": {"jsonrpc": {"const": "2.0"}, "id": {"const": None},
                                   "error": {"type": "object", "required": ["code", "message"],
                                             "properties": {"code": {"const": code}}}}},
                   response, "error response")
        if code not in self.error_codes:
            raise AssertionError(f"error code {code} is not in the document's components")
        self.counts["responses"] += 1
        self.counts["errors"] += 1

    def check_notification(self, subscribe_method, message):
        notification = self.method(subscribe_method)["x-notification"]
        self.check({"type": "object", "required": ["jsonrpc", "method", "params"],
                    "not": {"required": ["id"]},
                    "properties": {"method": {"const": notification["method"]}}},
                   message, "notification")
        self.check(notification["params"], message["params"], f"{notification['method']} params")
        self.counts["notifications"] += 1


# ---------------------------------------------------------------- transports


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path):
        super().__init__("localhost", timeout=120)
        self.unix_path = path

    def connect(self):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(120)
        self.sock.connect(self.unix_path)


class Agent:
    """JSON-RPC over HTTP POST / on the agent's socket; every call validated."""

    def __init__(self, path, document):
        self.path = path
        self.doc = document
        self.conn = UnixHTTPConnection(path)
        self.next_id = 0

    def post(self, body):
        self.conn.request("POST", "/", body=body, headers={"Content-Type": "application/json"})
        reply = self.conn.getresponse()
        return reply.status, json.loads(reply.read())

    def request(self, method, params=None, valid=True):
        """Sends a request; returns the whole validated response. A request sent wrong on
        purpose (`valid=False`) must be one the document refuses too."""
        self.next_id += 1
        request = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            request["params"] = params
        if not valid:
            if self.doc.is_valid_request(request):
                raise AssertionError(f"the document admits {request}, which is sent as invalid")
            self.doc.counts["refused"] = self.doc.counts.get("refused", 0) + 1
        elif method in self.doc.methods:
            self.doc.check_request(request)
        _, response = self.post(json.dumps(request).encode())
        self.doc.check_response(method, response, self.next_id)
        return response

    def call(self, method, params=None):
        response = self.request(method, params)
        if "error" in response:
            raise AssertionError(f"{method} failed: {response['error']}")
        return response["result"]

    def error(self, method, params, code, valid=True):
        response = self.request(method, params, valid)
        if response.get("error", {}).get("code") != code:
            raise AssertionError(f"{method} {params}: expected error {code}, got {response}")
        return response["error"]["message"]


class WebSocket:
    """A minimal RFC 6455 client on the agent's socket: text frames, masked, no
    extensions; answers pings."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(120)
        self.sock.connect(path)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET / HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                           f"Sec-WebSocket-Version: 13\r\n\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise AssertionError(f"WebSocket handshake: connection closed after {head!r}")
            head += chunk
        if not head.startswith(b"HTTP/1.1 101"):
            raise AssertionError(f"WebSocket handshake refused: {head!r}")

    def _exact(self, n):
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise AssertionError("WebSocket closed by the agent")
            data += chunk
        return data

    def _send_frame(self, opcode, payload):
        mask = os.urandom(4)
        n = len(payload)
        if n < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | n)
        elif n < 1 << 16:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, n)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def send(self, message):
        self._send_frame(0x1, json.dumps(message).encode())

    def receive(self):
        """The next text message, as JSON (fragments joined, pings answered)."""
        parts = []
        while True:
            b0, b1 = self._exact(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack("!H", self._exact(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._exact(8))[0]
            payload = self._exact(n)
            opcode = b0 & 0x0F
            if opcode == 0x9:
                self._send_frame(0xA, payload)
                continue
            if opcode == 0x8:
                raise AssertionError(f"WebSocket closed by the agent: {payload!r}")
            if opcode in (0x1, 0x2, 0x0):
                parts.append(payload)
                if b0 & 0x80:
                    return json.loads(b"".join(parts))


# ---------------------------------------------------------------- the snapshotter


def snapshotter(document_path, state, verb, separator, operation_id):
    if separator != "--":
        raise AssertionError(f"expected -- before the operation ID, got {separator!r}")
    doc = Document(document_path)
    method = {"progress": "operation.progress", "cancel": "operation.cancel"}[verb]
    params = json.load(sys.stdin)
    doc.check_request({"jsonrpc": "2.0", "id": 1, "method": method, "params": params})
    if params["operationId"] != operation_id:
        raise AssertionError(f"stdin names {params['operationId']}, argv {operation_id}")
    if verb == "cancel":
        result = None
        with open(os.path.join(state, f"cancelled-{operation_id}"), "w", encoding="utf-8"):
            pass
    else:
        done = operation_id.startswith("done-") or os.path.exists(
            os.path.join(state, f"release-{operation_id}"))
        result = {"completed": done, "nCompleted": 2 if done else 1, "nTotal": 2,
                  "operationUnits": "steps", "description": "copying",
                  "started": "2026-11-22T10:00:00Z"}
        if done:
            result["updated"] = "2026-11-22T10:01:00Z"
    doc.check_response(method, {"jsonrpc": "2.0", "id": 1, "result": result}, 1)
    with open(os.path.join(state, "validated"), "a", encoding="utf-8") as f:
        f.write(f"{verb} {operation_id}\n")
    if result is not None:
        print(json.dumps(result))


# ---------------------------------------------------------------- the backup server


PLUGIN = "example.io/python"


def op(operation_id, item, kind="BackupItemAction"):
    return {"plugin": {"kind": kind, "name": PLUGIN},
            "resource": {"group": "", "resource": "persistentvolumeclaims",
                         "namespace": "app", "name": item},
            "operationId": operation_id}


def drive(args):
    doc = Document(args.document)
    agent = Agent(args.socket, doc)
    checks = []

    def expect(condition, what):
        if not condition:
            raise AssertionError(what)
        checks.append(what)

    # What the agent says about itself (its document is compared at the end, so that a
    # document that differs shows first where the traffic does not match it).
    discovered = agent.call("rpc.discover")
    status = agent.call("agent.status")
    expect(status["apiVersion"] == doc.doc["info"]["version"], "apiVersion is the document's")
    expect("openrpc" in status["features"], "features list openrpc")

    # The program itself is the command snapshotter of PLUGIN.
    command = [sys.executable, os.path.abspath(__file__), "snapshotter",
               os.path.abspath(args.snapshotter_document), os.path.abspath(args.state)]
    agent.call("snapshotter.register", {"name": PLUGIN, "apiVersion": "v2", "command": command})
    agent.call("snapshotter.register", {"name": "example.io/old", "apiVersion": "v1"})
    expect({s["name"] for s in agent.call("snapshotter.list")} >= {PLUGIN, "example.io/old"},
           "snapshotter.list has both")
    agent.call("snapshotter.unregister", {"name": "example.io/old"})
    expect(agent.call("snapshotter.changed", {"plugin": PLUGIN, "operations": ["x"]}) is None,
           "snapshotter.changed answers null")
    agent.error("snapshotter.changed", {"plugin": "example.io/old"}, 1001)
    agent.error("snapshotter.unregister", {"name": "example.io/old"}, 1001)

    # A backup: InProgress, operations, Waiting, released, Finalizing, Completed.
    server = {"name": "python/server", "instance": "run-1"}
    owner = agent.call("backup.start", {"name": "b1", "uid": "u1", "server": server,
                                        "object": {"metadata": {"name": "b1"}},
                                        "itemOperationTimeout": "1h0m0s"})
    expect(owner["phase"] == "InProgress", "backup starts InProgress")
    expect(agent.call("backup.start", {"name": "b1", "uid": "u1", "server": server})["uid"] == "u1",
           "start again returns the owner")
    agent.error("backup.start", {"name": "b1", "uid": "other"}, 1002)
    agent.error("backup.start", {"name": "B_1", "uid": "u"}, -32602)
    added = agent.call("backup.addOperations", {"name": "b1", "operations": [
        op("done-1", "data"), op("slow-1", "logs")]})
    expect(added == {"added": 2, "alreadyKnown": 0}, "two operations added")
    again = agent.call("backup.addOperations", {"name": "b1", "operations": [op("done-1", "data")]})
    expect(again["alreadyKnown"] == 1, "a repeated operation is already known")
    agent.error("backup.addOperations", {"name": "nope", "operations": []}, 1001)
    waited = agent.call("backup.wait", {"name": "b1", "until": "readyToFinalize", "timeout": "10ms"})
    expect(waited["timedOut"] and waited["owner"]["phase"] == "InProgress",
           "wait on an InProgress backup times out")
    agent.call("backup.get", {"name": "b1"})
    agent.call("backup.list", {"phases": ["InProgress"], "limit": 10})
    agent.call("backup.operations", {"name": "b1", "phases": ["New", "InProgress"]})
    agent.call("backup.itemOperations", {"name": "b1"})

    ws = WebSocket(args.socket)
    subscribe = {"jsonrpc": "2.0", "id": "s1", "method": "backup.subscribe",
                 "params": {"name": "b1"}}
    doc.check_request(subscribe)
    ws.send(subscribe)
    reply = ws.receive()
    doc.check_response("backup.subscribe", reply, "s1")
    subscription = reply["result"]

    ended = agent.call("backup.endInProgress", {"name": "b1", "errors": 0, "warnings": 1})
    expect(ended["phase"] == "WaitingForPluginOperations",
           "endInProgress with an unfinished operation waits for it")
    agent.error("backup.addOperations", {"name": "b1", "operations": [op("x", "y")]}, 1003)
    agent.error("backup.endInProgress", {"name": "b1"}, 1003)
    agent.error("backup.finalize", {"name": "b1"}, 1003)
    with open(os.path.join(args.state, "release-slow-1"), "w", encoding="utf-8"):
        pass
    ready = agent.call("backup.wait", {"name": "b1", "until": "readyToFinalize", "timeout": "5m0s"})
    expect(ready["owner"]["phase"] == "Finalizing", "released operation: Finalizing")
    finalized = agent.call("backup.finalize", {"name": "b1"})
    expect(finalized["owner"]["phase"] == "Completed", "the backup is Completed")
    records = agent.call("backup.itemOperations", {"name": "b1"})
    expect(sorted(r["status"]["phase"] for r in records) == ["Completed", "Completed"],
           "both item operations Completed")
    history = agent.call("backup.events", {"name": "b1", "limit": 2})
    expect(len(history["items"]) == 2 and history["next"] == 2, "a first page of 2 events")
    rest = agent.call("backup.events", {"name": "b1", "after": history["next"]})
    expect(rest["next"] is None and rest["items"][-1]["message"].startswith("Finalizing → Completed"),
           f"the history ends with the finalize ({rest['items'][-1]})")
    expect(history["items"][0]["caller"]["pid"] == os.getpid(),
           "the history names this process as the caller of start")
    agent.error("backup.events", {"name": "b1", "limit": 0}, -32602)

    # The subscription's notifications up to the terminal phase.
    phases = []
    while not phases or phases[-1] != "Completed":
        message = ws.receive()
        doc.check_notification("backup.subscribe", message)
        phases.append(message["params"]["result"]["owner"]["phase"])
    expect("Finalizing" in phases, f"notifications saw Finalizing ({phases})")
    unsubscribe = {"jsonrpc": "2.0", "id": "u1", "method": "backup.unsubscribe",
                   "params": [subscription]}
    doc.check_request(unsubscribe)
    ws.send(unsubscribe)
    while True:
        message = ws.receive()
        if message.get("id") == "u1":
            doc.check_response("backup.unsubscribe", message, "u1")
            break
        doc.check_notification("backup.subscribe", message)

    # A restore that finalizes, then is deleted.
    agent.call("restore.start", {"name": "r1", "uid": "ru1", "finalize": True})
    agent.call("restore.addOperations", {"name": "r1", "operations": [op("done-2", "data", "RestoreItemAction")]})
    expect(agent.call("restore.endInProgress", {"name": "r1"})["phase"] == "Finalizing",
           "a finished restore with finalize goes to Finalizing")
    agent.call("restore.wait", {"name": "r1", "until": "terminal", "timeout": "10ms"})
    agent.call("restore.operations", {"name": "r1"})
    agent.call("restore.itemOperations", {"name": "r1"})
    expect(agent.call("restore.finalize", {"name": "r1", "errors": 1})["owner"]["phase"]
           == "PartiallyFailed", "finalize errors make the restore PartiallyFailed")
    agent.call("restore.list", {})
    agent.call("restore.get", {"name": "r1"})
    agent.call("restore.events", {"name": "r1", "after": 1, "limit": 1000})
    # A new uid takes the name of the ended restore; the old one is kept, retired.
    taken = agent.call("restore.start", {"name": "r1", "uid": "ru1-again"})
    expect(taken["uid"] == "ru1-again" and taken["phase"] == "InProgress",
           "a new uid takes an ended restore's name")
    owners = agent.call("restore.history", {"name": "r1"})
    expect([o["uid"] for o in owners] == ["ru1-again", "ru1"] and "retired" in owners[1]
           and "retired" not in owners[0], f"history: the current one, then the retired ({owners})")
    retired = agent.call("restore.get", {"name": "r1", "uid": "ru1"})
    expect(retired["phase"] == "PartiallyFailed", "the retired restore is found by its uid")
    agent.error("restore.start", {"name": "r1", "uid": "ru1"}, 1002)
    agent.error("restore.start", {"name": "r1", "uid": "ru1-third"}, 1002)
    expect(agent.call("backup.history", {"name": "nope"}) == [], "an unknown name has no history")
    agent.error("restore.finalize", {"name": "r1", "contents": {"input": "a", "output": "b"}},
                -32602)

    # A restore deleted while subscribed: the subscription ends with an error notification.
    agent.call("restore.start", {"name": "r2", "uid": "ru2"})
    subscribe = {"jsonrpc": "2.0", "id": 5, "method": "restore.subscribe",
                 "params": {"name": "r2"}}
    doc.check_request(subscribe)
    ws.send(subscribe)
    while True:
        message = ws.receive()
        if message.get("id") == 5:
            doc.check_response("restore.subscribe", message, 5)
            break
    first = ws.receive()
    doc.check_notification("restore.subscribe", first)
    expect(first["params"]["result"]["owner"]["phase"] == "InProgress",
           "the first notification is the owner as it is")
    agent.call("restore.delete", {"name": "r2"})
    last = ws.receive()
    doc.check_notification("restore.subscribe", last)
    expect("error" in last["params"], f"deleting ends the subscription with an error ({last})")
    unsubscribe = {"jsonrpc": "2.0", "id": 6, "method": "restore.unsubscribe", "params": [12345]}
    doc.check_request(unsubscribe)
    ws.send(unsubscribe)
    reply = ws.receive()
    doc.check_response("restore.unsubscribe", reply, 6)
    expect(reply["result"] is False, "unsubscribing an unknown id answers false")

    # A backup deleted with an unfinished operation: its Cancel reaches the snapshotter.
    agent.call("backup.start", {"name": "b2", "uid": "u2", "server": server})
    agent.call("backup.addOperations", {"name": "b2", "operations": [op("slow-2", "data")]})
    expect(agent.call("backup.delete", {"name": "b2"})["cancelled"] == 1,
           "delete cancels the unfinished operation")
    agent.error("backup.get", {"name": "b2"}, 1001)
    expect(os.path.exists(os.path.join(args.state, "cancelled-slow-2")),
           "the snapshotter got the Cancel")

    # Cancel on demand: one operation of a backup, then a whole restore.
    agent.call("backup.start", {"name": "b5", "uid": "u5"})
    agent.call("backup.addOperations", {"name": "b5", "operations": [op("slow-5", "data"),
                                                                     op("slow-6", "data")]})
    canceled = agent.call("backup.cancel", {"name": "b5", "operations": ["slow-5"],
                                            "reason": "python"})
    expect(canceled["canceled"] == 1 and canceled["owner"]["phase"] == "InProgress",
           "cancelling one operation leaves the backup InProgress")
    phases = [o["phase"] for o in agent.call("backup.operations", {"name": "b5"})]
    expect(phases == ["Canceled", "New"], f"only the chosen operation is Canceled ({phases})")
    agent.error("backup.cancel", {"name": "b5", "operations": ["slow-5"]}, 1003)
    agent.error("backup.cancel", {"name": "b5", "operations": ["nope"]}, 1001)
    agent.call("restore.start", {"name": "r3", "uid": "ru3"})
    agent.call("restore.addOperations", {"name": "r3", "operations": [op("slow-7", "data", "RestoreItemAction")]})
    canceled = agent.call("restore.cancel", {"name": "r3"})
    expect(canceled["owner"]["phase"] == "Failed"
           and canceled["owner"]["failureReason"] == "canceled: canceled by request",
           "a restore canceled whole is Failed with the reason")

    # A restarted backup server fails what its earlier instance left InProgress.
    agent.call("backup.start", {"name": "b3", "uid": "u3", "server": server})
    failed = agent.call("server.started", {"name": "python/server", "instance": "run-2"})
    expect(failed["failed"] == [{"kind": "backup", "name": "b3", "uid": "u3"}],
           "server.started fails the other instance's InProgress backup")
    expect(agent.call("backup.get", {"name": "b3"})["failureReason"] != "", "with a reason")

    # Errors every client meets.
    agent.error("backup.subscribe", {"name": "b1"}, -32601)
    agent.error("backup.explode", {}, -32601, valid=False)
    agent.error("backup.get", ["b1"], -32602, valid=False)
    agent.error("backup.get", {"name": "b1", "extra": 1}, -32602, valid=False)
    agent.error("backup.start", {"name": "b4"}, -32602, valid=False)
    agent.error("backup.wait", {"name": "b1", "until": "soon"}, -32602, valid=False)
    agent.error("backup.start", {"name": "b4", "uid": "u", "itemOperationTimeout": "4 hours"},
                -32602, valid=False)
    agent.error("backup.list", {"limit": 0}, -32602)
    agent.error("agent.status", {"verbose": True}, -32602, valid=False)
    agent.error("rpc.discover", {"verbose": True}, -32602, valid=False)
    status, parse = agent.post(b'{"jsonrpc": "2.0", "id": 1, "method": ')
    doc.check_envelope_error(parse, -32700)
    status, big = agent.post(json.dumps({"jsonrpc": "2.0", "id": 7, "method": "backup.get",
                                         "params": {"name": "x" * args.oversized}}).encode())
    expect(status == 413, f"an oversized request is HTTP 413 (got {status})")
    # The agent cannot know the id of a request it did not read.
    doc.check_envelope_error(big, -32007)
    agent.conn = UnixHTTPConnection(args.socket)

    expect(discovered == doc.doc, "rpc.discover answers the checked-in document")
    uncalled = sorted(set(doc.methods) - doc.called)
    with open(os.path.join(args.state, "validated"), encoding="utf-8") as f:
        snapshotter_calls = len(f.read().splitlines())
    print(json.dumps({"completed": "b1", **doc.counts, "snapshotterCalls": snapshotter_calls,
                      "checks": len(checks), "uncalled": uncalled}))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "snapshotter":
        try:
            snapshotter(*sys.argv[2:7])
        except Exception as e:  # the agent shows stderr's last line as the error
            print(f"python snapshotter: {e}".replace("\n", " "), file=sys.stderr)
            sys.exit(1)
        return
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="mode", required=True)
    d = sub.add_parser("drive")
    d.add_argument("--socket", required=True)
    d.add_argument("--document", required=True)
    d.add_argument("--snapshotter-document", required=True)
    d.add_argument("--state", required=True)
    d.add_argument("--oversized", type=int, required=True,
                   help="bytes of name that put a request over the agent's max_request_size")
    drive(parser.parse_args())


if __name__ == "__main__":
    main()
