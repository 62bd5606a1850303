"""Shared by the E2B Python SDK's runs against kvbox serve (TestServePython).

The environment names kvbox serve and the template: E2B_API_URL,
E2B_SANDBOX_URL and E2B_API_KEY (serve's), KVBOX_TEMPLATE (a snapshot of the
Debian image whose HTTP server on port 8000 answers KVBOX_TEMPLATE_PAGE),
KVBOX_SERVE_ADDR (host:port of serve, where get_host's names are sent).
"""

import http.client
import os
import time

import e2b
import pytest

TEMPLATE = os.environ["KVBOX_TEMPLATE"]
PAGE = os.environ["KVBOX_TEMPLATE_PAGE"]
SERVE_HOST, SERVE_PORT = os.environ["KVBOX_SERVE_ADDR"].rsplit(":", 1)
API_URL = os.environ["E2B_API_URL"]
API_KEY = os.environ["E2B_API_KEY"]

# Clones under emulation on a shared machine take seconds each, and
# creates queue behind each other: generous request timeouts.
REQUEST_TIMEOUT = 600


def sdk_version():
    from importlib.metadata import version

    return version("e2b")


def at_least(major, minor):
    v = tuple(int(x) for x in sdk_version().split(".")[:2])
    return v >= (major, minor)


def until(what, cond, tries=600, every=0.1):
    """Polls cond (bounded) for what arrives asynchronously."""
    for _ in range(tries):
        if cond():
            return
        time.sleep(every)
    pytest.fail(f"{what}: not seen after {tries} polls")


def host_get(host, path="/"):
    """GET path from kvbox serve with the Host a get_host name gives, as a
    browser resolving *.localhost to the loopback would send it."""
    c = http.client.HTTPConnection(SERVE_HOST, int(SERVE_PORT), timeout=REQUEST_TIMEOUT)
    try:
        c.request("GET", path, headers={"Host": host})
        r = c.getresponse()
        return r.status, r.read().decode()
    finally:
        c.close()


def pytest_report_header(config):
    return f"e2b {sdk_version()} against kvbox serve {API_URL}, template {TEMPLATE}"
