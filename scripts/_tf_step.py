"""TensorFlow's parameter server, measured the way scripts/_step_bench.py measures ours.

Run under a Python that has TensorFlow (``scripts/bench.py --tf-python PATH`` does that):

    PATH/python scripts/_tf_step.py --workers 4 --sizes 4096 1048576 --runs 7

One step: W worker processes each run ``apply_grad`` of one float32 gradient (a variable on
the worker, so its bytes travel worker -> parameter server over gRPC), released at once; the
chief runs
``take_grad(W)`` of a ``ConditionalAccumulator`` placed on the ``ps`` task and fetches the
mean; timed from the release to the fetched result. Prints one JSON object:
``{"<nbytes>": median ms, ...}``. Nothing of redis-accumulator is imported here.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from typing import Any


def _ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    return tf


def _cluster(ports: list[int]) -> dict[str, list[str]]:
    return {"ps": [f"localhost:{ports[0]}"], "worker": [f"localhost:{p}" for p in ports[1:]]}


def _ps(ports: list[int]) -> None:
    tf = _tf()
    server = tf.distribute.Server(_cluster(ports), job_name="ps", task_index=0)
    server.join()


def _graph(tf: Any, n: int, name: str) -> Any:
    with tf.device("/job:ps/task:0"):
        return tf.compat.v1.ConditionalAccumulator(tf.float32, shape=(n,), shared_name=name)


def _worker(ports: list[int], task: int, n: int, name: str, conn: Any) -> None:
    tf = _tf()
    server = tf.distribute.Server(_cluster(ports), job_name="worker", task_index=task)
    acc = _graph(tf, n, name)
    with tf.device(f"/job:worker/task:{task}"):
        # the gradient lives on the worker (as one computed there would): each apply sends
        # its bytes to the ps task over gRPC, nothing is fed from Python but the step
        grad = tf.compat.v1.Variable(tf.fill([n], float(task)), trainable=False,
                                     name=f"grad{task}")  # fmt: skip
        step = tf.compat.v1.placeholder(tf.int64, shape=())
        apply = acc.apply_grad(grad.read_value(), local_step=step)
    with tf.compat.v1.Session(server.target) as sess:
        sess.run(grad.initializer)
        conn.send("ready")
        while True:
            s = conn.recv()
            if s is None:
                break
            sess.run(apply, feed_dict={step: s})
            conn.send("applied")


def _chief(ports: list[int], n: int, name: str, workers: int, runs: int, pipes: list[Any],
           out: Any) -> None:  # fmt: skip
    tf = _tf()
    server = tf.distribute.Server(_cluster(ports), job_name="worker", task_index=0)
    acc = _graph(tf, n, name)
    with tf.device("/job:worker/task:0"):
        take = acc.take_grad(workers)
    times = []
    with tf.compat.v1.Session(server.target) as sess:
        for c in pipes:
            assert c.recv() == "ready"
        for step in range(runs + 1):
            t = time.perf_counter()
            for c in pipes:
                c.send(step)
            sess.run(take)
            for c in pipes:
                assert c.recv() == "applied"
            if step:
                times.append(time.perf_counter() - t)
        for c in pipes:
            c.send(None)
    out.send(1000 * statistics.median(times))


def steps_for(nbytes: int, runs: int) -> int:
    """Timed steps of one size: the rule of ``_step_bench.steps_for`` (which imports
    accumulator; this script runs in TensorFlow's Python)."""
    if nbytes <= 1 << 20:
        return 5 * runs
    return runs if nbytes <= 64 << 20 else max(2, runs // 5)


def measure(n: int, workers: int, runs: int) -> float:
    """Median step (ms) of one fresh cluster: a ps task, a chief and W workers, each a
    process (one gRPC server per process)."""
    ctx = mp.get_context("spawn")
    ports = _ports(workers + 2)
    name = f"acc{n}"
    procs = [ctx.Process(target=_ps, args=(ports,), daemon=True)]
    chief_ends = []
    for i in range(workers):
        mine, theirs = ctx.Pipe()
        procs.append(ctx.Process(target=_worker, args=(ports, i + 1, n, name, theirs),
                                 daemon=True))  # fmt: skip
        chief_ends.append(mine)
    result, result_in = ctx.Pipe()
    procs.append(ctx.Process(target=_chief, args=(ports, n, name, workers, runs, chief_ends,
                                                  result_in), daemon=True))  # fmt: skip
    for p in procs:
        p.start()
    try:
        if not result.poll(600):
            raise TimeoutError("the TF cluster did not finish in 600 s")
        return float(result.recv())
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(10)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", required=True, help="bytes")
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    out = {str(nbytes): measure(nbytes // 4, args.workers, steps_for(nbytes, args.runs))
           for nbytes in args.sizes}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
