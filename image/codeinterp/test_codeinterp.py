"""Unit tests of kvbox-codeinterp.py against a fake kernel: the NDJSON lines,
the contexts' bookkeeping and the HTTP contract (run by image's go test, or
python3 -m unittest in this folder). Not installed in the image."""

import http.client
import importlib.util
import json
import os
import socket
import threading
import time
import unittest

spec = importlib.util.spec_from_file_location("codeinterp", os.path.join(os.path.dirname(__file__), "kvbox-codeinterp.py"))
ci = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ci)
ci.KEEPALIVE = 0.3


class FakeKernel:
    """A kernel that answers a few made-up statements, one per line:
    print X, err X, result X, png, raise, sleep, die, env K."""

    instances = []

    def __init__(self, name, cwd):
        self.name, self.cwd = name, cwd
        self.env = {}
        self.q = []
        self.shellq = []
        self.cond = threading.Condition()
        self.interrupted = threading.Event()
        self.running = False
        self.count = 0
        self.started = 0
        self.codes = []
        self.interrupts = 0
        self.release = threading.Event()
        self.killed = False
        FakeKernel.instances.append(self)

    def start(self):
        self.running = True
        self.started += 1

    def stop(self):
        self.running = False

    def restart(self):
        self.running = True
        self.env = {}
        self.started += 1

    def alive(self):
        return self.running

    def exit_code(self):
        return None if self.running else 1

    def interrupt(self):
        self.interrupts += 1
        self.interrupted.set()

    def kill(self):
        self.killed = True
        self.running = False
        self.release.set()

    def _msg(self, pid, t, content):
        return {"msg_type": t, "parent_header": {"msg_id": pid}, "header": {"msg_type": t, "date": "2026-01-01T00:00:00Z"}, "content": content}

    def execute(self, code, silent=False):
        pid = "m%d" % len(self.codes)
        self.codes.append((code, silent))
        threading.Thread(target=self._run, args=(pid, code, silent), daemon=True).start()
        return pid

    def _put(self, m):
        with self.cond:
            self.q.append(m)
            self.cond.notify_all()

    def _run(self, pid, code, silent):
        self._put(self._msg(pid, "status", {"execution_state": "busy"}))
        if not silent:
            self.count += 1
            self._put(self._msg(pid, "execute_input", {"code": code, "execution_count": self.count}))
        status = "ok"
        if code.startswith("import os as _kvbox_os"):
            ns = {}
            exec(code.replace("import os as _kvbox_os", "_kvbox_os = _env").replace("del _kvbox_os", ""), {"_env": _Env(self.env)}, ns)
            code = ""
        for line in code.splitlines():
            op, _, arg = line.partition(" ")
            if op == "print":
                self._put(self._msg(pid, "stream", {"name": "stdout", "text": arg + "\n"}))
            elif op == "err":
                self._put(self._msg(pid, "stream", {"name": "stderr", "text": arg + "\n"}))
            elif op == "result":
                self._put(self._msg(pid, "execute_result", {"data": {"text/plain": arg}, "execution_count": self.count}))
            elif op == "png":
                self._put(self._msg(pid, "display_data", {"data": {"image/png": "iVBORw0K", "text/plain": "<Figure>", "application/x-thing": {"a": 1}}}))
            elif op == "env":
                self._put(self._msg(pid, "stream", {"name": "stdout", "text": "%s=%s\n" % (arg, self.env.get(arg, "<unset>"))}))
            elif op == "raise":
                self._put(self._msg(pid, "error", {"ename": "ZeroDivisionError", "evalue": "division by zero", "traceback": ["Traceback", "ZeroDivisionError: division by zero"]}))
                status = "error"
                break
            elif op == "sleep":
                if self.interrupted.wait(float(arg or 30)):
                    self.interrupted.clear()
                    self._put(self._msg(pid, "error", {"ename": "KeyboardInterrupt", "evalue": "", "traceback": ["KeyboardInterrupt"]}))
                    status = "error"
                    break
                self._put(self._msg(pid, "stream", {"name": "stdout", "text": "slept\n"}))
            elif op == "block":
                self.release.wait()
            elif op == "stubborn":
                # A cell that catches every KeyboardInterrupt: only a kill
                # ends it.
                self._put(self._msg(pid, "stream", {"name": "stdout", "text": "stubborn\n"}))
                self.release.wait()
                if self.killed:
                    return
            elif op == "die":
                self.running = False
                return
        self._put(self._msg(pid, "status", {"execution_state": "idle"}))
        with self.cond:
            self.shellq.append(self._msg(pid, "execute_reply", {"status": status}))
            self.cond.notify_all()

    def _get(self, q, timeout):
        with self.cond:
            if not q:
                self.cond.wait(timeout)
            return q.pop(0) if q else None

    def iopub(self, timeout):
        return self._get(self.q, timeout)

    def shell(self, timeout):
        return self._get(self.shellq, timeout)


