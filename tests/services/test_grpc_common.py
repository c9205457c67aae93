"""services/common over real gRPC on 127.0.0.1:0: health, reflection, message limits,
and the committed protobuf code matching its .proto files.

Each test drives its own event loop with asyncio.run: no pytest plugin needed.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from protos import common_pb2, generate as protogen, tokenizer_pb2, tokenizer_pb2_grpc
from services.common.channel import make_channel
from services.common.grpc_server import HealthServicer, make_server, set_serving, stop_server

MiB = 1024 * 1024
TOKENIZER = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


class EchoTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    """Echoes the concatenated message contents back as the rendered text."""

    async def ApplyChatTemplate(self, request, context):
        text = "".join(m.content for m in request.messages)
        return tokenizer_pb2.ApplyChatTemplateResponse(token_ids=[len(text)], text=text)

    async def Encode(self, request, context):
        # A small request whose reply is large: tests the server's send limit.
        return tokenizer_pb2.EncodeResponse(token_ids=[7] * int(request.text))


def chat_request(num_bytes: int) -> tokenizer_pb2.ApplyChatTemplateRequest:
    msg = common_pb2.ChatMessage(role="user", content="x" * num_bytes)
    return tokenizer_pb2.ApplyChatTemplateRequest(request_id="r1", messages=[msg])


async def start_echo_server(**kwargs):
    servicers = [(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, EchoTokenizer())]
    server, port = await make_server(servicers, [TOKENIZER], **kwargs)
    await server.start()
    return server, port


def test_health_reports_serving_for_service_and_server():
    async def main():
        server, port = await start_echo_server()
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                for name in ["", TOKENIZER]:
                    reply = await stub.Check(health_pb2.HealthCheckRequest(service=name))
                    assert reply.status == health_pb2.HealthCheckResponse.SERVING
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
                assert err.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            await stop_server(server, grace_s=0)

    asyncio.run(main())


def test_health_not_serving_until_warmed_up():
    async def main():
        checker = HealthServicer()
        server, port = await start_echo_server(health_servicer=checker, is_serving=False)
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                request = health_pb2.HealthCheckRequest(service=TOKENIZER)
                assert (await stub.Check(request)).status == health_pb2.HealthCheckResponse.NOT_SERVING
                await set_serving(checker, [TOKENIZER], True)
                assert (await stub.Check(request)).status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await stop_server(server, checker, grace_s=0)
        # Graceful shutdown turned every name NOT_SERVING before stopping.
        assert (await checker.Check(health_pb2.HealthCheckRequest(service=""), None)).status == (
            health_pb2.HealthCheckResponse.NOT_SERVING
        )

    asyncio.run(main())


def test_a_health_watch_ends_as_the_server_shuts_down_and_holds_no_grace():
    """A watcher hears NOT_SERVING, then its stream ends: the graceful stop waits for calls doing
    work, not for the gateway's watch of every worker."""
    async def main():
        checker = HealthServicer()
        server, port = await start_echo_server(health_servicer=checker)
        async with make_channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=TOKENIZER))
            statuses = [(await watch.read()).status]
            started = asyncio.get_running_loop().time()
            await stop_server(server, checker, grace_s=30)
            assert asyncio.get_running_loop().time() - started < 5
            while (response := await watch.read()) is not grpc.aio.EOF:
                statuses.append(response.status)
            assert statuses == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
            assert await watch.code() == grpc.StatusCode.OK

    asyncio.run(main())


