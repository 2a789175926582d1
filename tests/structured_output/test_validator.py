"""The front end's constraint validator process: it keeps serving whichever thread asks,
and does not outlive the process that started it, even one killed with SIGKILL."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import psutil

from tokenloom.structured_output.params import StructuredOutputsParams
from tokenloom.structured_output.validator import ConstraintValidator

# A front end in miniature: validates one constraint (starting the helper), then waits.
SERVER = """
import time
from tokenloom.structured_output.params import StructuredOutputsParams
from tokenloom.structured_output.validator import ConstraintValidator

validator = ConstraintValidator(in_subprocess=True)
validator(StructuredOutputsParams(regex="[a-z]+"))
print("ready", flush=True)
time.sleep(600)
"""


def pool_workers(parent: psutil.Process) -> list[psutil.Process]:
    """The process pool's workers among ``parent``'s children (not its resource tracker,
    nor children that are already zombies)."""
    workers = []
    for child in parent.children():
        try:
            if "spawn_main" in " ".join(child.cmdline()):
                workers.append(child)
        except psutil.Error:
            pass
    return workers


def the_worker(parent: psutil.Process) -> psutil.Process:
    """The pool's one worker (``/proc`` may list a new child a moment late)."""
    deadline = time.monotonic() + 10
    while len(workers := pool_workers(parent)) != 1:
        assert time.monotonic() < deadline, f"pool workers: {workers}"
        time.sleep(0.05)
    return workers[0]


def test_the_helper_dies_with_a_sigkilled_parent() -> None:
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    workers: list[psutil.Process] = []
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == b"ready"
        workers = [the_worker(psutil.Process(server.pid))]
        server.kill()
        server.wait(10)
        _, alive = psutil.wait_procs(workers, timeout=5)
        assert not alive, "the validator process outlived its SIGKILLed parent"
    finally:
        server.kill()
        for worker in workers:
            if worker.is_running():
                worker.kill()


def in_thread(
    validator: ConstraintValidator, params: StructuredOutputsParams
) -> BaseException | None:
    """Validate on a short-lived thread (as the front end's input threads may be)."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            validator(params)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    return errors[0] if errors else None


def test_the_helper_outlives_the_thread_that_first_asked() -> None:
    """Linux sends the parent-death signal when the thread that started the child exits;
    the helper must survive the exit of the request thread that triggered its start."""
    validator = ConstraintValidator(in_subprocess=True)
    try:
        assert in_thread(validator, StructuredOutputsParams(regex="[a-z]+")) is None
        worker = the_worker(psutil.Process())
        error = in_thread(validator, StructuredOutputsParams(regex="(unclosed"))
        assert isinstance(error, ValueError) and str(error).startswith("structured_outputs.regex")
        assert in_thread(validator, StructuredOutputsParams(choice=["yes", "no"])) is None
        assert worker.is_running() and pool_workers(psutil.Process()) == [worker]
    finally:
        validator.shutdown()
