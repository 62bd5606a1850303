"""E2B's code-interpreter Python SDK, its sync Sandbox, against kvbox serve:
one sandbox of the default template for the module, through run_code's
results, streams, errors, contexts (and a kernel that dies in one), env
vars, a timeout and a huge output."""

import base64
import os

import pytest
from e2b_code_interpreter import Sandbox
from e2b import NotFoundException, TimeoutException

from conftest import CELL, REQUEST_TIMEOUT, plain, serve_peak_rss, stdout


@pytest.fixture(scope="module")
def sbx():
    # No template: the SDK's default, code-interpreter-v1.
    s = Sandbox.create(timeout=1800, envs={"KV_PY": "sandbox"}, request_timeout=REQUEST_TIMEOUT)
    yield s
    s.kill()


def run(sbx, code, **kw):
    kw.setdefault("timeout", CELL)
    return sbx.run_code(code, **kw)


def test_default_template_and_state(sbx):
    assert Sandbox.default_template == "code-interpreter-v1"
    ex = run(sbx, "x = 41\nx + 1")
    assert ex.error is None
    assert ex.text == "42"
    assert ex.results[0].is_main_result
    ex2 = run(sbx, "x")
    assert ex2.text == "41"
    assert ex2.execution_count > ex.execution_count


def test_template_imported_the_data_stack(sbx):
    ex = run(sbx, 'import sys\nprint(sorted(m for m in ("numpy", "pandas", "matplotlib") if m in sys.modules))')
    assert stdout(ex) == "['matplotlib', 'numpy', 'pandas']\n"


