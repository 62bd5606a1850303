"""The E2B Python SDK's sync client (Sandbox) against kvbox serve: every
call TestServe proves for the JS SDK, plus the Python SDK's own habits
(its error classes, its client-side key check, HTTP/1.1 over plain HTTP).
A handful of sandboxes, reused across the tests of this module."""

import hashlib
import io
import re
import uuid

import httpx
import pytest
from e2b import (
    AuthenticationException,
    CommandExitException,
    FilesystemEventType,
    NotFoundException,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    PtySize,
    TimeoutException,
)

from conftest import API_KEY, API_URL, PAGE, REQUEST_TIMEOUT, TEMPLATE, at_least, host_get, sdk_version, until

RUN = uuid.uuid4().hex[:8]
META = {"suite": "py-sync", "sdk": sdk_version(), "run": RUN}


@pytest.fixture(scope="module")
def sbx():
    s = Sandbox.create(TEMPLATE, timeout=900, metadata=META, envs={"FOO": "from-create"}, request_timeout=REQUEST_TIMEOUT)
    yield s
    Sandbox.kill(s.sandbox_id, request_timeout=REQUEST_TIMEOUT)


@pytest.fixture(scope="module")
def other():
    """A second sandbox, for listing and for what is refused once it is gone."""
    s = Sandbox.create(TEMPLATE, timeout=900, metadata={"suite": "py-sync", "run": RUN, "other": "yes"}, request_timeout=REQUEST_TIMEOUT)
    yield s
    Sandbox.kill(s.sandbox_id, request_timeout=REQUEST_TIMEOUT)


def test_the_key_passes_the_sdks_check():
    # SDKs from 2.25 check the key's form on the client before sending it.
    assert re.fullmatch(r"e2b_[0-9a-f]+", API_KEY)
    with pytest.raises(AuthenticationException):
        Sandbox.list(api_key="e2b_" + "0" * 40, request_timeout=REQUEST_TIMEOUT).next_items()
    with pytest.raises(AuthenticationException):
        Sandbox.create(TEMPLATE, api_key="not-an-e2b-key", request_timeout=REQUEST_TIMEOUT)


def test_plain_http_is_http1():
    # httpx asked for HTTP/2 (the older SDK's transports) gets HTTP/1.1
    # from a plain-HTTP serve, as from E2B over http://.
    with httpx.Client(http2=True) as c:
        r = c.get(API_URL + "/health")
        assert r.status_code == 204
        assert r.http_version == "HTTP/1.1"
        r = c.post(API_URL + "/sandboxes", json={"templateID": "no-such-template"}, headers={"X-API-KEY": API_KEY})
        assert r.status_code == 404 and r.json()["code"] == 404


def test_create_a_warm_clone(sbx):
    r = sbx.commands.run('echo "$FOO $E2B_SANDBOX_ID"; id -un; hostname')
    assert r.stdout == f"from-create {sbx.sandbox_id}\nuser\n{sbx.sandbox_id}\n"
    assert re.fullmatch(r"[a-z0-9]{20}", sbx.sandbox_id)
    # E2B's base template has a python command.
    r = sbx.commands.run("python --version")
    assert r.exit_code == 0 and (r.stdout + r.stderr).startswith("Python 3.")
    info = sbx.get_info()
    assert info.sandbox_id == sbx.sandbox_id
    assert info.state == SandboxState.RUNNING
    assert info.metadata == META
    assert info.end_at > info.started_at
    assert sbx.is_running() is True


def test_get_host_reaches_the_templates_server(sbx):
    host = sbx.get_host(8000)
    assert host == f"8000-{sbx.sandbox_id}.{sbx.sandbox_domain}"
    assert host_get(host) == (200, PAGE)
    status, _ = host_get(sbx.get_host(8001))
    assert status == 502


