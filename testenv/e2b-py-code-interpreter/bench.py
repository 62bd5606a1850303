"""The Python SDK's side of make bench's codeinterp section
(testenv/bench/codeinterp.go), with e2b-code-interpreter's sync Sandbox: one
command a line on stdin, each answered with a JSON line.

  trivial TEMPLATE N   one sandbox: N run_code('1') and N commands.run('true'),
                       alternated, after one of each not counted:
                       {"cell_ms": [...], "command_ms": [...]}

Environment: E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY. Not a test (pytest
collects test_*.py only)."""

import json
import sys
import time

from e2b_code_interpreter import Sandbox


def trivial(template, n):
    sbx = Sandbox.create(template, timeout=600, request_timeout=600)
    try:
        sbx.run_code("1", timeout=600)
        sbx.commands.run("true")
        cells, commands = [], []
        for _ in range(n):
            t0 = time.perf_counter()
            ex = sbx.run_code("1", timeout=600)
            cells.append((time.perf_counter() - t0) * 1000)
            if ex.error is not None or ex.text != "1":
                raise RuntimeError("run_code('1') gave %r" % (ex,))
            t0 = time.perf_counter()
            sbx.commands.run("true")
            commands.append((time.perf_counter() - t0) * 1000)
        return {"cell_ms": cells, "command_ms": commands}
    finally:
        sbx.kill()


for line in sys.stdin:
    args = line.split()
    try:
        if args[:1] == ["trivial"]:
            out = trivial(args[1], int(args[2]))
        else:
            out = {"error": "unknown command %r" % line.strip()}
    except Exception as e:
        out = {"error": "%s: %s" % (type(e).__name__, e)}
    print(json.dumps(out), flush=True)
