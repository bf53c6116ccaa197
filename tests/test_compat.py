"""The oldest redis-py, numpy, msgpack and ml_dtypes that pyproject.toml allows (slow: pip
downloads them into a folder of the test's own): the plain-server paths work on them, and a
Redis Cluster, which needs a newer redis-py, is refused at the connection with an error that
says so."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

import accumulator
from accumulator import _cluster_client

#: Keep in step with pyproject.toml's ``redis>=`` (and with CLUSTER_REDIS_PY for the cluster).
OLDEST = "5.3.1"
#: The other dependencies at the oldest minor versions pyproject.toml allows (their last patch)
OLDEST_OTHERS = {"numpy": "1.24.4", "msgpack": "1.0.8", "ml_dtypes": "0.3.2"}
ROOT = Path(accumulator.__file__).resolve().parent.parent

SMOKE = textwrap.dedent("""
    import asyncio, sys
    import numpy as np, redis
    import accumulator
    from accumulator import aio
    from accumulator.sync import ParameterServer, Worker
    import ml_dtypes, msgpack
    url, tag = sys.argv[1], sys.argv[3]
    assert redis.__version__ == sys.argv[2], redis.__version__
    got = {"numpy": np.__version__, "msgpack": ".".join(map(str, msgpack.version)),
           "ml_dtypes": ml_dtypes.__version__}
    assert got == dict(a.split("=") for a in sys.argv[4:]), got
    bf = accumulator.ConditionalAccumulator(ml_dtypes.bfloat16, (2,), shared_name=f"{tag}/bf",
                                            client=url)
    assert bf.apply_grad(np.ones(2, ml_dtypes.bfloat16))
    assert bf.take_grad(1, timeout=10).dtype == ml_dtypes.bfloat16
    bf.close()
    for n in (3, 300_000):  # inline, and parts of 1 MiB
        acc = accumulator.ConditionalAccumulator(np.float32, (n,), shared_name=f"{tag}/{n}",
                                                 client=url)
        for v in (1.0, 3.0):
            assert acc.apply_grad(np.full(n, v, np.float32))
        assert (acc.take_grad(2, timeout=10) == 2).all()
        acc.close()
    sp = accumulator.SparseConditionalAccumulator(np.float32, (10, 2), shared_name=f"{tag}/sp",
                                                  client=url)
    sp.apply_grad([1, 3], np.ones((2, 2), np.float32))
    idx, vals, shape = sp.take_grad(1, timeout=10)
    assert list(idx) == [1, 3] and list(shape) == [10, 2]
    try:  # (numpy < 2 compared a uint64 with 2**63 - 1 as float64)
        sp.apply_grad(np.array([2**63], np.uint64), np.ones((1, 2), np.float32), local_step=1)
    except accumulator.InvalidArgumentError as exc:
        assert "outside the int64 range" in str(exc), exc
    else:
        raise AssertionError("an index past int64 was accepted")
    sp.close()

    async def main():
        for n in (3, 300_000):
            async with aio.ConditionalAccumulator(np.float32, (n,), shared_name=f"{tag}/a{n}",
                                                  client=url) as acc:
                for v in (1.0, 3.0):
                    await acc.apply_grad(np.full(n, v, np.float32))
                assert (await acc.take_grad(2, timeout=10) == 2).all()

    asyncio.run(main())
    ps = ParameterServer(f"{tag}/job", replicas_to_aggregate=1, client=url)
    ps.initialize({"w": np.zeros(4, np.float32)})
    worker = Worker(f"{tag}/job", client=url)
    step, params = worker.pull(timeout=10)
    worker.push(step, {"w": np.ones(4, np.float32)})
    ps.step(0.5, timeout=10)
    assert (worker.pull(after=step, timeout=10)[1]["w"] == -0.5).all()
    worker.close(); ps.close()
    try:
        accumulator.ConditionalAccumulator(np.float32, (3,), shared_name=f"{tag}/x",
                                           client="redis+cluster://127.0.0.1:1")
    except accumulator.FailedPreconditionError as exc:
        assert "redis-py >= 8.0" in str(exc), exc
    else:
        raise AssertionError("a cluster was not refused")
    print("ok")
""")


@pytest.mark.slow
def test_the_oldest_redis_py_allowed_works_with_a_plain_server(real_url, tmp_path):
    lib = tmp_path / "lib"
    fetched = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(lib),
         f"redis=={OLDEST}", "PyJWT", *(f"{k}=={v}" for k, v in OLDEST_OTHERS.items())],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    if fetched.returncode != 0:
        pytest.skip(f"pip could not fetch the oldest versions: {fetched.stderr.strip()[-300:]}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(lib), str(ROOT)])}
    tag = f"compat-{uuid.uuid4().hex[:8]}"
    others = [f"{k}={v}" for k, v in OLDEST_OTHERS.items()]
    ran = subprocess.run([sys.executable, "-c", SMOKE, real_url, OLDEST, tag, *others], env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ran.returncode == 0 and ran.stdout.strip().endswith("ok"), ran.stderr[-3000:]


@pytest.mark.parametrize("version", ["5.3.1", "6.4.0", "7.0.1"])
def test_a_cluster_with_a_redis_py_too_old_for_it_is_refused_at_the_connection(
    monkeypatch, version
):
    import numpy as np
    import redis

    from accumulator import aio

    monkeypatch.setattr(redis, "__version__", version)
    with pytest.raises(accumulator.FailedPreconditionError, match=r"redis-py >= 8\.0"):
        accumulator.ConditionalAccumulator(np.float32, (3,), shared_name="x",
                                           client="redis+cluster://127.0.0.1:1")  # fmt: skip

    async def main() -> None:
        acc = aio.ConditionalAccumulator(np.float32, (3,), shared_name="x",
                                         client="redis+cluster://127.0.0.1:1")  # fmt: skip
        await acc.open()

    with pytest.raises(accumulator.FailedPreconditionError, match=r"redis-py >= 8\.0"):
        asyncio.run(main())
    monkeypatch.setattr(redis, "__version__", "8.0.0")
    _cluster_client.require_cluster_client()  # no error
