"""llm-d's GetPodScores against a kvatlas server, as an llm-d router team would call it.

Usage:
  llmd_client.py train <dir>
      Trains a tiny byte-level BPE tokenizer (Hugging Face `tokenizers`) with a BOS token its
      post-processor adds, saves <dir>/tokenizer.json and prints {"tokenizer": path}.
  llmd_client.py run <server host:port> <proto dir> <scratch dir> <tokenizer.json> <model>
      1. Generates the kvatlas.v1 and indexer.v1 stubs from the repository's .proto files with
         grpcio-tools, and stubs from llm-d's upstream proto text (below, without kvatlas's
         field 3) in a separate process.
      2. Registers workers with pod names over kvatlas.v1 RegisterWorker and feeds them over ZMQ
         in vLLM's wire format (pyzmq + msgspec): GPU stores, an offload to the CPU tier, a batch
         carrying another data-parallel rank; feeds an unnamed worker over PublishEvents.
      3. Tokenizes the prompts with the same tokenizer, computes llm-d's scores itself (a port of
         llm-d's LongestPrefixScorer over its own request keys: gpu 1.0, cpu 0.8), and checks
         GetPodScores' answers against them, with a pod filter, an empty prompt, a model without
         a tokenizer; and that an upstream llm-d client reads the same answers.
      Prints one JSON object with what it saw; exits non-zero on any mismatch.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

BLOCK = 4
MODEL_WITHOUT_TOKENIZER = "no-tokenizer-model"

# llm-d-kv-cache's api/indexerpb/indexer.proto as upstream ships it (no field 3), under another
# file name; a client generated from it must read kvatlas's answers unchanged.
UPSTREAM_PROTO = """
syntax = "proto3";

package indexer.v1;

option go_package = "github.com/llm-d/llm-d-kv-cache/api/indexerpb;indexerpb";

service IndexerService {
  rpc GetPodScores(GetPodScoresRequest) returns (GetPodScoresResponse) {}
}

message GetPodScoresRequest {
  string prompt = 1;
  string model_name = 2;
  repeated string pod_identifiers = 3;
}

message GetPodScoresResponse {
  repeated PodScore scores = 1;
}

message PodScore {
  string pod = 1;
  double score = 2;
}
"""

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "a router sends each request to the worker that already holds its prefix",
    "kv cache blocks live on the gpu and move to the cpu when memory runs low",
    "the lazy dog sleeps while the quick fox runs around the warm house",
    "every prompt is cut into blocks of tokens and each block is hashed",
] * 20

PROMPT_A = (
    "the quick brown fox jumps over the lazy dog while a router sends each request "
    "to the worker that already holds its prefix and the kv cache blocks live on the gpu"
)
PROMPT_B = (
    "the quick brown fox jumps over the lazy dog and then the cat sleeps on the cpu "
    "because memory runs low in the warm house"
)


def train(directory: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tokenizer.save(str(path))
    print(json.dumps({"tokenizer": str(path)}))
    return 0


def request_keys(ids):
    """llm-d's request keys: one per full block, standing for the chained hash of the prefix."""
    return [tuple(ids[: (i + 1) * BLOCK]) for i in range(len(ids) // BLOCK)]


def llmd_scores(keys, entries, pod_filter):
    """llm-d's LongestPrefixScorer.Score (pkg/kvcache/kvblock_scorer.go) over `entries`, a map
    request key -> [(pod, tier)], after llm-d's pod filter (empty = every pod)."""
    weights = {"gpu": 1.0, "cpu": 0.8}

    def max_weights(key):
        current = {}
        for pod, tier in entries.get(key, []):
            if pod_filter and pod not in pod_filter:
                continue
            weight = weights.get(tier, 1.0)
            if pod not in current or weight > current[pod]:
                current[pod] = weight
        return current

    if not keys:
        return {}
    scores = dict(max_weights(keys[0]))
    active = set(scores)
    for key in keys[1:]:
        if not active:
            break
        current = max_weights(key)
        for pod in list(active):
            if pod in current:
                scores[pod] += current[pod]
            else:
                active.discard(pod)
    return scores


def generate(proto_dir: Path, out: Path, files):
    out.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{proto_dir}", f"--python_out={out}",
         f"--grpc_python_out={out}"] + [str(proto_dir / f) for f in files],
        check=True,
    )


