"""Generated protobuf/gRPC stubs for the ``tandem.v1`` contracts (see proto/tandem/v1/*.proto).

Never edit the ``*_pb2*.py`` files by hand: run ``python -m core.protogen`` and commit the result.
Only servicers and clients import these modules; domain code uses ``core`` types.
"""
