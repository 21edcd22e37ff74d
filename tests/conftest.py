"""Before any test: numba's disk cache of gradshare's kernels is filled once; the slowest
modules are handed to the xdist workers first.

numba compiles a kernel on its first call in a process and caches it on disk. In a fresh
clone the cache is empty, so every rank, example and launch the tests start early on would
compile the same kernels at once (~38 s of CPU for all of them, per process). The main pytest
process (not the xdist workers) runs every codec step once in two processes side by side, the
parallel kernels in one and their serial twins in the other (65 s and 22 s of one core in a
fresh clone). The tests start meanwhile: a test marked ``torch_ops`` (its launches run the
torch ops, bit for bit the kernels', ``GRADSHARE_KERNELS=0``) goes at once; any other waits
until the cache is filled (:func:`_kernels_cached`). The two compile at a higher priority
where the OS allows it (root): else the launches beside them, four processes or more, took
most of the cores and the tests that waited for the cache waited 30-70 s longer.

xdist's ``loadfile`` hands out whole modules; left to itself it orders them by their number
of tests, which put the modules that launch the most processes (few tests, each a minute)
last, and one worker ran them alone at the end. :data:`SECONDS` orders them longest first.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
_WARM = """
import os
import sys
try:  # ahead of the torch_ops launches that start beside it (where the OS allows it)
    os.nice(-10)
except OSError:
    pass
sys.path.insert(0, {here!r})
from codec_steps import run_steps
from gradshare.codec._dispatch import serial_kernels
if sys.argv[1] == "serial":
    with serial_kernels():
        run_steps()
else:
    run_steps()
"""


WARMED = "GRADSHARE_TESTS_WARMED"
"""The environment variable naming the file that says the cache is filled (empty) or why
filling it failed; the workers inherit it."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "torch_ops: the test's launches run the torch ops (GRADSHARE_KERNELS=0), so it need "
        "not wait for numba's cache",
    )
    # Two xdist workers share two cores, and each runs torch ops and parallel kernels on
    # OpenMP threads of its own. OpenMP's threads spin for a while when a parallel region
    # ends, on cores the other worker needs: the in-process modules took 31 s spinning and
    # 25 s sleeping, back to back (one pair; the spread between runs here is a few seconds).
    # Set before any OpenMP runtime loads (the workers and every process they start inherit
    # it; tests/test_threads.py launches without it, as users do).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if hasattr(config, "workerinput") or os.environ.get("GRADSHARE_KERNELS") == "0":
        return  # a worker (the main process warmed the cache), or no kernels at all
    code = _WARM.format(here=str(HERE))
    threads = {"parallel": "2", "serial": "1"}  # kernel threads: 2 wakes the parallel kernels
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, kind],
            env={**os.environ, "GRADSHARE_NUM_THREADS": n, "OMP_NUM_THREADS": "1"},
            stderr=subprocess.PIPE,
        )
        for kind, n in threads.items()
    ]
    done = Path(tempfile.mkdtemp(prefix="gradshare-warm-")) / "done"
    os.environ[WARMED] = str(done)

    def wait() -> None:  # writes `done` once both have ended, the errors in it
        errors = ""
        for proc in procs:
            _, err = proc.communicate(timeout=300)
            if proc.returncode != 0:  # the kernel tests will say what is wrong
                errors += f"warming numba's cache failed:\n{err.decode()[-2000:]}\n"
        written = done.with_suffix(".tmp")
        written.write_text(errors)
        written.replace(done)

    global _waiter
    _waiter = threading.Thread(target=wait, daemon=True)
    _waiter.start()


_waiter: threading.Thread | None = None


def pytest_unconfigure(config: pytest.Config) -> None:
    """A short run ends once the cache is filled, not with its compilers left running."""
    if _waiter is not None:
        _waiter.join(timeout=300)


_cached = False


@pytest.fixture(autouse=True)
def _kernels_cached(request: pytest.FixtureRequest) -> None:
    """Unless the test is marked ``torch_ops``, wait until numba's cache is filled (at most
    300 s; then the test compiles what it needs itself)."""
    global _cached
    path = os.environ.get(WARMED)
    if _cached or path is None or request.node.get_closest_marker("torch_ops"):
        return
    deadline = time.monotonic() + 300
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    _cached = True
    errors = Path(path).read_text() if os.path.exists(path) else "it took over 300 s\n"
    if errors:
        sys.stderr.write(errors)


SECONDS = {
    "test_integrations": 150,
    "test_hf_trainer": 125,
    "test_examples": 80,
    "test_distributed": 60,
    "test_elastic": 60,
    "test_threads": 50,
    "test_multinode": 50,
    "test_train": 45,
    "test_local_steps_example": 35,
    "test_kernels": 35,
    "test_ddp_hook": 30,
    "test_agreement": 30,
    "test_codec": 25,
    "test_local_steps": 25,
    "test_docs": 20,
    "test_hierarchical": 20,
}
"""Each module's seconds in a fresh clone's run (``--junitxml``, summed per module), as they
were before launches were folded (2026-12-04): kept as the order, which measured faster
(314 s and 336 s of pytest from fresh clones) than the order of today's seconds (375 s)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules first (a stable sort: each module's own order stays)."""
    items.sort(key=lambda item: -SECONDS.get(item.module.__name__ if item.module else "", 0))
