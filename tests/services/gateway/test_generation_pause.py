"""SGLang's POST /pause_generation and /continue_generation, and vLLM's /pause, /resume and /is_paused, on
a mesh of 2 prefill and 2 decode workers: in place, a running request stops streaming and later ends with
the tokens it would have had, a request arriving meanwhile waits, and a weight update is refused while
paused requests hold pages; retracting, the update goes through and the retracted request goes on with
the new weights; abort (the default) ends the running requests of every API at once (a held one, only
by its id); vLLM's wait lets them finish first. Each test leaves the mesh unpaused, on its own checkpoint."""
from __future__ import annotations

import json
import re
import threading
import time

import httpx
import openai
import pytest

from tests.services.gateway.test_weight_updates import PROMPT, greedy, next_checkpoint, update  # noqa: F401

LONG = 600  # tokens: a request still running when the pause comes


def pause(mesh, **body) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}/pause_generation", timeout=60, json=body or None)


def resume(mesh) -> httpx.Response:
    return httpx.post(f"{mesh.gateway.base_url}/continue_generation", timeout=60)


class StreamedSample:
    """A greedy /generate sample streamed on a thread: each event's output ids and arrival time."""

    def __init__(self, mesh, max_new_tokens: int = LONG) -> None:
        self.events: list[tuple[float, list[int]]] = []
        self.final: dict | None = None
        body = {"input_ids": PROMPT, "stream": True,
                "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}}
        self.thread = threading.Thread(target=self._read, args=(f"{mesh.gateway.base_url}/generate", body))
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        with httpx.stream("POST", url, json=body, timeout=120) as answer:
            for line in answer.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[len("data: "):])
                    self.events.append((time.monotonic(), event["output_ids"]))
                    self.final = event

    def wait_for_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while not self.events or len(self.events[-1][1]) < n:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the sample did not stream"
            time.sleep(0.005)

    def join(self) -> dict:
        self.thread.join(timeout=120)
        assert not self.thread.is_alive() and self.final is not None
        return self.final


@pytest.fixture
def unpaused(mesh, tiny_demo_model):
    """The mesh unpaused and back on the package's checkpoint after the test, whatever it did."""
    yield
    assert resume(mesh).status_code == 200
    answer = update(mesh, tiny_demo_model, weight_version="default")
    assert answer.status_code == 200, answer.text


def test_paused_in_place_a_request_stops_and_ends_as_it_would_have(mesh, next_checkpoint, unpaused):  # noqa: F811
    expected_long, expected_short = greedy(mesh, LONG), greedy(mesh)
    sample = StreamedSample(mesh)
    sample.wait_for_tokens(8)
    assert pause(mesh, mode="in_place").json() == {"message": "Generation paused successfully.", "status": "ok"}
    paused_at = time.monotonic()
    arriving: dict = {}
    thread = threading.Thread(target=lambda: arriving.update(tokens=greedy(mesh), at=time.monotonic()))
    thread.start()
    refused = update(mesh, next_checkpoint)  # the paused request's pages hold KV of these weights
    assert refused.status_code == 409 and "paused in place" in refused.json()["message"], refused.text
    time.sleep(1.0)
    streamed_while_paused = [n for at, n in sample.events if at > paused_at + 0.2]
    assert not streamed_while_paused and not arriving
    continued_at = time.monotonic()
    assert resume(mesh).json() == {"message": "Generation continued successfully.", "status": "ok"}
    final = sample.join()
    thread.join(timeout=60)
    assert final["output_ids"] == expected_long and final["meta_info"]["finish_reason"]["type"] == "length"
    assert arriving["tokens"] == expected_short and arriving["at"] > continued_at
    mesh.assert_decode_pools_free()


def test_retracted_requests_go_on_with_the_weights_updated_while_paused(mesh, next_checkpoint, unpaused):  # noqa: F811
    expected_long = greedy(mesh, LONG)
    sample = StreamedSample(mesh)
    sample.wait_for_tokens(8)
    assert pause(mesh, mode="retract").status_code == 200
    before_update = len(sample.events[-1][1])
    answer = update(mesh, next_checkpoint, weight_version="step-2")
    assert answer.status_code == 200 and answer.json()["message"].count("updated in") == 4, answer.text
    assert resume(mesh).status_code == 200
    final = sample.join()["output_ids"]
    assert len(final) == LONG and final[:before_update] == expected_long[:before_update]
    assert final != expected_long  # the rest is the new checkpoint's
    mesh.assert_decode_pools_free()


