"""Running an engine's independent slices on threads, or on a Dask cluster.

numpy's element-wise passes (the softmax and its backward: most of attention's time at long
sequences) run on one core; its matrix products on BLAS's threads. Slices of the work that
share nothing, (batch, kv head, block of rows), can run on a thread pool: numpy releases the
GIL inside its loops, so the element-wise passes of two slices run on two cores.

BLAS is held to one thread while an engine runs, for any number of workers (one included):
`workers` threads are all the threads there are. On several threads BLAS's own would compete
with the pool's for the same cores; and one product computed by BLAS's threads can round
differently from the same product on one thread (OpenBLAS splits the sum over k into other
blocks, for k from about 400 up), so only products on one thread in every case give the same
bits for every worker count. The limit is process-wide (threadpoolctl): the first of the
overlapping calls in a process sets it and the last one restores BLAS's own setting, so calls
from several threads can overlap and each computes on one BLAS thread throughout. (An
OpenBLAS built on OpenMP, as some conda packages are, takes the limit per thread instead:
there the pool's threads keep BLAS's threads, and the bits can depend on the worker count;
numpy's own wheels use OpenBLAS's pthreads build.) It does not stop OpenBLAS's idle threads:
after a product on several threads (outside the library) they spin for about 0.1 s before
they sleep, and a pool that starts meanwhile shares the cores with them. Only
OPENBLAS_THREAD_TIMEOUT, read when OpenBLAS loads, shortens that (docs/variants.md, Threads).

On a cluster (dask.distributed, the optional extra `dask`) the same slices are tasks: the
arrays every slice reads (k, v, the options) are sent to each worker once, each slice's own
arrays with its task, and the results come back in order.

Bitwise the same for any worker count, and on a cluster: the slicing does not depend on
them, each task computes only its own slices with BLAS on one thread, and a sum over slices
(dk, dv over the rows of one kv head) is one task's, in the serial order.
"""
import contextlib
import os
import queue
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial

import threadpoolctl
from threadpoolctl import ThreadpoolController


def run_tasks(fn, items, workers=1, shared=None, scheduler=None):
    """[fn(*item, **shared) for item in items], in order, with BLAS on one thread.

    workers > 1: on that many threads; 1: on the calling thread.
    scheduler: a dask.distributed Client or a scheduler's address (`cluster`): on its
    workers, each value of `shared` sent to every worker once.
    """
    shared = shared or {}
    if scheduler is not None and items:           # (no task: nothing to send, and Dask's scatter of none fails)
        with cluster(scheduler) as client:
            names = list(shared)                 # one object each (a tuple would be scattered item by item)
            sent = dict(zip(names, client.scatter([shared[name] for name in names], broadcast=True, hash=False)))
            placed = client.scatter([tuple(item) for item in items], hash=False)   # each task's own data
            return client.gather([client.submit(_apply, fn, item, **sent, pure=False) for item in placed])
    calls = [partial(fn, *item, **shared) for item in items]
    with blas_on_one_thread():
        if workers == 1 or len(calls) < 2 or _POOLS.inside():
            return [call() for call in calls]
        return _POOLS.run(calls, workers)


