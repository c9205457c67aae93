"""Baton's wire messages: the .proto files and the code generated from them.

Import generated modules as `from protos import decode_pb2, decode_pb2_grpc`.
Only servicers and converters import them (STYLE.md, rule 2). After editing a
.proto, regenerate with `python -m protos.generate` and commit the results.
"""
