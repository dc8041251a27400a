//! Scale-out over NATS JetStream with real parts: Debian's `nats-server` (file storage) on a
//! loopback port, `kvatlas serve --publish-to` ingests fed by mock vLLM engines over ZMQ, and
//! `kvatlas serve --consume-from` replicas — each a process, killed with SIGKILL where the
//! issue says "kill". Every replica must end exactly equal to the engines' caches (the oracle),
//! and replicas must agree query for query.

mod common;

use std::time::{Duration, Instant};

use common::fleet::{
    CONVERGE, Fleet, converges, eventually, metric, metric_sum, ready, runtime, signal,
};
use common::{Served, refused_start};
use kvatlas_fleet::nats::NatsServer;
use kvatlas_fleet::vllm::BLOCK_TOKENS;
use kvatlas_proto::v1::{self, indexer_client::IndexerClient};

const MODEL: &str = "m";

/// A query of model `m`'s default tenant by local hashes.
fn query_of(hashes: Vec<u64>) -> v1::QueryRequest {
    v1::QueryRequest {
        index: Some(v1::IndexSelector {
            model: MODEL.into(),
            tenant: String::new(),
        }),
        input: Some(v1::query_request::Input::LocalHashes(v1::LocalHashes {
            hashes,
        })),
        ..v1::QueryRequest::default()
    }
}

/// The answers of both servers to the same prompts, which must be equal.
fn agree(a: &Served, b: &Served, fleet: &mut Fleet) {
    let prompts: Vec<Vec<u64>> = fleet
        .trace
        .iter()
        .take(40)
        .map(|request| {
            fleet
                .engines
                .prompt(request)
                .locals
                .iter()
                .map(|l| l.get())
                .collect()
        })
        .collect();
    let answers = |grpc: &str| {
        runtime().block_on(async {
            let mut client = IndexerClient::connect(grpc.to_owned())
                .await
                .expect("connects");
            let mut all = Vec::new();
            for hashes in &prompts {
                let answer = client
                    .query(query_of(hashes.clone()))
                    .await
                    .expect("answered")
                    .into_inner();
                let mut scores: Vec<(u64, u32, u32)> = answer
                    .matches
                    .iter()
                    .map(|m| (m.instance_id, m.dp_rank, m.device_blocks))
                    .collect();
                scores.sort_unstable();
                all.push(scores);
            }
            all
        })
    };
    let (left, right) = (answers(&a.grpc), answers(&b.grpc));
    assert!(
        left.iter().any(|s| !s.is_empty()),
        "the prompts match something"
    );
    assert_eq!(left, right, "the replicas answer alike");
}

fn ingest(nats: &NatsServer, fleet: &Fleet) -> Served {
    ingest_with(nats, fleet, &[])
}

/// An ingest of the fleet's engines with `extra` flags.
fn ingest_with(nats: &NatsServer, fleet: &Fleet, extra: &[&str]) -> Served {
    let (url, block_size, workers) = (nats.url(), BLOCK_TOKENS.to_string(), fleet.workers_arg());
    let mut args = vec![
        "--publish-to",
        &url,
        "--model",
        MODEL,
        "--block-size",
        &block_size,
        "--workers",
        &workers,
    ];
    args.extend_from_slice(extra);
    Served::start(&args)
}

fn replica(nats: &NatsServer) -> Served {
    Served::start(&[
        "--consume-from",
        &nats.url(),
        "--nats-snapshot-interval-secs",
        "1",
    ])
}

#[test]
fn replicas_converge_through_a_replica_kill_a_nats_restart_and_a_late_start() {
    let mut nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    let ingest = ingest(&nats, &fleet);
    fleet.wait_subscribed(1);
    let first = replica(&nats);

    fleet.serve(300);
    converges(&first, &fleet, "replica 1");
    converges(&ingest, &fleet, "the ingest");
    // Let replica 1 write a snapshot, then kill it mid-stream.
    std::thread::sleep(Duration::from_millis(1500));
    fleet.serve(150);
    first.kill_9();
    fleet.serve(150);
    let first = replica(&nats);
    converges(&first, &fleet, "replica 1 after SIGKILL and restart");
    assert!(
        metric(&first, "kvatlas_log_consumed_total") < fleet.batches,
        "the restarted replica started from a snapshot, not the stream's beginning"
    );

    // nats-server restarts (file storage): nothing acknowledged is lost, both sides resume.
    nats.restart().expect("nats-server restarts");
    fleet.serve(300);
    converges(&first, &fleet, "replica 1 after the nats-server restart");
    for (server, name) in [(&ingest, "the ingest"), (&first, "replica 1")] {
        assert!(
            metric(server, "kvatlas_log_nats_disconnects_total") >= 1,
            "{name} counted the connection the restart took"
        );
    }
    assert_eq!(
        metric(&first, "kvatlas_log_stream_recreations_total"),
        0,
        "a restarted nats-server keeps the stream (and its creation time)"
    );

    // A replica started while the ingest is busy.
    let feeder = std::thread::spawn(move || {
        fleet.serve(400);
        fleet
    });
    std::thread::sleep(Duration::from_millis(100));
    let second = replica(&nats);
    let mut fleet = feeder.join().expect("the engines served");
    converges(&second, &fleet, "replica 2, started during the load");
    converges(&first, &fleet, "replica 1");
    agree(&first, &second, &mut fleet);
    for server in [&first, &second] {
        assert_eq!(metric(server, "kvatlas_log_dropped_invalid_total"), 0);
        assert_eq!(metric(server, "kvatlas_log_sequences_lost_total"), 0);
        // Every record the live path applied, the stream then delivered unchanged.
        assert_eq!(metric(server, "kvatlas_log_live_divergences_total"), 0);
        eventually("the stream confirmed every live record", || {
            metric(server, "kvatlas_log_live_confirmed_total")
                == metric(server, "kvatlas_log_live_applied_total")
        });
    }
    assert!(
        metric(&first, "kvatlas_log_live_applied_total")
            + metric(&second, "kvatlas_log_live_applied_total")
            > 0,
        "the replicas applied records off the live path"
    );
    assert_eq!(metric(&ingest, "kvatlas_log_queued_total"), fleet.batches);
    first.kill_9();
    second.kill_9();
    ingest.kill_9();
}

#[test]
fn a_publish_only_ingest_applies_nothing_and_refuses_queries() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    fleet.stamped = true;
    let ingest = ingest_with(&nats, &fleet, &["--publish-only"]);
    fleet.wait_subscribed(1);
    let replica = replica(&nats);
    fleet.serve(300);
    converges(&replica, &fleet, "the replica of a publish-only ingest");
    assert_eq!(metric(&ingest, "kvatlas_log_queued_total"), fleet.batches);
    // Every batch carried its engine's stamp through the log: the replica splits its age
    // at the stream's store (the ingest observes none).
    let stored_ages = "kvatlas_log_stored_age_seconds_count";
    assert_eq!(metric(&replica, stored_ages), fleet.batches);
    assert_eq!(metric(&ingest, stored_ages), 0);
    let memberships = |server| metric_sum(server, "kvatlas_index_memberships", "model=\"m\"");
    assert!(memberships(&replica) > 0);
    assert_eq!(memberships(&ingest), 0, "the ingest applied nothing");
    // The ingest holds nothing and says so, to queries and to snapshot requests alike.
    let refused = runtime().block_on(async {
        let mut client = IndexerClient::connect(ingest.grpc.clone())
            .await
            .expect("connects");
        client
            .query(query_of(vec![1, 2, 3]))
            .await
            .expect_err("refused")
    });
    // gRPC status 9: FAILED_PRECONDITION.
    assert_eq!(i32::from(refused.code()), 9, "{refused:?}");
    assert!(refused.message().contains("publish-only"), "{refused:?}");
    let snapshot = common::fleet::state_memberships(&ingest.grpc).expect_err("no snapshot");
    assert!(snapshot.contains("publish-only"), "{snapshot}");
    replica.kill_9();
    ingest.kill_9();
}

#[test]
fn two_ingests_deduplicate_and_the_survivor_carries_on() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    let one = ingest(&nats, &fleet);
    let two = ingest(&nats, &fleet);
    fleet.wait_subscribed(2);
    let replica = replica(&nats);
    fleet.serve(300);
    converges(&replica, &fleet, "the replica fed by two ingests");
    // Both ingests publish every batch: each second copy is dropped, by the stream (the same
    // message id) or by the replica (a batch it applied). Ingests group a source's backlog
    // differently, so which of the two drops a copy varies.
    let started = Instant::now();
    let dropped = loop {
        let dropped = metric(&one, "kvatlas_log_publish_duplicates_total")
            + metric(&two, "kvatlas_log_publish_duplicates_total")
            + metric(&replica, "kvatlas_log_dropped_duplicate_total")
            + metric(&replica, "kvatlas_log_dropped_stale_total");
        if dropped >= fleet.batches || started.elapsed() > CONVERGE {
            break dropped;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(dropped, fleet.batches, "each second copy was dropped once");
    assert!(
        metric(&one, "kvatlas_log_publish_duplicates_total")
            + metric(&two, "kvatlas_log_publish_duplicates_total")
            > 0,
        "the stream deduplicated by message id"
    );
    one.kill_9();
    fleet.serve(300);
    converges(&replica, &fleet, "the replica after one ingest died");
    // Every batch applied once: the copies were dropped by the stream or the replica.
    let applied = metric(&replica, "kvatlas_log_applied_total");
    assert_eq!(
        applied, fleet.batches,
        "each engine batch applied exactly once"
    );
    // Both ingests publish live too; a copy of a batch the replica holds does not continue
    // its chain, and the stream's copies agree with what the live path applied.
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 0);
    replica.kill_9();
    two.kill_9();
}

