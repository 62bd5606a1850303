"""E2B's code-interpreter Python SDK, its AsyncSandbox, against kvbox serve:
one sandbox on one event loop for the module, through the calls the sync
tests prove, in their async form (callbacks that are coroutines)."""

import asyncio
import base64

import pytest
from e2b_code_interpreter import AsyncSandbox
from e2b import NotFoundException, TimeoutException

from conftest import CELL, REQUEST_TIMEOUT, plain, stdout


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def sbx(loop):
    s = loop.run_until_complete(AsyncSandbox.create(timeout=1800, request_timeout=REQUEST_TIMEOUT))
    yield s
    loop.run_until_complete(s.kill())


async def run(sbx, code, **kw):
    kw.setdefault("timeout", CELL)
    return await sbx.run_code(code, **kw)


def test_state_results_and_data(loop, sbx):
    async def t():
        assert AsyncSandbox.default_template == "code-interpreter-v1"
        ex = await run(sbx, "x = 41\nx + 1")
        assert ex.text == "42"
        assert (await run(sbx, "x")).text == "41"
        ex = await run(sbx, "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 2])\nplt.show()")
        assert base64.b64decode([r for r in ex.results if r.png][0].png)[:4] == b"\x89PNG"
        ex = await run(sbx, 'import pandas as pd\npd.DataFrame({"k": ["a", "b"], "v": [0.5, 2]}).describe()')
        assert ex.results[0].data == {"v": [2.0, 1.25, 1.0606601717798212, 0.5, 0.875, 1.25, 1.625, 2.0]}
    loop.run_until_complete(t())


def test_async_callbacks_stream(loop, sbx):
    async def t():
        seen = []

        async def out(m):
            seen.append(("out", m.line))
            if "first" in m.line:
                await sbx.files.write("/tmp/go-async", "go")

        async def err(m):
            seen.append(("err", m.line))

        errors = []

        async def on_error(e):
            errors.append(e.name)

        ex = await run(sbx, "\n".join([
            "import os, sys, time",
            'print("first", flush=True)',
            'print("to stderr", file=sys.stderr, flush=True)',
            'while not os.path.exists("/tmp/go-async"):',
            "    time.sleep(0.1)",
            'print("second", flush=True)',
            "raise ValueError('after the streams')",
        ]), on_stdout=out, on_stderr=err, on_error=on_error)
        assert seen == [("out", "first\n"), ("err", "to stderr\n"), ("out", "second\n")]
        assert (ex.error.name, ex.error.value) == ("ValueError", "after the streams")
        assert "raise ValueError" in plain(ex.error.traceback)
        assert errors == ["ValueError"]
    loop.run_until_complete(t())


def test_contexts(loop, sbx):
    # A bash context, as in the sync tests.
    async def t():
        ctx = await sbx.create_code_context(language="bash", cwd="/tmp")
        assert (ctx.language, ctx.cwd) == ("bash", "/tmp")
        assert ctx.id in [c.id for c in await sbx.list_code_contexts()]
        await run(sbx, "Y=7", context=ctx)
        assert stdout(await run(sbx, 'echo "$Y $(pwd)"', context=ctx)) == "7 /tmp\n"
        await sbx.restart_code_context(ctx)
        assert stdout(await run(sbx, 'echo "[$Y]"', context=ctx)) == "[]\n"
        await sbx.remove_code_context(ctx.id)
        assert ctx.id not in [c.id for c in await sbx.list_code_contexts()]
        with pytest.raises(NotFoundException):
            await run(sbx, "1", context=ctx)
        assert (await run(sbx, "x")).text == "41"
    loop.run_until_complete(t())


def test_timeout_interrupts_an_endless_loop(loop, sbx):
    async def t():
        with pytest.raises(TimeoutException):
            await run(sbx, "n = 0\nwhile True:\n    n += 1", timeout=5)
        assert (await run(sbx, "n > 0, x", timeout=300)).text == "(True, 41)"
    loop.run_until_complete(t())
