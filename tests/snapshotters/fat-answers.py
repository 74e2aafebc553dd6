"""Socket snapshotters whose answers are valid JSON padded with spaces to a size under
the agent's 16 MiB limit, for tests of what such answers may make the agent hold.

usage: fat-answers.py DIR COUNT PAD_MIB
Serves COUNT snapshotters on DIR/fat-0.sock ...; each answers every Progress call
"completed". Every answer is sent but its last byte, which is held until every
snapshotter not yet answered is holding its answer or had its answer cut off by the
agent: so an agent that reads every answer whole holds all of them at once, without the
test waiting for time to pass. Prints "ready" once serving.
"""
import http.server
import json
import os
import socketserver
import sys
import threading

directory, count, pad = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) << 20
changed = threading.Condition()
# Per snapshotter, what became of its latest answer.
state = ["idle"] * count
released = 0


def settle():
    """Releases the held answers once nothing else can come (called holding `changed`)."""
    global released
    waiting = [s for s in state if s != "delivered"]
    if "held" in waiting and all(s in ("held", "failed") for s in waiting):
        released += 1
        changed.notify_all()


def handler(index):
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def address_string(self):
            return "unix"

        def do_POST(self):
            calls = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            answers = [
                {"jsonrpc": "2.0", "id": c["id"],
                 "result": {"completed": True, "nCompleted": 1, "nTotal": 1}}
                for c in calls
            ]
            body = json.dumps(answers).encode() + b" " * pad
            with changed:
                state[index] = "sending"
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            try:
                for start in range(0, len(body) - 1, 1 << 20):
                    self.wfile.write(body[start:min(start + (1 << 20), len(body) - 1)])
                self.wfile.flush()
            except OSError:
                with changed:
                    state[index] = "failed"
                    settle()
                return
            with changed:
                state[index] = "held"
                seen = released
                settle()
                changed.wait_for(lambda: released != seen)
            try:
                self.wfile.write(body[-1:])
                self.wfile.flush()
                outcome = "delivered"
            except OSError:
                outcome = "failed"
            with changed:
                state[index] = outcome
                settle()

    return Handler


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


for i in range(count):
    path = os.path.join(directory, "fat-%d.sock" % i)
    server = Server(path, handler(i))
    threading.Thread(target=server.serve_forever, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()