/// A ZMQ worker unregistered at an ingest and registered again within the stream's duplicate
/// window replays its engine's ring from 0. Those batches carry the sequence numbers and
/// payloads they had the first time: with the same message ids, the stream took them for
/// duplicates, and the replica missed the worker's blocks (the ingest held them). The new
/// incarnation's ids are salted, and the replica converges with the engines.
#[test]
fn a_zmq_worker_registered_again_reaches_the_replicas() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    let ingest = ingest(&nats, &fleet);
    fleet.wait_subscribed(1);
    let replica = replica(&nats);
    fleet.serve(200);
    converges(&replica, &fleet, "the replica before the unregistration");
    let engine = fleet.publishers.endpoints()[0].clone();
    let instance = u64::from(engine.worker);
    unregister_at(&ingest, instance, "", false);
    runtime().block_on(async {
        let mut client = IndexerClient::connect(ingest.grpc.clone())
            .await
            .expect("connects");
        client
            .register_worker(v1::RegisterWorkerRequest {
                index: Some(v1::IndexSelector {
                    model: MODEL.into(),
                    tenant: String::new(),
                }),
                instance_id: instance,
                block_size: BLOCK_TOKENS,
                engine: v1::EngineKind::Vllm as i32,
                endpoint: engine.live.clone(),
                replay_endpoint: engine.replay.clone(),
                ..v1::RegisterWorkerRequest::default()
            })
            .await
            .expect("registered again");
    });
    // The engine's next batch the new listener receives shows it joined late: it replays
    // from 0 (batches sent before its subscription took effect are not seen).
    eventually("the ingest holds the worker again", || {
        fleet.serve(10);
        std::thread::sleep(Duration::from_millis(50));
        common::fleet::state_digest(&ingest.grpc) == Ok(fleet.oracle())
    });
    converges(&replica, &fleet, "the replica, the worker registered again");
    replica.kill_9();
    ingest.kill_9();
}

#[test]
fn a_replica_behind_the_retention_window_rebootstraps_from_a_snapshot() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    // A stream that keeps only 100 kB of records.
    let ingest = ingest_with(&nats, &fleet, &["--nats-max-bytes", "100000"]);
    fleet.wait_subscribed(1);
    let keeper = replica(&nats);
    let sleeper = replica(&nats);
    for server in [&keeper, &sleeper] {
        ready(server);
    }
    fleet.serve(20);
    converges(&sleeper, &fleet, "the replica before it is stopped");
    // The sleeper stops reading; the stream moves past what it read. (Its position is read
    // first: one it applies after the read only makes the stream go further below.)
    let stopped_at = metric(&sleeper, "kvatlas_log_stream_sequence");
    signal(&sleeper, "STOP");
    // In steps the running replica keeps up with, until the stream is further ahead than what
    // the sleeper can still read without a gap: what its open pull requests asked for (an
    // ordered consumer asks for 500 messages, and for 500 more when half are left: at most 750
    // outstanding), which the server sends into its socket while it is stopped, plus what the
    // stream keeps (100 kB: here at most about 130 messages, each of several records of about
    // 770 B). Under load the ingest puts more records in one message, so more steps are needed.
    let mut steps = 0;
    while steps < 30 || metric(&keeper, "kvatlas_log_stream_sequence") < stopped_at + 1_200 {
        assert!(
            steps < 600,
            "the stream did not move 1,200 messages in {steps} steps"
        );
        fleet.serve(100);
        std::thread::sleep(Duration::from_millis(30));
        steps += 1;
    }
    converges(&keeper, &fleet, "the replica that kept up");
    // Let the keeper write a snapshot of the newest state.
    std::thread::sleep(Duration::from_millis(2_500));
    signal(&sleeper, "CONT");
    converges(
        &sleeper,
        &fleet,
        "the replica after it fell behind the retention window",
    );
    assert!(
        metric(&sleeper, "kvatlas_log_rebootstraps_total") >= 1,
        "the replica noticed the stream skipped what it had not read"
    );
    assert_eq!(metric(&sleeper, "kvatlas_log_sequences_lost_total"), 0);
    agree(&keeper, &sleeper, &mut fleet);
    keeper.kill_9();
    sleeper.kill_9();
    ingest.kill_9();
}

#[test]
fn records_lost_to_retention_with_no_snapshot_are_counted_and_the_replica_serves() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    let ingest = ingest_with(&nats, &fleet, &["--nats-max-bytes", "20000"]);
    fleet.wait_subscribed(1);
    // Published before any replica (so before any snapshot), far more than the stream keeps.
    fleet.serve(600);
    converges(&ingest, &fleet, "the ingest");
    eventually("the ingest published everything", || {
        metric(&ingest, "kvatlas_log_published_total") >= fleet.batches
    });
    let late = replica(&nats);
    ready(&late);
    let lost = metric(&late, "kvatlas_log_sequences_lost_total");
    assert!(
        lost > 0,
        "the stream's first records were gone and no snapshot covered them"
    );
    assert_eq!(metric(&late, "kvatlas_log_rebootstraps_total"), 1);
    assert_eq!(metric(&late, "kvatlas_log_dropped_invalid_total"), 0);
    late.kill_9();
    ingest.kill_9();
}

/// A hand-made event-log record of worker 7 of model `m`: a batch with sequence number `seq`
/// and fingerprint `fingerprint` storing one block (`external`, `local`) after `parent`.
fn record(seq: u64, fingerprint: u64, parent: Option<u64>, external: u64, local: u64) -> Vec<u8> {
    record_of(7, seq, fingerprint, parent, external, local)
}

/// [`record`] of worker `worker`.
fn record_of(
    worker: u64,
    seq: u64,
    fingerprint: u64,
    parent: Option<u64>,
    external: u64,
    local: u64,
) -> Vec<u8> {
    use prost::Message as _;
    use v1::log_mutation::Event;
    v1::LogRecord {
        index: Some(v1::IndexSelector {
            model: MODEL.into(),
            tenant: "default".into(),
        }),
        block_size: BLOCK_TOKENS,
        instance_id: worker,
        dp_rank: 0,
        body: Some(v1::log_record::Body::Batch(v1::LogBatch {
            seq: Some(seq),
            fingerprint,
            resync: false,
            mutations: vec![v1::LogMutation {
                dp_rank: 0,
                event: Some(Event::Stored(v1::LogStored {
                    parent_hash: parent,
                    block_hashes: vec![external],
                    local_hashes: vec![local],
                    tier: v1::StorageTier::Device.into(),
                })),
            }],
            published_unix_micros: None,
        })),
    }
    .encode_to_vec()
}

/// Worker 7's device blocks matching `prompt` at `server`, on its rank matching most (0: not
/// listed).
fn blocks_of_worker_7(server: &Served, prompt: &[u64]) -> u32 {
    blocks_of(server, 7, prompt)
}

/// Worker `instance`'s device blocks matching `prompt` at `server`, on its rank matching most
/// (0: not listed).
fn blocks_of(server: &Served, instance: u64, prompt: &[u64]) -> u32 {
    runtime().block_on(async {
        let mut client = IndexerClient::connect(server.grpc.clone())
            .await
            .expect("connects");
        let answer = client
            .query(query_of(prompt.to_vec()))
            .await
            .map(|response| response.into_inner());
        answer.map_or(0, |answer| {
            answer
                .matches
                .iter()
                .filter(|m| m.instance_id == instance)
                .map(|m| m.device_blocks)
                .max()
                .unwrap_or(0)
        })
    })
}

/// Hand-made records of worker 7, put into the stream or published live as an ingest does.
struct HandFeed {
    /// Drives the test's NATS connection (its task runs inside `block_on`).
    runtime: tokio::runtime::Runtime,
    client: async_nats::Client,
    js: async_nats::jetstream::Context,
}

impl HandFeed {
    fn connect(nats: &NatsServer) -> Self {
        let runtime = runtime();
        let client = runtime
            .block_on(async_nats::connect(nats.url()))
            .expect("connects to NATS");
        let js = {
            let _inside = runtime.enter();
            async_nats::jetstream::new(client.clone())
        };
        Self {
            runtime,
            client,
            js,
        }
    }

    /// Stores `record` (of worker 7) in the stream, framed as an ingest frames it.
    fn to_stream(&self, record: &[u8]) {
        self.to_stream_of(7, record);
    }

    /// Stores `record` of worker `worker` in the stream, framed as an ingest frames it.
    fn to_stream_of(&self, worker: u64, record: &[u8]) {
        self.try_to_stream_of(worker, record)
            .expect("published and stored");
    }

    /// [`Self::to_stream_of`], retried (as an ingest does) until the stream stores it, for at
    /// most 30 s: for a record sent while the connection comes back.
    fn to_stream_retrying(&self, worker: u64, record: &[u8]) {
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(error) = self.try_to_stream_of(worker, record) {
            assert!(Instant::now() < deadline, "never stored: {error}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn try_to_stream_of(&self, worker: u64, record: &[u8]) -> Result<(), String> {
        let mut framed = Vec::new();
        prost::encoding::encode_varint(record.len() as u64, &mut framed);
        framed.extend_from_slice(record);
        self.runtime.block_on(async {
            self.js
                .publish(
                    format!("kvatlas.events.{MODEL}.default.{worker}"),
                    framed.into(),
                )
                .await
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())?;
            Ok(())
        })
    }

    /// Publishes `record` on the live path, naming `prev` as its predecessor.
    fn live(&self, record: &[u8], prev: &[u8]) {
        let mut headers = async_nats::HeaderMap::new();
        let prev = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(prev));
        headers.insert("Kvatlas-Prev", prev.as_str());
        self.runtime.block_on(async {
            self.client
                .publish_with_headers(
                    format!("kvatlas.events-live.{MODEL}.default.7"),
                    headers,
                    record.to_vec().into(),
                )
                .await
                .expect("published live");
            self.client.flush().await.expect("flushed");
        });
    }
}

