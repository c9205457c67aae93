"""The decode service's batching of a request's engine outputs into chunks (services/decode/output_batches.py)."""
from __future__ import annotations

import asyncio

import pytest

from engine.outputs import RequestOutput
from services.decode.output_batches import OutputBatches


def output(new: list[int], so_far: list[int], finished: bool = False, **fields) -> RequestOutput:
    return RequestOutput(request_id="r", prompt_token_ids=[1, 2], new_token_ids=new, token_ids=so_far,
                         finished=finished, finish_reason="length" if finished else None,
                         new_logprobs=[{t: -0.5} for t in new], **fields)


def steps(num: int, finish_at: int | None = None) -> list[RequestOutput]:
    """One output per step, a token each (token i is i)."""
    return [output([i], list(range(i + 1)), finished=i + 1 == finish_at) for i in range(num)]


async def batches(outputs: OutputBatches, until_finished: bool = True) -> list[RequestOutput]:
    got = []
    while not got or (until_finished and not got[-1].finished):
        got.append(await outputs.next())
    return got


def queued(items) -> asyncio.Queue:
    queue = asyncio.Queue()
    for item in items:
        queue.put_nowait(item)
    return queue


def test_outputs_queued_behind_the_first_go_out_with_it():
    async def run():
        got = await batches(OutputBatches(queued(steps(5, finish_at=5))))
        assert [b.new_token_ids for b in got] == [[0, 1, 2, 3, 4]]
        assert got[0].token_ids == [0, 1, 2, 3, 4] and got[0].finished and got[0].finish_reason == "length"
        assert got[0].new_logprobs == [{t: -0.5} for t in range(5)]
    asyncio.run(run())


def test_an_output_that_finds_the_queue_empty_goes_out_alone():
    async def run():
        queue = asyncio.Queue()
        outputs = OutputBatches(queue, stream_interval=1)
        for out in steps(3, finish_at=3):
            queue.put_nowait(out)
            assert (await outputs.next()).new_token_ids == out.new_token_ids
    asyncio.run(run())


def test_a_stream_interval_holds_tokens_until_there_are_that_many_but_not_the_first_or_the_last():
    async def run():
        queue = asyncio.Queue()
        outputs = OutputBatches(queue, stream_interval=3)
        got = []

        async def feed():
            for out in steps(8, finish_at=8):
                queue.put_nowait(out)
                await asyncio.sleep(0)  # each step's output read before the next comes
                await asyncio.sleep(0)
        feeding = asyncio.ensure_future(feed())
        got = await batches(outputs)
        await feeding
        assert [b.new_token_ids for b in got] == [[0], [1, 2, 3], [4, 5, 6], [7]]
        assert [b.token_ids[-1] for b in got] == [0, 3, 6, 7]
    asyncio.run(run())


def test_after_a_first_token_sent_elsewhere_every_chunk_waits_for_the_interval():
    async def run():
        got = await batches(OutputBatches(queued(steps(7, finish_at=7)), stream_interval=3,
                                          is_first_token_sent=True))
        assert [len(b.new_token_ids) for b in got] == [7]  # all queued at once: one chunk
        queue = asyncio.Queue()
        outputs = OutputBatches(queue, stream_interval=3, is_first_token_sent=True)
        for out in steps(2):
            queue.put_nowait(out)
        pending = asyncio.ensure_future(outputs.next())
        await asyncio.sleep(0.01)
        assert not pending.done()  # two tokens of three
        queue.put_nowait(output([2], [0, 1, 2]))
        assert (await pending).new_token_ids == [0, 1, 2]
    asyncio.run(run())


def test_an_error_queued_behind_outputs_comes_after_them():
    async def run():
        failure = RuntimeError("the step failed")
        outputs = OutputBatches(queued([*steps(2), failure]), stream_interval=4)
        assert (await outputs.next()).new_token_ids == [0, 1]
        assert await outputs.next() is failure
    asyncio.run(run())


def test_the_first_outputs_facts_survive_the_merge():
    async def run():
        first = output([0], [0], prompt_logprobs=[None, {2: -1.0}], num_cached_tokens=16)
        got = await OutputBatches(queued([first, output([1], [0, 1], finished=True)])).next()
        assert got.prompt_logprobs == [None, {2: -1.0}] and got.num_cached_tokens == 16
        assert got.new_token_ids == [0, 1] and got.finished
    asyncio.run(run())


@pytest.mark.parametrize("interval", [0, 1])
def test_an_interval_of_0_or_1_holds_nothing_back(interval):
    async def run():
        queue = asyncio.Queue()
        outputs = OutputBatches(queue, stream_interval=interval, is_first_token_sent=True)
        queue.put_nowait(output([5], [5]))
        assert (await asyncio.wait_for(outputs.next(), 1)).new_token_ids == [5]
    asyncio.run(run())


def test_the_first_output_is_announced_as_it_is_taken_not_when_its_chunk_is_full():
    async def run():
        queue = queued([RuntimeError("refused")])
        outputs = OutputBatches(queue, stream_interval=4, is_first_token_sent=True)
        announced = []
        outputs.on_first_output = lambda: announced.append(True)
        assert isinstance(await outputs.next(), RuntimeError) and not announced  # no output: nothing taken
        queue.put_nowait(output([0], [0]))
        pending = asyncio.ensure_future(outputs.next())
        await asyncio.sleep(0.01)
        assert announced == [True] and not pending.done()
        for out in steps(4, finish_at=4)[1:]:
            queue.put_nowait(out)
        assert (await pending).new_token_ids == [0, 1, 2, 3] and announced == [True]
    asyncio.run(run())
