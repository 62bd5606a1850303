"""Shared by the runs of E2B's code-interpreter Python SDK
(e2b-code-interpreter, unmodified) against kvbox serve, in
TestCodeInterpreter, on clones of the SDK's default template
code-interpreter-v1 (a box of the code-interpreter image snapshotted with its
kernel up and the data stack imported).

Environment: E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY (serve's),
KVBOX_SERVE_PID (serve's process, whose memory the huge-output test reads).
"""

import os
import re
import time

import pytest

# Clones under emulation on a shared machine take seconds each: generous
# request timeouts, and a cell's bound far above what a cell here takes.
REQUEST_TIMEOUT = 600
CELL = 600


def sdk_version():
    from importlib.metadata import version

    return version("e2b-code-interpreter")


def stdout(ex):
    return "".join(ex.logs.stdout)


def plain(traceback):
    """A traceback without the colours IPython gives it."""
    return re.sub(r"\x1b\[[0-9;]*m", "", traceback)


def serve_peak_rss():
    """kvbox serve's peak resident memory so far (VmHWM), in bytes."""
    with open("/proc/%s/status" % os.environ["KVBOX_SERVE_PID"]) as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    pytest.fail("no VmHWM for kvbox serve")


def until(what, cond, tries=600, every=0.1):
    """Polls cond (bounded) for what arrives asynchronously."""
    for _ in range(tries):
        if cond():
            return
        time.sleep(every)
    pytest.fail(f"{what}: not seen after {tries} polls")


def pytest_report_header(config):
    return f"e2b-code-interpreter {sdk_version()} against kvbox serve {os.environ['E2B_API_URL']}"
