"""Running an engine's independent slices on threads, or on a Dask cluster.

numpy's element-wise passes (the softmax and its backward: most of attention's time at long
sequences) run on one core; its matrix products on BLAS's threads. Slices of the work that
share nothing, (batch, kv head, block of rows), can run on a thread pool: numpy releases the
GIL inside its loops, so the element-wise passes of two slices run on two cores. BLAS is
held to one thread meanwhile (threadpoolctl, for the pool's lifetime), or its own threads
would compete with the pool's for the same cores.

threadpoolctl's limit is process-wide: while a pool runs, BLAS is on one thread for every
thread of the process. One pool at a time sets and restores it (a lock), so overlapping calls
from several threads restore the caller's setting in order. The limit does not stop OpenBLAS's
own idle threads: after a product on several threads they spin (by default for about 0.1 s)
before they sleep, and a pool that starts meanwhile shares the cores with them. Only
OPENBLAS_THREAD_TIMEOUT, read when OpenBLAS loads, shortens that (docs/variants.md, Threads).
What the library can do is keep its own products off BLAS's threads next to a pool: a lone
task on several workers runs with BLAS on one thread too, and MultiHeadAttention runs its
projections as tasks when its attention runs on several threads.

On a cluster (dask.distributed, the optional extra `dask`) the same slices are tasks: the
arrays every slice reads (k, v, the options) are sent to each worker once, each slice's own
arrays with its task, and the results come back in order.

Bitwise the same for any worker count, and on a cluster: the slicing does not depend on
them, each task computes only its own slices, and a sum over slices (dk, dv over the rows
of one kv head) is one task's, in the serial order.
"""
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from threadpoolctl import threadpool_limits


_ONE_POOL_AT_A_TIME = threading.Lock()     # the BLAS limit is saved and restored by one pool at a time


def run_tasks(fn, items, workers=1, shared=None, scheduler=None):
    """[fn(*item, **shared) for item in items], in order.

    workers > 1: on that many threads, BLAS on one thread (a single item too: on the calling
    thread, so that no product on BLAS's threads leaves them spinning before the next pool).
    scheduler: a dask.distributed Client or a scheduler's address (`cluster`): on its
    workers, each value of `shared` sent to every worker once.
    """
    shared = shared or {}
    if scheduler is not None:
        with cluster(scheduler) as client:
            names = list(shared)                 # one object each (a tuple would be scattered item by item)
            sent = dict(zip(names, client.scatter([shared[name] for name in names], broadcast=True, hash=False)))
            placed = client.scatter([tuple(item) for item in items], hash=False)   # each task's own data
            return client.gather([client.submit(_apply, fn, item, **sent, pure=False) for item in placed])
    calls = [partial(fn, *item, **shared) for item in items]
    if workers == 1:
        return [call() for call in calls]
    with _ONE_POOL_AT_A_TIME, threadpool_limits(limits=1, user_api="blas"):
        if len(calls) < 2:
            return [call() for call in calls]
        with ThreadPoolExecutor(workers) as pool:
            futures = [pool.submit(call) for call in calls]
            return [future.result() for future in futures]


def _apply(fn, item, **shared):
    """fn(*item, **shared): a task on a cluster worker, its item sent ahead by scatter."""
    return fn(*item, **shared)


@contextlib.contextmanager
def cluster(scheduler):
    """The dask.distributed Client of `scheduler`: the Client itself (or None), or one opened
    on the address (a string such as 'tcp://host:8786') for the block's duration."""
    if not isinstance(scheduler, str):
        yield scheduler
        return
    try:
        from distributed import Client
    except ImportError:
        raise ImportError("a scheduler address needs dask.distributed (the extra 'dask': "
                          "pip install 'numpy-attention[dask]')") from None
    with Client(scheduler, set_as_default=False) as client:
        yield client
