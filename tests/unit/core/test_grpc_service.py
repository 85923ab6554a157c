"""GrpcService binds its port exclusively: a second server on a taken port fails, naming it; a
failed start-up stops what started; a service's ``python -m`` exit keeps its exit code and its
last log lines and skips the interpreter's teardown."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from core.grpc_service import GrpcService, run_until_signalled


async def test_a_second_service_on_a_taken_port_fails_naming_the_port() -> None:
    first = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], grace_s=0)
    port = await first.start()
    second = GrpcService("127.0.0.1", port, ["tandem.v1.Test"], grace_s=0)
    try:
        with pytest.raises(RuntimeError) as info:
            await second.start()
        assert str(info.value) == (
            f"cannot bind gRPC server to 127.0.0.1:{port}: port {port} is in use (another Tandem service?) "
            "or the host is not an interface of this machine")
    finally:
        await first.stop()


async def test_a_failed_start_up_stops_what_started_and_raises() -> None:
    """A start-up that fails after its server started (Redis refusing the registration, say)
    stops the server, so the process exits instead of serving unready forever."""
    service = GrpcService("127.0.0.1", 0, ["tandem.v1.Test"], grace_s=0)
    stopped = []

    async def start() -> None:
        await service.start()
        raise RuntimeError("registration refused")

    async def stop() -> None:
        await service.stop()
        stopped.append(True)

    with pytest.raises(RuntimeError, match="registration refused"):
        await run_until_signalled(start, stop)
    assert stopped == [True]


# A service entry point in miniature: a click command that logs to stderr, prints to a piped
# (block-buffered) stdout and ends as the argument says; an atexit hook stands for the teardown.
SERVICE = textwrap.dedent("""
    import atexit, logging, sys
    import click
    from core.grpc_service import exit_after

    @click.command()
    @click.argument("end")
    def main(end):
        logging.basicConfig(stream=sys.stderr, level="INFO", format="%(message)s")
        logging.getLogger("svc").info("drained")
        print("last words")
        atexit.register(lambda: print("teardown ran"))
        if end == "usage":
            raise click.UsageError("bad flag")
        if end == "message":
            sys.exit("refused: no model")
        if end == "code":
            sys.exit(3)

    exit_after(main)
""")


@pytest.mark.parametrize(("end", "code", "stderr_tail"), [
    ("stopped", 0, "drained"), ("code", 3, "drained"), ("message", 1, "refused: no model"),
    ("usage", 2, "Error: bad flag"),
])
def test_exit_after_keeps_the_code_and_the_output_and_skips_the_teardown(end, code, stderr_tail) -> None:
    done = subprocess.run([sys.executable, "-c", SERVICE, end], capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stderr
    assert done.stdout == "last words\n"  # flushed before the exit; the atexit hook never ran
    assert done.stderr.splitlines()[0] == "drained" and done.stderr.splitlines()[-1] == stderr_tail


# A service in miniature that keeps a reference cycle made at start-up and one made while serving,
# then says, at its stop, which of them the collector's generations still hold.
FREEZE = textwrap.dedent("""
    import asyncio, gc, os, signal
    from core.grpc_service import run_until_signalled

    held = {}

    async def start():
        held["start-up"] = cycle = []
        cycle.append(cycle)
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: (held.setdefault("serving", []).append(held["serving"]),
                                os.kill(os.getpid(), signal.SIGTERM)))

    async def stop():
        tracked = {id(o) for o in gc.get_objects()}
        print(gc.get_freeze_count() > 1000, {name: id(obj) in tracked for name, obj in sorted(held.items())})

    asyncio.run(run_until_signalled(start, stop))
""")


def test_the_start_up_heap_is_frozen_and_what_serving_makes_is_not() -> None:
    """Objects alive after start-up leave the collector's generations (its full passes would walk
    the whole model's heap, a pause of ~190 ms in a worker); what serving makes stays collectable."""
    done = subprocess.run([sys.executable, "-c", FREEZE], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "True {'serving': True, 'start-up': False}\n"
