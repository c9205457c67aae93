"""KV pages between workers (DESIGN.md, "The KV cache and its transport"): the transports
prefill writes through (transport.py: shared memory, gRPC stream, CUDA IPC), the chunks
the stream carries, and the kvstore node's host-memory page tier (`python -m services.kvstore`)."""