def test_reflection_lists_services_and_serves_their_descriptors():
    async def main():
        server, port = await start_echo_server()
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                stub = reflection_pb2_grpc.ServerReflectionStub(channel)
                requests = [
                    reflection_pb2.ServerReflectionRequest(list_services=""),
                    reflection_pb2.ServerReflectionRequest(file_containing_symbol=TOKENIZER),
                ]
                replies = [r async for r in stub.ServerReflectionInfo(iter(requests))]
        finally:
            await stop_server(server, grace_s=0)
        names = {s.name for s in replies[0].list_services_response.service}
        assert names == {TOKENIZER, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
        # The descriptor comes back too, so grpcurl can call the service unaided.
        assert replies[1].file_descriptor_response.file_descriptor_proto

    asyncio.run(main())


class SlowTokenizer(tokenizer_pb2_grpc.TokenizerServicer):
    async def Encode(self, request, context):
        await asyncio.sleep(1.0)
        return tokenizer_pb2.EncodeResponse(token_ids=[1])


def test_a_burst_of_calls_waits_its_turn_instead_of_being_cancelled():
    """gRPC core's default cancels calls arriving while 1000 wait to be taken: of 3000 at once, hundreds."""
    async def main():
        server, port = await make_server([(tokenizer_pb2_grpc.add_TokenizerServicer_to_server, SlowTokenizer())],
                                         [TOKENIZER])
        await server.start()
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)

                async def call() -> str:
                    try:
                        await stub.Encode(tokenizer_pb2.EncodeRequest(text="x"), timeout=60)
                        return "OK"
                    except grpc.aio.AioRpcError as e:
                        return e.code().name
                return await asyncio.gather(*(call() for _ in range(3000)))
        finally:
            await stop_server(server, grace_s=0)

    outcomes = asyncio.run(main())
    assert outcomes.count("OK") == len(outcomes), {code: outcomes.count(code) for code in set(outcomes)}


def test_message_over_grpc_default_4mib_goes_through_both_ways():
    async def main():
        server, port = await start_echo_server()  # default 64 MiB limits on both ends
        try:
            async with make_channel(f"127.0.0.1:{port}") as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                reply = await stub.ApplyChatTemplate(chat_request(5 * MiB))
        finally:
            await stop_server(server, grace_s=0)
        assert reply.token_ids == [5 * MiB]
        assert len(reply.text) == 5 * MiB

    asyncio.run(main())


@pytest.mark.parametrize("over", ["client_send", "server_receive", "server_send"])
def test_message_over_configured_limit_is_resource_exhausted(over):
    limit = 6 * MiB

    async def main():
        # The end under test holds the 6 MiB limit; the other end allows more,
        # so the failure can only come from the end under test.
        server_limit = limit if over.startswith("server") else 4 * limit
        client_limit = limit if over == "client_send" else 4 * limit
        server, port = await start_echo_server(max_message_bytes=server_limit)
        try:
            async with make_channel(f"127.0.0.1:{port}", client_limit) as channel:
                stub = tokenizer_pb2_grpc.TokenizerStub(channel)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    if over == "server_send":
                        # ~7 MiB of packed varints: 7 MiB of one-byte token ids.
                        await stub.Encode(tokenizer_pb2.EncodeRequest(request_id="r1", text=str(7 * MiB)))
                    else:
                        await stub.ApplyChatTemplate(chat_request(limit + 1))
                assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                # The channel and server survive a refused message.
                reply = await stub.ApplyChatTemplate(chat_request(1024))
                assert len(reply.text) == 1024
        finally:
            await stop_server(server, grace_s=0)

    asyncio.run(main())


def test_taken_port_is_refused():
    async def main():
        server, port = await start_echo_server()
        try:
            with pytest.raises(RuntimeError):
                await make_server([], [], address=f"127.0.0.1:{port}")
        finally:
            await stop_server(server, grace_s=0)

    asyncio.run(main())


def test_committed_protobuf_code_matches_the_protos(tmp_path: Path):
    """Fails when a .proto was edited without `python -m protos.generate` (or with another protoc)."""
    fresh = protogen.generate(tmp_path)
    committed = protogen.generated_files()
    assert [p.name for p in fresh] == [p.name for p in committed]
    stale = [p.name for p, c in zip(fresh, committed) if p.read_bytes() != c.read_bytes()]
    assert not stale, f"regenerate with `python -m protos.generate`: {stale}"