def upstream(address: str, stubs: Path, requests_json: str) -> int:
    """Runs the requests with stubs generated from llm-d's upstream proto (its own process: the
    package is the same as kvatlas's copy)."""
    sys.path.insert(0, str(stubs))
    import grpc
    import llmd_upstream_pb2 as pb
    import llmd_upstream_pb2_grpc as rpc

    stub = rpc.IndexerServiceStub(grpc.insecure_channel(address))
    answers = []
    for request in json.loads(requests_json):
        response = stub.GetPodScores(pb.GetPodScoresRequest(**request), timeout=10)
        answers.append(sorted([s.pod, s.score] for s in response.scores))
    print(json.dumps(answers))
    return 0


def vllm_batch(events, dp_rank):
    import msgspec

    return msgspec.msgpack.encode([time.time(), events, dp_rank])


def stored(hashes, parent, tokens, medium):
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BLOCK,
        "lora_id": None,
        "medium": medium,
    }


def removed(hashes, medium):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


class Engine:
    """A vLLM-format ZMQ publisher: frames [topic, seq (8 bytes big-endian), msgpack batch]."""

    def __init__(self, context, pod, model):
        import zmq

        self.socket = context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.bind("tcp://127.0.0.1:*")
        self.endpoint = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.topic = f"kv@{pod}@{model}".encode()
        self.seq = 0

    def publish(self, events, dp_rank=None):
        seq = self.seq
        self.socket.send_multipart([self.topic, seq.to_bytes(8, "big"), vllm_batch(events, dp_rank)])
        self.seq += 1
        return seq


