#!/usr/bin/env python3
"""Validates an agent's logged API traffic against opmon's OpenRPC document.

The test harness starts every agent of the end-to-end suite with the log filter
`opmon_traffic=trace`; the agent then logs each exchange it serves (the request as the
peer sent it, the response it got, and every subscription notification) as a line
ending in `opmon_traffic: exchange={...}`. This program reads such logs and checks
each exchange with the `jsonschema` package, independently of the Rust code:

  * a request the document admits gets a result matching the method's result schema,
    or an error whose code the method documents;
  * a request the document refuses (the suite sends many wrong on purpose) gets an
    error, with a code the method documents (-32601 for a method it does not list);
  * a batch is an array of requests answered by an array, paired by id;
  * a notification's result matches the subscription's `x-notification` schema.

Two modes:

  traffic.py DOCUMENT LOG...     validates the logs, prints a summary line of JSON,
                                 exits 1 with the first mismatch on stderr.
  traffic.py DOCUMENT --serve    reads one log path per line on stdin and answers each
                                 with one line of JSON: {"ok": true, "exchanges": N} or
                                 {"ok": false, "error": "..."} (the harness keeps one
                                 process per test binary, so Python starts once).
"""

import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from drive import Document  # noqa: E402  (the same validation rules as the driver)

MARKER = " opmon_traffic: exchange="


# Where a log record starts: its timestamp and level.
RECORD = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z\s+(TRACE|DEBUG|INFO|WARN|ERROR) ")


def exchanges(path):
    """The logged exchanges of the log at `path`, as parsed JSON objects."""
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, 1):
            at = line.find(MARKER)
            if at < 0 or not line.endswith("\n"):
                # A last line without its newline was cut by a SIGKILL mid-write.
                continue
            text = line[at + len(MARKER):].rstrip("\n")
            try:
                yield number, json.loads(text)
            except json.JSONDecodeError as e:
                # An exchange cut by a SIGKILL mid-write, and the next run's first record
                # appended to it: the cut one is skipped, the record read on its own.
                later = RECORD.search(text)
                if later is None:
                    raise AssertionError(f"{path}:{number}: logged exchange is not JSON ({e}): "
                                         f"{text[:500]}")
                rest = text[later.start():]
                at = rest.find(MARKER)
                if at >= 0:
                    yield number, json.loads(rest[at + len(MARKER):])


def subscription_of(document, notification_method):
    for method in document.doc["methods"]:
        if method.get("x-notification", {}).get("method") == notification_method:
            return method
    raise AssertionError(f"notification {notification_method} is not in the document")


def check_call(document, request, response):
    method = request.get("method")
    if method in document.methods and not document.is_valid_request(request):
        # Sent wrong on purpose: the agent must refuse it, with a code it documents.
        if "error" not in response:
            raise AssertionError(f"{method}: the document refuses {json.dumps(request)[:1000]}"
                                 f" but the agent answered {json.dumps(response)[:1000]}")
    elif method in document.methods:
        document.check_request(request)
    document.check_response(method, response, request.get("id"))


def check_exchange(document, exchange):
    if "notification" in exchange:
        method = subscription_of(document, exchange["notification"])
        schema = method["x-notification"]["params"]["properties"]["result"]
        document.check(schema, exchange["result"], f"{exchange['notification']} result")
        document.counts["notifications"] += 1
        return
    request, response = exchange["request"], exchange["response"]
    if isinstance(request, list):
        if not isinstance(response, list):
            # A batch as a whole may be refused with one error the document lists.
            if (response.get("id") is None and "error" in response
                    and response["error"].get("code") in document.error_codes):
                document.counts["errors"] += 1
                return
            raise AssertionError(f"a batch answered with {json.dumps(response)[:1000]}")
        by_id = {json.dumps(r.get("id")): r for r in response}
        for call in request:
            answer = by_id.get(json.dumps(call.get("id")))
            if answer is None:
                raise AssertionError(f"batch call {json.dumps(call)[:500]} got no response")
            check_call(document, call, answer)
    else:
        check_call(document, request, response)


def validate(document, path):
    count = 0
    for number, exchange in exchanges(path):
        try:
            check_exchange(document, exchange)
        except AssertionError as e:
            raise AssertionError(f"{path}:{number}: {e}")
        count += 1
    return count


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    document = Document(argv[1])
    if argv[2] == "--serve":
        for line in sys.stdin:
            path = line.rstrip("\n")
            try:
                answer = {"ok": True, "exchanges": validate(document, path)}
            except (AssertionError, OSError) as e:
                answer = {"ok": False, "error": str(e)}
            print(json.dumps(answer), flush=True)
        return
    total = sum(validate(document, path) for path in argv[2:])
    print(json.dumps({"exchanges": total, **document.counts}))


if __name__ == "__main__":
    try:
        main(sys.argv)
    except AssertionError as e:
        print(f"traffic.py: {e}", file=sys.stderr)
        sys.exit(1)
