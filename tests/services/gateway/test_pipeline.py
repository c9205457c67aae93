"""The gateway's request pipeline over a real mesh: a tokenizer, two prefill and two
decode processes on 127.0.0.1, driven as the HTTP layer will drive it. Output must equal
an in-process engine's; stop strings, early exits and refused prompts leave no page held.

Each test drives its own event loop with asyncio.run (the aio channels belong to it)."""
from __future__ import annotations

import asyncio
import socket
import time
from contextlib import aclosing

import pytest
from prometheus_client import REGISTRY

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from protos import common_pb2, decode_pb2_grpc, prefill_pb2_grpc, tokenizer_pb2_grpc
from services.common.settings import ConfigError
from services.decode.servicer import SERVICE_NAME as DECODE_SERVICE
from services.gateway.config import GatewayConfig
from services.gateway.deltas import Delta
from services.gateway.kept_calls import MAX_IDLE_S
from services.gateway.pipeline import RequestPipeline
from services.gateway.request_errors import ContextLengthError, InvalidRequestError
from services.gateway.workers import Worker, WorkerPool
from services.prefill.servicer import SERVICE_NAME as PREFILL_SERVICE
from services.tokenizer.model_tokenizer import ModelTokenizer
from services.tokenizer.servicer import SERVICE_NAME as TOKENIZER_SERVICE
from tests.services.gateway.mesh import DECODE_KV_BLOCKS, assert_decode_pools_free
from tests.services.service_process import ServiceProcess as Service, stop_processes, wait_all_serving

PROMPT = "The quick brown fox jumps over the lazy dog, and then"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]


def greedy(max_tokens: int) -> common_pb2.SamplingParams:
    return common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def mesh(tiny_demo_model):
    services = []
    try:
        # Started together, waited for in turn: they load and warm up at once.
        services.append(Service("tokenizer", TOKENIZER_SERVICE, tiny_demo_model, wait=False))
        for _ in range(2):
            services.append(Service("prefill", PREFILL_SERVICE, tiny_demo_model, "--kv-blocks", "64", wait=False))
        for _ in range(2):
            services.append(Service("decode", DECODE_SERVICE, tiny_demo_model,
                                    "--kv-blocks", str(DECODE_KV_BLOCKS), wait=False))
        wait_all_serving(services)
        tokenizer, prefills, decodes = services[0], services[1:3], services[3:5]
        yield tokenizer.address, [s.address for s in prefills], decodes
    finally:
        assert stop_processes(services) == [0] * len(services)


@pytest.fixture(scope="module")
def model_tokenizer(tiny_demo_model):
    return ModelTokenizer.from_dir(tiny_demo_model)


@pytest.fixture(scope="module")
def colocated(tiny_demo_model):
    return LLMEngine(EngineConfig(model=str(tiny_demo_model), num_kv_blocks=512))


def colocated_ids(engine: LLMEngine, request_id: str, prompt: list[int], max_tokens: int) -> list[int]:
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    ids: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                ids = out.token_ids
    return list(ids)


def run_with_pipeline(mesh, model_tokenizer, body, *, tokenizer_address: str | None = None,
                      local_tokenize_max_chars: int = 0):
    """asyncio.run(body(pipeline)) with a pipeline over fresh channels to the mesh (to another
    tokenizer service at `tokenizer_address`); by default the tokenizer service encodes every prompt."""
    mesh_tokenizer, prefill_addresses, decodes = mesh

    async def main():
        tokenizers = WorkerPool.connect([tokenizer_address or mesh_tokenizer], tokenizer_pb2_grpc.TokenizerStub)
        prefill = WorkerPool.connect(prefill_addresses, prefill_pb2_grpc.PrefillStub)
        decode = WorkerPool.connect([d.address for d in decodes], decode_pb2_grpc.DecodeStub)
        pipeline = RequestPipeline(tokenizers, model_tokenizer, prefill, decode,
                                   local_tokenize_max_chars=local_tokenize_max_chars)
        try:
            return await body(pipeline)
        finally:
            await pipeline.aclose()
            await asyncio.gather(tokenizers.close(), prefill.close(), decode.close())
            assert all(w.num_in_flight == 0 for w in tokenizers.workers + prefill.workers + decode.workers)

    return asyncio.run(main())


async def collect(stream) -> list[Delta]:
    async with aclosing(stream) as deltas:
        return [d async for d in deltas]