impl HandFeed {
    /// Makes the event-log stream by hand, with `config` (before a server makes it).
    fn stream_made_by_hand(&self, config: async_nats::jetstream::stream::Config) {
        self.runtime.block_on(async {
            self.js
                .create_stream(config)
                .await
                .expect("the stream is made by hand");
        });
    }

    /// The replicas' snapshot bucket.
    async fn bucket(&self) -> async_nats::jetstream::object_store::ObjectStore {
        self.js
            .get_object_store("KVATLAS_SNAPSHOTS")
            .await
            .expect("the bucket exists")
    }

    /// Every object of the replicas' snapshot bucket: name, description and bytes.
    fn snapshot_objects(&self) -> Vec<(String, Option<String>, Vec<u8>)> {
        use tokio::io::AsyncReadExt as _;
        use tokio_stream::StreamExt as _;
        self.runtime.block_on(async {
            let bucket = self.bucket().await;
            let mut infos = Vec::new();
            let mut list = bucket.list().await.expect("lists");
            while let Some(info) = list.next().await {
                infos.push(info.expect("an object's info"));
            }
            let mut objects = Vec::new();
            for info in infos {
                let mut bytes = Vec::new();
                let mut object = bucket.get(&info.name).await.expect("gets");
                object.read_to_end(&mut bytes).await.expect("reads");
                objects.push((info.name, info.description, bytes));
            }
            objects
        })
    }

    /// Messages in the stream that holds the snapshot bucket's objects.
    fn bucket_messages(&self) -> u64 {
        self.runtime.block_on(async {
            let mut stream = self
                .js
                .get_stream("OBJ_KVATLAS_SNAPSHOTS")
                .await
                .expect("the bucket's stream");
            stream.info().await.expect("its info").state.messages
        })
    }

    /// Deletes the event-log stream, as an operator (or a lost volume) would.
    fn delete_stream(&self) {
        self.runtime.block_on(async {
            self.js
                .delete_stream("KVATLAS_EVENTS")
                .await
                .expect("the stream is deleted");
        });
    }

    /// Puts an object into the snapshot bucket, as a replica does.
    fn put_snapshot_object(&self, name: &str, description: Option<String>, bytes: &[u8]) {
        self.runtime.block_on(async {
            let bucket = self.bucket().await;
            let meta = async_nats::jetstream::object_store::ObjectMetadata {
                name: name.to_owned(),
                description,
                ..Default::default()
            };
            bucket.put(meta, &mut &bytes[..]).await.expect("put");
        });
    }
}

/// A replica's put that finishes after a newer snapshot's (the replica was paused, or cut off
/// from NATS, mid-put) does not hide the newer one: a replica bootstrapping after retention
/// dropped the stream's first records restores the newest state and loses nothing.
#[test]
fn a_late_put_of_an_older_snapshot_does_not_hide_the_newest() {
    const RECORDS: u64 = 60;
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let url = nats.url();
    // The first replica creates a stream that keeps about 2 kB of records, and writes a
    // snapshot each second.
    let writer = Served::start(&[
        "--consume-from",
        &url,
        "--nats-snapshot-interval-secs",
        "1",
        "--nats-max-bytes",
        "2000",
    ]);
    ready(&writer);
    let feed = HandFeed::connect(&nats);
    let chain = |seq: u64| record(seq, 100 + seq, (seq > 1).then(|| seq - 1), seq, 1000 + seq);
    feed.to_stream(&chain(1));
    eventually("a snapshot covering the first record", || {
        metric(&writer, "kvatlas_log_snapshots_written_total") >= 1
    });
    let older = feed.snapshot_objects();
    assert_eq!(older.len(), 1, "one snapshot so far");
    // Three more snapshots, the last covering every record.
    for (from, to) in [(2, 40), (41, 50), (51, RECORDS)] {
        for seq in from..=to {
            feed.to_stream(&chain(seq));
        }
        let prompt: Vec<u64> = (1..=to).map(|seq| 1000 + seq).collect();
        eventually("the records applied", || {
            blocks_of_worker_7(&writer, &prompt) == to as u32
        });
        let written = metric(&writer, "kvatlas_log_snapshots_written_total");
        eventually("a snapshot covering them", || {
            metric(&writer, "kvatlas_log_snapshots_written_total") > written
        });
    }
    writer.kill_9();
    assert_eq!(
        feed.snapshot_objects().len(),
        2,
        "a put deletes all but the two newest snapshots"
    );
    assert_eq!(
        feed.bucket_messages(),
        4,
        "the two objects' metadata and chunk each: no marker of a pruned one is left"
    );
    let prompt: Vec<u64> = (1..=RECORDS).map(|seq| 1000 + seq).collect();
    // The first snapshot is put again, as a replica paused mid-put would finish it.
    let (name, description, bytes) = &older[0];
    feed.put_snapshot_object(name, description.clone(), bytes);

    let late = Served::start(&["--consume-from", &url, "--nats-snapshot-interval-secs", "0"]);
    ready(&late);
    assert_eq!(blocks_of_worker_7(&late, &prompt), RECORDS as u32);
    assert_eq!(metric(&late, "kvatlas_log_sequences_lost_total"), 0);
    late.kill_9();
}

/// The stream deleted (and created again), then nats-server's whole storage lost: the replicas
/// find the new stream, read it from its start and keep their state, so they still equal the
/// engines' caches; a replica started after the deletion restores a snapshot of the new stream,
/// not the old stream's (which covers sequences the new one has not reached).
#[test]
fn a_stream_created_again_is_read_from_its_start() {
    let mut nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let mut fleet = Fleet::new();
    let ingest = ingest(&nats, &fleet);
    fleet.wait_subscribed(1);
    let first = replica(&nats);
    fleet.serve(300);
    converges(&first, &fleet, "replica 1");
    let old_sequence = metric(&first, "kvatlas_log_stream_sequence");
    // A snapshot of the old stream's last record: more sequences than the new one will hold.
    let feed = HandFeed::connect(&nats);
    let old_name = format!("snapshot-KVATLAS_EVENTS-{old_sequence:020}");
    let mut old_stream = None;
    eventually("a snapshot of the old stream", || {
        old_stream = feed
            .snapshot_objects()
            .into_iter()
            .find(|(name, ..)| *name == old_name)
            .and_then(|(_, description, _)| description);
        old_stream.is_some()
    });
    let old_stream = old_stream
        .and_then(|d| {
            d.split(' ')
                .find(|f| f.starts_with("stream_created="))
                .map(str::to_owned)
        })
        .expect("a snapshot names the stream it was cut from");

    feed.delete_stream();
    fleet.serve(60);
    // (The live path may apply the new records before the replica notices the new stream.)
    eventually("replica 1 found the stream created again", || {
        metric(&first, "kvatlas_log_stream_recreations_total") == 1
    });
    converges(&first, &fleet, "replica 1 after the stream was deleted");
    assert!(
        metric(&first, "kvatlas_log_stream_sequence") < old_sequence,
        "the replica reads the new stream, which is shorter than the old"
    );
    eventually("a snapshot of the new stream", || {
        feed.snapshot_objects().iter().any(|(_, description, _)| {
            description
                .as_deref()
                .is_some_and(|d| d.contains("stream_created=") && !d.contains(&old_stream))
        })
    });
    let second = replica(&nats);
    converges(&second, &fleet, "replica 2, started on the new stream");
    assert_eq!(metric(&second, "kvatlas_log_stream_recreations_total"), 0);
    let mut log = second.startup_log.clone();
    log.extend(second.log_lines());
    assert!(
        log.iter()
            .any(|l| l.contains("restored a replica snapshot"))
            && !log.iter().any(|l| l.contains("cut from the stream before")),
        "replica 2 restored the new stream's snapshot, not the old stream's: {log:#?}"
    );

    nats.restart_losing_storage()
        .expect("nats-server starts again with an empty store");
    fleet.serve(60);
    eventually("both replicas found the stream created again", || {
        metric(&first, "kvatlas_log_stream_recreations_total") == 2
            && metric(&second, "kvatlas_log_stream_recreations_total") == 1
    });
    converges(
        &first,
        &fleet,
        "replica 1 after nats-server lost its storage",
    );
    converges(
        &second,
        &fleet,
        "replica 2 after nats-server lost its storage",
    );
    agree(&first, &second, &mut fleet);
    for server in [&first, &second] {
        assert_eq!(metric(server, "kvatlas_log_dropped_invalid_total"), 0);
        assert_eq!(metric(server, "kvatlas_log_sequences_lost_total"), 0);
    }
    first.kill_9();
    second.kill_9();
    ingest.kill_9();
}

/// A replica of `nats` without snapshots (and with `extra` flags), fed by hand: the stream's
/// first record of worker 7 (block 1, local 1001) is applied. Returns the replica, the feed
/// and that record.
fn hand_fed_replica(nats: &NatsServer, extra: &[&str]) -> (Served, HandFeed, Vec<u8>) {
    let url = nats.url();
    let mut args = vec!["--consume-from", &url, "--nats-snapshot-interval-secs", "0"];
    args.extend_from_slice(extra);
    let replica = Served::start(&args);
    // The replica created the stream and subscribed to the live path.
    ready(&replica);
    let feed = HandFeed::connect(nats);
    let first = record(1, 101, None, 1, 1001);
    feed.to_stream(&first);
    eventually("the stream's first record applied", || {
        blocks_of_worker_7(&replica, &[1001, 1002]) == 1
    });
    (replica, feed, first)
}