class _Pools:
    """The calls of run_tasks on `workers` threads: the calling thread and workers - 1 helpers
    from a pool, each taking the next call no thread has taken yet, so the calling thread starts
    at once instead of waiting for a helper to wake. A pool per number of workers, started at
    its first use and kept, like BLAS's own threads (starting and joining threads costs more
    than a small call's work, and a module step makes up to eight calls). The pools hold no data
    between calls, and which thread computes a call changes none of its bits. Calls from several
    threads share a pool: each caller computes its own calls too, and cancels the helpers that
    had not started when none were left. A thread inside a call (a helper, or the caller while
    it computes) that runs tasks runs them itself, in order (waiting for the pool from inside it
    could wait forever). A forked child has none of the parent's threads, so it starts its own
    pools.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._pools = {}                        # helpers -> ThreadPoolExecutor
        self._local = threading.local()         # .inside: this thread computes a call's tasks

    def run(self, calls, workers):
        """[call() for call in calls] on this thread and workers - 1 helpers; once every call
        has ended, the first failure (in the calls' order) is raised."""
        todo = queue.SimpleQueue()
        for i in range(len(calls)):
            todo.put(i)
        results, failures, stop = [None] * len(calls), {}, threading.Event()

        def take():                             # the next call no thread has taken, until none
            while not stop.is_set():
                try:
                    i = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    results[i] = calls[i]()
                except Exception as exc:        # the others still run: raised at the end
                    failures[i] = exc
        pool = self._get(workers - 1)
        helpers = [pool.submit(take) for _ in range(min(workers, len(calls)) - 1)]
        self._local.inside = True
        try:
            take()
        finally:
            self._local.inside = False
            stop.set()                          # after an interrupt, the helpers take no more
            started = [helper for helper in helpers if not helper.cancel()]
            wait(started)
        for helper in started:
            helper.result()                     # a helper stopped by more than an Exception
        if failures:
            raise failures[min(failures)]
        return results

    def _get(self, helpers):
        with self._lock:
            if helpers not in self._pools:
                self._pools[helpers] = ThreadPoolExecutor(helpers, "numpy_attention",
                                                          initializer=self._mark)
            return self._pools[helpers]

    def inside(self):
        return getattr(self._local, "inside", False)

    def _mark(self):
        self._local.inside = True

    def after_fork(self):
        self._lock, self._pools, self._local = threading.Lock(), {}, threading.local()


class _OneThreadBlas:
    """BLAS on one thread from the first entry to the last exit of overlapping `with` blocks.

    The process-wide setting is threadpoolctl's; this counts the blocks open in the process
    (by thread), so that one ending while another runs does not give BLAS its threads back.
    That holds among the library's own calls: code of yours that sets BLAS's threads while a
    call runs changes them under it. threadpoolctl finds the loaded BLAS libraries once, at
    the first entry (a search costs more than setting a limit on them):
    numpy's, loaded with numpy, and any loaded before; one loaded later (scipy.linalg's own
    OpenBLAS, say) is left alone. threadpoolctl lets one thread at a time set OpenBLAS's
    threads (its pthreads build, threadpoolctl >= 3.6) and ignores the others: the first
    entry and the last exit, from whichever threads, take that control for their change and
    give it back.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._open = {}                         # thread ident -> blocks it has open
        self._controller = self._limiter = None

    def after_fork(self):
        """In a forked child only the forking thread lives on: only its open blocks count, and
        with none BLAS gets its threads back."""
        self._lock = threading.Lock()
        mine = self._open.get(threading.get_ident(), 0)
        if sum(self._open.values()) and not mine:
            with _blas_control():
                self._limiter.restore_original_limits()
        self._open = {threading.get_ident(): mine} if mine else {}

    def __enter__(self):
        with self._lock:
            if not self._open:
                self._controller = self._controller or ThreadpoolController()
                with _blas_control():
                    self._limiter = self._controller.limit(limits=1, user_api="blas")
            me = threading.get_ident()
            self._open[me] = self._open.get(me, 0) + 1

    def __exit__(self, *exc):
        with self._lock:
            me = threading.get_ident()
            self._open[me] -= 1
            if not self._open[me]:
                del self._open[me]
            if not self._open:
                with _blas_control():
                    self._limiter.restore_original_limits()


@contextlib.contextmanager
def _blas_control():
    """This thread may set OpenBLAS's threads inside (threadpoolctl's controlling thread)."""
    clear = getattr(getattr(threadpoolctl, "OpenBLASController", None), "clear_controlling_thread", None)
    if clear is not None:
        clear(force=True)
    try:
        yield
    finally:
        if clear is not None:
            clear(force=True)


_ONE_THREAD_BLAS = _OneThreadBlas()          # one per process: the BLAS setting is the process's
os.register_at_fork(after_in_child=_ONE_THREAD_BLAS.after_fork)
_POOLS = _Pools()
os.register_at_fork(after_in_child=_POOLS.after_fork)


def blas_on_one_thread():
    """A context manager: BLAS on one thread inside (threadpoolctl; see _OneThreadBlas)."""
    return _ONE_THREAD_BLAS


def _apply(fn, item, **shared):
    """fn(*item, **shared) with BLAS on one thread: a task on a cluster worker, its item sent
    ahead by scatter."""
    with blas_on_one_thread():
        return fn(*item, **shared)


@contextlib.contextmanager
def cluster(scheduler):
    """The dask.distributed Client of `scheduler`: the Client itself (or None), or one opened
    on the address (a string such as 'tcp://host:8786', check_address) for the block's
    duration."""
    if not isinstance(scheduler, str):
        yield scheduler
        return
    with _distributed().Client(scheduler, set_as_default=False) as client:
        yield client


def check_address(address):
    """ValueError now for a string that dask.distributed cannot read as a scheduler's address
    (no port, an unknown scheme): a Client opened on it would fail half made, and its
    clean-up at the interpreter's exit would wait 60 s and print a traceback. A well-formed
    address where no scheduler answers fails when the Client connects, after dask's connect
    timeout (distributed.comm.timeouts.connect), with an OSError."""
    comm = _distributed().comm
    try:
        scheme, location = comm.parse_address(address)
        backend = comm.registry.get_backend(scheme)
        try:
            backend.get_address_host_port(location)
        except NotImplementedError:             # a scheme without host and port (inproc://)
            pass
    except ValueError as exc:
        raise ValueError(f"scheduler {address!r} is not a scheduler's address such as "
                         f"'tcp://host:8786' ({exc})") from None


def _distributed():
    """The module dask.distributed, or ImportError naming the extra that installs it."""
    try:
        import distributed
    except ImportError:
        raise ImportError("a scheduler address needs dask.distributed (the extra 'dask': "
                          "pip install 'numpy-attention[dask]')") from None
    return distributed