def joined(deltas: list[Delta]) -> tuple[str, list[int]]:
    return "".join(d.text for d in deltas), [t for d in deltas for t in d.token_ids]


def assert_pools_free(mesh, within_s: float = 1.0) -> None:
    assert_decode_pools_free(mesh[2], within_s)


async def pools_free_soon(pipeline: RequestPipeline, mesh) -> None:
    """Within 0.5 s of the consumer leaving, with the channels still open. The requests that
    use it ask for 900 tokens (~2 s here), so free pages mean they were aborted."""
    await pipeline.aclose()  # the Aborts sent on the way out
    await asyncio.to_thread(assert_pools_free, mesh, 0.5)


def expected_text(tok: ModelTokenizer, prompt: list[int], output: list[int]) -> str:
    # IncrementalDetokenizer's contract: what the output adds to the decoded prompt.
    return tok.decode(prompt + output)[len(tok.decode(prompt)):]


def test_greedy_text_matches_a_colocated_engine(mesh, model_tokenizer, colocated):
    prompt = model_tokenizer.encode(PROMPT)
    expected = colocated_ids(colocated, "ref-text", prompt, 24)
    deltas = run_with_pipeline(mesh, model_tokenizer, lambda p: collect(
        p.generate("text", prompt_text=PROMPT, sampling=greedy(24))))
    text, ids = joined(deltas)
    assert ids == expected
    assert text == expected_text(model_tokenizer, prompt, expected)
    assert [d.finish_reason for d in deltas[:-1]] == [None] * (len(deltas) - 1)
    assert deltas[-1].finish_reason == "length" and deltas[-1].matched_stop is None
    assert deltas[-1].usage.prompt_tokens == len(prompt) and deltas[-1].usage.completion_tokens == 24
    assert_pools_free(mesh)


def test_chat_messages_use_the_chat_template(mesh, model_tokenizer, colocated):
    _, prompt = model_tokenizer.apply_chat_template(MESSAGES)
    expected = colocated_ids(colocated, "ref-chat", prompt, 12)
    deltas = run_with_pipeline(mesh, model_tokenizer, lambda p: collect(
        p.generate("chat", messages=MESSAGES, sampling=greedy(12))))
    text, ids = joined(deltas)
    assert ids == expected
    assert text == expected_text(model_tokenizer, prompt, expected)
    assert deltas[-1].usage.prompt_tokens == len(prompt)


def test_short_prompts_are_encoded_here_and_long_ones_by_the_tokenizer_service(mesh, model_tokenizer, colocated):
    """Long prompts are sent to the tokenizer service: where none answers, encoded here after all."""
    with socket.socket() as sock:  # a port nothing listens on: no tokenizer service to ask
        sock.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{sock.getsockname()[1]}"
    prompt = model_tokenizer.encode(PROMPT)
    expected = colocated_ids(colocated, "ref-local", prompt, 6)
    _, chat_prompt = model_tokenizer.apply_chat_template(MESSAGES)
    long_text = PROMPT * 5
    assert len(PROMPT) <= 200 and sum(len(m["content"]) for m in MESSAGES) <= 200 < len(long_text)

    def fallbacks() -> float:
        return REGISTRY.get_sample_value("baton_gateway_tokenizer_fallbacks_total")

    async def body(pipeline):
        before = fallbacks()
        text = await collect(pipeline.generate("local-text", prompt_text=PROMPT, sampling=greedy(6)))
        chat = await collect(pipeline.generate("local-chat", messages=MESSAGES, sampling=greedy(2)))
        assert fallbacks() == before  # never sent
        long = await collect(pipeline.generate("long-text", prompt_text=long_text, sampling=greedy(2)))
        assert fallbacks() == before + 1  # sent, found unreachable, encoded here
        return text, chat, long

    text, chat, long = run_with_pipeline(mesh, model_tokenizer, body, tokenizer_address=nowhere,
                                         local_tokenize_max_chars=200)
    assert joined(text)[1] == expected and text[-1].usage.prompt_tokens == len(prompt)
    assert chat[-1].usage.prompt_tokens == len(chat_prompt)
    assert long[-1].usage.prompt_tokens == len(model_tokenizer.encode(long_text))
    assert_pools_free(mesh)