/// A live record whose stream copy comes after a NATS outage longer than the confirmation wait
/// (its ingest retried meanwhile) is confirmed: the wait runs from the end of the outage.
/// (The record was taken for an orphan as soon as the replica could read the stream's end
/// again: every replica emptied its indexes and re-bootstrapped at once.)
#[test]
fn a_live_record_stored_after_an_outage_longer_than_the_wait_is_confirmed() {
    const WAIT_SECS: u64 = 10;
    let mut nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let wait = WAIT_SECS.to_string();
    let (replica, feed, first) = hand_fed_replica(&nats, &["--nats-live-confirm-secs", &wait]);
    let second = record(2, 102, Some(1), 2, 1002);
    feed.live(&second, &first);
    eventually("the live record applied", || {
        metric(&replica, "kvatlas_log_live_applied_total") == 1
    });
    nats.stop();
    std::thread::sleep(Duration::from_secs(WAIT_SECS + 1));
    nats.restart().expect("nats-server starts again");
    // Another worker's record read: the replica is back on the stream.
    let consumed = metric(&replica, "kvatlas_log_consumed_total");
    feed.to_stream_retrying(8, &record_of(8, 1, 1, None, 10_001, 20_001));
    eventually("the replica reads the stream again", || {
        metric(&replica, "kvatlas_log_consumed_total") > consumed
    });
    // Past the replica's next read of the stream's end (asked for at most every 5 s), and
    // short of the wait after the outage.
    std::thread::sleep(Duration::from_secs(6));
    assert_eq!(
        metric(&replica, "kvatlas_log_live_divergences_total"),
        0,
        "the outage was taken for an orphaned live record"
    );
    feed.to_stream(&second);
    eventually("the stream's copy confirms the live record", || {
        metric(&replica, "kvatlas_log_live_confirmed_total") == 1
    });
    assert_eq!(blocks_of_worker_7(&replica, &[1001, 1002]), 2);
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 0);
    replica.kill_9();
}

/// A live record whose ingest died before the stream stored it is undone once the
/// confirmation wait has passed: the replica goes back to the stream's state.
#[test]
fn an_orphaned_live_record_is_undone() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let (replica, feed, first) = hand_fed_replica(&nats, &["--nats-live-confirm-secs", "1"]);
    feed.live(&record(2, 102, Some(1), 2, 1002), &first);
    eventually("the live record applied", || {
        metric(&replica, "kvatlas_log_live_applied_total") == 1
    });
    eventually("the orphaned live record undone", || {
        metric(&replica, "kvatlas_log_live_divergences_total") == 1
            && blocks_of_worker_7(&replica, &[1001, 1002]) == 1
    });
    ready(&replica);
    replica.kill_9();
}

/// A live record never stored (its ingest died) at a replica whose stream no longer holds its
/// first records, with no snapshot: the replica removes the instance the record was of and
/// keeps every other worker's state, still serving; that instance's next record starts it
/// afresh. (It emptied every index and read the stream from its start: worker 8's first
/// block, which only the dropped records held, was lost with everything else.)
#[test]
fn an_orphaned_live_record_without_a_snapshot_removes_only_its_instance() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    // Snapshots off (hand_fed_replica); a stream that keeps about 20 kB of records.
    let (replica, feed, first) = hand_fed_replica(
        &nats,
        &["--nats-live-confirm-secs", "1", "--nats-max-bytes", "20000"],
    );
    // Worker 8's blocks, each message about 100 B: retention drops the first ones.
    for seq in 1..=500 {
        feed.to_stream_of(8, &record_of(8, seq, seq, None, 10_000 + seq, 20_000 + seq));
    }
    eventually("worker 8's records applied", || {
        blocks_of(&replica, 8, &[20_500]) == 1
    });
    assert_eq!(blocks_of(&replica, 8, &[20_001]), 1);
    feed.live(&record(2, 102, Some(1), 2, 1002), &first);
    eventually("the orphaned live record undone", || {
        metric(&replica, "kvatlas_log_live_divergences_total") == 1
            && blocks_of_worker_7(&replica, &[1001, 1002]) == 0
    });
    ready(&replica);
    for seq in [1, 250, 500] {
        assert_eq!(
            blocks_of(&replica, 8, &[20_000 + seq]),
            1,
            "worker 8's block {seq} kept"
        );
    }
    assert_eq!(metric(&replica, "kvatlas_log_rebootstraps_total"), 0);
    // Worker 7's next record starts it afresh.
    feed.to_stream(&record(3, 103, None, 3, 1003));
    eventually("worker 7's next record applied", || {
        blocks_of_worker_7(&replica, &[1003]) == 1
    });
    replica.kill_9();
}

/// The stream delivering another record than one applied live, at a replica whose stream no
/// longer holds its first records, with no snapshot: the replica removes that record's
/// instance, applies the stream's record to it afresh and goes on, keeping every other
/// worker's state; the live path carries on from the stream's record.
#[test]
fn a_divergence_without_a_snapshot_applies_the_streams_record_to_its_instance_afresh() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let (replica, feed, first) = hand_fed_replica(&nats, &["--nats-max-bytes", "20000"]);
    for seq in 1..=500 {
        feed.to_stream_of(8, &record_of(8, seq, seq, None, 10_000 + seq, 20_000 + seq));
    }
    eventually("worker 8's records applied", || {
        blocks_of(&replica, 8, &[20_500]) == 1
    });
    feed.live(&record(2, 102, None, 2, 1002), &first);
    eventually("the live record applied", || {
        blocks_of_worker_7(&replica, &[1002]) == 1
    });
    // Another ingest's batch at that position.
    let consumed = metric(&replica, "kvatlas_log_consumed_total");
    let other = record(2, 999, None, 4, 2002);
    feed.to_stream(&other);
    eventually("the stream's record applied afresh", || {
        blocks_of_worker_7(&replica, &[2002]) == 1 && blocks_of_worker_7(&replica, &[1002]) == 0
    });
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 1);
    // Applied twice (the divergence, then afresh), consumed once.
    assert_eq!(metric(&replica, "kvatlas_log_consumed_total"), consumed + 1);
    assert_eq!(blocks_of_worker_7(&replica, &[1001]), 0, "worker 7 removed");
    for seq in [1, 500] {
        assert_eq!(
            blocks_of(&replica, 8, &[20_000 + seq]),
            1,
            "worker 8's block {seq}"
        );
    }
    ready(&replica);
    // The live path goes on from the stream's record, and the stream confirms it.
    let third = record(3, 103, Some(4), 5, 2003);
    feed.live(&third, &other);
    eventually("the live record after the divergence applied", || {
        blocks_of_worker_7(&replica, &[2002, 2003]) == 2
    });
    feed.to_stream(&third);
    eventually("the stream confirmed it", || {
        metric(&replica, "kvatlas_log_live_confirmed_total") == 1
    });
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 1);
    replica.kill_9();
}

/// A stream of the log's name that does not take its subjects (made by hand, or by a deployment
/// with another prefix) is refused at start, by an ingest and by a replica, naming both. (An
/// ingest started and every publish was retried for ever, its queue full and its engines
/// waiting; a replica read nothing.) So is one that takes more than the log's subjects (a
/// replica took every other message in it for a record the stream lost).
#[test]
fn a_stream_that_does_not_take_the_logs_subjects_is_refused_at_start() {
    for (subjects, said) in [
        ("kvatlas.prod.>", "takes the subjects [\"kvatlas.prod.>\"]"),
        ("kvatlas.>", "\"kvatlas.>\" is more than the event log's"),
    ] {
        let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
        HandFeed::connect(&nats).stream_made_by_hand(async_nats::jetstream::stream::Config {
            name: "KVATLAS_EVENTS".into(),
            subjects: vec![subjects.into()],
            ..Default::default()
        });
        for role in ["--publish-to", "--consume-from"] {
            let (status, log) = refused_start(&[role, &nats.url()]);
            assert!(!status.success(), "{role}: started: {log}");
            assert!(log.contains(said), "{role}, {subjects}: {log}");
        }
    }
}

/// An ingest publishing to `nats` and a replica consuming from it, both ready.
fn ingest_and_replica(nats: &NatsServer) -> (Served, Served) {
    let ingest = Served::start(&["--publish-to", &nats.url()]);
    let replica = replica(nats);
    ready(&ingest);
    ready(&replica);
    (ingest, replica)
}

/// Unregisters `instance_id` of model `m` at `server` (of `tenant`, or of every tenant).
fn unregister_at(
    server: &Served,
    instance_id: u64,
    tenant: &str,
    all_tenants: bool,
) -> v1::UnregisterWorkerResponse {
    runtime().block_on(async {
        let mut client = IndexerClient::connect(server.grpc.clone())
            .await
            .expect("connects");
        client
            .unregister_worker(v1::UnregisterWorkerRequest {
                index: Some(v1::IndexSelector {
                    model: MODEL.into(),
                    tenant: tenant.into(),
                }),
                instance_id,
                dp_rank: None,
                all_tenants,
            })
            .await
            .map(tonic::Response::into_inner)
            .expect("unregistered")
    })
}

/// The record of worker 7's unregistration (of one rank, or every rank).
fn unregistration(dp_rank: Option<u32>) -> Vec<u8> {
    use prost::Message as _;
    v1::LogRecord {
        index: Some(v1::IndexSelector {
            model: MODEL.into(),
            tenant: "default".into(),
        }),
        block_size: BLOCK_TOKENS,
        instance_id: 7,
        dp_rank: dp_rank.unwrap_or(0),
        body: Some(v1::log_record::Body::Unregister(v1::LogUnregister {
            dp_rank,
        })),
    }
    .encode_to_vec()
}

