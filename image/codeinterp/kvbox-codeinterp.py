#!/usr/bin/python3
"""kvbox's code-interpreter server: E2B's :49999 contract for runCode and code
contexts, on the guest's loopback, over one Jupyter kernel per context.

Written for kvbox (installed by `kvbox images build code-interpreter`). Debian's
jupyter_client starts each kernel and speaks the Jupyter wire protocol to it;
this program only maps E2B's HTTP requests and NDJSON lines onto it.

Requests come from kvbox-agent's forward (kvbox serve checked the sandbox's
token on the host and took every credential off), so nothing here checks a
token: the listener is on 127.0.0.1 only, and it serves a connection only
from root (the agent) or the kernels' own user, by the owner of the peer's
socket in /proc/net/tcp: any other guest process (nobody, a daemon's user)
would otherwise run code as the user, who has sudo. The server runs as root
to read the box's local envd token (sandbox-wide env vars come from envd's
GET /envs); kernels run as the image's user in /home/user.

Endpoints: GET /health, POST /execute (NDJSON stream), GET/POST /contexts,
POST /contexts/<id>/restart, DELETE /contexts/<id>.
"""

import base64
import datetime
import http.server
import json
import math
import os
import pwd
import queue
import select
import signal
import socket
import sys
import threading
import time
import urllib.request
import uuid

ADDR = os.environ.get("KVBOX_CODEINTERP_ADDR", "127.0.0.1")
PORT = int(os.environ.get("KVBOX_CODEINTERP_PORT", "49999"))
USER = os.environ.get("KVBOX_CODEINTERP_USER", "user")
DEFAULT_CWD = "/home/user"
RUN_DIR = os.environ.get("KVBOX_CODEINTERP_RUN", "/run/kvbox-codeinterp")
ENVD_URL = os.environ.get("KVBOX_CODEINTERP_ENVD", "http://127.0.0.1:49983/envs")
ENVD_TOKEN_FILE = os.environ.get("KVBOX_CODEINTERP_ENVD_TOKEN", "/var/lib/kvbox-agent/envd-token")
# "0": no kernel at start; the first call starts its context's (a lean
# template, or one whose kernels start cold).
WARM = os.environ.get("KVBOX_CODEINTERP_WARM", "1") != "0"
KEEPALIVE = 5.0  # seconds without a line before a keepalive line
POLL = 0.2  # seconds between looks at the client and the kernel
REINTERRUPT = 2.0  # seconds between interrupts of a cell whose client went
STOP_GRACE = 60.0  # seconds of interrupts before a cell that ignores them is killed
# Request bodies: a cell's code, and the small JSON of the other calls.
MAX_EXECUTE_BODY = 64 << 20
MAX_BODY = 64 << 10
# The e2b/data form of a DataFrame result (column -> values, as E2B's
# template gives it) for frames of at most this many cells; a larger one
# has its text and HTML forms alone (pandas truncates those).
MAX_DATA_CELLS = 100000

# What each kernel runs when it starts: the template's warm state. The
# inline backend is matplotlib's Agg with a PNG per figure on plt.show().
# A DataFrame also gets the MIME type e2b/data (the SDKs' Result.data):
# column -> list of values, as E2B's template gives it, in JSON's types
# (NaN, NaT and NA as null, timestamps in ISO 8601, anything else its str).
PRELUDE = {
    "python": """%matplotlib inline
import numpy, pandas, matplotlib, matplotlib.pyplot
def _kvbox_formatters():
    import datetime, math
    import numpy, pandas
    from IPython import get_ipython
    from IPython.core.formatters import BaseFormatter
    from traitlets import ObjectName, Unicode

    class DataFormatter(BaseFormatter):
        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict,)

    def value(v):
        if v is None or isinstance(v, (bool, str)):
            return v
        if isinstance(v, numpy.generic):
            v = v.item()
        if v is pandas.NaT or v is pandas.NA:
            return None
        if isinstance(v, float):
            return v if math.isfinite(v) else None
        if isinstance(v, int):
            return v
        if isinstance(v, (datetime.date, datetime.time)):
            return v.isoformat()
        return str(v)

    def frame(df):
        if df.size > MAX_DATA_CELLS:
            return None
        try:
            return {str(c): [value(v) for v in df.iloc[:, i].tolist()] for i, c in enumerate(df.columns)}
        except Exception:
            return None

    ip = get_ipython()
    f = DataFormatter(parent=ip.display_formatter)
    f.for_type(pandas.DataFrame, frame)
    ip.display_formatter.formatters["e2b/data"] = f
    if "e2b/data" not in ip.display_formatter.active_types:
        ip.display_formatter.active_types = list(ip.display_formatter.active_types) + ["e2b/data"]
_kvbox_formatters()
del _kvbox_formatters
""".replace("MAX_DATA_CELLS", str(MAX_DATA_CELLS)),
}