def test_a_long_prompt_the_tokenizer_service_does_not_answer_is_encoded_here_after_a_second(
        mesh, model_tokenizer):
    """A service that took the connection and says nothing (frozen, or a hung host) holds a call until its
    deadline (10 s) or keepalive finds it (10-20 s): after Deadlines.tokenizer_hedge_s (1 s) without its
    answer the gateway encodes the prompt (a conversation too) itself."""
    long_text = PROMPT * 5
    messages = [{"role": "user", "content": long_text}]

    def fallbacks() -> float:
        return REGISTRY.get_sample_value("baton_gateway_tokenizer_fallbacks_total")

    async def body(pipeline):
        before, started = fallbacks(), time.monotonic()
        text = await collect(pipeline.generate("silent-text", prompt_text=long_text, sampling=greedy(2)))
        chat = await collect(pipeline.generate("silent-chat", messages=messages, sampling=greedy(2)))
        return text, chat, fallbacks() - before, time.monotonic() - started

    with socket.socket() as silent:  # its backlog takes the connection; nothing reads it
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        text, chat, fallen_back, took_s = run_with_pipeline(
            mesh, model_tokenizer, body, tokenizer_address=f"127.0.0.1:{silent.getsockname()[1]}",
            local_tokenize_max_chars=200)
    assert text[-1].usage.prompt_tokens == len(model_tokenizer.encode(long_text))
    assert chat[-1].usage.prompt_tokens == len(model_tokenizer.apply_chat_template(messages)[1])
    assert fallen_back == 2
    assert took_s < 8  # two hedges of a second each and the replies; 20 s at least without them
    assert_pools_free(mesh)


@pytest.mark.parametrize("messages", [[], [{"role": "", "content": "hi"}]], ids=["none", "no-role"])
def test_chat_messages_are_refused_alike_here_and_by_the_tokenizer_service(mesh, model_tokenizer, messages):
    def refusal(local_tokenize_max_chars: int) -> str:
        async def body(pipeline):
            with pytest.raises(InvalidRequestError) as refused:
                await collect(pipeline.generate("bad-chat", messages=messages, sampling=greedy(2)))
            return str(refused.value)
        return run_with_pipeline(mesh, model_tokenizer, body, local_tokenize_max_chars=local_tokenize_max_chars)

    assert refusal(1000) == refusal(0) != ""


def test_a_reply_handed_out_whole_comes_as_its_first_token_then_the_rest(mesh, model_tokenizer, colocated):
    """Not streamed and without stop strings, the decode worker holds its tokens until the last: the
    gateway reads one chunk, not one per token. With stop strings the text is looked at as it comes."""
    prompt = model_tokenizer.encode(PROMPT)
    expected = colocated_ids(colocated, "ref-whole", prompt, 40)

    async def body(pipeline):
        whole = await collect(pipeline.generate("whole", prompt_token_ids=prompt, sampling=greedy(40),
                                                is_streamed=False))
        stop = expected_text(model_tokenizer, prompt, expected)[20:23]
        stopped = await collect(pipeline.generate("whole-stopped", prompt_token_ids=prompt, sampling=greedy(40),
                                                  stop=[stop], is_streamed=False))
        streamed = await collect(pipeline.generate("streamed-stopped", prompt_token_ids=prompt,
                                                   sampling=greedy(40), stop=[stop]))
        return whole, stopped, streamed, stop
    whole, stopped, streamed, stop = run_with_pipeline(mesh, model_tokenizer, body)
    assert [len(d.token_ids) for d in whole] == [1, 39] and joined(whole)[1] == expected
    assert whole[-1].finish_reason == "length" and whole[-1].usage.completion_tokens == 40
    assert joined(stopped)[0] == joined(streamed)[0] and stop not in joined(stopped)[0]
    assert stopped[-1].finish_reason == "stop"
    assert_pools_free(mesh)


def test_token_ids_in_and_max_tokens_one_finishes_at_prefill(mesh, model_tokenizer, colocated):
    prompt = model_tokenizer.encode(PROMPT)
    expected = colocated_ids(colocated, "ref-one", prompt, 1)
    deltas = run_with_pipeline(mesh, model_tokenizer, lambda p: collect(
        p.generate("one", prompt_token_ids=prompt, sampling=greedy(1))))
    assert len(deltas) == 1 and deltas[0].token_ids == expected and deltas[0].finish_reason == "length"
    assert deltas[0].usage.completion_tokens == 1
    assert_pools_free(mesh)  # the reservation was aborted


