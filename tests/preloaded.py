"""Scripts started from a pre-loaded interpreter (a fork server), for the tests that start many short runs.

A Python that imports torch, torchvision, pandas and matplotlib spends 5-10 s of CPU before a script's
first line, and the suite starts the official YOLOv9 scripts and the project's trainer about twenty times
(issue #22: the suite's time). ``PreloadedPython`` starts one interpreter that imports those packages and
nothing else, then forks it for each run. The child takes the run's environment, working directory,
``sys.argv`` and ``sys.path[0]``, sends its output to the run's log, and runs the script or module as
``__main__`` with ``runpy``, as ``python SCRIPT ARGS`` or ``python -m MODULE ARGS`` would. Neither the
script's own modules nor fastload are imported before the fork, so whatever they read from the environment
at import is the run's. Variables that the pre-loaded packages read when they load (threads, PYTHONPATH,
the matplotlib backend) must be the server's: ``spawn`` refuses a run whose values differ.

Each run is its own process (a pid that can be signalled), exits with its own status, and can fork or
start its own processes (DataLoader workers, torchrun) as under a plain interpreter.

``PreloadedPython.python`` is an executable that stands in for ``python`` in processes a run starts itself:
``PYTHON_EXEC`` (torchrun's documented choice of the interpreter its ranks run under) set to it makes each
rank a fork of the server as well. It hands the server its arguments, environment, working directory and
standard streams over a Unix socket, forwards the signals it gets to the forked rank and exits with its status.
The test processes hand it their runs the same way (their log files as the run's streams). Under pytest-xdist the
workers share one server (``PreloadedPython.shared``): its imports cost 5-6 s of CPU, and both workers start runs.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# imported once by the server; all of them are what the official scripts and the trainer import first (IPython: the
# official utils/general.py's, 0.2 s of each official run)
PRELOAD = ("numpy", "yaml", "cv2", "torch", "torchvision", "scipy.signal", "pandas", "matplotlib.pyplot", "seaborn",
           "torch.utils.tensorboard", "IPython")
# variables a pre-loaded package reads when it loads: a run must have the server's values
READ_AT_LOAD = ("PYTHONPATH", "PYTHONHASHSEED", "MPLBACKEND", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                "CUDA_VISIBLE_DEVICES")


def base_env(repo: Path) -> dict[str, str]:
    """This environment with ``repo`` first on PYTHONPATH, one OpenMP and MKL thread and matplotlib's Agg backend:
    what the runs of the suite's scripts share (two processes on two cores with two threads each spin-wait)."""
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), *filter(None, [os.environ.get("PYTHONPATH")])]),
                OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", MPLBACKEND="Agg")


def load_time_mismatch(env: dict[str, str], server_env: dict[str, str] | os._Environ) -> str | None:
    """Why a run with ``env`` cannot be forked from a server started with ``server_env``, or None."""
    differ = [k for k in READ_AT_LOAD if env.get(k) != server_env.get(k)]
    return f"a preloaded run needs the server's {', '.join(differ)} (read when torch & co. load)" if differ else None


