"""OpenAI's Responses API through the mesh, by the `openai` client: the same output as chat for
the same conversation, whole and streamed as typed events, with structured output, forced
function calls and their follow-up turn; conversations that go on from stored responses (kept in
the gateway, or in Redis for every gateway); what it cannot serve is a 400. The translation from
chat output is also checked alone, for what this random model does not write (thinking, its own
calls)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from services.gateway.deltas import Delta, Usage
from services.gateway.errors import APIError
from services.gateway.openai_responses import ResponseBuilder
from services.gateway.response_store import (
    GENERATOR_LEASE_S,
    GENERATOR_PREFIX,
    KEY_PREFIX,
    MemoryResponseStore,
    StoredResponse,
)
from services.gateway.responses_api import ResponsesShape, _StreamedItems
from services.gateway.responses_request import ResponsesRequest
from services.gateway.tool_parsers import PARSERS
from tests.services.gateway.mesh import GatewayProcess, gateway_client

QUESTION = "Name a colour."
TIME_TOOL = {"type": "function", "name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}


def chat_text(client, mesh, messages, **kwargs) -> tuple[str, str]:
    choice = client.chat.completions.create(model=mesh.model_name, messages=messages, temperature=0, **kwargs)
    return choice.choices[0].message.content, choice.choices[0].finish_reason


def test_a_response_is_what_chat_answers(mesh, client):
    response = client.responses.create(model=mesh.model_name, input=QUESTION, max_output_tokens=8, temperature=0)
    text, reason = chat_text(client, mesh, [{"role": "user", "content": QUESTION}], max_completion_tokens=8)
    assert response.output_text == text and response.object == "response" and response.id.startswith("resp_")
    assert reason == "length" and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    [item] = response.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert response.usage.output_tokens == 8 and response.usage.input_tokens > 0

    # Instructions are a system message first; a message's text parts are joined.
    response = client.responses.create(model=mesh.model_name, instructions="Be brief.", temperature=0,
                                       max_output_tokens=6, input=[{"role": "user", "content": [
                                           {"type": "input_text", "text": "Name"},
                                           {"type": "input_text", "text": "a colour."}]}])
    text, _ = chat_text(client, mesh, [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": "Name\na colour."}], max_tokens=6)
    assert response.output_text == text
    mesh.assert_decode_pools_free()


def test_a_streamed_response_is_typed_events_that_add_up_to_the_whole(mesh, client):
    kwargs = dict(model=mesh.model_name, input=QUESTION, max_output_tokens=12, temperature=0)
    whole = client.responses.create(**kwargs)
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert deltas == whole.output_text == done.output_text and done.status == whole.status
    assert done.usage.output_tokens == whole.usage.output_tokens
    mesh.assert_decode_pools_free()


def test_output_logprobs_are_chats_whole_and_streamed(mesh, client):
    """`include: ["message.output_text.logprobs"]` with `top_logprobs`: each output token's logprob and its
    top alternatives, as chat gives them for the same conversation; streamed, spread over the text deltas."""
    kwargs = dict(model=mesh.model_name, input=QUESTION, max_output_tokens=10, temperature=0,
                  include=["message.output_text.logprobs"], top_logprobs=3)
    chat = client.chat.completions.create(model=mesh.model_name, messages=[{"role": "user", "content": QUESTION}],
                                          max_tokens=10, temperature=0, logprobs=True, top_logprobs=3)
    expected = [entry.model_dump() for entry in chat.choices[0].logprobs.content]
    assert all(len(entry["top_logprobs"]) == 3 for entry in expected) and len(expected) == 10

    def assert_chats(entries) -> None:
        """The same tokens with the same logprobs, to float32's last digits: a request may find its prompt in
        one prefill worker's cache and not in another's, which computes the same numbers in another order."""
        got = [entry.model_dump() for entry in entries]
        assert [(e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in got] == [
            (e["token"], e["bytes"], [t["token"] for t in e["top_logprobs"]]) for e in expected]
        assert [x for e in got for x in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))] == pytest.approx(
            [x for e in expected for x in (e["logprob"], *(t["logprob"] for t in e["top_logprobs"]))], abs=1e-4)

    whole = client.responses.create(**kwargs)
    assert whole.top_logprobs == 3
    [part] = whole.output[0].content
    assert_chats(part.logprobs)
    events = list(client.responses.create(stream=True, **kwargs))
    assert_chats([entry for e in events if e.type == "response.output_text.delta" for entry in e.logprobs])
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert_chats(done.logprobs)
    assert_chats(events[-1].response.output[0].content[0].logprobs)
    assert client.responses.retrieve(whole.id).output[0].content[0].logprobs == part.logprobs  # stored with them
    # Without the include: none, even with top_logprobs.
    plain = client.responses.create(**{**kwargs, "include": None})
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == whole.output_text


def test_truncation_auto_leaves_out_the_oldest_turns_that_do_not_fit(mesh, client):
    """`truncation: "auto"` leaves out as few of the oldest turns as make the prompt fit the context with
    room for max_output_tokens, the instructions kept; "disabled" (the default) refuses the request."""
    max_model_len = client.models.retrieve(mesh.model_name).model_extra["max_model_len"]
    words = " ".join(f"word{i}" for i in range(max_model_len // 8))
    turns = []
    for n in range(6):
        turns += [{"role": "user", "content": f"Turn {n}: {words}"}, {"role": "assistant", "content": f"Reply {n}."}]
    turns.append({"role": "user", "content": QUESTION})
    kwargs = dict(model=mesh.model_name, instructions="Be brief.", input=turns, max_output_tokens=8, temperature=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**kwargs)
    assert refused.value.code == "context_length_exceeded"
    fitted = client.responses.create(truncation="auto", **kwargs)
    assert fitted.truncation == "auto" and fitted.status == "incomplete"
    assert fitted.usage.input_tokens <= max_model_len - 8

    def chat(start: int):
        messages = [{"role": "system", "content": "Be brief."}, *turns[start:]]
        return client.chat.completions.create(model=mesh.model_name, messages=messages, max_tokens=8, temperature=0)

    # The same as chat on the longest tail of the conversation that starts at a user turn and fits.
    for start in range(0, len(turns), 2):
        try:
            expected = chat(start)
            break
        except openai.BadRequestError:
            continue
    assert 0 < start < len(turns) - 1  # some turns left out, not all
    assert fitted.output_text == expected.choices[0].message.content
    assert fitted.usage.input_tokens == expected.usage.prompt_tokens
    # A conversation that fits is sent whole.
    short = dict(model=mesh.model_name, input=turns[-3:], max_output_tokens=8, temperature=0)
    assert client.responses.create(truncation="auto", **short).output_text == client.responses.create(
        **short).output_text
    mesh.assert_decode_pools_free()


def test_structured_output_and_a_forced_function_call_then_its_answer(mesh, client):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}, "required": ["colour"]}
    response = client.responses.create(model=mesh.model_name, input=QUESTION, temperature=0, max_output_tokens=60,
                                       text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    assert isinstance(json.loads(response.output_text)["colour"], str)

    called = client.responses.create(model=mesh.model_name, input="What time is it?", temperature=0,
                                     max_output_tokens=60, tools=[TIME_TOOL],
                                     tool_choice={"type": "function", "name": "get_time"})
    [call] = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_time" and json.loads(call.arguments)["zone"] in ("UTC", "CET") and call.call_id

    streamed = list(client.responses.create(model=mesh.model_name, input="What time is it?", temperature=0,
                                            max_output_tokens=60, tools=[TIME_TOOL], stream=True,
                                            tool_choice={"type": "function", "name": "get_time"}))
    arguments = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert arguments == call.arguments
    [done] = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments

    follow_up = client.responses.create(model=mesh.model_name, temperature=0, max_output_tokens=5, tools=[TIME_TOOL],
                                        tool_choice="none", input=[
                                            {"role": "user", "content": "What time is it?"},
                                            {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                             "arguments": call.arguments},
                                            {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "12:00"}])
    assert follow_up.output_text and follow_up.output[0].type == "message"
    mesh.assert_decode_pools_free()


def test_a_conversation_goes_on_from_stored_responses(mesh, client):
    """Each turn answers the whole conversation so far, as chat answers it, its instructions not
    carried over; a stream is stored by the time its last event is read; a response is read back,
    with its input items, and deleted; one stored with `store: false` is not."""
    first = client.responses.create(model=mesh.model_name, instructions="Be brief.", input=QUESTION, temperature=0,
                                    max_output_tokens=6)
    assert first.store and first.previous_response_id is None
    second = client.responses.create(model=mesh.model_name, previous_response_id=first.id, input="And another?",
                                     temperature=0, max_output_tokens=6)
    conversation = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "And another?"}]
    assert second.output_text == chat_text(client, mesh, conversation, max_completion_tokens=6)[0]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    events = list(client.responses.create(model=mesh.model_name, previous_response_id=second.id, stream=True,
                                          input=[{"role": "user", "content": "Why?"}], temperature=0,
                                          max_output_tokens=6))
    third = events[-1].response
    conversation += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Why?"}]
    assert third.output_text == chat_text(client, mesh, conversation, max_completion_tokens=6)[0]
    assert client.responses.retrieve(third.id).model_dump() == third.model_dump()
    assert client.responses.retrieve(first.id).model_dump() == first.model_dump()

    items = client.responses.input_items.list(third.id, order="asc")
    texts = [item.content[0].text for item in items.data]
    assert texts == [QUESTION, first.output_text, "And another?", second.output_text, "Why?"]
    assert all(item.id for item in items.data) and not items.has_more
    newest = client.responses.input_items.list(third.id, limit=2)
    assert [item.content[0].text for item in newest.data] == ["Why?", second.output_text] and newest.has_more
    after = client.responses.input_items.list(third.id, limit=2, after=newest.last_id)
    assert [item.content[0].text for item in after.data] == ["And another?", first.output_text]

    deleted = client.responses.delete(first.id)
    assert deleted is None or getattr(deleted, "deleted", True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    response = httpx.post(f"{mesh.gateway.base_url}/v1/responses", timeout=30, json={
        "model": mesh.model_name, "input": "hi", "max_output_tokens": 2, "previous_response_id": first.id})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "previous_response_not_found"
    assert client.responses.retrieve(second.id).id == second.id  # a response it began is kept

    unstored = client.responses.create(model=mesh.model_name, input=QUESTION, max_output_tokens=2, store=False)
    assert not unstored.store
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    mesh.assert_decode_pools_free()


def wait_until_ended(client, response_id: str, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while (response := client.responses.retrieve(response_id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return response


def test_a_background_response_is_answered_at_once_and_read_when_done(mesh, client):
    kwargs = dict(model=mesh.model_name, input=QUESTION, temperature=0, max_output_tokens=8)
    queued = client.responses.create(background=True, **kwargs)
    assert queued.status == "queued" and queued.background and queued.output == []
    done = wait_until_ended(client, queued.id)
    assert done.status == "incomplete" and done.background
    assert done.output_text == client.responses.create(**kwargs).output_text
    assert client.responses.cancel(queued.id).status == "incomplete"  # ended: answered as it is

    long = dict(model=mesh.model_name, input="Tell me a long story.", temperature=0, max_output_tokens=1500)
    running = client.responses.create(background=True, **long)
    cancelled = client.responses.cancel(running.id)
    assert cancelled.status == "cancelled" and cancelled.output == []
    assert client.responses.retrieve(running.id).status == "cancelled"
    mesh.assert_decode_pools_free()
    # Uncancelled, the same request runs far longer than the cancel took: it was cut, not done.
    whole = wait_until_ended(client, client.responses.create(background=True, **long).id)
    assert whole.usage.output_tokens > 100

    for body, param in (({"stream": True}, "stream"), ({"store": False}, "background")):
        refused = httpx.post(f"{mesh.gateway.base_url}/v1/responses", timeout=30,
                             json={"model": mesh.model_name, "input": "hi", "background": True, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(client.responses.create(**kwargs).id)  # not a background one


def test_gateways_sharing_redis_go_on_from_each_others_responses(mesh, redis_server, redis_client):
    """With --redis every gateway reads the responses any stored: a conversation may go on through
    another replica behind a load balancer, and a background response is cancelled through any.
    Each record expires after --responses-ttl-s."""
    with gateway_client(mesh, "--redis", redis_server.url, "--responses-ttl-s", "600") as one, \
            gateway_client(mesh, "--redis", redis_server.url) as other:
        first = one.responses.create(model=mesh.model_name, input=QUESTION, temperature=0, max_output_tokens=4)
        second = other.responses.create(model=mesh.model_name, previous_response_id=first.id, input="Another?",
                                        temperature=0, max_output_tokens=4)
        assert second.previous_response_id == first.id
        assert one.responses.retrieve(second.id).output_text == second.output_text
        assert 0 < redis_client.pttl(KEY_PREFIX + first.id) <= 600_000
        assert redis_client.pttl(KEY_PREFIX + second.id) > 600_000  # the default, an hour
        one.responses.delete(second.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(second.id)

        # A background response generating on one gateway is read, and cancelled, through the other.
        running = one.responses.create(model=mesh.model_name, input="Tell me a long story.", temperature=0,
                                       max_output_tokens=1500, background=True)
        assert other.responses.retrieve(running.id).status in ("queued", "in_progress")
        assert redis_client.exists(GENERATOR_PREFIX + running.id)  # one's lease on it
        cancelled = other.responses.cancel(running.id)
        assert cancelled.status == "cancelled" and one.responses.retrieve(running.id).status == "cancelled"
        assert not redis_client.exists(GENERATOR_PREFIX + running.id)
        mesh.assert_decode_pools_free()

        # One whose gateway dies reads as failed once the lease lapses, not as generating until it expires.
        dying = GatewayProcess(mesh.model_dir, mesh.tokenizer.address, [p.address for p in mesh.prefill],
                               [d.address for d in mesh.decode], "--redis", redis_server.url)
        try:
            orphan = httpx.post(f"{dying.base_url}/v1/responses", timeout=30, json={
                "model": mesh.model_name, "input": "Tell me a long story.", "max_output_tokens": 1500,
                "background": True}).json()
            assert other.responses.retrieve(orphan["id"]).status in ("queued", "in_progress")
        finally:
            dying.proc.kill()
            dying.proc.wait(10)
        deadline = time.monotonic() + GENERATOR_LEASE_S + 2
        while (failed := other.responses.retrieve(orphan["id"])).status != "failed":
            assert failed.status in ("queued", "in_progress") and time.monotonic() < deadline, failed
            time.sleep(0.1)
        assert failed.error.code == "server_error" and "stopped before it ended" in failed.error.message
        assert other.responses.cancel(orphan["id"]).status == "failed"  # ended: answered as it is, no 409
        mesh.assert_decode_pools_free()
    with gateway_client(mesh, "--responses-ttl-s", "0") as unstoring:
        response = unstoring.responses.create(model=mesh.model_name, input=QUESTION, max_output_tokens=2)
        assert not response.store
        with pytest.raises(openai.NotFoundError):
            unstoring.responses.retrieve(response.id)


def test_the_gateways_own_store_keeps_the_most_recent_for_their_time():
    async def scenario() -> None:
        store = MemoryResponseStore(ttl_s=0.2, capacity=2)
        for n in range(3):
            await store.put(StoredResponse({"id": f"resp_{n}", "output": []}, []))
        assert await store.get("resp_0") is None and (await store.get("resp_2")).response["id"] == "resp_2"
        time.sleep(0.25)
        assert await store.get("resp_2") is None and not await store.delete("resp_1")
    asyncio.run(scenario())


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"previous_response_id": "resp_1"}, 404, "previous_response_id"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400, "input"),  # text model
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "x"}]}]}, 400, "input[0].content"),
    ({"input": [{"type": "web_search_call"}]}, 400, "input[0]"),
    ({"tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
    ({"text": {"format": "json"}}, 400, "text.format"),
    # chat's model-level checks, named too: a schema that cannot be compiled, a second structured output
    ({"text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nonsense"}}}}, 400, "text.format"),
    ({"text": {"format": {"type": "json_object"}}, "tools": [TIME_TOOL], "tool_choice": "required"}, 400,
     "tool_choice"),
    ({"temperature": -1}, 400, "temperature"),
    ({"max_output_tokens": 0}, 400, "max_output_tokens"),  # chat's max_completion_tokens, named as asked
    ({"reasoning": {"effort": "enormous"}}, 400, "reasoning.effort"),
    ({"model": "nope"}, 404, "model"),
])
def test_what_cannot_be_served_is_refused_clearly(mesh, body, status, param):
    response = httpx.post(f"{mesh.gateway.base_url}/v1/responses",
                          json={"model": mesh.model_name, "input": "hi", "max_output_tokens": 4, **body}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    mesh.assert_decode_pools_free()


def test_reasoning_comes_first_as_its_own_item():
    """The translation alone, from chat output with thinking in it, as a reasoning parser gives it."""
    builder = ResponseBuilder(kind="chat", response_id="resp_x", model="m", num_choices=1, prompt_of_choice=[0],
                              token_text=str, want_logprobs=False)
    shape = ResponsesShape(ResponsesRequest(model="m", input="hi"), builder)
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
             "prompt_tokens_details": {"cached_tokens": 0}, "completion_tokens_details": {"reasoning_tokens": 3}}
    chat = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Blue.", "reasoning": "Pick one.", "tool_calls": []}}], "usage": usage}
    body = shape.whole(chat)
    assert [item["type"] for item in body["output"]] == ["reasoning", "message"]
    assert body["output"][0]["content"][0] == {"type": "reasoning_text", "text": "Pick one."}
    assert body["status"] == "completed" and body["usage"]["output_tokens"] == 5
    assert body["usage"]["output_tokens_details"] == {"reasoning_tokens": 3}

    items = _StreamedItems(shape)
    chunks = [{"delta": {"role": "assistant", "reasoning": "Pick"}, "finish_reason": None},
              {"delta": {"reasoning": " one.", "content": "Blue"}, "finish_reason": None},
              {"delta": {"content": "."}, "finish_reason": "stop"}]
    events = [json.loads(raw.split(b"data: ", 1)[1]) for chunk in chunks
              for raw in items.chunk({"choices": [{"index": 0, **chunk}]})]
    kinds = [e["type"] for e in events]
    assert kinds == ["response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
                     "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
                     "response.output_item.done", "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done", "response.completed"]
    final = events[-1]["response"]["output"]
    assert [i["type"] for i in final] == ["reasoning", "message"] and final[1]["content"][0]["text"] == "Blue."
    assert events[6]["output_index"] == 0 and events[7]["output_index"] == 1


def test_a_call_the_model_chose_streams_as_a_function_call_item():
    """The translation alone, from a chat stream whose text a hermes parser reads: the text before the
    call is a message, closed as the call begins; the call's arguments come as they are written."""
    builder = ResponseBuilder(kind="chat", response_id="resp_x", model="m", num_choices=1, prompt_of_choice=[0],
                              token_text=str, want_logprobs=False, tool_call_syntax=PARSERS["hermes"])
    items = _StreamedItems(ResponsesShape(ResponsesRequest(model="m", input="hi"), builder))
    text = 'Checking. <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}</tool_call>'
    pieces = [text[i:i + 4] for i in range(0, len(text), 4)]
    events = []
    for i, piece in enumerate(pieces):
        is_last = i == len(pieces) - 1
        delta = Delta(piece, [i], finish_reason="stop" if is_last else None, usage=Usage(1, i + 1, 0) if is_last
                      else None, prompt_token_ids=[0] if i == 0 else ())
        events += [json.loads(event.split(b"data: ", 1)[1]) for raw in items.chunk(builder.chunk(0, delta, False))
                   for event in raw.split(b"\n\n") if event]
    kinds = [e["type"] for e in events]
    added = kinds.index("response.output_item.added", kinds.index("response.output_item.done"))
    assert events[added]["item"]["type"] == "function_call" and events[added]["item"]["name"] == "get_time"
    arguments = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    assert len(arguments) > 1 and "".join(arguments) == '{"zone": "CET"}'
    assert kinds.index("response.function_call_arguments.delta") < kinds.index("response.function_call_arguments.done")
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Checking. "
    assert final["output"][1]["arguments"] == '{"zone": "CET"}' and final["output"][1]["status"] == "completed"