def test_stop_string_ends_the_text_before_it_and_frees_the_pages(mesh, model_tokenizer, colocated):
    prompt = model_tokenizer.encode(PROMPT)
    full = expected_text(model_tokenizer, prompt, colocated_ids(colocated, "ref-stop", prompt, 40))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop.strip(), f"pick another stop string from {full!r}"
    cut = full.find(stop)
    for include in (False, True):
        async def body(pipeline):
            deltas = await collect(pipeline.generate(
                f"stop-{include}", prompt_text=PROMPT, sampling=greedy(900), stop=["never appears", stop],
                include_stop_str_in_output=include))
            await pools_free_soon(pipeline, mesh)  # before the channels close (which cancels any call)
            return deltas

        deltas = run_with_pipeline(mesh, model_tokenizer, body)
        text, ids = joined(deltas)
        assert text == full[:cut + (len(stop) if include else 0)]
        assert deltas[-1].finish_reason == "stop" and deltas[-1].matched_stop == stop
        assert deltas[-1].usage.completion_tokens == len(ids) <= 40


def calls_made() -> dict[tuple[str, str], float]:
    return {(worker, call): REGISTRY.get_sample_value(f"baton_gateway_{worker}_calls_total", {"call": call}) or 0.0
            for worker in ("prefill", "decode") for call in ("preopened", "new")}


def test_prompts_after_a_workers_first_go_on_calls_opened_ahead(mesh, model_tokenizer, colocated):
    """After its first prompt the gateway keeps a call open to each prefill worker and to each
    decode worker, and the worker's next prompt is that call's request. A kept call too old for
    its deadline is dropped for a new call. Either way the output is the same and no page
    stays held."""
    prompts = [[(7 * j + i) % 900 + 3 for j in range(40 + i)] for i in range(6)]
    # Some end at the decode worker's first chunk: the next call is opened all the same.
    lengths = [6, 2, 2, 6, 6, 2]
    expected = [colocated_ids(colocated, f"kept-ref-{i}", prompt, n)
                for i, (prompt, n) in enumerate(zip(prompts, lengths))]
    # Six prompts one after another take turns on the two idle workers of each kind: each
    # worker's first goes on a new call, the other four on kept ones; with no kept call young
    # enough, none.
    for max_idle_s, calls in ((MAX_IDLE_S, {"preopened": 4, "new": 2}), (0.0, {"preopened": 0, "new": 6})):
        async def body(pipeline):
            pipeline.steps.prefill_calls.max_idle_s = pipeline.steps.decode_calls.max_idle_s = max_idle_s
            return [joined(await collect(pipeline.generate(f"kept-{max_idle_s}-{i}", prompt_token_ids=prompt,
                                                           sampling=greedy(n))))[1]
                    for i, (prompt, n) in enumerate(zip(prompts, lengths))]

        before = calls_made()
        assert run_with_pipeline(mesh, model_tokenizer, body) == expected
        after = calls_made()
        assert {key: after[key] - before[key] for key in after} == {
            (worker, call): n for worker in ("prefill", "decode") for call, n in calls.items()}
    assert_pools_free(mesh)


def test_a_burst_of_prompts_finds_as_many_calls_kept_as_the_one_before_it(mesh, model_tokenizer, colocated):
    """Three prompts at once to one prefill worker: the first burst opens new calls, and each of its
    prompts leaves one kept, so all of the next burst's go on kept calls. (Their decode calls are
    made as each handoff comes, and the ones made later may take a call an earlier one left.)"""
    one_of_each = (mesh[0], mesh[1][:1], mesh[2][:1])
    prompts = [[(11 * j + i) % 900 + 3 for j in range(30 + i)] for i in range(3)]
    expected = [colocated_ids(colocated, f"burst-ref-{i}", prompt, 4) for i, prompt in enumerate(prompts)]
    made = []

    async def body(pipeline):
        outputs = []
        for burst in range(2):
            before = calls_made()
            outputs.append(await asyncio.gather(*(
                collect(pipeline.generate(f"burst-{burst}-{i}", prompt_token_ids=prompt, sampling=greedy(4)))
                for i, prompt in enumerate(prompts))))
            after = calls_made()
            made.append({key: after[key] - before[key] for key in after})
        return outputs

    for outputs in run_with_pipeline(one_of_each, model_tokenizer, body):
        assert [joined(deltas)[1] for deltas in outputs] == expected
    assert [{call: burst["prefill", call] for call in ("preopened", "new")} for burst in made] == [
        {"preopened": 0, "new": 3}, {"preopened": 3, "new": 0}]
    assert all(burst["decode", "preopened"] + burst["decode", "new"] == 3 for burst in made)
    assert_pools_free(mesh)


