"""Worker processes that solve candidates ahead of the search, on the machine's other cores.

The search visits candidates one by one, each asking its solvers with the cutoff (the K-th
best step time known) of that moment; that order is what makes a plan the same from run to
run. Workers keep it: each solves a candidate the search will reach soon
(`search.solve_candidate`) with the cutoff known when it was handed out, and the search, on
reaching that candidate, takes the answer only where it is the one it would have got itself
(`search.Outcome`): asked with the same cutoff, or cut off under a looser one, which a
tighter one cuts off too. Otherwise it solves the candidate again itself; and a job asked
under a looser cutoff than the search's by the time it gets there, still running, is
abandoned, since proving an optimum the search would cut off can take a hundred times
longer (the 405B shape: 19 s where the search's own solve took 0.4 s). So the plan does
not depend on how many workers ran or how fast: only the time does (and the count of
MILPs shown, which includes what workers solved under looser cutoffs).

Each worker is a `python -m planner.parallel` process (torch-free: the planner's imports
only) holding its own cost model of the search's profile and options; jobs and answers
cross its stdin and a copy of its stdout as pickles, and whatever else it prints goes to
/dev/null.
"""

from __future__ import annotations

import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path


def _send(stream, obj) -> None:
    _send_bytes(stream, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _send_bytes(stream, data: bytes) -> None:
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _receive(stream):
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the worker closed its pipe")
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


class Job:
    """One job handed to the workers: its Future (of an Outcome) and the process running it."""

    def __init__(self, args: tuple):
        self.args = args
        self.future: Future | None = None
        self.proc: subprocess.Popen | None = None
        self.abandoned = False


class Workers:
    """`n` worker processes for one search, started at once; `submit` hands one a job
    (search.solve_candidate's arguments), `abandon` takes it back (a worker running it is
    stopped and a new one takes its place). A worker that stops of its own accord marks them
    all `broken`: the search hands out nothing more."""

    def __init__(self, profile, opts, n: int):
        root = str(Path(__file__).resolve().parents[1])          # where planner/ and profiles/ are importable from
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.setup = pickle.dumps((profile, opts), protocol=pickle.HIGHEST_PROTOCOL)   # (megabytes for a deep model)
        self.procs: list[subprocess.Popen] = []     # every worker started, stopped ones too
        self.idle: queue.Queue = queue.Queue()
        self.closed = self.broken = False
        try:
            for _ in range(n):
                self.idle.put(self._start())
        except OSError:
            for proc in self.procs:
                proc.kill()
            raise
        self.pool = ThreadPoolExecutor(n, thread_name_prefix="plan-worker")

    def _start(self) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-m", "planner.parallel"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env)
        # The setup is read once the worker has imported the planner: written meanwhile, by a thread.
        proc.setup_sent = threading.Thread(target=self._send_setup, args=(proc,), daemon=True)
        proc.setup_sent.start()
        self.procs.append(proc)
        return proc

    def _send_setup(self, proc: subprocess.Popen) -> None:
        try:
            _send_bytes(proc.stdin, self.setup)
        except OSError:                      # it stopped: its first job finds out
            pass

    def submit(self, args: tuple) -> Job:
        job = Job(args)
        job.future = self.pool.submit(self._run, job)
        return job

    def abandon(self, job: Job) -> None:
        """Take a job back: unstarted, it is dropped; running, its worker is stopped."""
        job.abandoned = True
        proc = job.proc
        if not job.future.cancel() and proc is not None and not job.future.done():
            proc.kill()

    def _run(self, job: Job):
        proc = job.proc = self.idle.get()
        try:
            proc.setup_sent.join()
            _send(proc.stdin, job.args)
            answer = _receive(proc.stdout)
        finally:
            job.proc = None
            if proc.poll() is not None and not self.closed:
                try:
                    if not job.abandoned:
                        raise OSError("stopped of its own accord")
                    proc = self._start()     # stopped by abandon: a new worker takes its place
                except OSError:
                    self.broken = True       # something is wrong with workers here: the search goes on alone
            self.idle.put(proc)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def close(self) -> None:
        """Stop every worker: the idle ones at the end of their input, the busy ones at once."""
        self.closed = True
        self.pool.shutdown(wait=False, cancel_futures=True)
        idle = []
        while not self.idle.empty():
            idle.append(self.idle.get())
        for proc in self.procs:
            if proc in idle:
                try:
                    proc.stdin.close()       # a worker ends at the end of its input
                except OSError:
                    pass
            else:
                proc.kill()                  # still solving a candidate the search no longer needs
        for proc in self.procs:
            try:
                proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass


def serve() -> None:
    """A worker: read the profile and options, then jobs, answering each with its Outcome
    (or the exception it raised)."""
    jobs = os.fdopen(os.dup(0), "rb")
    answers = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)                       # stray output (a solver's banner) must not enter the answers
    from .cost import CostModel
    from .search import solve_candidate
    profile, opts = _receive(jobs)
    model = CostModel(profile, opts.hardware, opts.node_size, opts.memory_limit)
    while True:
        try:
            job = _receive(jobs)
        except EOFError:
            return
        try:
            answer = solve_candidate(model, opts, *job)
        except Exception as err:             # handed back: the search solves that candidate itself
            answer = err
        _send(answers, answer)


if __name__ == "__main__":
    serve()