def test_png_from_matplotlib(sbx):
    seen = []
    ex = run(sbx, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()", on_result=seen.append)
    assert ex.error is None
    pngs = [r for r in ex.results if r.png]
    assert len(pngs) == 1, [list(r.formats()) for r in ex.results]
    assert base64.b64decode(pngs[0].png)[:8] == b"\x89PNG\r\n\x1a\n"
    assert not pngs[0].is_main_result
    assert seen == ex.results


def test_dataframe_display_data(sbx):
    ex = run(sbx, 'import pandas as pd\ndf = pd.DataFrame({"a": [1, 2, 3], "b": ["x", "y", None]})\ndf')
    r = ex.results[0]
    assert r.is_main_result
    assert "<table" in r.html
    assert r.data == {"a": [1, 2, 3], "b": ["x", "y", None]}
    assert "data" in r.formats()
    # describe(): its NaN-free statistics; a display() call is a result too,
    # not the cell's own.
    ex = run(sbx, "display(df.head(1))\ndf.describe()")
    shown, main = ex.results
    assert not shown.is_main_result and shown.data == {"a": [1], "b": ["x"]}
    assert main.is_main_result and main.data == {"a": [3.0, 2.0, 1.0, 1.0, 1.5, 2.0, 2.5, 3.0]}
    # NaN is JSON's null, in the data and in an application/json result.
    ex = run(sbx, 'import numpy as np\nfrom IPython.display import JSON\ndisplay(JSON({"n": 1.5}))\npd.DataFrame({"f": [1.5, np.nan]})')
    assert ex.results[0].json == {"n": 1.5}
    assert ex.results[1].data == {"f": [1.5, None]}


def test_error_with_traceback(sbx):
    errs = []
    ex = run(sbx, "def f():\n    return 1/0\nf()", on_error=errs.append)
    assert ex.error.name == "ZeroDivisionError"
    assert ex.error.value == "division by zero"
    assert "return 1/0" in plain(ex.error.traceback)
    assert errs == [ex.error]
    assert run(sbx, "x").text == "41", "the context goes on after an error"


def test_stdout_and_stderr_stream_while_the_cell_runs(sbx):
    # The cell waits for a file the callback writes once it has the cell's
    # first line: the cell ends only if that line came while it ran.
    seen = []

    def out(m):
        seen.append(("out", m.line, m.error))
        if "first" in m.line:
            sbx.files.write("/tmp/go-sync", "go")

    ex = run(sbx, "\n".join([
        "import os, sys, time",
        'print("first", flush=True)',
        'print("to stderr", file=sys.stderr, flush=True)',
        'while not os.path.exists("/tmp/go-sync"):',
        "    time.sleep(0.1)",
        'print("second")',
    ]), on_stdout=out, on_stderr=lambda m: seen.append(("err", m.line, m.error)))
    assert ex.error is None
    assert seen == [("out", "first\n", False), ("err", "to stderr\n", True), ("out", "second\n", False)]
    assert ex.logs.stdout == ["first\n", "second\n"] and ex.logs.stderr == ["to stderr\n"]


def test_contexts(sbx):
    # A bash context: its kernel starts in seconds, a Python one's with the
    # prelude's imports takes far longer under emulation (the JS run
    # creates and restarts Python ones).
    b = sbx.create_code_context(language="bash", cwd="/tmp")
    assert (b.language, b.cwd) == ("bash", "/tmp")
    listed = sbx.list_code_contexts()
    assert any(c.id == b.id for c in listed)
    assert any(c.language == "python" for c in listed), "the default python context"
    assert stdout(run(sbx, "M=1; pwd", context=b)) == "/tmp\n"
    assert stdout(run(sbx, 'echo "[$M]"', context=b)) == "[1]\n"
    sbx.restart_code_context(b)
    assert stdout(run(sbx, 'echo "[$M]"', context=b)) == "[]\n"
    # Its kernel dies (SIGKILL from the cell): the cell says so, and the
    # next, until a restart.
    died = run(sbx, "kill -9 $PPID", context=b)
    assert died.error.name == "DeadKernelError", died
    nxt = run(sbx, "echo hi", context=b)
    assert nxt.error.name == "DeadKernelError"
    assert "restart" in nxt.error.value
    sbx.restart_code_context(b.id)
    assert stdout(run(sbx, "echo back", context=b)) == "back\n"
    sbx.remove_code_context(b)
    assert not any(c.id == b.id for c in sbx.list_code_contexts())
    with pytest.raises(NotFoundException):
        run(sbx, "1", context=b)
    # A language by name: its default context, the warm one for python.
    assert run(sbx, "x", language="python").text == "41", "the default context kept its state"


def test_env_vars(sbx):
    code = 'import os\nprint(os.environ.get("KV_PY"), os.environ.get("KV_CALL"))'
    assert stdout(run(sbx, code)) == "sandbox None\n"
    assert stdout(run(sbx, code, envs={"KV_PY": "call", "KV_CALL": "it's"})) == "call it's\n"
    assert stdout(run(sbx, code)) == "sandbox None\n"


def test_timeout_interrupts_an_endless_loop(sbx):
    with pytest.raises(TimeoutException):
        run(sbx, "n = 0\nwhile True:\n    n += 1", timeout=5)
    # The next cell runs only once the loop is over: had the kernel not
    # been interrupted when the SDK went, this would wait out its bound.
    ex = run(sbx, "n > 0, x", timeout=300)
    assert ex.text == "(True, 41)"


def test_huge_output_streams_through_serve(sbx):
    # 32 MiB of stdout reaches the client whole, one chunk a line, while
    # kvbox serve's memory grows by far less than that: it streams.
    mib = 32
    with open("/proc/%s/clear_refs" % os.environ["KVBOX_SERVE_PID"], "w") as f:
        f.write("5")  # resets serve's peak resident memory to what it has now
    base = serve_peak_rss()
    ex = run(sbx, "import sys\nfor _ in range(%d):\n    sys.stdout.write('x' * (1 << 20))\n    sys.stdout.flush()\nprint('end')" % mib)
    assert ex.error is None
    out = stdout(ex)
    assert len(out) == (mib << 20) + len("end\n")
    assert out.endswith("xend\n") and out.count("x") == mib << 20
    grew = serve_peak_rss() - base
    assert grew < (mib << 20) // 2, "kvbox serve's peak memory grew by %d MiB passing %d MiB" % (grew >> 20, mib)
    print("serve's peak memory grew by %.1f MiB passing %d MiB of output" % (grew / (1 << 20), mib))
