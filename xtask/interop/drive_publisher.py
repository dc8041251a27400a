"""Drives vLLM's or SGLang's *real* KV-event publisher for kvatlas's interop test.

Usage:
    drive_publisher.py --engine vllm|sglang --src <extracted sources> \
        --endpoint tcp://*:PORT --replay-endpoint tcp://*:PORT [--topic kv-events]

The engine's publisher modules are loaded unmodified from the files `cargo xtask interop`
extracted from the PyPI wheel (`target/interop/src/<pkg>-<version>/`), without torch, as
docs/events.md §6 describes: bare package objects whose `__path__` points at the real files
(no `__init__.py` executed) and a few stand-ins for the torch-heavy modules the publisher imports
only for types or decorators. Everything that shapes the wire (msgspec structs, encoder, PUB and
ROUTER sockets, the replay loop, the config) is upstream code.

The test (crates/kvatlas-events/tests/interop.rs) steps the scenario through stdin, one command
per line; every command is answered by one JSON line on stdout:

    start              create a publisher (a new engine incarnation: its seq restarts at 0)
    publish <step>     publish one scenario batch: store_root, store_chain, remove_store, clear,
                       store_after_clear, empty, remove_parent (evict chain a's last block, the
                       parent of chain b: a head-first eviction), restore_parent (store it again)
    burst <n> <seed> [leaf]
                       publish n random batches (stores of 1-4 chained blocks under a held block
                       or a root, drawn from 4 blocks of tokens so that workers share prefixes;
                       removes of held blocks, rarely a clear) as fast as the
                       publisher takes them; the answer lists every batch's seq, payload and
                       stored blocks ([hash, parent or null, tokens], hashes as u64).
                       With `leaf`, only blocks no held block descends from are removed (the
                       leaf-first eviction vLLM's and SGLang's caches do) and nothing is cleared
    stop               shut the publisher down (the engine process "dies")
    quit               exit

A `publish` answer carries the batch's sequence number, the exact msgpack payload the publisher
sent (hex; the batch encoded with msgspec's default encoder, as the publisher's thread does), the
logical events and the driver's own model of the worker's cache after the batch (engine hash and
tier of every held block) so the test can check the index independently of kvatlas's decoder.
"""

import argparse
import importlib
import json
import sys
import time
import types
from pathlib import Path

MASK64 = (1 << 64) - 1
BLOCK_SIZE = 16


def bare_package(name, src):
    """Registers `name` as a package whose submodules load from `src` (no `__init__` run)."""
    module = types.ModuleType(name)
    module.__path__ = [str(Path(src, *name.split(".")))]
    module.__package__ = name
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def stand_in(name, **attributes):
    """Registers a plain module `name` with `attributes` (replaces a torch-heavy module)."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


def load_vllm(src, version):
    """Imports vLLM's publisher modules from the wheel's files (docs/events.md §6), returns them."""
    for package in ["vllm", "vllm.distributed", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core"]:
        bare_package(package, src)
    sys.modules["vllm"].__version__ = version

    def config(cls=None, **_kwargs):
        # vllm/config/utils.py's decorator: a pydantic dataclass that forbids unknown fields.
        from pydantic import ConfigDict
        from pydantic.dataclasses import dataclass

        def wrap(c):
            return dataclass(c, config=ConfigDict(extra="forbid", arbitrary_types_allowed=True))

        return wrap if cls is None else wrap(cls)

    stand_in("vllm.config.utils", config=config)
    stand_in("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    kv_events = importlib.import_module("vllm.distributed.kv_events")
    config_module = importlib.import_module("vllm.config.kv_events")
    hashing = importlib.import_module("vllm.utils.hashing")
    return kv_events, config_module, hashing


def load_sglang(src):
    """Imports SGLang's publisher module from the wheel's files (docs/events.md §6), returns it."""
    for package in ["sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.utils"]:
        bare_package(package, src)

    class Parallel:
        pp_rank = attn_tp_rank = attn_cp_rank = attn_dp_rank = dp_rank = 0
        attn_dp_size = 1

    stand_in("sglang.srt.runtime_context", get_parallel=lambda: Parallel())
    return importlib.import_module("sglang.srt.disaggregation.kv_events")


class Engine:
    """One engine flavour: how to build its publisher, its events and its block hashes."""

    def __init__(self, args):
        self.name = args.engine
        self.src = args.src
        self.args = args
        if args.engine == "vllm":
            version = Path(args.src).name.split("-", 1)[-1]
            self.kv, self.config_module, self.hashing = load_vllm(args.src, version)
            self.cpu_medium = "CPU"
        else:
            self.kv = load_sglang(args.src)
            self.cpu_medium = "CPU_PINNED"

    def create(self):
        """Creates the engine's real publisher through its own factory."""
        a = self.args
        if self.name == "vllm":
            config = self.config_module.KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=a.endpoint,
                replay_endpoint=a.replay_endpoint,
                topic=a.topic,
            )
            return self.kv.EventPublisherFactory.create(config, 0)
        config = json.dumps(
            {
                "publisher": "zmq",
                "endpoint": a.endpoint,
                "replay_endpoint": a.replay_endpoint,
                "topic": a.topic,
            }
        )
        return self.kv.EventPublisherFactory.create(config, 0)

    def block_hash(self, parent, tokens):
        """The block hash the engine would compute (opaque to kvatlas, but realistic)."""
        if self.name == "vllm":
            # vLLM: sha256_cbor((parent, tokens, extra_keys)), the last 8 bytes as u64.
            digest = self.hashing.sha256_cbor((parent, tuple(tokens), None))
            return int.from_bytes(digest[-8:], "big")
        # SGLang: SHA-256 over the page chain, the first 8 bytes as a signed i64.
        import hashlib

        h = hashlib.sha256()
        if parent is not None:
            h.update(parent.to_bytes(8, "big", signed=True))
        for t in tokens:
            h.update(t.to_bytes(4, "little"))
        return int.from_bytes(h.digest()[:8], "big", signed=True)

    def stored(self, hashes, parent, tokens, medium):
        fields = dict(
            block_hashes=hashes,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=BLOCK_SIZE,
            lora_id=None,
            medium=medium,
            lora_name=None,
        )
        cls = self.kv.BlockStored
        return cls(**{k: v for k, v in fields.items() if k in cls.__struct_fields__})

    def removed(self, hashes, medium):
        return self.kv.BlockRemoved(block_hashes=hashes, medium=medium)

    def cleared(self):
        return self.kv.AllBlocksCleared()

    def batch(self, events):
        return self.kv.KVEventBatch(ts=time.time(), events=events)