# MIME type -> field of E2B's result line. Anything else goes into "extra".
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}


def log(*a):
    print("kvbox-codeinterp:", *a, file=sys.stderr, flush=True)


class HTTPError(Exception):
    def __init__(self, status, text):
        super().__init__(text)
        self.status = status
        self.text = text


def normalize_language(lang):
    """E2B's language names: lower-cased, trimmed, js/ts aliases."""
    lang = (lang or "python").strip().lower()
    return {"js": "javascript", "ts": "javascript", "typescript": "javascript", "py": "python", "python3": "python", "sh": "bash"}.get(lang, lang)


def kernel_name(lang):
    return "python3" if lang == "python" else lang


def iso(ts):
    if isinstance(ts, datetime.datetime):
        if ts.tzinfo is None:
            ts = ts.replace(tzinfo=datetime.timezone.utc)
        return ts.isoformat()
    if ts:
        return str(ts)
    return datetime.datetime.now(datetime.timezone.utc).isoformat()


def result_line(data, main):
    """A Jupyter MIME bundle as E2B's result line."""
    out = {"type": "result", "is_main_result": bool(main)}
    extra = {}
    for mime, value in (data or {}).items():
        field = MIME_FIELDS.get(mime)
        if field is None:
            extra[mime] = value
            continue
        if field == "text" and main and isinstance(value, str) and len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        if field in ("png", "jpeg", "pdf") and isinstance(value, bytes):
            value = base64.b64encode(value).decode()
        out[field] = value
    if extra:
        out["extra"] = extra
    return out


def translate(msg):
    """An iopub message as E2B's NDJSON lines (none for most types)."""
    t = msg.get("msg_type") or msg.get("header", {}).get("msg_type")
    c = msg.get("content", {})
    ts = iso(msg.get("header", {}).get("date"))
    if t == "stream":
        return [{"type": "stderr" if c.get("name") == "stderr" else "stdout", "text": c.get("text", ""), "timestamp": ts}]
    if t == "execute_result":
        return [result_line(c.get("data"), True)]
    if t == "display_data":
        return [result_line(c.get("data"), False)]
    if t == "error":
        return [error_line(c.get("ename", "Error"), c.get("evalue", ""), c.get("traceback") or [])]
    if t == "execute_input":
        return [{"type": "number_of_executions", "execution_count": c.get("execution_count")}]
    return []


def error_line(name, value, traceback):
    if isinstance(traceback, list):
        traceback = "\n".join(traceback)
    return {"type": "error", "name": name, "value": value, "traceback": traceback}


def encode(line):
    """One NDJSON line. JSON has no NaN or Infinity (JSON.parse, the JS
    SDK's, refuses them): a kernel's float that is neither goes as null."""
    try:
        s = json.dumps(line, separators=(",", ":"), default=str, allow_nan=False)
    except ValueError:
        s = json.dumps(finite(line), separators=(",", ":"), default=str, allow_nan=False)
    return (s + "\n").encode()