def test_commands_output_and_exit_codes(sbx):
    out, err = [], []
    with pytest.raises(CommandExitException) as e:
        sbx.commands.run("for i in 1 2 3; do echo out$i; echo err$i >&2; done; exit 4", on_stdout=out.append, on_stderr=err.append)
    assert e.value.exit_code == 4
    assert "".join(out) == "out1\nout2\nout3\n" and "".join(err) == "err1\nerr2\nerr3\n"
    assert e.value.stdout == "out1\nout2\nout3\n"
    assert sbx.commands.run("true").exit_code == 0
    # A command's timeout is its lifetime, as envd's.
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=2)


def test_background_command_reattached_listed_and_killed(sbx):
    h = sbx.commands.run("i=0; while :; do i=$((i+1)); echo tick $i; sleep 0.2; done", background=True)
    assert any(p.pid == h.pid for p in sbx.commands.list())
    h.disconnect()
    again = sbx.commands.connect(h.pid)
    seen = []
    for stdout, _, _ in again:
        if stdout:
            seen.append(stdout)
        if "tick" in "".join(seen):
            break
    assert sbx.commands.kill(h.pid) is True
    with pytest.raises(CommandExitException):
        again.wait()
    assert not any(p.pid == h.pid for p in sbx.commands.list())
    assert sbx.commands.kill(h.pid) is False


