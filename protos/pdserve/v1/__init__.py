"""``pdserve.v1``: the client API.

The ``*.proto`` files here are the source of truth; ``*_pb2.py``, ``*_pb2.pyi`` and
``*_pb2_grpc.py`` are generated next to them by ``scripts/gen_protos.sh`` (run by
``make install``), git-ignored, and never edited by hand.
"""