/// [`record`] of worker 7's source at rank `source_rank`, storing one block on each of the
/// ranks `stores` name (rank, external hash, local hash).
fn record_on_ranks(
    seq: u64,
    fingerprint: u64,
    source_rank: u32,
    stores: &[(u32, u64, u64)],
) -> Vec<u8> {
    use prost::Message as _;
    let mut record =
        v1::LogRecord::decode(&record(seq, fingerprint, None, 0, 0)[..]).expect("a record");
    record.dp_rank = source_rank;
    if let Some(v1::log_record::Body::Batch(batch)) = &mut record.body {
        let template = batch.mutations[0].clone();
        batch.mutations = stores
            .iter()
            .map(|&(dp_rank, external, local)| {
                let mut mutation = template.clone();
                mutation.dp_rank = dp_rank;
                if let Some(v1::log_mutation::Event::Stored(stored)) = &mut mutation.event {
                    stored.block_hashes = vec![external];
                    stored.local_hashes = vec![local];
                }
                mutation
            })
            .collect();
    }
    record.encode_to_vec()
}

/// A divergence repaired in place removes, of the worker, the diverged source's rank and the
/// ranks its unconfirmed live record changed, and nothing else: a sibling rank fed by an
/// engine of its own (vLLM's data parallelism) and a further rank only the stream's confirmed
/// records fed keep their blocks. (Every rank of the worker was removed, and this replica
/// under-counted them until their engines stored the blocks again.)
#[test]
fn a_divergence_repaired_in_place_keeps_the_ranks_it_did_not_change() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let (replica, feed, _first) = hand_fed_replica(&nats, &["--nats-max-bytes", "20000"]);
    // Rank 1, a source of its own; rank 2, fed by rank 0's confirmed record.
    feed.to_stream(&record_on_ranks(1, 201, 1, &[(1, 50, 5001)]));
    let second = record_on_ranks(2, 102, 0, &[(0, 2, 1002), (2, 60, 6001)]);
    feed.to_stream(&second);
    for seq in 1..=500 {
        feed.to_stream_of(8, &record_of(8, seq, seq, None, 10_000 + seq, 20_000 + seq));
    }
    eventually("every record applied", || {
        blocks_of(&replica, 8, &[20_500]) == 1
            && blocks_of_worker_7(&replica, &[5001]) == 1
            && blocks_of_worker_7(&replica, &[6001]) == 1
    });
    // Rank 0's live record; another ingest's batch takes its place.
    feed.live(&record_on_ranks(3, 103, 0, &[(0, 3, 1003)]), &second);
    eventually("the live record applied", || {
        blocks_of_worker_7(&replica, &[1003]) == 1
    });
    feed.to_stream(&record_on_ranks(3, 999, 0, &[(0, 4, 2004)]));
    eventually("the stream's record applied afresh", || {
        blocks_of_worker_7(&replica, &[2004]) == 1
    });
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 1);
    assert_eq!(blocks_of_worker_7(&replica, &[1001]), 0, "rank 0 removed");
    assert_eq!(
        blocks_of_worker_7(&replica, &[1003]),
        0,
        "the live record's block removed"
    );
    assert_eq!(
        blocks_of_worker_7(&replica, &[5001]),
        1,
        "the sibling rank 1 kept"
    );
    assert_eq!(
        blocks_of_worker_7(&replica, &[6001]),
        1,
        "rank 2, fed by confirmed records, kept"
    );
    ready(&replica);
    replica.kill_9();
}

/// A live record that changes a rank other than its source's is left to the stream: applied
/// ahead of it, it could overtake the stream's record of that rank before it (here rank 1's
/// unregistration, after which the ingest's rank 1 holds the live record's block and nothing
/// before it). Before, the unregistration, applied after the live record, removed its block
/// at the replica for good.
#[test]
fn a_live_record_that_changes_another_rank_is_left_to_the_stream() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let (replica, feed, first) = hand_fed_replica(&nats, &[]);
    // Rank 0's source stores block 5001 on rank 1, then 5002; rank 1 is unregistered between.
    let on_rank_1 = record_on_ranks(2, 102, 0, &[(1, 50, 5001)]);
    feed.to_stream(&on_rank_1);
    eventually("rank 1's first block applied", || {
        blocks_of_worker_7(&replica, &[5001]) == 1
    });
    let again = record_on_ranks(3, 103, 0, &[(1, 51, 5002)]);
    let live_seen = || {
        metric(&replica, "kvatlas_log_live_skipped_total")
            + metric(&replica, "kvatlas_log_live_applied_total")
    };
    let before = live_seen();
    feed.live(&again, &on_rank_1);
    eventually("the live record seen", || live_seen() > before);
    assert_eq!(
        blocks_of_worker_7(&replica, &[5002]),
        0,
        "not applied ahead of the stream"
    );
    feed.to_stream(&unregistration(Some(1)));
    feed.to_stream(&again);
    eventually(
        "the stream's order kept: rank 1 holds the later block only",
        || blocks_of_worker_7(&replica, &[5002]) == 1 && blocks_of_worker_7(&replica, &[5001]) == 0,
    );
    let _ = first;
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 0);
    replica.kill_9();
}

/// A replica whose live path keeps up while its stream reading falls behind the retention
/// window keeps the live record whose stream copy retention dropped: the stream's next record
/// of that source continues it. (It was taken for a divergence: the replica emptied its
/// indexes and went back to an older state, here the stream's start, losing the records
/// before the hole; seen once in CI, on the keeper of
/// `a_replica_behind_the_retention_window_rebootstraps_from_a_snapshot`.)
#[test]
fn a_live_record_whose_stream_copy_retention_dropped_is_kept() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    // A stream that keeps about 20 kB of records.
    let (replica, feed, first) = hand_fed_replica(&nats, &["--nats-max-bytes", "20000"]);
    // Records of another worker, each message about 100 B.
    let other_worker = |from: u64, count: u64| {
        for seq in from..from + count {
            feed.to_stream_of(8, &record_of(8, seq, seq, None, 10_000 + seq, 20_000 + seq));
        }
    };
    signal(&replica, "STOP");
    // More than the stopped replica's open pull requests asked for (at most 750 messages):
    // what follows stays in the stream until retention drops it.
    other_worker(1, 1_000);
    let second = record(2, 102, Some(1), 2, 1002);
    feed.live(&second, &first);
    feed.to_stream(&second);
    // Far past 20 kB: the stream drops its copy of the live record.
    other_worker(1_001, 500);
    feed.to_stream(&record(3, 103, Some(2), 3, 1003));
    signal(&replica, "CONT");
    eventually(
        "the stream's last record applied after the live one",
        || blocks_of_worker_7(&replica, &[1001, 1002, 1003]) == 3,
    );
    assert!(
        metric(&replica, "kvatlas_log_sequences_lost_total") > 0,
        "retention dropped records the replica had not read"
    );
    assert_eq!(metric(&replica, "kvatlas_log_live_applied_total"), 1);
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 0);
    replica.kill_9();
}

/// Two ingests' copies of one resync (the same engine batch: sequence number, fingerprint and
/// flag) clearing different ranks (a listener restarted since knows only the ranks it has seen
/// since) are two records: a replica that applied the copy clearing fewer ranks live is not
/// confirmed by the stream's copy clearing more (it was: the replica kept, uncounted, blocks the
/// stream's state had cleared), it goes back to the stream's state.
#[test]
fn a_resync_clearing_other_ranks_than_the_streams_copy_is_not_confirmed_by_it() {
    use prost::Message as _;
    use v1::log_mutation::Event;
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let (replica, feed, _first) = hand_fed_replica(&nats, &[]);
    // Worker 7 feeds rank 1 too (one endpoint, several ranks): block 50, local 5001.
    let mut on_rank_1 =
        v1::LogRecord::decode(&record(2, 102, None, 50, 5001)[..]).expect("a record");
    if let Some(v1::log_record::Body::Batch(batch)) = &mut on_rank_1.body {
        batch.mutations[0].dp_rank = 1;
    }
    let on_rank_1 = on_rank_1.encode_to_vec();
    feed.to_stream(&on_rank_1);
    eventually("rank 1's block applied", || {
        blocks_of_worker_7(&replica, &[5001]) == 1
    });
    // The engine restarted: sequence 3 is a resync. One ingest clears ranks 0 and 1, the
    // other (restarted, it has seen rank 0 only) rank 0.
    let resync = |ranks: &[u32]| {
        let mut resync =
            v1::LogRecord::decode(&record(3, 103, None, 2, 1002)[..]).expect("a record");
        if let Some(v1::log_record::Body::Batch(batch)) = &mut resync.body {
            batch.resync = true;
            let clears = ranks.iter().map(|&dp_rank| v1::LogMutation {
                dp_rank,
                event: Some(Event::Cleared(v1::AllBlocksCleared {})),
            });
            batch.mutations.splice(0..0, clears);
        }
        resync.encode_to_vec()
    };
    feed.live(&resync(&[0]), &on_rank_1);
    eventually("the narrower resync applied live", || {
        metric(&replica, "kvatlas_log_live_applied_total") == 1
            && blocks_of_worker_7(&replica, &[1002]) == 1
    });
    assert_eq!(blocks_of_worker_7(&replica, &[5001]), 1);
    feed.to_stream(&resync(&[0, 1]));
    eventually("the stream's state: rank 1 cleared", || {
        metric(&replica, "kvatlas_log_live_divergences_total") == 1
            && blocks_of_worker_7(&replica, &[5001]) == 0
            && blocks_of_worker_7(&replica, &[1002]) == 1
    });
    ready(&replica);
    replica.kill_9();
}

