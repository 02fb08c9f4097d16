"""Compile in a child process, so that a compiler crash costs one candidate, not the search.

A compiler that dies with a signal takes its process with it: libtpu 0.0.42.1 overflows its
stack (SIGSEGV) compiling the 220M step for one v6e chip with the loss in 8 vocabulary chunks,
while 16 chunks compile. `python -m delta_jax.plan.where` compiles dozens of candidates in one
run; it hands each to a Worker, a spawned process that outlives the candidates (jax starts
once) and is started afresh after a crash, which the caller sees as a CompilerCrash naming the
signal and can skip.
"""
from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable
from typing import Any


class CompilerCrash(RuntimeError):
    """The child process died (a signal or an exit) before answering."""


def _serve(connection) -> None:
    """The child's loop: call each request's function on its arguments and send back the
    result or error."""
    while True:
        try:
            function, args = connection.recv()
        except EOFError:  # the parent closed its end
            return
        try:
            reply = ("ok", function(*args))
        except Exception as err:  # noqa: BLE001 - re-raised in the parent
            reply = ("error", err)
        try:
            connection.send(reply)
        except Exception as err:  # noqa: BLE001 - e.g. an exception that does not pickle
            connection.send(("error", RuntimeError(f"{type(reply[1]).__name__}: {reply[1]} "
                                                   f"(not sent whole: {err})")))


def _describe_exit(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with status {code}"


class Worker:
    """`function(*args)` in a spawned child process; the child is kept between calls.

    `function` must be picklable by reference (a module-level function), as must any other
    function given to `call`. Their exceptions are re-raised here; a child that dies raises
    CompilerCrash and is replaced on the next call.
    """

    def __init__(self, function: Callable):
        self._function = function
        self._context = multiprocessing.get_context("spawn")  # no forked jax state
        self._process = None
        self._connection = None

    def _start(self) -> None:
        parent, child = self._context.Pipe()
        self._process = self._context.Process(target=_serve, args=(child,), daemon=True)
        self._process.start()
        child.close()
        self._connection = parent

    def __call__(self, *args) -> Any:
        return self.call(self._function, *args)

    def call(self, function: Callable, *args) -> Any:
        """`function(*args)` in the same child (jax started once for both functions)."""
        if self._process is None or not self._process.is_alive():
            self._start()
        try:
            self._connection.send((function, args))
            kind, value = self._connection.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._process.join()
            code = self._process.exitcode
            self.close()
            raise CompilerCrash(f"the compiling process was {_describe_exit(code)}") from None
        if kind == "error":
            raise value
        return value

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
        if self._process is not None:
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
                self._process.join()
        self._process = self._connection = None

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