def finite(v):
    """v with every float that is not finite as None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [finite(x) for x in v]
    return v


def env_code(lang, set_vars, unset=()):
    """Code that sets set_vars and removes unset in a kernel of lang."""
    if lang == "python":
        parts = ["import os as _kvbox_os"]
        if set_vars:
            parts.append("_kvbox_os.environ.update(%r)" % (dict(set_vars),))
        for k in unset:
            parts.append("_kvbox_os.environ.pop(%r, None)" % (k,))
        parts.append("del _kvbox_os")
        return "\n".join(parts)
    if lang == "bash":
        parts = ["export %s=%s" % (k, shell_quote(v)) for k, v in set_vars.items() if valid_name(k)]
        parts += ["unset %s" % k for k in unset if valid_name(k)]
        return "\n".join(parts)
    if lang == "javascript":
        parts = ["process.env[%s] = %s;" % (json.dumps(k), json.dumps(v)) for k, v in set_vars.items()]
        parts += ["delete process.env[%s];" % json.dumps(k) for k in unset]
        return "\n".join(parts)
    if lang == "r":
        parts = ["Sys.setenv(%s = %s)" % (json.dumps(k), json.dumps(v)) for k, v in set_vars.items()]
        parts += ["Sys.unsetenv(%s)" % json.dumps(k) for k in unset]
        return "\n".join(parts)
    return None


def valid_name(k):
    return k.replace("_", "a").isalnum() and not k[:1].isdigit()


def shell_quote(v):
    return "'" + str(v).replace("'", "'\\''") + "'"


_envd_warned = []


def read_global_envs():
    """The sandbox's env vars from envd's loopback door, {} when it has none."""
    try:
        with open(ENVD_TOKEN_FILE) as f:
            tok = f.read().strip()
    except OSError:
        tok = ""
    req = urllib.request.Request(ENVD_URL, headers={"X-Access-Token": tok} if tok else {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            envs = json.load(r)
    except Exception as e:  # envd not up, or no agent: no sandbox-wide envs
        if not _envd_warned:
            _envd_warned.append(True)
            log("envd /envs (no sandbox-wide env vars until it answers):", e)
        return {}
    _envd_warned.clear()
    return {str(k): str(v) for k, v in (envs or {}).items()}


def emulated_cpu():
    """Whether the guest's CPU is QEMU's generic model (TCG)."""
    try:
        with open("/proc/cpuinfo") as f:
            return any(l.startswith("model name") and "QEMU Virtual CPU" in l for l in f)
    except OSError:
        return False


def peer_uid(sock):
    """The uid owning the other end of the loopback TCP connection sock (a
    socket of this network namespace: its line in /proc/net/tcp has our
    end as its remote one), None if it is not there or not IPv4."""
    if sock.family != socket.AF_INET:
        return None

    def hexaddr(a):
        ip, port = a[:2]
        return "%08X:%04X" % (int.from_bytes(socket.inet_aton(ip), "little"), port)

    theirs, ours = hexaddr(sock.getpeername()), hexaddr(sock.getsockname())
    try:
        with open("/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) > 7 and fields[1] == theirs and fields[2] == ours:
                    return int(fields[7])
    except (OSError, ValueError, StopIteration):
        return None
    return None


def allowed_uids(user=USER):
    """Who may connect: root (kvbox-agent's forward), this server's own
    user and the kernels' user."""
    uids = {0, os.geteuid()}
    try:
        uids.add(pwd.getpwnam(user).pw_uid)
    except KeyError:
        pass
    return uids


class Lines:
    """Where an execution's lines go: the client's stream, which says when
    its client has gone."""

    def __init__(self, write, gone):
        self._write = write
        self._gone = gone
        self.last = time.monotonic()
        self.closed = False

    def send(self, line):
        if self.closed:
            return
        try:
            self._write(encode(line))
        except OSError:
            self.closed = True
        self.last = time.monotonic()

    def gone(self):
        return self.closed or self._gone()

    def keepalive(self):
        if time.monotonic() - self.last >= KEEPALIVE:
            self.send({"type": "keepalive"})


class Kernel:
    """One Jupyter kernel through jupyter_client (a real one in the image; a
    fake in the unit tests). Methods: start, stop, restart, alive,
    interrupt, kill, execute(code, silent) -> msg_id, iopub(timeout) -> msg or
    None, shell(timeout) -> msg or None, exit_code."""

    def __init__(self, name, cwd, run_dir=RUN_DIR, user=USER):
        self.name = name
        self.cwd = cwd
        self.run_dir = run_dir
        self.user = user
        self.km = None
        self.kc = None

    def start(self):
        from jupyter_client.manager import KernelManager

        os.makedirs(self.run_dir, mode=0o755, exist_ok=True)
        kw = {"cwd": self.cwd, "env": dict(os.environ)}
        owner = None
        try:
            pw = pwd.getpwnam(self.user) if os.geteuid() == 0 else None
        except KeyError:
            pw = None
        if pw is not None:
            owner = (pw.pw_uid, pw.pw_gid)
            kw.update(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[])
            kw["env"].update(HOME=pw.pw_dir, USER=pw.pw_name, LOGNAME=pw.pw_name, SHELL=pw.pw_shell)
        kw["env"].pop("INVOCATION_ID", None)
        kw["env"].pop("JOURNAL_STREAM", None)
        if emulated_cpu():
            # On QEMU's generic CPU (emulation, no KVM) OpenBLAS's own pick
            # of kernels runs an instruction the emulator lacks (matplotlib
            # died of SIGILL drawing a line): name a core it has.
            kw["env"].setdefault("OPENBLAS_CORETYPE", "Prescott")

        class Manager(KernelManager):
            def write_connection_file(self, **a):
                r = super().write_connection_file(**a)
                if owner is not None:
                    os.chown(self.connection_file, *owner)
                return r

        self.km = Manager(kernel_name=self.name, connection_file=os.path.join(self.run_dir, "kernel-%s.json" % uuid.uuid4()))
        self.km.start_kernel(**kw)
        self._connect()

    def _connect(self):
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)

    def stop(self):
        try:
            if self.kc is not None:
                self.kc.stop_channels()
        finally:
            if self.km is not None:
                self.km.shutdown_kernel(now=True)
                try:
                    os.remove(self.km.connection_file)
                except OSError:
                    pass

    def restart(self):
        if self.kc is not None:
            self.kc.stop_channels()
        self.km.restart_kernel(now=True)
        self._connect()

    def alive(self):
        return self.km is not None and self.km.is_alive()

    def exit_code(self):
        p = getattr(getattr(self.km, "provisioner", None), "process", None) or getattr(self.km, "kernel", None)
        return getattr(p, "returncode", None)

    def interrupt(self):
        self.km.interrupt_kernel()

    def kill(self):
        self.km.signal_kernel(signal.SIGKILL)

    def execute(self, code, silent=False):
        return self.kc.execute(code, silent=silent, store_history=not silent, allow_stdin=False, stop_on_error=True)

    def iopub(self, timeout):
        try:
            return self.kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            return None

    def shell(self, timeout):
        try:
            return self.kc.get_shell_msg(timeout=timeout)
        except queue.Empty:
            return None