class PreloadedProcess:
    """One run forked by the server: the subset of ``subprocess.Popen`` that the tests use."""

    def __init__(self, server: PreloadedPython, run_id: int, pid: int):
        self._server, self._id, self.pid = server, run_id, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server._exit_status(self._id, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            rc = self._server._exit_status(self._id, timeout=timeout)
            if rc is None:
                raise subprocess.TimeoutExpired(f"preloaded run {self._id}", timeout or 0)
            self.returncode = rc
        return self.returncode

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass


class PreloadedPython:
    """A fork server with ``PRELOAD`` imported, started with environment ``env``; ``spawn`` runs a script in it.

    ``PreloadedPython.shared(env, folder)`` is the one server of the test processes that share ``folder`` (pytest-xdist's
    workers): the first starts it, the others join it. Each holds a lease (the server's stdin for the one that started
    it, a connection for the others); the server ends when every lease is given back and its runs have ended."""

    def __init__(self, env: dict[str, str], *, shared: bool = False):
        self.env = dict(env)
        self._dir = tempfile.mkdtemp(prefix="preloaded-")
        self.socket = os.path.join(self._dir, "server.sock")
        self.python = os.path.join(self._dir, "python")  # the stand-in for python (see the module's docstring)
        with open(self.python, "w") as f:
            # -IS: no site packages, no PYTHON* variables: a stand-in starts in milliseconds
            f.write(f"#!{sys.executable} -IS\nimport sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\n"
                    f"from preloaded import stand_in_main\nsys.exit(stand_in_main({self.socket!r}))\n")
        os.chmod(self.python, 0o755)
        # its stdin is this process's lease: closed (or this process gone), the server ends once its runs have
        self._proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--serve", self.socket], env=self.env, stdin=subprocess.PIPE)
        self.server_pid = self._proc.pid
        self._shared = shared  # another test process may hold a lease: close() does not wait for the server
        self._lease: socket.socket | None = None
        self._lock = threading.Condition()
        self._replies: dict[int, dict] = {}
        self._next_id = 0

    @classmethod
    def shared(cls, env: dict[str, str], folder: Path) -> PreloadedPython:
        """The server of the test processes sharing ``folder``: joined where one of them has started it and it still
        serves (with the same values of the variables read at load), else started here and announced there.

        The pre-loaded imports cost 5-6 s of CPU per server; pytest-xdist's two workers both start runs."""
        import fcntl

        with open(folder / "preloaded.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # one starts it while the other waits, then joins it
            announced = folder / "preloaded.json"
            if announced.is_file():
                joined = cls._join(json.loads(announced.read_text()), env)
                if joined is not None:
                    return joined
            server = cls(env, shared=True)
            announced.write_text(json.dumps({"socket": server.socket, "python": server.python,
                                             "pid": server.server_pid, "env": server.env}))
            return server

    @classmethod
    def _join(cls, info: dict, env: dict[str, str]) -> PreloadedPython | None:
        """A lease on the announced server ``info``; None where it cannot serve runs of ``env`` or is gone."""
        if load_time_mismatch(env, info["env"]):
            return None
        self = cls.__new__(cls)
        self.env, self.socket, self.python, self.server_pid = info["env"], info["socket"], info["python"], info["pid"]
        self._dir, self._proc, self._shared = None, None, True
        self._lock = threading.Condition()
        self._replies, self._next_id = {}, 0
        try:
            self._lease = self._connect(timeout=120)
            self._lease.sendall(b'{"lease": true}\n')
            if self._lease.makefile("r").readline() == "":  # it was ending: it closed the connection unanswered
                self._lease.close()
                return None
        except (OSError, RuntimeError):
            return None
        return self

    def _connect(self, timeout: float) -> socket.socket:
        """A connection to the server, once it listens (it binds its socket after its imports)."""
        deadline = time.monotonic() + timeout
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.connect(self.socket)
                return conn
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if not self._server_alive():
                    raise RuntimeError("the preloaded interpreter has ended") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the preloaded interpreter did not listen within {timeout} s") from None
                time.sleep(0.05)

    def _server_alive(self) -> bool:
        if self._proc is not None:
            return self._proc.poll() is None
        try:
            os.kill(self.server_pid, 0)
            return True
        except ProcessLookupError:
            return False

    def spawn(self, argv: list[str], cwd: Path | str, env: dict[str, str], log: Path | str,
              err_log: Path | str | None = None) -> PreloadedProcess:
        """Start ``python ARGV`` (``argv`` is what follows the interpreter: ``SCRIPT ...`` or ``-m MODULE ...``) in
        ``cwd`` with ``env``, its stdout into ``log`` and its stderr too, or into ``err_log`` where given."""
        mismatch = load_time_mismatch(env, self.env)
        if mismatch:
            raise ValueError(mismatch)
        conn = self._connect(timeout=120)
        # the run's streams, passed as a stand-in passes its own: no input, the log (and the error log: 2>&1 where none)
        streams = [os.open(os.devnull, os.O_RDONLY), os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)]
        streams.append(os.open(err_log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) if err_log and str(err_log) != str(log)
                       else os.dup(streams[1]))
        try:
            request = {"argv": list(argv), "cwd": str(cwd), "env": env, "unbuffered": False}
            socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], streams)
        finally:
            for fd in streams:
                os.close(fd)
        replies = conn.makefile("r")
        started = json.loads(replies.readline() or '{"error": "the preloaded interpreter went away"}')
        if "error" in started:
            conn.close()
            raise RuntimeError(f"preloaded python: {started['error']}")
        with self._lock:
            run_id, self._next_id = self._next_id, self._next_id + 1
            self._replies[run_id] = {"pid": started["pid"]}
        threading.Thread(target=self._read_exit_status, args=(run_id, conn, replies), daemon=True).start()
        return PreloadedProcess(self, run_id, started["pid"])

    def _read_exit_status(self, run_id: int, conn: socket.socket, replies) -> None:
        line = replies.readline()
        conn.close()
        with self._lock:  # no line: the server is gone, and the run with it
            self._replies[run_id]["rc"] = json.loads(line)["rc"] if line else -9
            self._lock.notify_all()

    def _exit_status(self, run_id: int, timeout: float | None) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: "rc" in self._replies.get(run_id, {}), timeout=timeout)
            return self._replies.get(run_id, {}).get("rc")

    def close(self) -> None:
        """Give the lease back. The server ends once its runs have ended and no other test process holds a lease:
        waited for (60 s at most) unless it is shared."""
        if self._lease is not None:
            self._lease.close()
            return
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        if self._shared:
            return  # another process may still use it; it removes its folder when it ends
        try:
            self._proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        assert self._dir is not None
        shutil.rmtree(self._dir, ignore_errors=True)


