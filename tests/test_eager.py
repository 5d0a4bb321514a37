"""``start_eagerly``: a handler's coroutine runs its first step in the caller; a task only if it waits."""

from __future__ import annotations

import asyncio

import pytest

from backroom.agents.eager import start_eagerly


async def test_a_coroutine_that_never_waits_finishes_in_the_call_without_a_task() -> None:
    seen: list[str] = []

    async def answer() -> None:
        seen.append("answered")

    assert start_eagerly(answer()) is None
    assert seen == ["answered"]  # before the loop ran anything else


async def test_a_coroutine_that_waits_continues_in_a_task_where_it_stopped() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    seen: list[str] = []

    async def answer() -> int:
        seen.append("first step")
        got = await gate
        await asyncio.sleep(0)  # a bare yield on the way, as asyncio.sleep(0) makes
        seen.append(f"resumed with {got}")
        return got * 2

    task = start_eagerly(answer())
    assert seen == ["first step"] and task is not None and not task.done()
    gate.set_result(21)
    assert await task == 42
    assert seen == ["first step", "resumed with 21"]


async def test_cancelling_the_task_cancels_the_coroutine_inside_its_await() -> None:
    cleaned: list[str] = []

    async def waits_forever() -> None:
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append("finally ran")

    task = start_eagerly(waits_forever())
    assert task is not None
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert cleaned == ["finally ran"]


async def test_errors_reach_the_caller_before_a_wait_and_the_task_after() -> None:
    async def fails_at_once() -> None:
        raise ValueError("bad policy")

    with pytest.raises(ValueError, match="bad policy"):
        start_eagerly(fails_at_once())

    async def fails_later() -> None:
        await asyncio.sleep(0.01)
        raise KeyError("later")

    task = start_eagerly(fails_later())
    assert task is not None
    with pytest.raises(KeyError):
        await task


async def test_an_exception_caught_inside_the_coroutine_after_a_wait_is_handled_there() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def guarded() -> str:
        try:
            await gate
        except RuntimeError as exc:
            return f"handled {exc}"
        return "no error"

    task = start_eagerly(guarded())
    assert task is not None
    gate.set_exception(RuntimeError("boom"))
    assert await task == "handled boom"


async def test_the_first_step_runs_as_part_of_its_caller_so_callers_opt_in() -> None:
    """Why ``Agent.inline`` is opt-in on 3.11: until its first wait the coroutine has no task of its
    own (in a delivery callback there is none at all, and asyncio.timeout raises)."""
    seen: list[object] = []

    async def probe() -> None:
        seen.append(asyncio.current_task())
        await asyncio.sleep(0)
        seen.append(asyncio.current_task())

    caller = asyncio.current_task()
    task = start_eagerly(probe())
    assert task is not None
    await task
    assert seen == [caller, task]