/// An unsequenced batch published twice: the second live copy, equal to the first still
/// pending, is left to the stream (pending records are found by their digest).
#[test]
fn a_live_record_equal_to_a_pending_one_is_left_to_the_stream() {
    use prost::Message as _;
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let (replica, feed, first) = hand_fed_replica(&nats, &[]);
    let mut unsequenced =
        v1::LogRecord::decode(&record(0, 0, Some(1), 2, 1002)[..]).expect("a record");
    if let Some(v1::log_record::Body::Batch(batch)) = &mut unsequenced.body {
        batch.seq = None;
    }
    let unsequenced = unsequenced.encode_to_vec();
    feed.live(&unsequenced, &first);
    eventually("the first copy applied live", || {
        metric(&replica, "kvatlas_log_live_applied_total") == 1
    });
    feed.live(&unsequenced, &unsequenced);
    eventually("the second copy left to the stream", || {
        metric(&replica, "kvatlas_log_live_skipped_total") == 1
    });
    feed.to_stream(&unsequenced);
    feed.to_stream(&unsequenced);
    eventually("both stream copies consumed", || {
        metric(&replica, "kvatlas_log_consumed_total") == 3
    });
    assert_eq!(metric(&replica, "kvatlas_log_live_applied_total"), 1);
    assert_eq!(metric(&replica, "kvatlas_log_live_confirmed_total"), 1);
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 0);
    assert_eq!(blocks_of_worker_7(&replica, &[1001, 1002]), 2);
    replica.kill_9();
}

#[test]
fn the_live_path_applies_ahead_of_the_stream_and_a_divergence_restores_the_streams_state() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    // No snapshots: a divergence re-reads the stream from its start.
    let (replica, feed, first) = hand_fed_replica(&nats, &[]);
    let to_stream = |record: &[u8]| feed.to_stream(record);
    let live = |record: &[u8], prev: &[u8]| feed.live(record, prev);

    // A live record that continues the chain is applied although the stream does not hold it.
    let second = record(2, 102, Some(1), 2, 1002);
    live(&second, &first);
    eventually("the live record applied ahead of the stream", || {
        blocks_of_worker_7(&replica, &[1001, 1002]) == 2
    });
    assert_eq!(metric(&replica, "kvatlas_log_live_applied_total"), 1);
    // One that does not continue it (its predecessor is unknown) is left to the stream.
    live(&record(3, 103, Some(2), 3, 1003), &record(9, 9, None, 9, 9));
    eventually("the broken link skipped", || {
        metric(&replica, "kvatlas_log_live_skipped_total") == 1
    });
    assert_eq!(blocks_of_worker_7(&replica, &[1001, 1002, 1003]), 2);

    // The stream holds another batch at that position (another ingest's): the replica goes
    // back to the stream's state.
    let other = record(2, 999, Some(1), 4, 2002);
    to_stream(&other);
    eventually("the stream's state restored", || {
        blocks_of_worker_7(&replica, &[1001, 2002]) == 2
            && blocks_of_worker_7(&replica, &[1001, 1002]) == 1
    });
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 1);

    // The chain goes on from the stream's record; the stream then confirms the live record,
    // which is not applied twice.
    let third = record(3, 103, Some(4), 5, 2003);
    live(&third, &other);
    eventually("the live record after the divergence applied", || {
        blocks_of_worker_7(&replica, &[1001, 2002, 2003]) == 3
    });
    to_stream(&third);
    eventually("the stream confirmed the live record", || {
        metric(&replica, "kvatlas_log_live_confirmed_total") == 1
    });
    assert_eq!(metric(&replica, "kvatlas_log_live_applied_total"), 2);
    assert_eq!(metric(&replica, "kvatlas_log_dropped_duplicate_total"), 0);
    assert_eq!(blocks_of_worker_7(&replica, &[1001, 2002, 2003]), 3);
    replica.kill_9();
}

/// A `PublishEvents` batch of worker 7 of model `m` with sequence number `seq`, storing one
/// block (`external`, `local`) after `parent`.
fn published(seq: u64, parent: Option<u64>, external: u64, local: u64) -> v1::PublishEventsRequest {
    v1::PublishEventsRequest {
        index: Some(v1::IndexSelector {
            model: MODEL.into(),
            tenant: String::new(),
        }),
        instance_id: 7,
        block_size: BLOCK_TOKENS,
        seq: Some(seq),
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                parent_hash: parent,
                block_hashes: vec![external],
                local_hashes: vec![local],
                ..v1::BlocksStored::default()
            })),
        }],
        ..v1::PublishEventsRequest::default()
    }
}

/// A `PublishEvents` producer that restarts at sequence number 0 (its first incarnation's
/// numbers reused, within the stream's duplicate window): the ingest clears the rank and
/// applies the new batches, and so does every replica — the batches are told apart by their
/// content, not taken for retries of the first incarnation's.
#[test]
fn a_publish_events_producer_restarting_at_zero_is_resynced_at_the_replicas() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let (ingest, replica) = ingest_and_replica(&nats);
    let publish = |messages| common::publish(&ingest.grpc, messages);
    let (first, second) = ([1001, 1002, 1003], [2001, 2002]);
    publish(vec![
        published(0, None, 1, 1001),
        published(1, Some(1), 2, 1002),
        published(2, Some(2), 3, 1003),
    ]);
    for server in [&ingest, &replica] {
        eventually("the first incarnation's blocks", || {
            blocks_of_worker_7(server, &first) == 3
        });
    }
    // The producer restarts: 0 and 1 again, other blocks.
    publish(vec![
        published(0, None, 11, 2001),
        published(1, Some(11), 12, 2002),
    ]);
    for (name, server) in [("the ingest", &ingest), ("the replica", &replica)] {
        eventually(&format!("{name} holds the second incarnation only"), || {
            blocks_of_worker_7(server, &second) == 2 && blocks_of_worker_7(server, &first) == 0
        });
    }
    assert_eq!(metric(&replica, "kvatlas_log_dropped_duplicate_total"), 0);
    replica.kill_9();
    ingest.kill_9();
}

/// A `PublishEvents` producer that restarts with the same batches as before (a deterministic
/// warm-up, a sidecar replaying): its batches are chained onto the rank's history, so the
/// stream takes them as new records, not duplicates of the earlier incarnation's alike in
/// sequence number and content; so are a new feed's after the rank was unregistered. Before,
/// the second incarnation's batch 1 (the same as the first's) was dropped by the stream's
/// duplicate window, a third incarnation's resync (the same as the second's) too, and so was
/// the first batch of a feed started afresh after an unregistration: the replica missed a
/// block, then a clear, then a block.
#[test]
fn a_producer_restarting_with_the_same_batches_reaches_the_replicas() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let (ingest, replica) = ingest_and_replica(&nats);
    let publish = |messages| common::publish(&ingest.grpc, messages);
    let (abc, abd) = ([1001, 1002, 1003], [1001, 1002, 1004]);
    let agree = |what: &str, depths: (u32, u32)| {
        for (name, server) in [("the ingest", &ingest), ("the replica", &replica)] {
            eventually(&format!("{name}: {what}"), || {
                (
                    blocks_of_worker_7(server, &abc),
                    blocks_of_worker_7(server, &abd),
                ) == depths
            });
        }
    };
    let (a, b) = (published(0, None, 1, 1001), published(1, Some(1), 2, 1002));
    publish(vec![a.clone(), b.clone(), published(2, Some(2), 3, 1003)]);
    agree("the first incarnation's A B C", (3, 2));
    // Restarted: A and B again (B alike in number and content), then D.
    publish(vec![a.clone(), b, published(2, Some(2), 4, 1004)]);
    agree("the second incarnation's A B D", (2, 3));
    // Restarted again: A alone, the same resync as the second incarnation's first batch.
    publish(vec![a.clone()]);
    agree("the third incarnation's A", (1, 1));
    // Unregistered, then fed afresh with the first incarnation's batch 0.
    unregister_at(&ingest, 7, "", false);
    agree("worker 7 unregistered", (0, 0));
    publish(vec![a]);
    agree("a fresh feed's A", (1, 1));
    assert_eq!(metric(&replica, "kvatlas_log_dropped_duplicate_total"), 0);
    replica.kill_9();
    ingest.kill_9();
}

