"""The E2B Python SDK against `kvbox serve --tls`, with nothing but the
SDK's own defaults for the sandbox's traffic: no E2B_SANDBOX_URL, so envd
is reached at https://49983-ID.DOMAIN (HTTP/2 where the SDK's transport
negotiates it), each name resolved by the system's resolver and serve's
certificate verified against its CA (SSL_CERT_FILE). Run by TestServe's
TLS step; not a pytest module.

Environment: E2B_API_URL (https://ADDR), E2B_API_KEY, KVBOX_TEMPLATE,
KVBOX_TEMPLATE_PAGE, KVBOX_SERVE_ADDR."""

import os

from e2b import Sandbox

assert "E2B_SANDBOX_URL" not in os.environ
assert os.environ["E2B_API_URL"].startswith("https://")
port = os.environ["KVBOX_SERVE_ADDR"].rsplit(":", 1)[1]

sbx = Sandbox.create(os.environ["KVBOX_TEMPLATE"], timeout=300, request_timeout=600)
try:
    r = sbx.commands.run("echo over-tls; hostname")
    assert r.stdout == f"over-tls\n{sbx.sandbox_id}\n", r.stdout
    sbx.files.write("/home/user/tls-py.txt", "written over TLS")
    assert sbx.files.read("/home/user/tls-py.txt") == "written over TLS"
    assert sbx.is_running() is True
    host = sbx.get_host(8000)
    assert host == f"8000-{sbx.sandbox_id}.kvbox.localhost:{port}", host
    print(f"# e2b (Python): envd of {sbx.sandbox_id} over https, names from the resolver")
finally:
    Sandbox.kill(sbx.sandbox_id, request_timeout=600)
assert Sandbox.kill(sbx.sandbox_id, request_timeout=600) is False