def run(server: PreloadedPython, argv: list[str], cwd: Path, env: dict[str, str], timeout: float = 600
        ) -> subprocess.CompletedProcess:
    """``subprocess.run([python, *argv], capture_output=True, text=True, ...)`` through ``server``."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="preloaded-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        proc = server.spawn(argv, cwd, env, out, err)
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        return subprocess.CompletedProcess([sys.executable, *argv], rc, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


# ----------------------------------------------------------------------------------------- the server
def _redirect(streams: list[int]) -> None:
    """Standard streams of a run: the three descriptors that came with its request (a stand-in's own, or a test
    process's: no input, its log files)."""
    for target, fd in enumerate(streams):
        os.dup2(fd, target)
        os.close(fd)


def _run_child(request: dict, streams: list[int]) -> int:
    """In the forked child: become ``python ARGV`` and return its exit status."""
    import runpy
    import traceback

    _redirect(streams)
    sys.stdin = open(0, closefd=False)
    if request.get("unbuffered"):  # python -u
        sys.stdout.reconfigure(write_through=True)
        sys.stderr.reconfigure(write_through=True)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = request["argv"]
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in argv[0], as python -m does
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(argv[0])
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(script)
            runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def _exit(code: int) -> None:
    """End the child as a plain interpreter ends, less the teardown of every module: non-daemon threads joined,
    atexit handlers run, output flushed. That teardown writes to nearly every page of the heap the server
    shares with its children (reference counts), which copies them: 4-5 s per run with torch loaded."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _read_stand_in_request(conn: socket.socket) -> tuple[dict, list[int]]:
    """A stand-in's request line and the three descriptors that came with it."""
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not data.endswith(b"\n"):
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("a stand-in went away before its request was complete")
        data += more
    return json.loads(data), list(fds)


def serve(socket_path: str) -> None:
    """Import ``PRELOAD``, then fork a child per request on ``socket_path`` (a stand-in's, or a test process's: its
    arguments, environment, working directory and standard streams), reporting its pid and exit status on that
    connection. Serves while its stdin is open, a lease connection is, or a run goes on; then removes its folder."""
    import gc
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # an optional package absent here: the run imports what it needs itself
    gc.freeze()  # what the server imported stays out of the children's collections: fewer pages copied
    os.dup2(2, 1)  # anything a package prints goes to stderr
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(socket_path)
    listener.listen(16)
    children: dict[int, socket.socket] = {}  # pid -> the connection its exit status goes to
    leases: set[socket.socket] = set()  # the connections of test processes that use this server besides its parent
    open_stdin = True

    def start(request: dict, streams: list[int]) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for conn in (listener, *leases, *children.values()):  # the server's, not the run's
                conn.close()
            _exit(_run_child(request, streams))
        return pid

    while open_stdin or children or leases:
        ready, _, _ = select.select([listener, *leases, *([0] if open_stdin else [])], [], [], 0.05)
        if 0 in ready:
            open_stdin = bool(os.read(0, 1 << 16))  # the parent's lease: nothing but its end is ever sent
        for lease in leases & set(ready):  # a lease given back (closed, or its process gone)
            leases.discard(lease)
            lease.close()
        if listener in ready:
            conn, _ = listener.accept()
            try:
                request, streams = _read_stand_in_request(conn)
            except (EOFError, OSError, ValueError):  # gone before its request was complete (killed): nobody to serve
                conn.close()
                continue
            mismatch = None if request.get("lease") else load_time_mismatch(request["env"], os.environ)
            if request.get("lease"):
                leases.add(conn)
                conn.sendall(b'{"leased": true}\n')
            elif mismatch:
                conn.sendall(json.dumps({"error": mismatch}).encode() + b"\n")
                conn.close()
            else:
                pid = start(request, streams)
                children[pid] = conn
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            for fd in streams:
                os.close(fd)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in children:
                owner, rc = children.pop(pid), os.waitstatus_to_exitcode(status)
                try:
                    owner.sendall(json.dumps({"rc": rc}).encode() + b"\n")
                except OSError:
                    pass  # the stand-in is gone (killed): nobody waits for this status
                owner.close()
    listener.close()  # a late connection is refused: whoever makes it starts a server of its own
    shutil.rmtree(os.path.dirname(socket_path), ignore_errors=True)  # its socket and the stand-in


# ------------------------------------------------------------------------------------------ the stand-in
def stand_in_main(socket_path: str) -> int:
    """``python [-u] (-m MODULE | SCRIPT) ARGS`` run by the server (``PreloadedPython.python``): this process hands
    the server its arguments, environment, working directory and standard streams, passes on the signals it
    receives to the run (torchrun stops its ranks with SIGTERM) and exits with the run's status."""
    args, unbuffered = sys.argv[1:], False
    while args[:1] == ["-u"]:
        args, unbuffered = args[1:], True
    if not args or (args[0].startswith("-") and args[0] != "-m"):
        print(f"preloaded python: only [-u] (-m MODULE | SCRIPT) ARGS, not {sys.argv[1:]}", file=sys.stderr)
        return 2
    request = {"argv": args, "cwd": os.getcwd(), "env": dict(os.environ), "unbuffered": unbuffered}
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(socket_path)
        socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
        replies = conn.makefile("r")
        started = json.loads(replies.readline())
        if "error" in started:
            print(f"preloaded python: {started['error']}", file=sys.stderr)
            return 1
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(sig, lambda number, _frame: os.kill(started["pid"], number))
        line = replies.readline()
    rc = json.loads(line)["rc"] if line else 1  # no line: the server went away
    if rc < 0:  # killed by a signal: so is this process, as a parent sees it
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    return rc


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(sys.argv[2])