class _Env:
    def __init__(self, d):
        self.environ = d


def wait_for(cond, bound=20):
    deadline = time.monotonic() + bound
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("not within %ss" % bound)
        time.sleep(0.02)


def lines(resp):
    return [json.loads(l) for l in resp.read().decode().splitlines() if l.strip()]


class Base(unittest.TestCase):
    def setUp(self):
        FakeKernel.instances = []
        self.global_envs = {"G": "global"}
        self.kernels = ["python3"]
        self.interp = ci.Interpreter(new_kernel=FakeKernel, kernels=lambda: self.kernels, global_envs=lambda: dict(self.global_envs))
        ci.DEFAULT_CWD = "/"
        self.srv = ci.serve(self.interp, "127.0.0.1", 0)
        self.port = self.srv.server_address[1]
        threading.Thread(target=self.srv.serve_forever, daemon=True).start()
        self.assertTrue(self.interp.ready.wait(10))

    def tearDown(self):
        self.srv.shutdown()
        self.srv.server_close()

    def req(self, method, path, body=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request(method, path, body=None if body is None else json.dumps(body), headers={"Content-Type": "application/json"})
        return c.getresponse()

    def run_code(self, code, **kw):
        r = self.req("POST", "/execute", dict(code=code, **kw))
        if r.status != 200:
            self.fail("%d %s" % (r.status, r.read()))
        self.assertEqual(r.getheader("Content-Type"), "application/x-ndjson")
        out = lines(r)
        self.assertEqual(out[-1], {"type": "end_of_execution"})
        return out[:-1]


class TestLines(unittest.TestCase):
    def test_result_fields(self):
        l = ci.result_line({"text/plain": "'hi'", "image/png": "AAA", "text/html": "<b>", "application/x-y": 1}, True)
        self.assertEqual(l, {"type": "result", "is_main_result": True, "text": "hi", "png": "AAA", "html": "<b>", "extra": {"application/x-y": 1}})
        self.assertEqual(ci.result_line({"text/plain": "'hi'"}, False)["text"], "'hi'")

    def test_error_traceback_joined(self):
        m = {"msg_type": "error", "header": {}, "content": {"ename": "E", "evalue": "v", "traceback": ["a", "b"]}}
        self.assertEqual(ci.translate(m), [{"type": "error", "name": "E", "value": "v", "traceback": "a\nb"}])

    def test_encode_one_line(self):
        b = ci.encode({"type": "stdout", "text": "a\nb"})
        self.assertTrue(b.endswith(b"\n"))
        self.assertEqual(b.count(b"\n"), 1)

    def test_encode_no_nan(self):
        # JSON.parse (the JS SDK's) refuses NaN and Infinity.
        b = ci.encode({"type": "result", "json": {"a": float("nan"), "b": [1.5, float("inf"), {"c": float("-inf")}]}})
        self.assertEqual(json.loads(b, parse_constant=lambda c: self.fail("non-JSON constant " + c)),
                         {"type": "result", "json": {"a": None, "b": [1.5, None, {"c": None}]}})

    def test_prelude_gives_frames_data(self):
        # What the Python prelude registers for DataFrames (run for real in
        # a kernel by TestCodeInterpreter).
        p = ci.PRELUDE["python"]
        self.assertIn('"e2b/data"', p)
        self.assertIn("df.size > %d" % ci.MAX_DATA_CELLS, p)
        compile(p.replace("%matplotlib inline", ""), "prelude", "exec")

    def test_languages(self):
        for given, want in [(None, "python"), (" Python ", "python"), ("js", "javascript"), ("ts", "javascript"), ("bash", "bash"), ("R", "r")]:
            self.assertEqual(ci.normalize_language(given), want)

    def test_env_code_quotes(self):
        self.assertEqual(ci.env_code("bash", {"A": "it's"}), "export A='it'\\''s'")
        self.assertEqual(ci.env_code("bash", {"A B": "x"}), "")
        self.assertIsNone(ci.env_code("cobol", {"A": "x"}))


class TestHTTP(Base):
    def test_health(self):
        r = self.req("GET", "/health")
        self.assertEqual((r.status, r.read()), (200, b'"OK"'))

    def test_state_stdout_result(self):
        out = self.run_code("print hello\nerr oops\nresult 42")
        types = [l["type"] for l in out]
        self.assertEqual(types, ["number_of_executions", "stdout", "stderr", "result"])
        self.assertEqual(out[1]["text"], "hello\n")
        self.assertEqual(out[3]["text"], "42")
        self.assertTrue(out[3]["is_main_result"])
        # The same (default) context the second time.
        self.run_code("result 1")
        self.assertEqual(len(FakeKernel.instances), 1)

    def test_png_and_error(self):
        out = self.run_code("png")
        res = [l for l in out if l["type"] == "result"][0]
        self.assertEqual(res["png"], "iVBORw0K")
        self.assertFalse(res["is_main_result"])
        self.assertEqual(res["extra"], {"application/x-thing": {"a": 1}})
        out = self.run_code("raise")
        err = [l for l in out if l["type"] == "error"][0]
        self.assertEqual(err["name"], "ZeroDivisionError")
        self.assertIn("ZeroDivisionError: division by zero", err["traceback"])

    def test_both_context_and_language(self):
        r = self.req("POST", "/execute", {"code": "x", "context_id": "a", "language": "python"})
        self.assertEqual(r.status, 400)

    def test_unknown_context_404(self):
        r = self.req("POST", "/execute", {"code": "x", "context_id": "nope"})
        self.assertEqual(r.status, 404)
        self.assertIn(b"nope", r.read())

    def test_unknown_language_names_kernels(self):
        r = self.req("POST", "/execute", {"code": "x", "language": "cobol"})
        self.assertEqual(r.status, 404)
        self.assertIn(b"python3", r.read())

    def test_new_language_default_context(self):
        self.kernels = ["python3", "bash"]
        self.run_code("print a", language="bash")
        self.run_code("print b", language="bash")
        langs = sorted(c["language"] for c in json.loads(self.req("GET", "/contexts").read()))
        self.assertEqual(langs, ["bash", "python"])

    def test_contexts_lifecycle(self):
        r = self.req("POST", "/contexts", {"language": "python", "cwd": "/tmp"})
        self.assertEqual(r.status, 200)
        ctx = json.loads(r.read())
        self.assertEqual((ctx["language"], ctx["cwd"]), ("python", "/tmp"))
        ids = [c["id"] for c in json.loads(self.req("GET", "/contexts").read())]
        self.assertIn(ctx["id"], ids)
        self.assertEqual(len(ids), 2)
        k = FakeKernel.instances[-1]
        self.assertEqual(k.cwd, "/tmp")
        r = self.req("POST", "/contexts/%s/restart" % ctx["id"])
        self.assertEqual((r.status, r.read()), (200, b"null"))
        self.assertEqual(k.started, 2)
        r = self.req("DELETE", "/contexts/%s" % ctx["id"])
        self.assertEqual((r.status, r.read()), (200, b"null"))
        self.assertFalse(k.running)
        self.assertEqual(self.req("DELETE", "/contexts/%s" % ctx["id"]).status, 404)
        self.assertEqual(self.req("POST", "/contexts/%s/restart" % ctx["id"]).status, 404)

    def test_bad_cwd(self):
        self.assertEqual(self.req("POST", "/contexts", {"cwd": "/does/not/exist"}).status, 400)

    def test_env_vars_per_call_and_global(self):
        out = self.run_code("env G\nenv L", env_vars={"L": "local", "G": "over"})
        self.assertEqual([l["text"] for l in out if l["type"] == "stdout"], ["G=over\n", "L=local\n"])
        out = self.run_code("env G\nenv L")
        self.assertEqual([l["text"] for l in out if l["type"] == "stdout"], ["G=global\n", "L=<unset>\n"])
        # A clone's sandbox has other sandbox-wide envs: the next call sees them.
        self.global_envs = {"H": "h"}
        out = self.run_code("env G\nenv H")
        self.assertEqual([l["text"] for l in out if l["type"] == "stdout"], ["G=<unset>\n", "H=h\n"])

    def test_keepalive(self):
        out = self.run_code("sleep 1")
        self.assertIn({"type": "keepalive"}, out)
        self.assertEqual(out[-1]["text"], "slept\n")

    def test_disconnect_interrupts(self):
        s = socket.create_connection(("127.0.0.1", self.port))
        body = json.dumps({"code": "sleep 30\nprint never"}).encode()
        s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        k = FakeKernel.instances[0]
        wait_for(lambda: any(c.startswith("sleep") for c, _ in k.codes))
        s.close()
        wait_for(lambda: k.interrupts >= 1)
        # The context is usable again once the interrupted cell is over.
        out = self.run_code("print after")
        self.assertIn("after\n", [l.get("text") for l in out])
        self.assertNotIn("never\n", [l.get("text") for l in out])

    def test_client_gone_while_waiting_runs_nothing(self):
        done = []
        t = threading.Thread(target=lambda: done.append(self.run_code("block")))
        t.start()
        k = FakeKernel.instances[0]
        wait_for(lambda: ("block", False) in k.codes)
        s = socket.create_connection(("127.0.0.1", self.port))
        body = json.dumps({"code": "print waited"}).encode()
        s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        s.close()
        k.release.set()
        t.join()
        out = self.run_code("print next")
        self.assertEqual([l["text"] for l in out if l["type"] == "stdout"], ["next\n"])
        self.assertNotIn("print waited", [c for c, _ in k.codes])

    def test_dead_kernel_then_restart(self):
        out = self.run_code("die")
        err = [l for l in out if l["type"] == "error"][0]
        self.assertEqual(err["name"], "DeadKernelError")
        out = self.run_code("print x")
        err = [l for l in out if l["type"] == "error"][0]
        self.assertIn("restart", err["value"])
        cid = json.loads(self.req("GET", "/contexts").read())[0]["id"]
        self.assertEqual(self.req("POST", "/contexts/%s/restart" % cid).status, 200)
        out = self.run_code("print x")
        self.assertEqual([l["text"] for l in out if l["type"] == "stdout"], ["x\n"])

    def test_stubborn_cell_killed_after_its_grace(self):
        grace = ci.STOP_GRACE
        ci.STOP_GRACE = 0.5
        self.addCleanup(setattr, ci, "STOP_GRACE", grace)
        s = socket.create_connection(("127.0.0.1", self.port))
        body = json.dumps({"code": "stubborn"}).encode()
        s.sendall(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        k = FakeKernel.instances[0]
        wait_for(lambda: ("stubborn", False) in k.codes)
        s.close()
        wait_for(lambda: k.killed)
        self.assertGreaterEqual(k.interrupts, 1)
        out = self.run_code("print x")
        err = [l for l in out if l["type"] == "error"][0]
        self.assertEqual(err["name"], "DeadKernelError")
        self.assertIn("interrupts", err["value"])
        self.assertIn("restart", err["value"])
        cid = json.loads(self.req("GET", "/contexts").read())[0]["id"]
        self.assertEqual(self.req("POST", "/contexts/%s/restart" % cid).status, 200)
        self.assertEqual([l["text"] for l in self.run_code("print x") if l["type"] == "stdout"], ["x\n"])

    def raw(self, head, body=b""):
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        s.sendall(head + b"\r\n\r\n" + body)
        r = http.client.HTTPResponse(s)
        r.begin()
        out = (r.status, r.read())
        s.close()
        return out

    def test_bodies_bounded(self):
        st, text = self.raw(b"POST /contexts HTTP/1.1\r\nHost: x\r\nContent-Length: %d" % (ci.MAX_BODY + 1))
        self.assertEqual(st, 413, text)
        st, _ = self.raw(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: %d" % (ci.MAX_EXECUTE_BODY + 1))
        self.assertEqual(st, 413)
        st, _ = self.raw(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: -5")
        self.assertEqual(st, 400)
        st, _ = self.raw(b"POST /execute HTTP/1.1\r\nHost: x\r\nContent-Length: five")
        self.assertEqual(st, 400)
        st, _ = self.raw(b"POST /execute HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked", b"5\r\nhello\r\n0\r\n\r\n")
        self.assertEqual(st, 411)
        # A cell's code may be larger than the other calls' bodies.
        code = "print big" + "\n" * (2 * ci.MAX_BODY)
        self.assertEqual([l["text"] for l in self.run_code(code) if l["type"] == "stdout"], ["big\n"])
        self.assertEqual(len(FakeKernel.instances), 1, "no kernel for the refused requests")

    def test_peer_uid(self):
        c = socket.create_connection(("127.0.0.1", self.port))
        self.addCleanup(c.close)
        self.assertEqual(ci.peer_uid(c), os.geteuid())

    def test_other_users_refused(self):
        # The test's own uid stands for a guest process of another user.
        uids = ci.Handler.uids
        ci.Handler.uids = frozenset(uids - {os.geteuid()})
        self.addCleanup(setattr, ci.Handler, "uids", uids)
        for method, path, body in [("GET", "/health", None), ("GET", "/contexts", None), ("POST", "/execute", {"code": "print x"})]:
            r = self.req(method, path, body)
            self.assertEqual(r.status, 403, path)
            self.assertIn(b"uid %d" % os.geteuid(), r.read())
        self.assertEqual([c for c, silent in FakeKernel.instances[0].codes if not silent], [], "no cell ran")

    def test_one_execution_at_a_time(self):
        done = []

        def slow():
            self.run_code("sleep 1")
            done.append("slow")

        t = threading.Thread(target=slow)
        t.start()
        k = FakeKernel.instances[0]
        wait_for(lambda: any(c.startswith("sleep") for c, _ in k.codes))
        self.run_code("print fast")
        done.append("fast")
        t.join()
        self.assertEqual(done, ["slow", "fast"])


class TestCold(Base):
    """A server started with KVBOX_CODEINTERP_WARM=0: healthy at once, the
    default context's kernel started by the first call."""

    def setUp(self):
        warm = ci.WARM
        ci.WARM = False
        try:
            super().setUp()
        finally:
            ci.WARM = warm

    def test_kernel_on_first_call(self):
        self.assertEqual(self.req("GET", "/health").status, 200)
        self.assertEqual(FakeKernel.instances, [])
        self.assertEqual(json.loads(self.req("GET", "/contexts").read()), [])
        self.assertEqual([l["text"] for l in self.run_code("print hi") if l["type"] == "stdout"], ["hi\n"])
        self.assertEqual(len(FakeKernel.instances), 1)


if __name__ == "__main__":
    unittest.main()
