"""Drives a kvatlas server with the gRPC clients a Python router team would use.

Usage: grpc_clients.py <server host:port> <proto dir> <scratch dir> [token [CA certificate]]
       (spec on stdin; with a CA certificate, over TLS trusting it)

1. Generates the kvatlas.v1 stubs from the repository's .proto with grpcio-tools (at test time,
   so they always match the server's API).
2. Checks health with grpcio-health-checking and lists services with grpcio-reflection
   (v1alpha, the version the Python client speaks).
3. Publishes the spec's stores over PublishEvents (client streaming, token ids), asks the spec's
   prompts with Query (unary) and QueryStream (bidirectional), and makes a few bad calls.

The spec (JSON on stdin): {"model": str, "block_size": int, "stores": [{"instance": int,
"tokens": [int]}], "prompts": [[int]]}. The result (one JSON object on stdout) carries what the
server answered; the Rust test (tests/interop.rs) checks it against its reference model.
"""

import json
import subprocess
import sys
from pathlib import Path


def main() -> int:
    address, proto_dir, scratch = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    token = sys.argv[4] if len(sys.argv) > 4 else None
    ca_certificate = Path(sys.argv[5]).read_bytes() if len(sys.argv) > 5 else None
    spec = json.load(sys.stdin)
    scratch.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}",
            f"--python_out={scratch}", f"--grpc_python_out={scratch}",
            str(proto_dir / "kvatlas" / "v1" / "indexer.proto"),
        ],
        check=True,
    )
    sys.path.insert(0, str(scratch))

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from kvatlas.v1 import indexer_pb2 as pb
    from kvatlas.v1 import indexer_pb2_grpc as rpc

    metadata = [("authorization", f"Bearer {token}")] if token else []
    if ca_certificate is None:
        channel = grpc.insecure_channel(address)
    else:
        credentials = grpc.ssl_channel_credentials(root_certificates=ca_certificate)
        channel = grpc.secure_channel(address, credentials)
    result = {}

    health = health_pb2_grpc.HealthStub(channel)
    answer = health.Check(health_pb2.HealthCheckRequest(service="kvatlas.v1.Indexer"), timeout=10)
    result["health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
        metadata=metadata,
        timeout=10,
    )
    result["services"] = sorted(
        s.name for r in responses for s in r.list_services_response.service
    )

    stub = rpc.IndexerStub(channel)
    index = pb.IndexSelector(model=spec["model"])
    block = spec["block_size"]

    def publishes():
        for seq, store in enumerate(spec["stores"]):
            n = len(store["tokens"]) // block
            yield pb.PublishEventsRequest(
                index=index,
                instance_id=store["instance"],
                seq=seq,
                block_size=block,
                events=[
                    pb.KvEvent(
                        stored=pb.BlocksStored(
                            block_hashes=[store["instance"] * 1000 + i for i in range(n)],
                            token_ids=store["tokens"],
                        )
                    )
                ],
            )

    acked = stub.PublishEvents(publishes(), metadata=metadata, timeout=10)
    result["messages_applied"] = acked.messages_applied

    def rows(response):
        return [
            [m.instance_id, m.dp_rank, m.device_blocks, m.host_blocks, m.longest_blocks]
            for m in response.matches
        ]

    result["unary"] = [
        rows(
            stub.Query(
                pb.QueryRequest(index=index, tokens=pb.TokenIds(ids=prompt)),
                metadata=metadata,
                timeout=10,
            )
        )
        for prompt in spec["prompts"]
    ]
    requests = (
        pb.QueryRequest(index=index, tokens=pb.TokenIds(ids=prompt), request_id=i)
        for i, prompt in enumerate(spec["prompts"])
    )
    streamed = {}
    for answer in stub.QueryStream(requests, metadata=metadata, timeout=10):
        streamed[answer.request_id] = rows(answer.response)
    result["stream"] = [streamed.get(i) for i in range(len(spec["prompts"]))]

    errors = {}
    for name, request in [
        ("empty_model", pb.QueryRequest(tokens=pb.TokenIds(ids=[1]))),
        ("unknown_model", pb.QueryRequest(index=pb.IndexSelector(model="nope"), tokens=pb.TokenIds(ids=[1]))),
    ]:
        try:
            stub.Query(request, metadata=metadata, timeout=10)
            errors[name] = ["OK", ""]
        except grpc.RpcError as error:
            errors[name] = [error.code().name, error.details()]
    result["errors"] = errors
    workers = stub.ListWorkers(pb.ListWorkersRequest(), metadata=metadata, timeout=10)
    result["workers"] = sorted([w.instance_id, pb.WorkerSource.Name(w.source)] for w in workers.workers)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