def test_prompts_whose_clients_left_still_leave_calls_kept_for_the_next(mesh, model_tokenizer, colocated):
    """A client that goes away while its prompt computes frees the call it took (cancelled), and
    leaves one opened for a next prompt all the same: the worker did nothing wrong."""
    one_of_each = (mesh[0], mesh[1][:1], mesh[2][:1])
    prompts = [[(13 * j + i) % 900 + 3 for j in range(30 + i)] for i in range(3)]
    expected = [colocated_ids(colocated, f"left-ref-{i}", prompt, 4) for i, prompt in enumerate(prompts)]

    async def body(pipeline):
        leaving = []
        for i, prompt in enumerate(prompts):
            dispatched = asyncio.Event()
            leaving.append((asyncio.ensure_future(collect(pipeline.generate(
                f"left-{i}", prompt_token_ids=prompt, sampling=greedy(4), on_dispatch=dispatched.set))), dispatched))
        for task, dispatched in leaving:
            await dispatched.wait()
            task.cancel()
        await asyncio.gather(*(task for task, _ in leaving), return_exceptions=True)
        before = calls_made()
        outputs = await asyncio.gather(*(
            collect(pipeline.generate(f"after-left-{i}", prompt_token_ids=prompt, sampling=greedy(4)))
            for i, prompt in enumerate(prompts)))
        after = calls_made()
        return outputs, {call: after["prefill", call] - before["prefill", call] for call in ("preopened", "new")}

    outputs, prefill_calls = run_with_pipeline(one_of_each, model_tokenizer, body)
    assert [joined(deltas)[1] for deltas in outputs] == expected
    assert prefill_calls == {"preopened": 3, "new": 0}
    assert_pools_free(mesh)


def test_on_dispatch_is_called_once_the_prompt_is_with_its_worker_before_the_first_delta(mesh, model_tokenizer,
                                                                                        colocated):
    """The gRPC API sends its response headers then: once per request, before any delta, whether
    a prefill worker or the decode worker computes the first token; never for a refused request."""
    prompt = [(5 * j) % 900 + 3 for j in range(40)]
    expected = colocated_ids(colocated, "dispatch-ref", prompt, 4)

    async def body(pipeline):
        events = {}
        for where, local_max in (("prefill", 0), ("decode", 1000)):
            pipeline.local_prefill_max_tokens = local_max
            seen = events[where] = []
            async for delta in pipeline.generate(f"dispatch-{where}", prompt_token_ids=prompt, sampling=greedy(4),
                                                 on_dispatch=lambda seen=seen: seen.append("dispatched")):
                seen.append(delta.token_ids)
        refused = []
        with pytest.raises(InvalidRequestError):
            await collect(pipeline.generate("dispatch-refused", prompt_text=PROMPT, stop=[""],
                                            on_dispatch=lambda: refused.append("dispatched")))
        return events, refused

    events, refused = run_with_pipeline(mesh, model_tokenizer, body)
    for seen in events.values():
        assert seen[0] == "dispatched" and seen.count("dispatched") == 1
        assert [t for ids in seen[1:] for t in ids] == expected
    assert refused == []
    assert_pools_free(mesh)


def test_eight_concurrent_requests_complete_with_correct_usage(mesh, model_tokenizer):
    prompts = [f"Request number {i}: " + "tell me a story " * (i + 1) for i in range(8)]

    async def body(pipeline):
        return await asyncio.gather(*(collect(pipeline.generate(
            f"many-{i}", prompt_text=text, sampling=greedy(8 + 3 * i))) for i, text in enumerate(prompts)))

    results = run_with_pipeline(mesh, model_tokenizer, body)
    for i, deltas in enumerate(results):
        prompt = model_tokenizer.encode(prompts[i])
        text, ids = joined(deltas)
        assert deltas[-1].finish_reason == "length"
        assert deltas[-1].usage.prompt_tokens == len(prompt)
        assert deltas[-1].usage.completion_tokens == len(ids) == 8 + 3 * i
        assert text == expected_text(model_tokenizer, prompt, ids)
    assert_pools_free(mesh)


