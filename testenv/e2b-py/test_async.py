"""The E2B Python SDK's async client (AsyncSandbox) against kvbox serve: one
sandbox, on one event loop for the module, through the calls the sync
tests prove, in their async form (the async client watches a directory with
a stream, where the sync one polls)."""

import asyncio
import uuid

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    CommandExitException,
    FilesystemEventType,
    NotFoundException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)

from conftest import PAGE, REQUEST_TIMEOUT, TEMPLATE, host_get, sdk_version

RUN = uuid.uuid4().hex[:8]
META = {"suite": "py-async", "sdk": sdk_version(), "run": RUN}


@pytest.fixture(scope="module")
def loop():
    lp = asyncio.new_event_loop()
    yield lp
    lp.close()


@pytest.fixture(scope="module")
def sbx(loop):
    s = loop.run_until_complete(
        AsyncSandbox.create(TEMPLATE, timeout=900, metadata=META, envs={"FOO": "async"}, request_timeout=REQUEST_TIMEOUT))
    yield s
    loop.run_until_complete(AsyncSandbox.kill(s.sandbox_id, request_timeout=REQUEST_TIMEOUT))


async def until(what, cond, tries=600, every=0.1):
    for _ in range(tries):
        if await cond():
            return
        await asyncio.sleep(every)
    pytest.fail(f"{what}: not seen after {tries} polls")


def test_create_info_and_list(loop, sbx):
    async def t():
        r = await sbx.commands.run('echo "$FOO $E2B_SANDBOX_ID"; id -un')
        assert r.stdout == f"async {sbx.sandbox_id}\nuser\n"
        info = await sbx.get_info()
        assert info.state == SandboxState.RUNNING and info.metadata == META
        assert await sbx.is_running() is True
        listed = await AsyncSandbox.list(query=SandboxQuery(metadata=META), request_timeout=REQUEST_TIMEOUT).next_items()
        assert [s.sandbox_id for s in listed] == [sbx.sandbox_id]
        assert host_get(sbx.get_host(8000)) == (200, PAGE)
    loop.run_until_complete(t())


def test_commands(loop, sbx):
    async def t():
        out = []
        with pytest.raises(CommandExitException) as e:
            await sbx.commands.run("echo one; echo two; exit 3", on_stdout=out.append)
        assert e.value.exit_code == 3 and "".join(out) == "one\ntwo\n"
        with pytest.raises(TimeoutException):
            await sbx.commands.run("sleep 30", timeout=2)
        seen = []
        h = await sbx.commands.run("while :; do echo tick; sleep 0.2; done", background=True, on_stdout=seen.append)

        async def ticked():
            return "tick" in "".join(seen)
        await until("output of a background command", ticked)
        assert any(p.pid == h.pid for p in await sbx.commands.list())
        assert await sbx.commands.kill(h.pid) is True
        with pytest.raises(CommandExitException):
            await h.wait()
        assert not any(p.pid == h.pid for p in await sbx.commands.list())
    loop.run_until_complete(t())


def test_files_and_watch(loop, sbx):
    async def t():
        d = f"/home/user/async-{RUN}"
        assert await sbx.files.make_dir(d) is True
        events = []
        w = await sbx.files.watch_dir(d, on_event=events.append)
        await sbx.files.write(f"{d}/new.txt", "async data")

        async def created():
            return any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in events)
        await until("a create event", created, 300, 0.2)
        await w.stop()
        assert await sbx.files.read(f"{d}/new.txt") == "async data"
        assert [e.name for e in await sbx.files.list(d)] == ["new.txt"]
        await sbx.files.rename(f"{d}/new.txt", f"{d}/moved.txt")
        assert (await sbx.files.get_info(f"{d}/moved.txt")).size == len("async data")
        await sbx.files.remove(f"{d}/moved.txt")
        await sbx.files.remove(f"{d}/moved.txt")  # not there: a no-op
        assert await sbx.files.exists(f"{d}/moved.txt") is False
        with pytest.raises(NotFoundException):
            await sbx.files.read(f"{d}/moved.txt")
        async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT) as c:
            r = await c.post(sbx.upload_url(f"{d}/up.txt"), files={"file": ("x", b"signed")})
            assert r.status_code == 200, r.text
            r = await c.get(sbx.download_url(f"{d}/up.txt"))
            assert r.status_code == 200 and r.text == "signed"
    loop.run_until_complete(t())


def test_timeout_pause_connect_kill(loop, sbx):
    async def t():
        await sbx.set_timeout(1200)
        a = (await sbx.get_info()).end_at
        await AsyncSandbox.connect(sbx.sandbox_id, timeout=60, request_timeout=REQUEST_TIMEOUT)
        assert (await sbx.get_info()).end_at == a
        await sbx.commands.run("echo before > /tmp/state")
        assert await sbx.pause() is True
        assert await sbx.is_running() is False
        again = await AsyncSandbox.connect(sbx.sandbox_id, timeout=900, request_timeout=REQUEST_TIMEOUT)
        assert await again.is_running() is True
        assert await again.files.read("/tmp/state") == "before\n"
        sid = sbx.sandbox_id
        assert await AsyncSandbox.kill(sid, request_timeout=REQUEST_TIMEOUT) is True
        assert await sbx.is_running() is False
        with pytest.raises(NotFoundException):
            await AsyncSandbox.get_info(sid, request_timeout=REQUEST_TIMEOUT)
        with pytest.raises(TimeoutException):
            await sbx.commands.run("true")
    loop.run_until_complete(t())