def test_a_reasoning_item_is_the_thinking_of_the_assistant_turn_after_it():
    """As chat takes an earlier turn's thinking (`reasoning_content`, which templates that show it read):
    a reasoning item as this API returns it (its content) or as OpenAI's clients may send it (a summary)."""
    request = ResponsesRequest(model="m", input=[
        {"role": "user", "content": "Add 2 and 2."},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "2+2"}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "4"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "it said 4"}]},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Thanks."}])
    messages = [m.as_template_input() for m in request.as_chat().messages]
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "assistant", "user"]
    assert messages[1]["reasoning_content"] == "2+2" and messages[1]["tool_calls"][0]["id"] == "c1"
    assert messages[3]["reasoning_content"] == "it said 4"
    assert all("reasoning_content" not in m for m in (messages[0], messages[2], messages[4]))


def test_a_cache_salt_reaches_the_chat_request_and_an_empty_one_is_refused():
    request = ResponsesRequest(model="m", input="Hi.", cache_salt="tenant-a")
    assert request.as_chat().sampling(4, None, 0).cache_salt == "tenant-a"
    assert not ResponsesRequest(model="m", input="Hi.").as_chat().sampling(4, None, 0).HasField("cache_salt")
    with pytest.raises(APIError) as refused:
        ResponsesRequest(model="m", input="Hi.", cache_salt="").as_chat()
    assert refused.value.param == "cache_salt"


def test_null_in_openais_nullable_fields_means_their_default():
    request = ResponsesRequest.model_validate({"model": "m", "input": "Hi.", "stream": None, "store": None,
                                               "background": None, "parallel_tool_calls": None})
    assert not request.stream and request.store and not request.background and request.parallel_tool_calls
