"""SIGTERM and SIGINT as an exception, so that a killed job or command unwinds like any other
failure: staging folders and temporary files are removed, and a Hydra job records status "killed".

SIGTERM is how Slurm ends a job at its time limit (and what `timeout` and `kill` send); its default
action ends the process without running any Python cleanup. `KillSwitch` is the one place that
turns both signals into `Killed`; the experiment runner wraps each job in one, and
`moejax.hf.io.staging.staged_directory` wraps every checkpoint it writes in one. SIGKILL
cannot be caught: staging folders carry a marker file so that a later run can remove them.
"""

from __future__ import annotations

import gc
import signal
import threading
import time


class Killed(BaseException):
    """SIGTERM or SIGINT arrived inside a KillSwitch. A BaseException (like KeyboardInterrupt) so
    that no `except Exception` swallows it; exit status 128 + signum by convention."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"killed by {self.signal_name}"


KILL_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _unsafe_to_raise(frame) -> bool:
    """Whether an exception raised at `frame` would be lost or would crash the process: inside one
    of gc.callbacks (Python swallows its exceptions), or inside an import (an exception in the
    middle of initialising a C extension such as jaxlib aborts or segfaults the interpreter)."""
    callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks} - {None}
    while frame is not None:
        code = frame.f_code
        if code in callbacks or code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


class KillSwitch:
    """While installed, SIGTERM and SIGINT raise Killed in the main thread.

    Raising from a signal handler is not safe everywhere: the exception is lost when the signal
    lands while Python runs a gc callback, a __del__ or a weakref callback ("Exception ignored
    in ..."; JAX registers a gc callback), and raised inside an import it can crash the interpreter
    (jaxlib's extension modules abort). So the handler does not raise there (`_unsafe_to_raise`),
    and after the first signal a helper thread sends it again every RESEND_S seconds until the job
    `acknowledge`s it (first thing in its except clause); the runner also `check`s before writing
    results. The helper starts with the switch, so that the handler itself only sets flags (starting
    a thread there could deadlock on a lock the interrupted code holds). A signal that was ignored
    when the job started (SIG_IGN, e.g. SIGINT of a background job of a shell without job control)
    stays ignored. Off the main thread (where Python cannot set handlers) the switch does nothing.
    """

    RESEND_S = 0.2

    def __init__(self):
        self.signum: int | None = None
        self.stopped = False  # a plain attribute: setting it cannot itself be interrupted
        self._armed = threading.Event()
        self._resender: threading.Thread | None = None
        self._previous: dict = {}

    def _handler(self, signum, frame):
        if self.stopped:
            return  # the job is writing its status, or has finished
        if self.signum is None:
            self.signum = signum
            self._armed.set()
        if not _unsafe_to_raise(frame):  # otherwise the resend, RESEND_S later, tries again
            raise Killed(self.signum)

    def _resend(self):
        main = threading.main_thread().ident
        self._armed.wait()
        while not self.stopped:
            signal.pthread_kill(main, self.signum)
            time.sleep(self.RESEND_S)

    def acknowledge(self) -> None:
        """No more Killed from here on (a signal now is dropped); stops the helper."""
        self.stopped = True
        self._armed.set()  # wakes the helper, which sees `stopped`
        if self._resender is not None:
            self._resender.join()
            self._resender = None

    def check(self) -> None:
        """Raise Killed if a signal came whose exception was lost."""
        if self.signum is not None and not self.stopped:
            raise Killed(self.signum)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for s in KILL_SIGNALS:
                if signal.getsignal(s) is not signal.SIG_IGN:
                    self._previous[s] = signal.signal(s, self._handler)
            if self._previous:
                self._resender = threading.Thread(target=self._resend, name="moejax-kill-resend", daemon=True)
                self._resender.start()
        return self

    def __exit__(self, *exc_info):
        self.acknowledge()
        for s, h in self._previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
        return False