def run(address, proto_dir, scratch, tokenizer_path, model) -> int:
    import grpc
    import zmq
    from tokenizers import Tokenizer

    generate(proto_dir, scratch / "stubs", ["kvatlas/v1/indexer.proto", "indexer/v1/indexer.proto"])
    upstream_dir = scratch / "upstream"
    upstream_dir.mkdir(parents=True, exist_ok=True)
    (upstream_dir / "llmd_upstream.proto").write_text(UPSTREAM_PROTO)
    generate(upstream_dir, upstream_dir / "out", ["llmd_upstream.proto"])
    sys.path.insert(0, str(scratch / "stubs"))
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    from indexer.v1 import indexer_pb2 as llmd
    from indexer.v1 import indexer_pb2_grpc as llmd_rpc
    from kvatlas.v1 import indexer_pb2 as pb
    from kvatlas.v1 import indexer_pb2_grpc as rpc

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    bos = tokenizer.token_to_id("<s>")
    ids_a = tokenizer.encode(PROMPT_A).ids
    ids_b = tokenizer.encode(PROMPT_B).ids
    assert ids_a[0] == bos and ids_b[0] == bos, "the tokenizer adds its BOS"
    blocks_a = len(ids_a) // BLOCK
    assert blocks_a >= 6, f"prompt A has {blocks_a} blocks"
    block = lambda ids, i: ids[i * BLOCK:(i + 1) * BLOCK]  # noqa: E731
    run_of = lambda ids, start, end: [t for i in range(start, end) for t in block(ids, i)]  # noqa: E731

    channel = grpc.insecure_channel(address)
    kv = rpc.IndexerStub(channel)
    index = pb.IndexSelector(model=model)
    # What each worker rank holds, mirrored for llm-d's scorer: (instance, rank) -> [(block, tier)].
    held = {}

    def hold(worker, ids, start, end, tier):
        for i in range(start, end):
            held.setdefault(worker, []).append((tuple(ids[: (i + 1) * BLOCK]), tier))

    def unhold(worker, ids, start, end, tier):
        gone = {tuple(ids[: (i + 1) * BLOCK]) for i in range(start, end)}
        held[worker] = [(k, t) for k, t in held[worker] if not (k in gone and t == tier)]

    context = zmq.Context()
    engines = {}
    for instance, pod in [(1, "10.0.0.1:8000"), (2, "10.0.0.2:8000")]:
        engine = Engine(context, pod, model)
        kv.RegisterWorker(
            pb.RegisterWorkerRequest(
                index=index, instance_id=instance, block_size=BLOCK, endpoint=engine.endpoint,
                pod_name=pod,
            ),
            timeout=10,
        )
        engines[instance] = engine

    def worker_info(instance):
        listed = kv.ListWorkers(pb.ListWorkersRequest(model=model), timeout=10).workers
        return next(w for w in listed if w.instance_id == instance and w.dp_rank == 0)

    deadline = time.time() + 20
    for instance, engine in engines.items():
        # Empty batches until the listener hears the engine (ZMQ's slow joiner).
        while worker_info(instance).status != pb.WORKER_STATUS_ACTIVE:
            assert time.time() < deadline, f"the listener of worker {instance} stays silent"
            engine.publish([])
            time.sleep(0.05)

    hashes = lambda instance, start, end: [instance * 1000 + i for i in range(start, end)]  # noqa: E731
    parent = lambda instance, start: instance * 1000 + start - 1 if start > 0 else None  # noqa: E731
    # Worker 1: 5 blocks of A on the GPU; blocks 3 and 4 then offloaded to the CPU and evicted
    # from the GPU (vLLM's offloading connector publishes the CPU store, the GPU removal).
    e1 = engines[1]
    e1.publish([stored(hashes(1, 0, 5), None, run_of(ids_a, 0, 5), "GPU")])
    hold((1, 0), ids_a, 0, 5, "gpu")
    e1.publish([stored(hashes(1, 3, 5), parent(1, 3), run_of(ids_a, 3, 5), "CPU"),
                removed(hashes(1, 3, 5), "GPU")])
    hold((1, 0), ids_a, 3, 5, "cpu")
    unhold((1, 0), ids_a, 3, 5, "gpu")
    last_1 = e1.publish([])
    # Worker 2: its rank 0 holds 2 blocks of A; a batch carrying rank 1 stores 10 blocks of A
    # (the pod's best rank for A).
    e2 = engines[2]
    e2.publish([stored(hashes(2, 0, 2), None, run_of(ids_a, 0, 2), "GPU")])
    hold((2, 0), ids_a, 0, 2, "gpu")
    e2.publish([stored([2100 + i for i in range(10)], None, run_of(ids_a, 0, 10), "GPU")], dp_rank=1)
    hold((2, 1), ids_a, 0, 10, "gpu")
    # ... and rank 0 all of B on the GPU (B shares its first blocks with A).
    e2.publish([stored([2200 + i for i in range(len(ids_b) // BLOCK)], None,
                       run_of(ids_b, 0, len(ids_b) // BLOCK), "GPU")])
    hold((2, 0), ids_b, 0, len(ids_b) // BLOCK, "gpu")
    last_2 = e2.publish([])
    # Worker 7, fed over PublishEvents without a pod name: 2 blocks of A on the device, 1 on
    # the host.
    acked = kv.PublishEvents(iter([pb.PublishEventsRequest(
        index=index, instance_id=7, block_size=BLOCK, seq=0,
        events=[
            pb.KvEvent(stored=pb.BlocksStored(block_hashes=[701, 702], token_ids=run_of(ids_a, 0, 2))),
            pb.KvEvent(stored=pb.BlocksStored(parent_hash=702, block_hashes=[703],
                                              token_ids=run_of(ids_a, 2, 3),
                                              tier=pb.STORAGE_TIER_HOST)),
        ],
    )]), timeout=10)
    assert acked.messages_applied == 1, acked
    hold((7, 0), ids_a, 0, 2, "gpu")
    hold((7, 0), ids_a, 2, 3, "cpu")
    for instance, last in [(1, last_1), (2, last_2)]:
        while worker_info(instance).last_seq != last:
            assert time.time() < deadline, f"worker {instance}'s batches are not applied"
            time.sleep(0.05)

    # The pods, as documented: the registered pod name, a batch's rank under its instance's pod,
    # the instance id for a worker without one; a pod with several ranks scores its best rank.
    pod_of = {(1, 0): "10.0.0.1:8000", (2, 0): "10.0.0.2:8000", (2, 1): "10.0.0.2:8000",
              (7, 0): "7"}

    def expected(ids, pod_filter):
        keys = request_keys(ids)
        best = {}
        for worker, blocks in held.items():
            entries = {}
            for key, tier in blocks:
                entries.setdefault(key, []).append((worker, tier))
            score = llmd_scores(keys, entries, set()).get(worker)
            pod = pod_of[worker]
            if score is None or (pod_filter and pod not in pod_filter):
                continue
            if pod not in best or score > best[pod][0]:
                best[pod] = (score, worker[1])
        return sorted([pod, s, rank] for pod, (s, rank) in best.items())

    scorer = llmd_rpc.IndexerServiceStub(channel)
    cases = [
        ("A", PROMPT_A, ids_a, []),
        ("B", PROMPT_B, ids_b, []),
        ("A filtered", PROMPT_A, ids_a, ["7", "10.0.0.2:8000", "not-a-pod"]),
        ("empty", "", tokenizer.encode("").ids, []),
    ]
    result = {"bos": bos, "blocks_a": blocks_a, "answers": {}}
    for name, prompt, ids, pods in cases:
        answer = scorer.GetPodScores(
            llmd.GetPodScoresRequest(prompt=prompt, model_name=model, pod_identifiers=pods),
            timeout=10,
        )
        got = sorted(
            [s.pod, s.score, s.data_parallel_rank if s.HasField("data_parallel_rank") else None]
            for s in answer.scores
        )
        want = expected(ids, set(pods))
        assert got == want, f"{name}: kvatlas answered {got}, llm-d's scorer gives {want}"
        # Best first.
        scores = [s.score for s in answer.scores]
        assert scores == sorted(scores, reverse=True), f"{name}: {scores}"
        result["answers"][name] = got
    assert result["answers"]["A"], "prompt A is held"

    try:
        scorer.GetPodScores(llmd.GetPodScoresRequest(prompt=PROMPT_A, model_name=MODEL_WITHOUT_TOKENIZER),
                            timeout=10)
        result["no_tokenizer"] = ["OK", ""]
    except grpc.RpcError as error:
        result["no_tokenizer"] = [error.code().name, error.details()]

    # An upstream llm-d client (no field 3) reads the same pods and scores.
    requests = [{"prompt": p, "model_name": model, "pod_identifiers": pods} for _, p, _, pods in cases]
    upstream_answers = json.loads(subprocess.run(
        [sys.executable, __file__, "upstream", address, str(upstream_dir / "out"), json.dumps(requests)],
        check=True, stdout=subprocess.PIPE, text=True,
    ).stdout)
    for (name, *_), answer in zip(cases, upstream_answers):
        want = [[pod, score] for pod, score, _ in result["answers"][name]]
        assert answer == want, f"{name}: the upstream client read {answer}, not {want}"
    result["upstream_client"] = "same answers"

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
    )
    result["services"] = sorted(s.name for r in responses for s in r.list_services_response.service)
    listed = kv.ListWorkers(pb.ListWorkersRequest(model=model), timeout=10).workers
    result["pod_names"] = sorted([w.instance_id, w.dp_rank, w.pod_name] for w in listed)
    print(json.dumps(result))
    return 0


def main() -> int:
    mode = sys.argv[1]
    if mode == "train":
        return train(Path(sys.argv[2]))
    if mode == "upstream":
        return upstream(sys.argv[2], Path(sys.argv[3]), sys.argv[4])
    if mode == "run":
        return run(sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5]), sys.argv[6])
    raise SystemExit(f"unknown mode {mode!r} (train, run or upstream)")


if __name__ == "__main__":
    sys.exit(main())