def test_files(sbx):
    d = f"/home/user/py-{RUN}"
    assert sbx.files.make_dir(d) is True
    assert sbx.files.make_dir(d) is False
    sbx.files.write(f"{d}/a.txt", "hello")
    sbx.files.write(f"{d}/b.bin", b"\x00\x01\x02")
    assert sbx.files.read(f"{d}/a.txt") == "hello"
    assert bytes(sbx.files.read(f"{d}/b.bin", format="bytes")) == b"\x00\x01\x02"
    assert sorted(e.name for e in sbx.files.list(d)) == ["a.txt", "b.bin"]
    info = sbx.files.get_info(f"{d}/a.txt")
    assert info.name == "a.txt" and info.size == 5 and info.type.value == "file"
    sbx.files.rename(f"{d}/a.txt", f"{d}/c.txt")
    assert sbx.files.exists(f"{d}/a.txt") is False and sbx.files.exists(f"{d}/c.txt") is True
    assert sbx.commands.run(f"stat -c %U {d}/c.txt").stdout == "user\n"
    sbx.files.remove(f"{d}/c.txt")
    assert sbx.files.exists(f"{d}/c.txt") is False
    # Removing what is not there is a no-op, as in E2B's envd.
    sbx.files.remove(f"{d}/c.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read(f"{d}/c.txt")
    with pytest.raises(NotFoundException):
        sbx.files.get_info(f"{d}/nothing")


def test_python_sdk_habits(sbx):
    """What the Python SDK sends that the JS SDK's run does not: several
    files in one multipart upload, file-like data as octet-stream, gzip
    both ways, a streamed read, a command's own user, directory and
    variables, stdin, and a PTY."""
    d = f"/home/user/habits-{RUN}"
    sbx.files.make_dir(d)
    infos = sbx.files.write_files([{"path": f"{d}/one", "data": "1"}, {"path": f"{d}/two", "data": b"2"}])
    assert sorted(i.path for i in infos) == [f"{d}/one", f"{d}/two"]
    assert sbx.files.read(f"{d}/one") == "1" and sbx.files.read(f"{d}/two") == "2"
    big = bytes(range(256)) * 4096
    sbx.files.write(f"{d}/file-like", io.BytesIO(big))
    assert bytes(sbx.files.read(f"{d}/file-like", format="bytes")) == big
    sbx.files.write(f"{d}/gzipped", big, gzip=True)
    assert bytes(sbx.files.read(f"{d}/gzipped", format="bytes", gzip=True)) == big
    assert b"".join(sbx.files.read(f"{d}/gzipped", format="stream")) == big
    assert sbx.commands.run("sha256sum < gzipped | cut -c1-16", cwd=d).stdout == hashlib.sha256(big).hexdigest()[:16] + "\n"
    r = sbx.commands.run('id -un; pwd; echo "$X"', user="root", cwd="/tmp", envs={"X": "per-command"})
    assert r.stdout == "root\n/tmp\nper-command\n"
    h = sbx.commands.run("read line; echo got $line", background=True, stdin=True)
    sbx.commands.send_stdin(h.pid, "typed\n")
    assert h.wait().stdout == "got typed\n"
    chunks = []
    p = sbx.pty.create(PtySize(rows=24, cols=80))
    sbx.pty.resize(p.pid, PtySize(rows=30, cols=100))
    sbx.pty.send_stdin(p.pid, b"stty size; echo pty-$((40+2)); exit 7\n")
    with pytest.raises(CommandExitException) as e:
        p.wait(on_pty=chunks.append)
    assert e.value.exit_code == 7
    out = b"".join(chunks).decode(errors="replace")
    assert "30 100" in out and "pty-42" in out


def test_watch_dir(sbx):
    # The sync client watches by polling (CreateWatcher, GetWatcherEvents).
    d = f"/home/user/watched-{RUN}"
    sbx.files.make_dir(d)
    w = sbx.files.watch_dir(d)
    sbx.files.write(f"{d}/new.txt", "x")
    events = []
    until("a create event", lambda: events.extend(w.get_new_events()) or any(e.name == "new.txt" and e.type == FilesystemEventType.CREATE for e in events), 300, 0.2)
    # Written in place, as E2B's envd writes: a write event of the file
    # itself, then another when it is written again, and no other name.
    until("a write event", lambda: events.extend(w.get_new_events()) or any(e.name == "new.txt" and e.type == FilesystemEventType.WRITE for e in events), 300, 0.2)
    events.clear()
    sbx.files.write(f"{d}/new.txt", "written again")
    until("a write event of the file written again", lambda: events.extend(w.get_new_events()) or any(e.name == "new.txt" and e.type == FilesystemEventType.WRITE for e in events), 300, 0.2)
    assert {e.name for e in events} == {"new.txt"}
    w.stop()


def test_file_metadata_and_watch_entries(sbx):
    # envd 0.6.2: file metadata; 0.6.3: each event's entry.
    d = f"/home/user/meta-{RUN}"
    sbx.files.make_dir(d)
    w = sbx.files.watch_dir(d, include_entry=True)
    info = sbx.files.write(f"{d}/m.txt", "twelve bytes", metadata={"Owner": "ci", "job": "17"})
    assert info.metadata == {"owner": "ci", "job": "17"}
    assert sbx.files.get_info(f"{d}/m.txt").metadata == {"owner": "ci", "job": "17"}
    events = []
    until("a write event with its entry", lambda: events.extend(w.get_new_events()) or any(e.type == FilesystemEventType.WRITE and e.entry is not None and e.entry.size == 12 for e in events), 300, 0.2)
    w.stop()
    sbx.files.write(f"{d}/m.txt", "again")
    assert not sbx.files.get_info(f"{d}/m.txt").metadata, "a write without metadata keeps none"


def test_signed_urls(sbx):
    path = f"/home/user/signed-{RUN}.txt"
    up = sbx.upload_url(path)
    assert "signature=" in up
    r = httpx.post(up, files={"file": ("ignored", b"uploaded through a signed URL")}, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    assert sbx.files.read(path) == "uploaded through a signed URL"
    r = httpx.get(sbx.download_url(path, use_signature_expiration=600), timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200 and r.text == "uploaded through a signed URL"
    r = httpx.get(sbx.download_url(path, use_signature_expiration=-10), timeout=REQUEST_TIMEOUT)
    assert r.status_code == 401
    assert r.json() == {"code": 401, "message": "signature is already expired"}
    tampered = sbx.download_url(path).replace("signed-", "other-")
    assert httpx.get(tampered, timeout=REQUEST_TIMEOUT).status_code == 401


def test_list_by_metadata_state_and_pages(sbx, other):
    mine = Sandbox.list(query=SandboxQuery(metadata=META), request_timeout=REQUEST_TIMEOUT).next_items()
    assert [s.sandbox_id for s in mine] == [sbx.sandbox_id]
    both = Sandbox.list(query=SandboxQuery(metadata={"suite": "py-sync", "run": RUN}), request_timeout=REQUEST_TIMEOUT).next_items()
    assert {s.sandbox_id for s in both} == {sbx.sandbox_id, other.sandbox_id}
    paused = Sandbox.list(query=SandboxQuery(metadata={"run": RUN}, state=[SandboxState.PAUSED]), request_timeout=REQUEST_TIMEOUT).next_items()
    assert paused == []
    pages = Sandbox.list(query=SandboxQuery(metadata={"run": RUN}, state=[SandboxState.RUNNING]), limit=1, request_timeout=REQUEST_TIMEOUT)
    ids = [s.sandbox_id for s in pages.next_items()]
    assert pages.has_next
    ids += [s.sandbox_id for s in pages.next_items()]
    assert sorted(ids) == sorted([sbx.sandbox_id, other.sandbox_id]) and not pages.has_next
    if at_least(2, 40) and "started_after" in SandboxQuery.__dataclass_fields__:
        # started_after is "at or after": a sandbox started at that very time is listed.
        at = other.get_info().started_at
        listed = Sandbox.list(query=SandboxQuery(metadata={"run": RUN}, started_after=at), request_timeout=REQUEST_TIMEOUT).next_items()
        assert other.sandbox_id in [s.sandbox_id for s in listed]


def test_set_timeout_and_connect(sbx):
    sbx.set_timeout(1200)
    a = sbx.get_info().end_at
    Sandbox.connect(sbx.sandbox_id, timeout=60, request_timeout=REQUEST_TIMEOUT)
    assert sbx.get_info().end_at == a, "connect with a shorter timeout shortened the deadline"
    sbx.set_timeout(900)
    assert sbx.get_info().end_at < a, "set_timeout did not shorten the deadline"


def test_pause_and_connect(sbx):
    counting = "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; sleep 0.2; done"
    sbx.commands.run(counting, background=True)
    until("the counter", lambda: sbx.files.exists("/tmp/counter") and int(sbx.files.read("/tmp/counter").strip() or 0) > 3)
    before = int(sbx.files.read("/tmp/counter").strip())
    assert sbx.pause() is True
    try:
        assert sbx.get_info().state == SandboxState.PAUSED
        # A paused sandbox runs nothing: is_running says so, and its calls fail.
        assert sbx.is_running() is False
        with pytest.raises(SandboxException, match="paused"):
            sbx.commands.run("true")
        assert sbx.pause() is False, "pausing a paused sandbox"
    finally:
        # Resumed whatever failed: the tests after this one use it.
        again = Sandbox.connect(sbx.sandbox_id, timeout=900, request_timeout=REQUEST_TIMEOUT)
    assert again.is_running() is True
    resumed = int(again.files.read("/tmp/counter").strip())
    assert resumed >= before
    until("the counter counting on", lambda: int(again.files.read("/tmp/counter").strip()) > resumed + 3)


# One cold boot per run is enough: 2.63.0's pause(mode="filesystem") sends
# the memory false that 2.34.0's pause(keep_memory=False) sends too, and
# each boot costs a guest's whole boot.
@pytest.mark.skipif(not at_least(2, 60), reason="the cold boot is proven with the newer SDK (the same memory false on the wire), once per run")
def test_pause_without_memory_boots_from_its_disk():
    # A filesystem-only pause: the disk is kept, the memory is not; connect
    # boots it cold, with the same id, and its envd answers.
    s = Sandbox.create(TEMPLATE, timeout=600, metadata=META, request_timeout=REQUEST_TIMEOUT)
    try:
        s.files.write("/home/user/kept.txt", "on the disk")
        s.commands.run("sync")
        s.commands.run("sleep 100000", background=True)
        assert s.pause(mode="filesystem") is True
        assert s.get_info().state == SandboxState.PAUSED
        assert s.is_running() is False
        with pytest.raises(SandboxException, match="paused"):
            s.commands.run("true")
        again = Sandbox.connect(s.sandbox_id, timeout=600, request_timeout=REQUEST_TIMEOUT)
        assert again.sandbox_id == s.sandbox_id
        assert again.files.read("/home/user/kept.txt") == "on the disk"
        r = again.commands.run("hostname; pgrep -xf 'sleep 100000' || echo none")
        assert r.stdout == f"{s.sandbox_id}\nnone\n", "booted cold: nothing that ran is running"
    finally:
        Sandbox.kill(s.sandbox_id, request_timeout=REQUEST_TIMEOUT)


def test_snapshot_and_a_sandbox_from_it(sbx):
    sbx.files.write("/home/user/before-snapshot", "kept")
    snap = sbx.create_snapshot()
    assert snap.snapshot_id
    listed = Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id, request_timeout=REQUEST_TIMEOUT).next_items()
    assert snap.snapshot_id in [x.snapshot_id for x in listed]
    child = Sandbox.create(snap.snapshot_id, timeout=300, request_timeout=REQUEST_TIMEOUT)
    try:
        assert child.files.read("/home/user/before-snapshot") == "kept"
        assert child.sandbox_id != sbx.sandbox_id
        assert sbx.is_running() is True, "the sandbox runs on"
    finally:
        child.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id, request_timeout=REQUEST_TIMEOUT) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id, request_timeout=REQUEST_TIMEOUT) is False


