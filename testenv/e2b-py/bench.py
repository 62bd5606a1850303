"""The Python SDK's side of make bench's serve section
(testenv/bench/serve.go), with e2b's sync Sandbox: one command a line on
stdin, each answered with a JSON line, as testenv/e2b/bench.mjs does for the
JS SDK.

  one   Sandbox.create(KVBOX_TEMPLATE), then commands.run('true'):
        {"create_ms", "first_ms"} (first_ms from before the create); the
        sandbox is killed after it was timed

Environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY, KVBOX_TEMPLATE. Not
a test (pytest collects test_*.py only)."""

import json
import os
import sys
import time

from e2b import Sandbox

TEMPLATE = os.environ["KVBOX_TEMPLATE"]


def one():
    t0 = time.perf_counter()
    sbx = Sandbox.create(TEMPLATE, timeout=600, request_timeout=600)
    t1 = time.perf_counter()
    try:
        sbx.commands.run("true")
        t2 = time.perf_counter()
    finally:
        sbx.kill()
    return {"create_ms": (t1 - t0) * 1000, "first_ms": (t2 - t0) * 1000}


for line in sys.stdin:
    args = line.split()
    try:
        if args[:1] == ["one"]:
            out = one()
        else:
            out = {"error": "unknown command %r" % line.strip()}
    except Exception as e:
        out = {"error": "%s: %s" % (type(e).__name__, e)}
    print(json.dumps(out), flush=True)
