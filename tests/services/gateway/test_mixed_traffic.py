"""Many clients at once, each request of a random kind, as a production gateway sees them:
both APIs, streamed and not, `n` > 1, stop strings, logprobs, seeds, prompts sharing
prefixes, clients that go away mid-stream or time out before their first token (at
random points of the request's path), and bad input. Every answer must be one of those
a client is promised (a result, 400, 404 or 429), and when it is over no decode page is
left held and the gateway has logged no unexpected error."""
from __future__ import annotations

import asyncio
import collections
import random
import time

import grpc
import httpx
import openai

from protos import common_pb2, gateway_pb2, gateway_pb2_grpc

DURATION_S = 10.0
CLIENTS = 12
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex every bold jumper".split()
BAD_BODIES = [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"n": 0}, {"prompt": "x " * 3000}]


class Traffic:
    """One random request after another, each checked and its outcome counted."""

    def __init__(self, mesh, seed: int) -> None:
        self.mesh = mesh
        self.rng = random.Random(seed)
        self.outcomes: collections.Counter[str] = collections.Counter()
        self.prefixes = [self.words(50, 300) for _ in range(3)]

    def words(self, least: int, most: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(least, most)))

    def prompt(self) -> str:
        shared = self.rng.choice(self.prefixes) + " " if self.rng.random() < 0.5 else ""
        return shared + self.words(1, 200)

    async def one(self, client: openai.AsyncOpenAI, http: httpx.AsyncClient, stub) -> None:
        kind = self.rng.random()
        try:
            if kind < 0.1:
                await self.bad_input(http)
            elif kind < 0.3:
                await self.generate(stub)
            else:
                await self.openai(client)
        except openai.APITimeoutError:
            self.outcomes["timed out"] += 1
        except openai.APIStatusError as e:
            assert e.status_code == 429, (e.status_code, e.message)
            self.outcomes["429"] += 1
        except openai.APIError as e:  # in a stream, after its first token: the pages could not be reserved
            assert e.body["code"] == "overloaded", e.body
            self.outcomes["429"] += 1

    async def bad_input(self, http: httpx.AsyncClient) -> None:
        body = {"model": self.mesh.model_name, "prompt": "hi", "max_tokens": 4, **self.rng.choice(BAD_BODIES)}
        if self.rng.random() < 0.2:
            body["model"] = "no-such-model"
        response = await http.post("/v1/completions", json=body)
        assert response.status_code in (400, 404), response.text
        assert response.json()["error"]["message"]
        self.outcomes[f"refused {response.status_code}"] += 1

    async def generate(self, stub) -> None:
        """The public gRPC API; some calls are cancelled after a few messages (or none)."""
        call = stub.Generate(gateway_pb2.GenerateRequest(
            text=self.prompt(), stop=self.rng.choice([[], ["e"], [" fox"]]),
            sampling=common_pb2.SamplingParams(max_tokens=self.rng.randint(1, 40),
                                               temperature=self.rng.choice([0.0, 0.8])),
            stream_options=gateway_pb2.StreamOptions(stream=True)), timeout=60)
        cancel_after = self.rng.choice([None, None, 0, 2])
        seen = 0
        async for message in call:
            if message.WhichOneof("response") == "error":
                assert message.error.code == 429, message.error
                self.outcomes["429"] += 1
                return
            seen += 1
            if cancel_after is not None and seen > cancel_after:
                call.cancel()
                self.outcomes["cancelled"] += 1
                return
        self.outcomes["generated"] += 1

    async def openai(self, client: openai.AsyncOpenAI) -> None:
        rng = self.rng
        n, max_tokens, stream = rng.choice([1, 1, 2]), rng.randint(1, 48), rng.random() < 0.6
        args = dict(model=self.mesh.model_name, max_tokens=max_tokens, n=n, stream=stream,
                    temperature=rng.choice([0.0, 0.8, 1.2]), stop=rng.choice([None, "e", ["\n", " the"], " fox"]),
                    timeout=rng.choice([30.0, 30.0, 30.0, 0.05, 0.3]))
        if rng.random() < 0.3:
            args["seed"] = rng.randint(0, 100)
        if stream:
            args["stream_options"] = {"include_usage": True}
        chat = rng.random() < 0.4
        if chat:
            if rng.random() < 0.3:
                args.update(logprobs=True, top_logprobs=2)
            response = await client.chat.completions.create(messages=[{"role": "user", "content": self.prompt()}],
                                                            **args)
        else:
            if rng.random() < 0.3:
                args["logprobs"] = 2
            response = await client.completions.create(prompt=self.prompt(), **args)
        if not stream:
            assert len(response.choices) == n
            assert response.usage.completion_tokens <= n * max_tokens
            self.outcomes["answered"] += 1
            return
        leave_after = rng.choice([None, None, 0, 2])
        chunks = 0
        async for chunk in response:
            chunks += 1
            if leave_after is not None and chunks > leave_after:
                await response.close()
                self.outcomes["went away"] += 1
                return
            if not chunk.choices:  # the usage chunk, last before [DONE]
                assert chunk.usage.completion_tokens <= n * max_tokens
        self.outcomes["streamed"] += 1


def test_mixed_traffic_gets_only_promised_answers_and_leaves_no_page_held(mesh):
    traffic = Traffic(mesh, seed=14)

    async def client_loop(until: float) -> None:
        async with openai.AsyncOpenAI(base_url=f"{mesh.gateway.base_url}/v1", api_key="unused",
                                      max_retries=0) as client, \
                httpx.AsyncClient(base_url=mesh.gateway.base_url, timeout=30) as http, \
                grpc.aio.insecure_channel(mesh.gateway.grpc_address) as channel:
            stub = gateway_pb2_grpc.GenerateStub(channel)
            while time.monotonic() < until:
                await traffic.one(client, http, stub)

    async def main() -> None:
        until = time.monotonic() + DURATION_S
        await asyncio.gather(*(client_loop(until) for _ in range(CLIENTS)))

    logged_before = len(mesh.gateway.stderr_lines)
    asyncio.run(main())
    outcomes = traffic.outcomes
    # Every kind of outcome happened, or the test did not test what it says.
    for kind in ("refused 400", "cancelled", "generated", "answered", "went away", "streamed", "timed out"):
        assert outcomes[kind] > 0, outcomes
    mesh.assert_decode_pools_free(within_s=2.0)
    logged = mesh.gateway.stderr_lines[logged_before:]
    assert not [line for line in logged if "Traceback" in line or "unexpected error" in line], logged