def test_abort_ends_running_requests_of_every_api_and_holds_new_ones_until_continued(mesh, unpaused):
    sample = StreamedSample(mesh, max_new_tokens=2000)
    completion: dict = {"text": ""}

    def complete() -> None:
        with openai.OpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused", max_retries=0) as client:
            for chunk in client.completions.create(model=mesh.model_name, prompt=PROMPT, max_tokens=2000, stream=True,
                                                   temperature=0, extra_body={"ignore_eos": True}):
                completion["text"] += chunk.choices[0].text
                completion["finish_reason"] = chunk.choices[0].finish_reason
    openai_stream = threading.Thread(target=complete)
    openai_stream.start()
    sample.wait_for_tokens(4)
    while not completion["text"]:
        time.sleep(0.005)
    assert pause(mesh).status_code == 200  # no body: SGLang's default mode, abort
    final = sample.join()
    openai_stream.join(timeout=60)
    assert final["meta_info"]["finish_reason"]["type"] == "abort" and len(final["output_ids"]) < 2000
    assert completion["finish_reason"] == "abort" and completion["text"]
    arriving: dict = {}
    thread = threading.Thread(target=lambda: arriving.update(tokens=greedy(mesh)))
    thread.start()
    time.sleep(0.5)
    assert not arriving
    mesh.assert_decode_pools_free()
    assert resume(mesh).status_code == 200
    thread.join(timeout=60)
    assert len(arriving["tokens"]) == 8


def test_a_request_held_by_the_pause_is_aborted_by_its_id_but_not_by_abort_all(mesh, unpaused):
    """As SGLang's: aborting all ends what runs, and what waits for /continue_generation waits on; named,
    a held request ends at once, having reached no worker."""
    base = mesh.gateway.base_url
    assert pause(mesh).status_code == 200
    arriving: dict = {}
    chat: dict = {}

    def held_chat() -> None:
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0) as client:
            chat["answer"] = client.chat.completions.create(
                model=mesh.model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                extra_headers={"x-request-id": "held-chat"})
    threads = [threading.Thread(target=lambda: arriving.update(tokens=greedy(mesh))),
               threading.Thread(target=held_chat)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 10
    while pause_gauges(mesh)[1] < 2:
        assert time.monotonic() < deadline, "the requests were not held"
        time.sleep(0.01)
    assert httpx.post(f"{base}/abort_request", json={"abort_all": True}, timeout=10).status_code == 200
    time.sleep(0.3)
    assert not arriving and not chat and pause_gauges(mesh)[1] == 2
    assert httpx.post(f"{base}/abort_request", json={"rid": "held-chat"}, timeout=10).status_code == 200
    threads[1].join(timeout=2)
    choice = chat["answer"].choices[0]
    assert choice.finish_reason == "abort" and not choice.message.content
    assert not arriving and pause_gauges(mesh)[1] == 1
    assert resume(mesh).status_code == 200
    threads[0].join(timeout=60)
    assert len(arriving["tokens"]) == 8
    mesh.assert_decode_pools_free()


def test_vllms_pause_waits_for_running_requests_and_keeps_new_ones_until_resumed(mesh, unpaused):
    base = mesh.gateway.base_url
    expected = greedy(mesh, LONG)
    sample = StreamedSample(mesh)
    sample.wait_for_tokens(8)
    answer = httpx.post(f"{base}/pause", params={"mode": "wait"}, timeout=60)
    assert answer.json() == {"status": "paused"} and not sample.thread.is_alive()  # it returned once they ended
    assert sample.join()["output_ids"] == expected
    assert httpx.get(f"{base}/is_paused", timeout=10).json() == {"is_paused": True}
    arriving: dict = {}
    thread = threading.Thread(target=lambda: arriving.update(tokens=greedy(mesh)))
    thread.start()
    time.sleep(0.5)
    assert not arriving
    assert pause_gauges(mesh) == ({"abort": 0, "in_place": 0, "retract": 0, "wait": 1}, 1)  # the one arriving
    assert httpx.post(f"{base}/resume", timeout=60).json() == {"status": "resumed"}
    thread.join(timeout=60)
    assert len(arriving["tokens"]) == 8
    assert httpx.get(f"{base}/is_paused", timeout=10).json() == {"is_paused": False}
    assert pause_gauges(mesh) == ({"abort": 0, "in_place": 0, "retract": 0, "wait": 0}, 0)
    assert httpx.post(f"{base}/pause", params={"mode": "keep"}, timeout=60).status_code == 200
    states = httpx.get(f"{base}/get_server_info", timeout=10).json()["internal_states"]
    assert all(state["is_paused"] for state in states)  # keep: SGLang's in_place, on every worker


def pause_gauges(mesh) -> tuple[dict[str, float], float]:
    """The gateway's baton_gateway_generation_paused by mode, and its baton_gateway_requests_held."""
    text = httpx.get(f"{mesh.gateway.base_url}/metrics", timeout=10).text
    paused = {m["mode"]: float(m["value"]) for m in re.finditer(
        r'^baton_gateway_generation_paused\{[^}]*mode="(?P<mode>\w+)"[^}]*\} (?P<value>\S+)$', text, re.M)}
    return paused, float(re.search(r"^baton_gateway_requests_held\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_a_mode_neither_has_is_refused(mesh):
    answer = pause(mesh, mode="sideways")
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "mode", answer.text
    answer = httpx.post(f"{mesh.gateway.base_url}/pause", params={"mode": "sideways"}, timeout=10)
    assert answer.status_code == 400 and answer.json()["error"]["message"], answer.text
    assert httpx.get(f"{mesh.gateway.base_url}/is_paused", timeout=10).json() == {"is_paused": False}
    assert resume(mesh).status_code == 200  # not paused: nothing to do