/// An unregistration at an ingest that holds nothing of the worker — restarted since (an
/// ingest keeps no snapshot), or the worker was fed through another ingest — reaches the
/// replicas all the same. Before, it was NOT_FOUND at the ingest, and the replicas kept the
/// worker's blocks for good.
#[test]
fn an_ingest_forwards_the_unregistration_of_a_worker_it_does_not_hold() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let first = Served::start(&["--publish-to", &nats.url(), "--publish-only"]);
    let replica = replica(&nats);
    ready(&first);
    ready(&replica);
    let of_worker = |instance_id: u64, external: u64, local: u64| {
        let mut message = published(0, None, external, local);
        message.instance_id = instance_id;
        message
    };
    let blocks = [1001, 1002, 1003];
    common::publish(
        &first.grpc,
        vec![
            published(0, None, 1, 1001),
            published(1, Some(1), 2, 1002),
            published(2, Some(2), 3, 1003),
        ],
    );
    common::publish(&first.grpc, vec![of_worker(6, 31, 3001)]);
    let memberships = || metric_sum(&replica, "kvatlas_index_memberships", "model=\"m\"");
    eventually("the replica holds workers 6 and 7", || {
        blocks_of_worker_7(&replica, &blocks) == 3 && memberships() == 4
    });
    first.kill_9();
    let second = Served::start(&["--publish-to", &nats.url(), "--publish-only"]);
    ready(&second);
    let unregister = |instance_id: u64, tenant: &str, all_tenants: bool| {
        unregister_at(&second, instance_id, tenant, all_tenants)
    };
    // No index of the model here: to the default tenant, where registrations naming none go.
    let forwarded = unregister(6, "", true);
    assert_eq!(forwarded.ranks_removed, 0, "the ingest held none of it");
    assert_eq!(forwarded.indexes.len(), 1);
    eventually("the replica removed worker 6", || memberships() == 3);
    // Worker 8 publishes through the new ingest, which then holds the model's index, not
    // worker 7.
    common::publish(&second.grpc, vec![of_worker(8, 21, 2001)]);
    let forwarded = unregister(7, "", true);
    assert_eq!(forwarded.ranks_removed, 0, "the ingest held none of it");
    assert_eq!(forwarded.indexes.len(), 1);
    eventually("the replica removed worker 7 and kept worker 8", || {
        blocks_of_worker_7(&replica, &blocks) == 0 && memberships() == 1
    });
    // Of a tenant the replica holds no index of: nothing is created there. Every record is
    // applied once: 5 batches and 3 unregistrations.
    unregister(9, "elsewhere", false);
    eventually("the replica applied every record", || {
        metric(&replica, "kvatlas_log_applied_total") == 8
    });
    let tenants = runtime().block_on(async {
        let mut client = IndexerClient::connect(replica.grpc.clone())
            .await
            .expect("connects");
        let listed = client
            .list_indexes(v1::ListIndexesRequest::default())
            .await
            .expect("listed")
            .into_inner();
        listed
            .indexes
            .into_iter()
            .filter_map(|info| info.index.map(|index| index.tenant))
            .collect::<Vec<_>>()
    });
    assert!(!tenants.iter().any(|t| t == "elsewhere"), "{tenants:?}");
    replica.kill_9();
    second.kill_9();
}

/// A record larger than nats-server's `max_payload` can never be published: the ingest counts
/// it refused (an error log says what to change) and goes on with the worker's next records,
/// which the replicas get. (Before, it was retried for ever, and the worker's later records
/// waited behind it: the replicas never saw them, and once 8,192 records waited every
/// listener of the ingest stalled.)
#[test]
fn a_record_too_large_for_nats_is_refused_and_the_next_ones_are_published() {
    let nats = NatsServer::start_with_max_payload(4096)
        .expect("nats-server starts (cargo xtask ci installs it)");
    let (ingest, replica) = ingest_and_replica(&nats);
    publish_a_record_of_7_kb_between_two(&ingest, &replica);
    assert_eq!(
        blocks_of_worker_7(&ingest, &[1001, 5000, 5001]),
        3,
        "the ingest applied it"
    );
    assert_eq!(
        blocks_of_worker_7(&replica, &[1001, 5000]),
        1,
        "the replicas did not get it"
    );
    replica.kill_9();
    ingest.kill_9();
}

/// Worker 7's batches 0 to 2 through `ingest`, batch 1 a record of about 7 KB (400 blocks) that
/// the stream refuses: waits until `replica` has batch 2, and checks the refusal was counted.
fn publish_a_record_of_7_kb_between_two(ingest: &Served, replica: &Served) {
    // 400 blocks in one batch: a record of about 7 KB.
    let mut large = published(1, Some(1), 100, 5000);
    if let Some(v1::kv_event::Event::Stored(stored)) = &mut large.events[0].event {
        stored.block_hashes = (100..500).collect();
        stored.local_hashes = (5000..5400).collect();
    }
    common::publish(
        &ingest.grpc,
        vec![
            published(0, None, 1, 1001),
            large,
            published(2, Some(1), 2, 1002),
        ],
    );
    eventually("the replica has the batch after the refused one", || {
        blocks_of_worker_7(replica, &[1001, 1002]) == 2
    });
    assert_eq!(metric(ingest, "kvatlas_log_publish_refused_total"), 1);
}

/// A record larger than the stream's own message limit (`max_msg_size`, set on a stream made by
/// hand, which keeps its settings) is refused as one larger than nats-server's is, and neither
/// published live: the ingest counts it and goes on with the worker's next records. (It was
/// retried for ever, and the worker's later records waited behind it.)
#[test]
fn a_record_larger_than_the_streams_message_limit_is_refused_and_the_next_ones_are_published() {
    let nats = NatsServer::start().expect("nats-server starts (cargo xtask ci installs it)");
    let feed = HandFeed::connect(&nats);
    feed.stream_made_by_hand(async_nats::jetstream::stream::Config {
        name: "KVATLAS_EVENTS".into(),
        subjects: vec!["kvatlas.events.>".into()],
        max_message_size: 4096,
        ..Default::default()
    });
    let (ingest, replica) = ingest_and_replica(&nats);
    publish_a_record_of_7_kb_between_two(&ingest, &replica);
    assert_eq!(blocks_of_worker_7(&replica, &[1001, 5000]), 1);
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 0);
    replica.kill_9();
    ingest.kill_9();
}

/// A record the stream would refuse is not published live either. A live message's headers are
/// a few dozen bytes smaller than the stream message's (its message id), so a record of a
/// narrow range of sizes went live and was then refused by the stream: a replica that applied
/// it live took the source's next record for a divergence, emptied its indexes and
/// re-bootstrapped.
#[test]
fn a_record_the_stream_refuses_does_not_go_live() {
    const LADDER: u64 = 24;
    const SMALL_AT_MOST: u64 = 40;
    let nats = NatsServer::start_with_max_payload(4096)
        .expect("nats-server starts (cargo xtask ci installs it)");
    let (ingest, replica) = ingest_and_replica(&nats);
    // Batches of 236 to 259 blocks, each block 16 bytes of the record (two fixed64 hashes):
    // records from below the 4,096 bytes of the stream's messages to above them, and above
    // what a live message takes; then batches of one block. One at a time, each stored (or
    // refused) and read before the next, so that the replica's chain continues.
    let ladder = (0..LADDER).map(|seq| {
        let blocks = 236 + seq;
        let mut batch = published(seq, None, 0, 0);
        if let Some(v1::kv_event::Event::Stored(stored)) = &mut batch.events[0].event {
            stored.block_hashes = (1_000..1_000 + blocks).collect();
            stored.local_hashes = (9_000..9_000 + blocks).collect();
        }
        batch
    });
    let send = |done: u64, batch| {
        common::publish(&ingest.grpc, vec![batch]);
        eventually("the record stored or refused, and read", || {
            let published = metric(&ingest, "kvatlas_log_published_total");
            published + metric(&ingest, "kvatlas_log_publish_refused_total") == done
                && metric(&replica, "kvatlas_log_consumed_total") == published
        });
    };
    for (done, batch) in (1..).zip(ladder) {
        send(done, batch);
    }
    // A chain of one-block batches until one is applied live (a few dozen at most): the live
    // copy races the stream's, and under load the stream's can reach the replica first, the
    // live one then skipped. Local hashes 1001, 1002, ...
    let mut chain = Vec::new();
    for block in 1..=SMALL_AT_MOST {
        send(
            LADDER + block,
            published(
                LADDER + block - 1,
                (block > 1).then_some(block - 1),
                block,
                1000 + block,
            ),
        );
        chain.push(1000 + block);
        if block >= 2 && metric(&replica, "kvatlas_log_live_applied_total") > 0 {
            break;
        }
    }
    assert_eq!(
        blocks_of_worker_7(&replica, &chain),
        u32::try_from(chain.len()).expect("small")
    );
    let refused = metric(&ingest, "kvatlas_log_publish_refused_total");
    assert!(
        refused > 0 && refused < LADDER,
        "the stream took some of the ladder's records: {refused} refused"
    );
    assert!(
        metric(&replica, "kvatlas_log_live_applied_total") > 0,
        "the replica applied records off the live path"
    );
    assert_eq!(metric(&replica, "kvatlas_log_live_divergences_total"), 0);
    replica.kill_9();
    ingest.kill_9();
}

/// A private CA and, signed by it, a server certificate for 127.0.0.1 and a client
/// certificate, written as PEM files into `dir`: (ca, server cert, server key, client cert,
/// client key).
fn private_ca(dir: &std::path::Path) -> [std::path::PathBuf; 5] {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    std::fs::create_dir_all(dir).expect("dir");
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().expect("CA key");
    let ca_cert = ca_params.self_signed(&ca_key).expect("CA certificate");
    let issuer = Issuer::new(ca_params, ca_key);
    let leaf = |name: &str| {
        let key = KeyPair::generate().expect("key");
        let cert = CertificateParams::new(vec![name.to_owned()])
            .expect("params")
            .signed_by(&key, &issuer)
            .expect("signed");
        (cert.pem(), key.serialize_pem())
    };
    let (server_cert, server_key) = leaf("127.0.0.1");
    let (client_cert, client_key) = leaf("kvatlas");
    let files = [
        ("ca.pem", ca_cert.pem()),
        ("server.pem", server_cert),
        ("server-key.pem", server_key),
        ("client.pem", client_cert),
        ("client-key.pem", client_key),
    ];
    files.map(|(name, pem)| {
        let path = dir.join(name);
        std::fs::write(&path, pem).expect("write");
        path
    })
}

/// A scratch directory for one test's files (removed first if a run left it).
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvatlas-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