class Context:
    def __init__(self, language, cwd, kernel):
        self.id = str(uuid.uuid4())
        self.language = language
        self.cwd = cwd
        self.kernel = kernel
        self.lock = threading.Lock()  # one execution at a time
        self.envs = {}  # the sandbox-wide env vars set in the kernel
        self.dead = None  # why the kernel is not running, once it is not

    def json(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}


class Interpreter:
    """The contexts and what runs in them; the HTTP layer is Handler."""

    def __init__(self, new_kernel=Kernel, kernels=None, global_envs=read_global_envs):
        self.new_kernel = new_kernel
        self.kernels = kernels  # callable -> names of the kernels present
        self.global_envs = global_envs
        self.lock = threading.Lock()
        self.contexts = {}
        self.defaults = {}  # language -> context id
        self.lang_locks = {}
        self.ready = threading.Event()

    def available(self):
        if self.kernels is not None:
            return sorted(self.kernels())
        from jupyter_client.kernelspec import KernelSpecManager

        return sorted(KernelSpecManager().find_kernel_specs())

    def create(self, language=None, cwd=None):
        lang = normalize_language(language)
        cwd = cwd or DEFAULT_CWD
        name = kernel_name(lang)
        have = self.available()
        if name not in have:
            raise HTTPError(404, "no kernel for language %r in this sandbox: its kernels are %s" % (lang, ", ".join(have) or "none"))
        if not os.path.isdir(cwd):
            raise HTTPError(400, "cwd %r is not a directory in the sandbox" % cwd)
        k = self.new_kernel(name, cwd)
        try:
            k.start()
        except Exception as e:
            log("start kernel", name, e)
            raise HTTPError(500, "could not start kernel %s: %s" % (name, e))
        ctx = Context(lang, cwd, k)
        self._prelude(ctx)
        with self.lock:
            self.contexts[ctx.id] = ctx
        return ctx

    def _prelude(self, ctx):
        code = PRELUDE.get(ctx.language)
        if code:
            self.run_silent(ctx, code, timeout=600)

    def default(self, language):
        lang = normalize_language(language)
        with self.lock:
            cid = self.defaults.get(lang)
            if cid in self.contexts:
                return self.contexts[cid]
            ll = self.lang_locks.setdefault(lang, threading.Lock())
        with ll:
            with self.lock:
                cid = self.defaults.get(lang)
                if cid in self.contexts:
                    return self.contexts[cid]
            ctx = self.create(lang)
            with self.lock:
                self.defaults[lang] = ctx.id
            return ctx

    def get(self, cid):
        with self.lock:
            ctx = self.contexts.get(cid)
        if ctx is None:
            raise HTTPError(404, "context %s not found" % cid)
        return ctx

    def list(self):
        with self.lock:
            return [c.json() for c in self.contexts.values()]

    def remove(self, cid):
        ctx = self.get(cid)
        with self.lock:
            self.contexts.pop(cid, None)
            for lang, d in list(self.defaults.items()):
                if d == cid:
                    del self.defaults[lang]
        try:
            ctx.kernel.stop()
        except Exception as e:
            log("stop kernel", cid, e)

    def restart(self, cid):
        ctx = self.get(cid)
        # After the cell running in it, if any.
        with ctx.lock:
            try:
                ctx.kernel.restart()
            except Exception as e:
                raise HTTPError(500, "could not restart context %s: %s" % (cid, e))
            ctx.dead = None
            ctx.envs = {}
            # Under the lock: a cell beside it would share its messages.
            self._prelude(ctx)

    def run_silent(self, ctx, code, timeout=60):
        """Runs code in ctx's kernel, output discarded; the caller holds
        ctx.lock or owns ctx alone. Returns the error line, if any."""
        msg_id = ctx.kernel.execute(code, silent=True)
        deadline = time.monotonic() + timeout
        err = None
        while time.monotonic() < deadline:
            msg = ctx.kernel.iopub(POLL)
            if msg is None:
                if not ctx.kernel.alive():
                    return error_line("DeadKernelError", "the kernel exited", "")
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if msg.get("msg_type") == "error":
                err = translate(msg)[0]
                log("silent code failed:", err.get("name"), err.get("value"))
            if msg.get("msg_type") == "status" and msg.get("content", {}).get("execution_state") == "idle":
                break
        self._drain_shell(ctx, msg_id)
        return err

    def _drain_shell(self, ctx, msg_id, timeout=2):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = ctx.kernel.shell(POLL)
            if m is None:
                if not ctx.kernel.alive():
                    return None
                continue
            if m.get("parent_header", {}).get("msg_id") == msg_id:
                return m
        return None

    def _sync_global_envs(self, ctx):
        envs = self.global_envs()
        if envs == ctx.envs:
            return
        unset = [k for k in ctx.envs if k not in envs]
        code = env_code(ctx.language, envs, unset)
        if code is not None:
            self.run_silent(ctx, code)
        ctx.envs = dict(envs)

    def execute(self, code, context_id, language, env_vars, out):
        """Runs code, sending its lines to out (a Lines); the caller sends
        end_of_execution."""
        if context_id and language:
            raise HTTPError(400, "Only one of context_id or language can be provided")
        ctx = self.get(context_id) if context_id else self.default(language)
        env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        with ctx.lock:
            if out.gone():
                # Its client went while it waited for the cell before it.
                log("client gone before its cell ran: not running it in context", ctx.id)
                return
            if ctx.dead or not ctx.kernel.alive():
                ctx.dead = ctx.dead or self._dead_reason(ctx)
                out.send(error_line("DeadKernelError", ctx.dead, ctx.dead))
                return
            self._sync_global_envs(ctx)
            if env_vars:
                code_set = env_code(ctx.language, env_vars)
                if code_set is None:
                    out.send(error_line("UnsupportedError", "env_vars are not supported for language %s" % ctx.language, ""))
                    return
                self.run_silent(ctx, code_set)
            try:
                self._run(ctx, code, out)
            finally:
                if env_vars and ctx.kernel.alive():
                    restore = {k: ctx.envs[k] for k in env_vars if k in ctx.envs}
                    unset = [k for k in env_vars if k not in ctx.envs]
                    c = env_code(ctx.language, restore, unset)
                    if c:
                        self.run_silent(ctx, c)

    def _dead_reason(self, ctx):
        rc = ctx.kernel.exit_code()
        how = "exited" if rc is None else "exited with status %s" % rc
        return "the %s kernel of context %s %s: restart the context (restartCodeContext) to run code in it again" % (ctx.language, ctx.id, how)

    def _run(self, ctx, code, out):
        k = ctx.kernel
        msg_id = k.execute(code)
        interrupted = None
        last = 0.0
        while True:
            now = time.monotonic()
            if interrupted is None and out.gone():
                log("client gone: interrupting context", ctx.id)
                interrupted = now
            if interrupted is not None:
                # Again until the cell is over: a kernel that had not begun
                # the cell when the first came ignored it.
                if now - last >= REINTERRUPT:
                    k.interrupt()
                    last = now
                if now - interrupted > STOP_GRACE:
                    # A cell that catches or ignores SIGINT: left running,
                    # it would hold the kernel, and every next cell of the
                    # context would wait behind it. The kernel goes; the
                    # context says why until it is restarted.
                    log("context", ctx.id, "ran on through %.0f s of interrupts: killing its kernel" % STOP_GRACE)
                    try:
                        k.kill()
                    except Exception as e:
                        log("kill kernel", ctx.id, e)
                    ctx.dead = ("the %s kernel of context %s was killed: its cell ran on through %.0f s of interrupts after its client went; "
                                "restart the context (restartCodeContext) to run code in it again" % (ctx.language, ctx.id, STOP_GRACE))
                    return
            msg = k.iopub(POLL)
            if msg is None:
                if not k.alive():
                    ctx.dead = self._dead_reason(ctx)
                    out.send(error_line("DeadKernelError", "the kernel died while running this cell: " + ctx.dead, ""))
                    return
                out.keepalive()
                continue
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            t = msg.get("msg_type")
            if t == "status" and msg.get("content", {}).get("execution_state") == "idle":
                break
            for line in translate(msg):
                out.send(line)
        reply = self._drain_shell(ctx, msg_id)
        if reply is not None and reply.get("content", {}).get("status") == "abort":
            out.send(error_line("ExecutionAborted", "the kernel aborted this cell", ""))


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    interp = None  # set by serve()
    uids = frozenset()  # who may connect, set by serve()
    peer = None  # the uid of this connection's peer, once looked up

    def log_message(self, fmt, *a):
        pass

    def _body(self, limit=MAX_BODY):
        if self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise HTTPError(411, "a body with a Content-Length, not chunked")
        try:
            n = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            n = -1
        if n < 0:
            self.close_connection = True
            raise HTTPError(400, "a bad Content-Length")
        if n > limit:
            # Not read: the connection goes with the answer.
            self.close_connection = True
            raise HTTPError(413, "a body of %d bytes: at most %d here" % (n, limit))
        raw = self.rfile.read(n) if n else b""
        if not raw.strip():
            return {}
        try:
            b = json.loads(raw)
        except ValueError:
            raise HTTPError(400, "the body is not JSON")
        if not isinstance(b, dict):
            raise HTTPError(400, "the body is not a JSON object")
        return b

    def _reply(self, status, body, ctype="application/json"):
        if not isinstance(body, bytes):
            body = (json.dumps(body) if ctype == "application/json" else str(body)).encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _route(self, method):
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = [p for p in path.split("/") if p]
        try:
            if self.peer is None:
                self.peer = peer_uid(self.connection)
            if self.peer not in self.uids:
                self.close_connection = True
                who = "an unknown peer" if self.peer is None else "uid %d" % self.peer
                raise HTTPError(403, "the code interpreter serves kvbox serve's clients (through kvbox-agent) and the user %s, not %s" % (USER, who))
            if method == "GET" and parts == ["health"]:
                if not self.interp.ready.is_set():
                    return self._reply(503, "starting", "text/plain")
                return self._reply(200, "OK")
            if method == "POST" and parts == ["execute"]:
                return self._execute(self._body(MAX_EXECUTE_BODY))
            if parts[:1] == ["contexts"]:
                if method == "GET" and len(parts) == 1:
                    return self._reply(200, self.interp.list())
                if method == "POST" and len(parts) == 1:
                    b = self._body()
                    return self._reply(200, self.interp.create(b.get("language"), b.get("cwd")).json())
                if method == "POST" and len(parts) == 3 and parts[2] == "restart":
                    self.interp.restart(parts[1])
                    return self._reply(200, None)
                if method == "DELETE" and len(parts) == 2:
                    self.interp.remove(parts[1])
                    return self._reply(200, None)
            raise HTTPError(404, "no such endpoint: %s %s" % (method, path))
        except HTTPError as e:
            self._reply(e.status, e.text, "text/plain")

    def _execute(self, b):
        code = b.get("code")
        if not isinstance(code, str):
            raise HTTPError(400, "code (a string) is required")
        env_vars = b.get("env_vars") or {}
        if not isinstance(env_vars, dict):
            raise HTTPError(400, "env_vars must be an object")
        started = []

        def start():
            if not started:
                started.append(True)
                self.send_response(200)
                self.send_header("Content-Type", "application/x-ndjson")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

        def write(data):
            start()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

        out = Lines(write, self._client_gone)
        try:
            # Errors before the first line (a bad context) are HTTP errors.
            self.interp.execute(code, b.get("context_id"), b.get("language"), env_vars, out)
        except HTTPError as e:
            if not started:
                raise
            out.send(error_line("Error", e.text, ""))
        except Exception as e:
            log("execute:", repr(e))
            if not started:
                raise HTTPError(500, "execution failed: %s" % e)
            out.send(error_line(type(e).__name__, str(e), ""))
        out.send({"type": "end_of_execution"})
        if not out.closed:
            try:
                self.wfile.write(b"0\r\n\r\n")
            except OSError:
                pass

    def _client_gone(self):
        """The client closed its connection (a cancel): the request was
        read whole, so a readable socket with nothing in it is its EOF."""
        s = self.connection
        try:
            r, _, _ = select.select([s], [], [], 0)
            if not r:
                return False
            return s.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def do_GET(self):
        self._route("GET")

    def do_POST(self):
        self._route("POST")

    def do_DELETE(self):
        self._route("DELETE")


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def handle_error(self, request, client_address):
        # A client that went (a reset from the agent's forward) is no error.
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return
        super().handle_error(request, client_address)


def serve(interp, addr=ADDR, port=PORT, warm=None):
    """The server, its Python context started in the background unless
    warm (WARM by default) is false."""
    if warm is None:
        warm = WARM
    Handler.interp = interp
    Handler.uids = frozenset(allowed_uids())
    srv = Server((addr, port), Handler)

    def warmup():
        if warm:
            try:
                interp.default("python")
                log("python context ready")
            except Exception as e:
                log("python context:", e)
        interp.ready.set()

    threading.Thread(target=warmup, daemon=True).start()
    return srv


def main():
    srv = serve(Interpreter())
    log("listening on %s:%d" % srv.server_address[:2])
    srv.serve_forever()


if __name__ == "__main__":
    main()