class Driver:
    """The scenario state: the publisher, its sequence numbers and the cache model."""

    def __init__(self, engine):
        self.engine = engine
        self.publisher = None
        self.incarnation = 0
        self.next_seq = 0
        self.held = {}  # engine hash (u64) -> set of tiers
        self.chains = {}  # named chain -> list of (hash, tokens)
        self.live = {}  # the random workload's held blocks (engine hash, as published)
        self.stored_blocks = []
        self.encoder = None

    def tokens(self, start):
        return list(range(start, start + BLOCK_SIZE))

    def chain(self, name, parent, starts):
        """Blocks of `BLOCK_SIZE` tokens starting at each of `starts`, chained under `parent`."""
        blocks = []
        for start in starts:
            tokens = self.tokens(start)
            h = self.engine.block_hash(parent, tokens)
            blocks.append((h, tokens))
            parent = h
        self.chains[name] = blocks
        return blocks

    def hold(self, blocks, tier):
        for h, _ in blocks:
            self.held.setdefault(h & MASK64, set()).add(tier)

    def step(self, name):
        """The events of scenario step `name`, applied to the model."""
        e = self.engine
        inc = 1000 * self.incarnation
        if name == "store_root":
            blocks = self.chain("a", None, [inc + 100, inc + 116])
            self.hold(blocks, "Device")
            return [e.stored([h for h, _ in blocks], None, sum((t for _, t in blocks), []), "GPU")]
        if name == "store_chain":
            parent = self.chains["a"][-1][0]
            blocks = self.chain("b", parent, [inc + 132])
            self.hold(blocks, "Device")
            return [e.stored([blocks[0][0]], parent, blocks[0][1], "GPU")]
        if name == "remove_store":
            # Evict the chained block from the GPU and offload another one to the CPU tier.
            victim = self.chains["b"][0][0]
            self.held.pop(victim & MASK64, None)
            parent = self.chains["a"][-1][0]
            blocks = self.chain("c", parent, [inc + 500])
            self.hold(blocks, "Host")
            return [
                e.removed([victim], "GPU"),
                e.stored([blocks[0][0]], parent, blocks[0][1], e.cpu_medium),
            ]
        if name == "clear":
            self.held.clear()
            return [e.cleared()]
        if name == "store_after_clear":
            blocks = self.chain("d", None, [inc + 700, inc + 716, inc + 732])
            self.hold(blocks, "Device")
            return [e.stored([h for h, _ in blocks], None, sum((t for _, t in blocks), []), "GPU")]
        if name == "remove_parent":
            victim = self.chains["a"][-1][0]
            self.held.pop(victim & MASK64, None)
            return [e.removed([victim], "GPU")]
        if name == "restore_parent":
            (root, _), (h, tokens) = self.chains["a"][0], self.chains["a"][-1]
            self.hold([(h, tokens)], "Device")
            return [e.stored([h], root, tokens, "GPU")]
        if name == "empty":
            return []
        raise ValueError(f"unknown step {name!r}")

    def random_events(self, rng, leaf_only):
        """1-3 random events over the random workload's own blocks (`self.live`: hash ->
        parent hash)."""
        e = self.engine
        events = []
        for _ in range(rng.randint(1, 3)):
            roll = rng.random()
            if roll < 0.01 and not leaf_only:
                self.live.clear()
                self.held.clear()
                events.append(e.cleared())
            elif roll < 0.35 and self.live:
                candidates = sorted(self.live)
                if leaf_only:
                    parents = set(self.live.values())
                    candidates = [h for h in candidates if h not in parents]
                victims = rng.sample(candidates, min(len(candidates), rng.randint(1, 3)))
                for victim in victims:
                    self.live.pop(victim, None)
                    self.held.pop(victim & MASK64, None)
                events.append(e.removed(victims, "GPU"))
            else:
                parent = rng.choice(sorted(self.live)) if self.live and rng.random() < 0.7 else None
                hashes, tokens = [], []
                stored = self.stored_blocks
                for _ in range(rng.randint(1, 4)):
                    # A small alphabet of blocks: workers (and requests) share prefixes, and
                    # equal (parent, tokens) get equal hashes on every worker of an engine.
                    block_tokens = self.tokens(100_000 + 100 * rng.randint(0, 3))
                    h = e.block_hash(hashes[-1] if hashes else parent, block_tokens)
                    hashes.append(h)
                    tokens.extend(block_tokens)
                    self.live[h] = hashes[-2] if len(hashes) > 1 else parent
                    block_parent = self.live[h]
                    stored.append(
                        [h & MASK64, None if block_parent is None else block_parent & MASK64, block_tokens]
                    )
                    self.held.setdefault(h & MASK64, set()).add("Device")
                events.append(e.stored(hashes, parent, tokens, "GPU"))
        return events

    def burst(self, count, seed, leaf_only=False):
        import random

        import msgspec

        if self.publisher is None:
            raise RuntimeError("burst before start")
        rng = random.Random(seed)
        encoder = msgspec.msgpack.Encoder()
        batches = []
        for _ in range(count):
            self.stored_blocks = []
            batch = self.engine.batch(self.random_events(rng, leaf_only))
            self.publisher.publish(batch)
            batches.append(
                {
                    "seq": self.next_seq,
                    "payload": encoder.encode(batch).hex(),
                    "stored": self.stored_blocks,
                }
            )
            self.next_seq += 1
        return {"ok": "burst", "batches": batches}

    def start(self):
        deadline = time.time() + 10
        while True:
            try:
                self.publisher = self.engine.create()
                break
            except Exception as error:  # zmq.ZMQError: the old socket's port is still closing
                if "Address already in use" not in str(error) or time.time() > deadline:
                    raise
                time.sleep(0.05)
        self.incarnation += 1
        self.next_seq = 0
        # A new engine process starts with an empty cache.
        self.held.clear()
        self.live.clear()
        return {"ok": "start", "incarnation": self.incarnation}

    def publish(self, name):
        import msgspec

        if self.publisher is None:
            raise RuntimeError("publish before start")
        events = self.step(name)
        batch = self.engine.batch(events)
        self.publisher.publish(batch)  # fills the data-parallel rank, as the engine's does
        payload = msgspec.msgpack.Encoder().encode(batch)
        seq = self.next_seq
        self.next_seq += 1
        return {
            "seq": seq,
            "incarnation": self.incarnation,
            "step": name,
            "payload": payload.hex(),
            "events": msgspec.to_builtins(events),
            "held": sorted([h, sorted(tiers)] for h, tiers in self.held.items()),
        }

    def stop(self):
        if self.publisher is not None:
            self.publisher.shutdown()
            self.publisher = None
        return {"ok": "stop"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["vllm", "sglang"], required=True)
    parser.add_argument("--src", required=True, help="directory of the extracted wheel files")
    parser.add_argument("--endpoint", required=True)
    parser.add_argument("--replay-endpoint", required=True)
    parser.add_argument("--topic", default="kv-events")
    args = parser.parse_args()

    # Replies own stdout; everything else (vLLM's logger writes to sys.stdout) goes to stderr.
    replies = sys.stdout
    sys.stdout = sys.stderr

    def reply(obj):
        replies.write(json.dumps(obj) + "\n")
        replies.flush()

    try:
        driver = Driver(Engine(args))
    except Exception as error:
        reply({"error": f"loading the {args.engine} publisher from {args.src}: {error!r}"})
        return 1
    reply({"ok": "ready", "engine": args.engine, "src": args.src})
    for line in sys.stdin:
        command = line.split()
        if not command:
            continue
        try:
            if command[0] == "start":
                reply(driver.start())
            elif command[0] == "publish" and len(command) == 2:
                reply(driver.publish(command[1]))
            elif command[0] == "burst" and len(command) in (3, 4):
                leaf = len(command) == 4 and command[3] == "leaf"
                reply(driver.burst(int(command[1]), int(command[2]), leaf))
            elif command[0] == "stop":
                reply(driver.stop())
            elif command[0] == "quit":
                break
            else:
                reply({"error": f"unknown command {line.strip()!r}"})
        except Exception as error:
            reply({"error": f"{line.strip()}: {error!r}"})
    driver.stop()
    reply({"ok": "quit"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
