"""Running an engine's independent slices on threads, with BLAS held to one thread inside.

numpy's element-wise passes (the softmax and its backward: most of attention's time at long
sequences) run on one core; its matrix products on BLAS's threads. Slices of the work that
share nothing, (batch, kv head, block of rows), can run on a thread pool: numpy releases the
GIL inside its loops, so the element-wise passes of two slices run on two cores. BLAS is
held to one thread meanwhile (threadpoolctl, for the pool's lifetime), or its own threads
would compete with the pool's for the same cores.

threadpoolctl's limit is process-wide: while a pool runs, BLAS is on one thread for every
thread of the process. One pool at a time sets and restores it (a lock), so overlapping calls
from several threads restore the caller's setting in order.

Bitwise the same for any worker count: the slicing does not depend on it, each task writes
only its own slices, and a sum over slices (dk, dv over the rows of one kv head) is one task's,
in the serial order.
"""
import threading
from concurrent.futures import ThreadPoolExecutor

from threadpoolctl import threadpool_limits


_ONE_POOL_AT_A_TIME = threading.Lock()     # the BLAS limit is saved and restored by one pool at a time


def run_tasks(tasks, workers):
    """[task() for task in tasks], on `workers` threads (BLAS on one thread) when workers > 1."""
    if workers == 1 or len(tasks) < 2:
        return [task() for task in tasks]
    with _ONE_POOL_AT_A_TIME, threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(workers) as pool:
        futures = [pool.submit(task) for task in tasks]
        return [future.result() for future in futures]