#[test]
fn an_ingest_and_a_replica_reach_a_nats_with_mutual_tls_an_nkey_and_a_password() {
    let dir = scratch("nats-tls");
    let [ca, server_cert, server_key, client_cert, client_key] = private_ca(&dir);
    let user = nkeys::KeyPair::new_user();
    let seed_file = dir.join("ingest.nk");
    std::fs::write(&seed_file, format!("{}\n", user.seed().expect("seed"))).expect("write");
    let nats = NatsServer::start_with_config(&format!(
        "tls {{\n  cert_file: {server_cert:?}\n  key_file: {server_key:?}\n  ca_file: {ca:?}\n  \
         verify: true\n}}\nauthorization {{\n  users: [\n    {{ nkey: {:?} }}\n    \
         {{ user: \"replica\", password: \"pw-0123456789\" }}\n  ]\n}}\n",
        user.public_key()
    ))
    .expect("nats-server starts with TLS and users");
    let (ca, client_cert, client_key, seed_file) = (
        ca.display().to_string(),
        client_cert.display().to_string(),
        client_key.display().to_string(),
        seed_file.display().to_string(),
    );
    let tls = [
        "--nats-ca-cert",
        &ca,
        "--nats-tls-cert",
        &client_cert,
        "--nats-tls-key",
        &client_key,
    ];
    let mut fleet = Fleet::new();
    let mut extra = vec!["--nats-nkey-file", seed_file.as_str()];
    extra.extend_from_slice(&tls);
    let ingest = ingest_with(&nats, &fleet, &extra);
    fleet.wait_subscribed(1);
    let replica_url = format!("nats://replica:pw-0123456789@127.0.0.1:{}", nats.port());
    fn replica_with<'a>(url: &'a str, more: &[&'a str]) -> Vec<&'a str> {
        let mut args = vec!["--consume-from", url];
        args.extend_from_slice(more);
        args
    }
    // With the debug log, in which async-nats prints each server's address as it connects.
    let mut debug = replica_with(&replica_url, &tls);
    debug.extend_from_slice(&["--log", "debug"]);
    let replica = Served::start(&debug);
    fleet.serve(200);
    converges(&replica, &fleet, "the replica through mutual TLS");
    converges(&ingest, &fleet, "the ingest");
    let logged = [replica.startup_log.clone(), replica.log_lines()].concat();
    assert!(
        logged
            .iter()
            .any(|line| line.contains("attempting connection")),
        "the debug log is on"
    );
    assert!(
        !logged.iter().any(|line| line.contains("pw-0123456789")),
        "the password is never logged"
    );

    // What NATS refuses, a server says at start, naming what to check.
    let wrong_password = format!("nats://replica:wrong-password@127.0.0.1:{}", nats.port());
    let no_client_cert = ["--nats-ca-cert", ca.as_str()];
    for (args, expected) in [
        (
            replica_with(&wrong_password, &tls),
            "refused the credentials",
        ),
        (
            replica_with(&replica_url, &no_client_cert),
            "BadCertificate",
        ),
        // Without the private CA, the system's roots do not know the server's certificate.
        (replica_with(&replica_url, &tls[2..]), "UnknownIssuer"),
    ] {
        let (status, log) = refused_start(&args);
        assert!(!status.success(), "{args:?} started: {log}");
        assert!(
            log.contains("cannot reach NATS") && log.contains(expected),
            "{args:?}: {log}"
        );
        assert!(
            !log.contains("pw-0123456789") && !log.contains("wrong-password"),
            "{log}"
        );
    }
    replica.kill_9();
    ingest.kill_9();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_rotated_nats_token_is_read_again_at_the_reconnection() {
    let dir = scratch("nats-token");
    let token_file = dir.join("nats.token");
    let first = "first-token-0123456789";
    std::fs::write(&token_file, format!("# the NATS token\n{first}\n")).expect("write");
    let config = |token: &str| format!("authorization {{\n  token: {token:?}\n}}\n");
    let mut nats = NatsServer::start_with_config(&config(first)).expect("nats-server starts");
    let token_arg = token_file.display().to_string();
    let token = ["--nats-token-file", token_arg.as_str()];
    let mut fleet = Fleet::new();
    let ingest = ingest_with(&nats, &fleet, &token);
    fleet.wait_subscribed(1);
    let replica = Served::start(&["--consume-from", &nats.url(), token[0], token[1]]);
    fleet.serve(200);
    converges(&replica, &fleet, "the replica with the first token");

    // The token is rotated: the file first, then the server, which drops the connections
    // its new token does not authorize; both reconnect with the file's new token.
    let second = "second-token-9876543210";
    std::fs::write(&token_file, format!("{second}\n")).expect("write");
    nats.reload_config(&config(second))
        .expect("nats-server reloads");
    for (server, name) in [(&ingest, "the ingest"), (&replica, "the replica")] {
        eventually(&format!("{name} lost its connection"), || {
            metric(server, "kvatlas_log_nats_disconnects_total") >= 1
        });
    }
    fleet.serve(200);
    converges(&replica, &fleet, "the replica with the rotated token");

    // A token NATS does not take, and a file without one, stop a start with what to check.
    let stale = dir.join("stale.token");
    std::fs::write(&stale, format!("{first}\n")).expect("write");
    let empty = dir.join("empty.token");
    std::fs::write(&empty, "# nothing yet\n").expect("write");
    for (file, expected) in [
        (&stale, "refused the credentials"),
        (&empty, "holds no token"),
    ] {
        let file = file.display().to_string();
        let (status, log) =
            refused_start(&["--consume-from", &nats.url(), "--nats-token-file", &file]);
        assert!(!status.success(), "{file} started: {log}");
        assert!(log.contains(expected), "{file}: {log}");
        assert!(!log.contains(first), "the token is never logged: {log}");
    }
    replica.kill_9();
    ingest.kill_9();
    let _ = std::fs::remove_dir_all(&dir);
}

/// A NATS JWT (`ed25519-nkey`) of `claims`, signed by `issuer` (its `iss`).
fn nats_jwt(issuer: &nkeys::KeyPair, subject: &str, nats: serde_json::Value) -> String {
    use base64::Engine;
    let encode = |bytes: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(bytes);
    let header = encode(br#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = serde_json::json!({
        "jti": format!("KVATLAS{subject}"),
        "iat": 1_700_000_000u64,
        "iss": issuer.public_key(),
        "name": "kvatlas-test",
        "sub": subject,
        "nats": nats,
    });
    let body = format!("{header}.{}", encode(claims.to_string().as_bytes()));
    let signature = issuer.sign(body.as_bytes()).expect("signs");
    format!("{body}.{}", encode(&signature))
}

/// nats-server in operator mode: an operator, an account with JetStream (preloaded into a
/// memory resolver) and a user of it. The configuration's text and the user's credentials
/// file's text (as `nsc` writes it).
fn operator_mode() -> (String, String) {
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    // JetStream in operator mode needs a system account.
    let system = nkeys::KeyPair::new_account();
    let user = nkeys::KeyPair::new_user();
    let operator_jwt = nats_jwt(
        &operator,
        &operator.public_key(),
        serde_json::json!({ "type": "operator", "version": 2 }),
    );
    let account_jwt = nats_jwt(
        &operator,
        &account.public_key(),
        serde_json::json!({
            "limits": {
                "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
                "wildcards": true, "conn": -1, "leaf": -1,
                "mem_storage": -1, "disk_storage": -1, "streams": -1, "consumer": -1,
            },
            "type": "account",
            "version": 2,
        }),
    );
    let system_jwt = nats_jwt(
        &operator,
        &system.public_key(),
        serde_json::json!({ "type": "account", "version": 2 }),
    );
    let user_jwt = nats_jwt(
        &account,
        &user.public_key(),
        serde_json::json!({
            "pub": {}, "sub": {}, "subs": -1, "data": -1, "payload": -1,
            "type": "user", "version": 2,
        }),
    );
    let config = format!(
        "operator: {operator_jwt:?}\nsystem_account: {system}\nresolver: MEMORY\n\
         resolver_preload: {{\n  {account}: {account_jwt:?}\n  {system}: {system_jwt:?}\n}}\n",
        account = account.public_key(),
        system = system.public_key(),
    );
    let creds = format!(
        "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n\
         ************************* IMPORTANT *************************\n\
         NKEY Seed printed below can be used to sign and prove identity.\n\n\
         -----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n\n\
         *************************************************************\n",
        user.seed().expect("seed")
    );
    (config, creds)
}

#[test]
fn a_credentials_file_reaches_a_nats_in_operator_mode() {
    let dir = scratch("nats-creds");
    let (config, creds) = operator_mode();
    let nats = NatsServer::start_with_config(&config).expect("nats-server starts in operator mode");
    let creds_file = dir.join("kvatlas.creds");
    std::fs::write(&creds_file, creds).expect("write");
    let creds_arg = creds_file.display().to_string();
    let mut fleet = Fleet::new();
    let ingest = ingest_with(&nats, &fleet, &["--nats-creds-file", &creds_arg]);
    fleet.wait_subscribed(1);
    // A list of servers, the first of which does not answer (a closed port).
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let list = format!("127.0.0.1:{closed}, {}", nats.url());
    let replica = Served::start(&["--consume-from", &list, "--nats-creds-file", &creds_arg]);
    fleet.serve(200);
    converges(
        &replica,
        &fleet,
        "the replica with a credentials file and a list",
    );
    // Without credentials, and with a file that is not one, a start is refused.
    let (status, log) = refused_start(&["--consume-from", &nats.url()]);
    assert!(
        !status.success() && log.contains("refused the credentials"),
        "{log}"
    );
    let not_creds = dir.join("not.creds");
    std::fs::write(
        &not_creds,
        "SUAIO3FHUX5PNV2LQIIP7TZ3N4L7TX3W53MQGEIVYFIGA635OZCKEYHFLM\n",
    )
    .expect("write");
    let not_creds = not_creds.display().to_string();
    let (status, log) = refused_start(&[
        "--consume-from",
        &nats.url(),
        "--nats-creds-file",
        &not_creds,
    ]);
    assert!(
        !status.success() && log.contains("not a NATS credentials file"),
        "{log}"
    );
    replica.kill_9();
    ingest.kill_9();
    let _ = std::fs::remove_dir_all(&dir);
}