def test_fork(sbx):
    sbx.files.write("/home/user/before-fork", "forked")
    forks = sbx.fork(count=2, timeout=300, request_timeout=REQUEST_TIMEOUT)
    try:
        assert len(forks) == 2
        for f in forks:
            assert isinstance(f, Sandbox), f
        ids = {sbx.sandbox_id} | {f.sandbox_id for f in forks}
        assert len(ids) == 3
        for f in forks:
            assert f.commands.run("cat /home/user/before-fork; echo; hostname").stdout == f"forked\n{f.sandbox_id}\n"
        assert sbx.is_running() is True, "the source runs on"
    finally:
        for f in forks:
            if isinstance(f, Sandbox):
                f.kill()


def test_refused_as_the_sdk_expects(sbx, other):
    # The SDK's create parser knows no 404: a generic error naming it.
    with pytest.raises(SandboxException, match="404.*not found"):
        Sandbox.create("no-such-template", request_timeout=REQUEST_TIMEOUT)
    # Another sandbox's token on this one's envd, as a client holding it
    # would send it: refused before anything reaches the box.
    r = httpx.get(API_URL + "/files", params={"path": "/etc/hostname"}, timeout=REQUEST_TIMEOUT,
                  headers={"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": other._envd_access_token})
    assert r.status_code == 401 and r.json()["code"] == 401
    sid = other.sandbox_id
    assert Sandbox.kill(sid, request_timeout=REQUEST_TIMEOUT) is True
    assert other.is_running() is False
    assert Sandbox.kill(sid, request_timeout=REQUEST_TIMEOUT) is False
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sid, request_timeout=REQUEST_TIMEOUT)
    with pytest.raises(NotFoundException):
        Sandbox.connect(sid, request_timeout=REQUEST_TIMEOUT)
    # A 502 from serve: the SDK's "not running any more".
    with pytest.raises(TimeoutException):
        other.commands.run("true")
    with pytest.raises(TimeoutException):
        other.files.read("/etc/hostname")


def test_a_timeout_shorter_than_the_create(sbx):
    # Counted from when the sandbox is ready: a clone under emulation takes
    # longer than this, and the sandbox is created all the same (its reaper
    # stopped it while it booted when the timeout counted from the request).
    s = Sandbox.create(TEMPLATE, timeout=1, request_timeout=REQUEST_TIMEOUT)
    until("the sandbox gone at its timeout", lambda: not s.is_running(), 240, 0.5)

    def gone():
        try:
            Sandbox.get_info(s.sandbox_id, request_timeout=REQUEST_TIMEOUT)
        except NotFoundException:
            return True
        except SandboxException:
            return False  # its box in the middle of its removal
        return False
    until("get_info of the expired sandbox not found", gone, 120, 0.5)
