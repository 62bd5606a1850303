#!/usr/bin/python3
"""kvbox's small bash kernel: language "bash" for kvbox's code interpreter
(Debian packages no bash kernel).

One bash process per kernel keeps the shell's state (variables, functions,
the working directory) from cell to cell. Each cell is written to a file and
sourced with stdin from /dev/null; a marker written after it, on stdout and
stderr, with the cell's exit status, ends the cell. Output streams to the
client as bash writes it. An interrupt (SIGINT to the kernel's process
group) stops the command running and returns from the cell (the shell's
trap), the shell lives on. A status other than 0 is the cell's error.
"""

import os
import queue
import signal
import subprocess
import tempfile
import threading
import uuid

from ipykernel.kernelapp import IPKernelApp
from ipykernel.kernelbase import Kernel


class Stream(threading.Thread):
    """Reads one of bash's outputs, putting (name, text) chunks and
    (name, None, status) at each cell's end marker on q."""

    def __init__(self, name, fd, marker, q):
        super().__init__(daemon=True)
        self.name, self.fd, self.marker, self.q = name, fd, marker, q

    def run(self):
        buf = b""
        m = self.marker
        while True:
            try:
                chunk = os.read(self.fd, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                if buf:
                    self.q.put((self.name, buf.decode(errors="replace")))
                self.q.put((self.name, None, None))
                return
            buf += chunk
            while True:
                i = buf.find(m)
                if i >= 0:
                    j = buf.find(b"\n", i)
                    if j < 0:
                        break
                    if i:
                        self.q.put((self.name, buf[:i].decode(errors="replace")))
                    status = buf[i + len(m):j].strip()
                    self.q.put((self.name, None, int(status) if status.isdigit() else 0))
                    buf = buf[j + 1:]
                    continue
                # Keep back what may be the start of a marker.
                keep = 0
                for n in range(min(len(m) - 1, len(buf)), 0, -1):
                    if m.startswith(buf[-n:]):
                        keep = n
                        break
                out, buf = (buf[:-keep], buf[-keep:]) if keep else (buf, b"")
                if out:
                    self.q.put((self.name, out.decode(errors="replace")))
                break


class BashKernel(Kernel):
    implementation = "kvbox_bash"
    implementation_version = "1"
    language = "bash"
    language_version = "5"
    language_info = {"name": "bash", "mimetype": "text/x-sh", "file_extension": ".sh", "codemirror_mode": "shell"}
    banner = "kvbox bash kernel"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.dir = tempfile.mkdtemp(prefix="kvbox-bash-")
        self.bash = None

    def _start(self):
        self.marker = ("\x1ekvbox-end-%s " % uuid.uuid4().hex).encode()
        self.q = queue.Queue()
        self.bash = subprocess.Popen(
            ["/bin/bash", "--noprofile", "--norc"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            # The kernel ignores SIGINT between cells; bash and what it runs
            # must not inherit that.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.bash.stdin.write(b"trap 'return 130' INT\n")
        self.bash.stdin.flush()
        for name, f in (("stdout", self.bash.stdout), ("stderr", self.bash.stderr)):
            Stream(name, f.fileno(), self.marker, self.q).start()

    def do_execute(self, code, silent, store_history=True, user_expressions=None, allow_stdin=False, **kw):
        if self.bash is None or self.bash.poll() is not None:
            self._start()
        path = os.path.join(self.dir, "cell.sh")
        with open(path, "w") as f:
            f.write(code)
            if not code.endswith("\n"):
                f.write("\n")
        m = self.marker.decode()
        self.bash.stdin.write((". %s </dev/null\n__kvbox_s=$?\nprintf '%s%%s\\n' \"$__kvbox_s\"\nprintf '%s%%s\\n' \"$__kvbox_s\" >&2\n"
                               % (path, m, m)).encode())
        self.bash.stdin.flush()
        done = {}
        interrupted = False
        while len(done) < 2:
            try:
                item = self.q.get()
            except KeyboardInterrupt:
                # bash, in this process group, had the SIGINT too: its trap
                # returns from the cell and the markers follow.
                interrupted = True
                continue
            if len(item) == 3:
                done[item[0]] = item[2]
                continue
            if not silent:
                self.send_response(self.iopub_socket, "stream", {"name": item[0], "text": item[1]})
        status = done.get("stdout")
        if status is None:
            self.bash = None
            return self._error(silent, "BashExited", "bash exited; the next cell starts a new one")
        if interrupted:
            return self._error(silent, "KeyboardInterrupt", "interrupted")
        if status != 0:
            return self._error(silent, "ExitStatus", "exit status %d" % status)
        return {"status": "ok", "execution_count": self.execution_count, "payload": [], "user_expressions": {}}

    def _error(self, silent, name, value):
        content = {"ename": name, "evalue": value, "traceback": ["%s: %s" % (name, value)]}
        if not silent:
            self.send_response(self.iopub_socket, "error", content)
        content.update(status="error", execution_count=self.execution_count)
        return content

    def do_shutdown(self, restart):
        if self.bash is not None and self.bash.poll() is None:
            self.bash.kill()
        return {"status": "ok", "restart": restart}


if __name__ == "__main__":
    IPKernelApp.launch_instance(kernel_class=BashKernel)