def test_a_consumer_that_stops_early_frees_the_decode_pages(mesh, model_tokenizer):
    async def body(pipeline):
        async with aclosing(pipeline.generate("early", prompt_text=PROMPT, sampling=greedy(900))) as stream:
            async for delta in stream:
                if delta.token_ids and delta.finish_reason is None:
                    break
        await pools_free_soon(pipeline, mesh)

        async def consume():  # a task cancelled mid-stream (the HTTP client went away)
            async for _ in pipeline.generate("cancelled", prompt_text=PROMPT, sampling=greedy(900)):
                pass
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await pools_free_soon(pipeline, mesh)

    run_with_pipeline(mesh, model_tokenizer, body)


def test_context_overflow_and_bad_input_are_invalid_requests(mesh, model_tokenizer):
    async def body(pipeline):
        with pytest.raises(ContextLengthError, match="maximum context length is 2048"):
            await collect(pipeline.generate("over", prompt_text=PROMPT, sampling=greedy(2040)))
        with pytest.raises(ContextLengthError):
            await collect(pipeline.generate("long", prompt_token_ids=[5] * 2048))
        with pytest.raises(InvalidRequestError):
            await collect(pipeline.generate("none"))
        with pytest.raises(InvalidRequestError):
            await collect(pipeline.generate("empty-stop", prompt_text=PROMPT, stop=[""]))
        with pytest.raises(InvalidRequestError):  # the tokenizer refuses it
            await collect(pipeline.generate("no-messages", messages=[]))
        with pytest.raises(InvalidRequestError):  # prefill refuses it
            await collect(pipeline.generate("bad-temp", prompt_text=PROMPT,
                                            sampling=common_pb2.SamplingParams(temperature=-1)))

    run_with_pipeline(mesh, model_tokenizer, body)
    assert_pools_free(mesh)


def test_worker_pool_picks_the_least_loaded_round_robin_on_ties():
    pool = WorkerPool([Worker(f"w{i}", channel=None, stub=None) for i in range(3)])
    assert [pool.pick().address for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    with pool.hold() as a, pool.hold() as b:
        assert {a.address, b.address} == {"w1", "w2"}  # the turn moved on after w0
        assert pool.pick().address == "w0"
        with pool.hold() as c:
            assert c.address == "w0" and c.num_in_flight == 1
    assert [w.num_in_flight for w in pool.workers] == [0, 0, 0]


def test_prefill_calls_are_preopened_unless_set_to_new(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]
    assert GatewayConfig.from_args(common, {}).prefill_calls == "preopened"
    assert GatewayConfig.from_args(common, {"BATON_PREFILL_CALLS": "new"}).prefill_calls == "new"
    with pytest.raises(ConfigError, match="--prefill-calls must be one of preopened, new, got 'sometimes'"):
        GatewayConfig.from_args([*common, "--prefill-calls", "sometimes"], {})


def test_generation_defaults_come_from_flags_and_variables(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]
    assert not GatewayConfig.from_args(common, {}).generation_defaults  # the demo model recommends none
    env = {"BATON_OVERRIDE_GENERATION_CONFIG": '{"top_p": 0.9}'}
    assert GatewayConfig.from_args(common, env).generation_defaults.top_p == 0.9
    flag = GatewayConfig.from_args([*common, "--override-generation-config", '{"temperature": 0.2}'], env)
    assert (flag.generation_defaults.temperature, flag.generation_defaults.top_p) == (0.2, None)  # a flag wins
    for override, message in (("{nope", "not JSON"), ("[1]", "a JSON object"), ('{"top_k": -2}', "top_k must be")):
        with pytest.raises(ConfigError, match=message):
            GatewayConfig.from_args([*common, "--override-generation-config", override], {})
    with pytest.raises(ConfigError, match="--generation-config: 'elsewhere' is not a directory"):
        GatewayConfig.from_args([*common, "--generation-config", "elsewhere"], {})


def test_served_model_names_come_from_the_flag_or_the_variable(tiny_demo_model):
    common = ["--model", str(tiny_demo_model), "--tokenizer", "127.0.0.1:1", "--prefill", "127.0.0.1:2",
              "--decode", "127.0.0.1:3"]
    assert GatewayConfig.from_args(common, {}).served_model_names == (tiny_demo_model.resolve().name,)
    env = {"BATON_SERVED_MODEL_NAME": "a, b"}
    assert GatewayConfig.from_args(common, env).served_model_names == ("a", "b")
    flagged = GatewayConfig.from_args([*common, "--served-model-name", "c", "d"], env)
    assert (flagged.served_model_names, flagged.served_model_name) == (("c", "d"), "c")
    with pytest.raises(ConfigError, match="--served-model-name"):
        GatewayConfig.from_args([*common, "--served-model-name", " padded"], {})
