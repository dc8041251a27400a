//! Recovery without engines: a restart from the data directory continues every rank's numbering
//! and answers like the reference; periodic snapshots are written only when the state changed;
//! the `Snapshot` RPC and `GET /snapshot` stream the state exactly; unreadable snapshot files,
//! and files that read but do not fit the server, are moved aside and the previous one is used; a replica bootstraps from a peer's snapshot,
//! and a peer that breaks off mid-snapshot is skipped with nothing of it restored. (With real engines publishing and replaying — bootstrap under load, `kill -9` — see
//! `interop.rs`.)

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::*;
use kvatlas_index::{KvIndex, ReferenceIndex, Worker};
use kvatlas_proto::v1;
use kvatlas_server::{Bootstrap, Persistence, Restored, ServerConfig};

const MODEL: &str = "recovering";
const BLOCK: u32 = 4;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvatlas-recovery-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn persistent(dir: &Path, interval: Option<Duration>) -> ServerConfig {
    ServerConfig {
        persistence: Some(Persistence {
            data_dir: dir.to_owned(),
            interval,
        }),
        ..ServerConfig::default()
    }
}

/// Random prompts answered by the server exactly as by the reference.
async fn assert_answers(h: &mut Harness, reference: &ReferenceIndex, seed: u64, what: &str) {
    let mut rng = Rng(seed);
    for _ in 0..60 {
        let (_, locals) = random_prompt(&mut rng, BLOCK);
        let answer = query_hashes(h, MODEL, &locals).await;
        assert_eq!(
            answer_rows(&answer),
            reference_rows(&reference_answer(reference, &locals)),
            "{what}: {locals:?}"
        );
    }
}

fn snapshot_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("list")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvs"))
        .collect();
    files.sort();
    files
}

/// A missing peer token file fails the start also when the data directory's snapshot makes a
/// bootstrap unnecessary: a typo otherwise shows only on the day the directory is empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peer_access_files_are_read_at_every_start() {
    let dir = temp_dir("peer-files");
    let workers = [Worker::new(1, 0)];
    let batches = script(27, MODEL, &workers, 50, BLOCK);
    let mut h = start(persistent(&dir, None)).await;
    publish_script(&mut h.client, &batches).await;
    let report = h.server.shutdown().await;
    assert!(matches!(report.snapshot, Some(Ok(_))), "{report:?}");
    let missing = dir.join("no-such-token-file");
    let error = kvatlas_server::RunningServer::start(ServerConfig {
        peers: vec!["http://127.0.0.1:9".into()],
        peer_token_file: Some(missing.clone()),
        ..persistent(&dir, None)
    })
    .await
    .expect_err("the token file is missing");
    assert!(error.to_string().contains("no-such-token-file"), "{error}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_from_the_data_dir_continues_where_it_stopped() {
    let dir = temp_dir("restart");
    let workers = [Worker::new(1, 0), Worker::new(1, 1), Worker::new(2, 0)];
    let batches = script(21, MODEL, &workers, 900, BLOCK);
    let (first, second) = batches.split_at(500);
    let mut reference = ReferenceIndex::new();

    let mut h = start(persistent(&dir, None)).await;
    assert_eq!(h.server.restored(), &Restored::Nothing);
    let acked = publish_script(&mut h.client, first).await;
    assert_eq!(acked.messages_applied as usize, first.len());
    apply_script(&mut reference, first);
    let report = h.server.shutdown().await;
    let written = report
        .snapshot
        .expect("a data directory")
        .expect("the final snapshot is written");
    assert_eq!(report.indexes[0].digest, reference.snapshot().digest());
    assert_eq!(written.memberships, report.indexes[0].memberships);
    assert!(written.path.starts_with(&dir), "{written:?}");

    // Restart: the same state, the same sequence numbers.
    let mut h = start(persistent(&dir, None)).await;
    assert_eq!(
        h.server.restored(),
        &Restored::DataDir {
            path: written.path.clone(),
            memberships: written.memberships
        }
    );
    assert_answers(&mut h, &reference, 5, "after the restart").await;
    let listed = h
        .client
        .list_workers(v1::ListWorkersRequest::default())
        .await
        .expect("list")
        .into_inner();
    let grpc_ranks: Vec<_> = listed
        .workers
        .iter()
        .filter(|w| w.source == v1::WorkerSource::Grpc as i32)
        .map(|w| (w.instance_id, w.dp_rank, w.last_seq))
        .collect();
    let expected_ranks: Vec<_> = report.indexes[0]
        .last_seq
        .iter()
        .map(|(w, seq)| (w.worker_id, w.dp_rank, *seq))
        .collect();
    assert_eq!(grpc_ranks, expected_ranks, "each rank's numbering survives");
    // The publishers continue their numbering: nothing is a gap, a duplicate or a resync.
    let acked = publish_script(&mut h.client, second).await;
    assert_eq!(acked.messages_applied as usize, second.len());
    assert_eq!(
        (acked.duplicates, acked.gaps, acked.resyncs),
        (0, 0, 0),
        "{acked:?}"
    );
    apply_script(&mut reference, second);
    // A message applied before the restart is a duplicate now.
    let acked = publish_script(&mut h.client, &first[first.len() - 1..]).await;
    assert_eq!(
        (acked.duplicates, acked.messages_applied),
        (1, 0),
        "{acked:?}"
    );
    assert_answers(&mut h, &reference, 6, "after more events").await;
    let report = h.server.shutdown().await;
    assert_eq!(report.indexes[0].digest, reference.snapshot().digest());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A root chain of `hashes` holding the first blocks of the prompt `[1, 1, 1]`.
fn stored(hashes: Vec<u64>) -> VllmEvent {
    let tokens = prompt_tokens(&[1, 1, 1], BLOCK);
    VllmEvent::Stored {
        tokens: tokens[..hashes.len() * BLOCK as usize].to_vec(),
        hashes,
        parent: None,
        block_size: BLOCK,
    }
}

/// A server persisting into a fresh data directory named after `name`, and an engine
/// registered as instance 7 (rank 0) that stored the first 3 blocks of the prompt `[1, 1, 1]`.
async fn rank_0_of_an_engine(name: &str) -> (PathBuf, Harness, VllmPublisher) {
    let dir = temp_dir(name);
    let mut engine = VllmPublisher::bind();
    let mut h = start(persistent(&dir, None)).await;
    register_engine(&mut h.client, (MODEL, BLOCK), 7, &engine).await;
    wait_for_an_active_listener(&h.client, &mut engine).await;
    engine.publish(&[stored(vec![71, 72, 73])], None);
    (dir, h, engine)
}

/// Whether the server answers `query` with `want`'s rows.
fn rows_are(
    client: &v1::indexer_client::IndexerClient<tonic::transport::Channel>,
    query: &v1::QueryRequest,
    want: &[(u64, u32, u32, u32, u32)],
) -> impl std::future::Future<Output = bool> + use<> {
    let (mut client, query, want) = (client.clone(), query.clone(), want.to_vec());
    async move { answer_rows(&client.query(query).await.expect("query").into_inner()) == want }
}

/// A ZMQ listener resumed after a restart from the data directory remembers the further rank
/// its engine's batches fed (a batch names its rank; that rank holds blocks and no one
/// registers it): when the engine restarts (its numbering starts again), the resync clears it
/// with the registered rank. A listener that remembered only its own rank after resuming left
/// the further rank's blocks in the index for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_after_a_server_restart_clears_the_ranks_its_batches_fed() {
    let (dir, h, mut engine) = rank_0_of_an_engine("batch-ranks").await;
    let tokens = prompt_tokens(&[1, 1, 1], BLOCK);
    engine.publish(&[stored(vec![171, 172])], Some(1));
    let query = token_query(MODEL, "", tokens.clone());
    let both = [(7, 0, 3, 3, 3), (7, 1, 2, 2, 2)];
    wait_until("both ranks' blocks", || rows_are(&h.client, &query, &both)).await;
    let report = h.server.shutdown().await;
    assert!(matches!(report.snapshot, Some(Ok(_))), "{report:?}");

    let mut h = start(persistent(&dir, None)).await;
    assert!(rows_are(&h.client, &query, &both).await, "restored");
    // The engine restarts: its numbering starts again, with other content (sent until the
    // resumed listener has joined; a repeat is a duplicate).
    wait_until(
        "the restart's resync and the new incarnation's block",
        || {
            engine.seq = 0;
            engine.publish_at(&[stored(vec![81])], None, VLLM_TS + 1.0);
            rows_are(&h.client, &query, &[(7, 0, 1, 1, 1)])
        },
    )
    .await;
    let listed = listed_workers(&mut h.client).await;
    let ranks: Vec<_> = listed
        .workers
        .iter()
        .map(|w| (w.instance_id, w.dp_rank))
        .collect();
    assert_eq!(
        ranks,
        [(7, 0)],
        "the further rank holds nothing: {listed:?}"
    );
    h.server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two ranks of one instance, each registered with an engine of its own (vLLM's data
/// parallelism): after a restart from the data directory, the first engine's restart clears
/// its rank only. The other rank is no further rank of the first's source, also while the
/// restore registers the ranks again one after the other (it holds a checkpoint of its own).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_after_a_server_restart_leaves_a_sibling_ranks_blocks() {
    let dir = temp_dir("sibling-ranks");
    let mut engines = [VllmPublisher::bind(), VllmPublisher::bind()];
    let mut h = start(persistent(&dir, None)).await;
    for (rank, engine) in (0..).zip(&mut engines) {
        h.client
            .register_worker(v1::RegisterWorkerRequest {
                index: selector(MODEL, ""),
                instance_id: 7,
                dp_rank: rank,
                block_size: BLOCK,
                endpoint: engine.endpoint.clone(),
                ..v1::RegisterWorkerRequest::default()
            })
            .await
            .expect("registers");
        wait_until("the rank's listener to become active", || {
            engine.publish(&[], None);
            let mut client = h.client.clone();
            async move {
                let listed = listed_workers(&mut client).await;
                listed
                    .workers
                    .iter()
                    .any(|w| w.dp_rank == rank && w.status == v1::WorkerStatus::Active as i32)
            }
        })
        .await;
    }
    let tokens = prompt_tokens(&[1, 1, 1], BLOCK);
    engines[0].publish(&[stored(vec![71, 72, 73])], None);
    engines[1].publish(&[stored(vec![171, 172])], None);
    let query = token_query(MODEL, "", tokens);
    restart_the_server_then_rank_0s_engine(&dir, h, &mut engines[0], &query).await;
}

/// As [`an_engine_restart_after_a_server_restart_leaves_a_sibling_ranks_blocks`] with the
/// sibling rank fed over `PublishEvents` without sequence numbers, which records no checkpoint:
/// while the restore registers the ranks again one after the other, the sibling is recorded
/// and not yet fed, and no further rank of rank 0's source.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_restart_after_a_server_restart_leaves_an_unsequenced_publish_events_ranks_blocks()
 {
    let (dir, mut h, mut engine) = rank_0_of_an_engine("unsequenced-sibling").await;
    let tokens = prompt_tokens(&[1, 1, 1], BLOCK);
    let sibling = v1::PublishEventsRequest {
        index: selector(MODEL, ""),
        instance_id: 7,
        dp_rank: 1,
        seq: None,
        block_size: BLOCK,
        events: vec![v1::KvEvent {
            event: Some(v1::kv_event::Event::Stored(v1::BlocksStored {
                block_hashes: vec![171, 172],
                token_ids: tokens[..2 * BLOCK as usize].to_vec(),
                tier: v1::StorageTier::Device as i32,
                ..v1::BlocksStored::default()
            })),
        }],
    };
    h.client
        .publish_events(tokio_stream::iter([sibling]))
        .await
        .expect("published");
    let query = token_query(MODEL, "", tokens);
    restart_the_server_then_rank_0s_engine(&dir, h, &mut engine, &query).await;
}

/// With instance 7's rank 0 fed by `engine` holding 3 blocks of `query` and rank 1 (fed
/// otherwise) 2: restarts the server `h` from `dir`, then `engine` (its numbering starts
/// again, with other content). Rank 0 is resynced and rank 1 keeps its blocks.
async fn restart_the_server_then_rank_0s_engine(
    dir: &Path,
    h: Harness,
    engine: &mut VllmPublisher,
    query: &v1::QueryRequest,
) {
    let both = [(7, 0, 3, 3, 3), (7, 1, 2, 2, 2)];
    wait_until("both ranks' blocks", || rows_are(&h.client, query, &both)).await;
    let report = h.server.shutdown().await;
    assert!(matches!(report.snapshot, Some(Ok(_))), "{report:?}");

    let h = start(persistent(dir, None)).await;
    assert!(rows_are(&h.client, query, &both).await, "restored");
    wait_until("rank 0's resync and its new incarnation's block", || {
        engine.seq = 0;
        engine.publish_at(&[stored(vec![81])], None, VLLM_TS + 1.0);
        rows_are(&h.client, query, &[(7, 0, 1, 1, 1), (7, 1, 2, 2, 2)])
    })
    .await;
    h.server.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_snapshots_and_the_snapshot_streams_hold_the_state() {
    let dir = temp_dir("periodic");
    let interval = Duration::from_millis(100);
    let mut h = start(persistent(&dir, Some(interval))).await;
    let workers = [Worker::new(4, 0), Worker::new(5, 0)];
    let batches = script(22, MODEL, &workers, 300, BLOCK);
    publish_script(&mut h.client, &batches).await;
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    let digest = reference.snapshot().digest();
    let digest_of = |images: &[kvatlas_server::snapshot::IndexImage]| {
        assert_eq!(images.len(), 1);
        images[0].snapshot.digest()
    };
    // A periodic snapshot appears and holds the state.
    let http = h.server.http_addr();
    wait_until("a periodic snapshot of the state", || {
        let dir = dir.clone();
        async move {
            snapshot_files(&dir).last().is_some_and(|file| {
                std::fs::File::open(file)
                    .ok()
                    .and_then(|f| kvatlas_server::snapshot::read(std::io::BufReader::new(f)).ok())
                    .is_some_and(|(_, images)| digest_of(&images) == digest)
            })
        }
    })
    .await;
    // The counter moves once the write has finished, just after the file is in place.
    wait_until("the written snapshot counted", || async move {
        let (_, metrics) = http_get(http, "/metrics", None);
        metric(&metrics, "kvatlas_snapshots_total{outcome=\"written\"}").expect("metric") >= 1.0
    })
    .await;
    // Nothing changes: no more snapshots are written.
    let files = snapshot_files(&dir);
    tokio::time::sleep(interval * 5).await;
    assert_eq!(
        snapshot_files(&dir),
        files,
        "an unchanged state is not written again"
    );

    // The gRPC stream: chunks that concatenate to one snapshot of the same state.
    let mut stream = h
        .client
        .snapshot(v1::SnapshotRequest::default())
        .await
        .expect("snapshot")
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await.expect("chunk") {
        assert!(chunk.data.len() <= 1 << 20);
        bytes.extend_from_slice(&chunk.data);
    }
    let (_, images) = kvatlas_server::snapshot::read(&bytes[..]).expect("a valid snapshot");
    assert_eq!(digest_of(&images), digest);
    let marks: Vec<_> = images[0]
        .marks
        .iter()
        .map(|(w, m)| (*w, Some(m.position)))
        .collect();
    let expected: Vec<_> = workers
        .iter()
        .map(|w| {
            let last = batches
                .iter()
                .filter(|b| Worker::new(b.message.instance_id, b.message.dp_rank) == *w)
                .filter_map(|b| b.message.seq)
                .max();
            (*w, last)
        })
        .collect();
    assert_eq!(marks, expected, "the watermark of every rank");
    // Filtered by tenant: nothing in another tenant.
    let mut stream = h
        .client
        .snapshot(v1::SnapshotRequest {
            model: String::new(),
            tenant: "elsewhere".into(),
        })
        .await
        .expect("snapshot")
        .into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await.expect("chunk") {
        bytes.extend_from_slice(&chunk.data);
    }
    let (_, images) = kvatlas_server::snapshot::read(&bytes[..]).expect("valid");
    assert!(images.is_empty());
    let report = h.server.shutdown().await;
    assert_eq!(report.indexes[0].digest, digest);
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreadable_snapshots_are_moved_aside_and_the_previous_one_is_used() {
    let dir = temp_dir("corrupt");
    let workers = [Worker::new(7, 0)];
    let batches = script(23, MODEL, &workers, 400, BLOCK);
    let (first, second) = batches.split_at(200);
    let mut older = ReferenceIndex::new();
    apply_script(&mut older, first);
    // Two snapshots: after the first part, then after both.
    let mut h = start(persistent(&dir, None)).await;
    publish_script(&mut h.client, first).await;
    let older_written = h
        .server
        .shutdown()
        .await
        .snapshot
        .expect("dir")
        .expect("ok");
    let mut h = start(persistent(&dir, None)).await;
    publish_script(&mut h.client, second).await;
    let newer_written = h
        .server
        .shutdown()
        .await
        .snapshot
        .expect("dir")
        .expect("ok");
    assert_ne!(older_written.path, newer_written.path);

    for (case, damage) in [
        ("truncated", Damage::Truncate),
        ("bit-flipped", Damage::FlipBit),
        ("newer format version", Damage::NewerVersion),
    ] {
        // The newer file damaged; the older one intact.
        let pristine = std::fs::read(&newer_written.path).expect("read");
        let mut bytes = pristine.clone();
        match damage {
            Damage::Truncate => bytes.truncate(bytes.len() * 2 / 3),
            Damage::FlipBit => {
                let at = bytes.len() / 2;
                bytes[at] ^= 0x10;
            }
            // The version follows the 8-byte magic.
            Damage::NewerVersion => bytes[8] = 0xff,
        }
        std::fs::write(&newer_written.path, &bytes).expect("damage");
        let mut h = start(persistent(&dir, None)).await;
        assert_eq!(
            h.server.restored(),
            &Restored::DataDir {
                path: older_written.path.clone(),
                memberships: older_written.memberships
            },
            "{case}"
        );
        assert_answers(&mut h, &older, 8, case).await;
        let mut aside = newer_written.path.clone().into_os_string();
        aside.push(".rejected");
        // A damaged file is moved aside; a newer build's (a rollback) is sound and left for a
        // roll forward, not counted as rejected.
        let moved = !matches!(damage, Damage::NewerVersion);
        let (_, metrics) = http_get(h.server.http_addr(), "/metrics", None);
        assert_eq!(
            metric(&metrics, "kvatlas_snapshot_files_rejected_total"),
            Some(if moved { 1.0 } else { 0.0 }),
            "{case}"
        );
        assert_eq!(
            (PathBuf::from(&aside).is_file(), newer_written.path.exists()),
            (moved, !moved),
            "{case}: moved aside, or left in place"
        );
        // Shut down without a new snapshot changing the picture: put the files back.
        drop(h.client);
        let report = h.server.shutdown().await;
        let _ = std::fs::remove_file(report.snapshot.expect("dir").expect("ok").path);
        if moved {
            std::fs::rename(&aside, &newer_written.path).expect("restore the file");
        }
        std::fs::write(&newer_written.path, &pristine).expect("restore the bytes");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_that_does_not_fit_the_server_is_set_aside_whole_and_the_previous_one_used() {
    let dir = temp_dir("unfit");
    let workers = [Worker::new(7, 0)];
    let batches = script(29, MODEL, &workers, 200, BLOCK);
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    // The older snapshot holds one index; the newer one a second index as well.
    let mut h = start(persistent(&dir, None)).await;
    publish_script(&mut h.client, &batches).await;
    let older = h
        .server
        .shutdown()
        .await
        .snapshot
        .expect("dir")
        .expect("ok");
    let mut h = start(persistent(&dir, None)).await;
    publish_script(
        &mut h.client,
        &script(31, "another-model", &workers, 50, BLOCK),
    )
    .await;
    let newer = h
        .server
        .shutdown()
        .await
        .snapshot
        .expect("dir")
        .expect("ok");

    // A server allowed one index cannot restore the newer file: it is set aside whole (not
    // its first index only) and the older one is restored.
    let mut config = persistent(&dir, None);
    config.limits.max_indexes = 1;
    let mut h = start(config).await;
    assert_eq!(
        h.server.restored(),
        &Restored::DataDir {
            path: older.path.clone(),
            memberships: older.memberships
        }
    );
    assert_answers(&mut h, &reference, 12, "the older snapshot").await;
    let indexes = h
        .client
        .list_indexes(v1::ListIndexesRequest::default())
        .await
        .expect("listed")
        .into_inner()
        .indexes;
    let models: Vec<_> = indexes
        .iter()
        .filter_map(|i| i.index.as_ref().map(|s| s.model.as_str()))
        .collect();
    assert_eq!(models, [MODEL], "nothing of the newer file was applied");
    let (_, metrics) = http_get(h.server.http_addr(), "/metrics", None);
    assert_eq!(
        metric(&metrics, "kvatlas_snapshot_files_rejected_total"),
        Some(1.0)
    );
    let mut aside = newer.path.clone().into_os_string();
    aside.push(".rejected");
    assert!(PathBuf::from(&aside).is_file() && !newer.path.exists());
    drop(h.client);
    h.server.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Starts a replica with `config`, which must bootstrap from `peer`'s native snapshot and then
/// answer like `reference`; shuts it down, checks its final digest against the reference and
/// returns that digest.
async fn bootstrapped_replica(
    config: ServerConfig,
    peer: &str,
    reference: &ReferenceIndex,
    seed: u64,
    what: &str,
) -> u64 {
    let mut replica = start(config).await;
    let outcome = replica.server.bootstrap().await.expect("a bootstrap ran");
    assert!(
        matches!(&outcome, Bootstrap::Snapshot { peer: used, .. } if used == peer),
        "{what}: expected {peer}'s snapshot, got {outcome:?}"
    );
    assert_answers(&mut replica, reference, seed, what).await;
    let report = replica.server.shutdown().await;
    assert_eq!(
        report.indexes[0].digest,
        reference.snapshot().digest(),
        "{what}"
    );
    report.indexes[0].digest
}

#[derive(Clone, Copy)]
enum Damage {
    Truncate,
    FlipBit,
    NewerVersion,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_bootstraps_from_a_peer_snapshot() {
    let workers = [Worker::new(1, 0), Worker::new(2, 0), Worker::new(2, 1)];
    let batches = script(24, MODEL, &workers, 600, BLOCK);
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    let mut a = start(ServerConfig::default()).await;
    publish_script(&mut a.client, &batches).await;

    let peer = format!("http://{}", a.server.http_addr());
    let mut b = start(ServerConfig {
        // An unreachable peer first: it is skipped.
        peers: vec!["http://127.0.0.1:9".into(), peer.clone()],
        ..ServerConfig::default()
    })
    .await;
    assert_eq!(b.server.restored(), &Restored::Peers);
    let outcome = b.server.bootstrap().await.expect("a bootstrap ran");
    let Bootstrap::Snapshot {
        peer: used,
        memberships,
    } = outcome
    else {
        panic!("expected the native snapshot, got {outcome:?}");
    };
    assert_eq!(used, peer);
    assert!(memberships > 0);
    assert!(b.server.ready());
    assert_answers(&mut b, &reference, 9, "the replica").await;
    let (_, peers) = http_get(b.server.http_addr(), "/peers", None);
    assert!(peers.contains(&peer), "{peers}");
    let b_report = b.server.shutdown().await;
    let a_report = a.server.shutdown().await;
    assert_eq!(b_report.indexes[0].digest, reference.snapshot().digest());
    assert_eq!(a_report.indexes[0].digest, b_report.indexes[0].digest);
}

/// `GET /snapshot` of `server`, whole.
async fn fetched_snapshot(server: &Harness) -> Vec<u8> {
    let addr = server.server.http_addr();
    let (status, whole) =
        tokio::task::spawn_blocking(move || http_get_bytes(addr, "/snapshot", None))
            .await
            .expect("fetched");
    assert_eq!(status, 200);
    whole
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_breaks_off_mid_snapshot_is_skipped_and_nothing_of_it_restored() {
    let workers = [Worker::new(1, 0), Worker::new(2, 0)];
    let batches = script(25, MODEL, &workers, 300, BLOCK);
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    let mut a = start(ServerConfig::default()).await;
    publish_script(&mut a.client, &batches).await;
    let whole = fetched_snapshot(&a).await;
    assert!(whole.len() > 100, "{} bytes", whole.len());

    // A peer that announces the whole snapshot and sends half of it.
    let broken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let broken_addr = broken.local_addr().expect("addr");
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        if let Ok((mut stream, _)) = broken.accept() {
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            let _ = write!(
                stream,
                "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\n\r\n",
                whole.len()
            );
            let _ = stream.write_all(&whole[..whole.len() / 2]);
        }
    });

    let peer = format!("http://{}", a.server.http_addr());
    let b_digest = bootstrapped_replica(
        ServerConfig {
            peers: vec![format!("http://{broken_addr}"), peer.clone()],
            ..ServerConfig::default()
        },
        &peer,
        &reference,
        10,
        "the replica, the broken peer skipped for the next one",
    )
    .await;
    let a_report = a.server.shutdown().await;
    assert_eq!(a_report.indexes[0].digest, b_digest);

    // Alone, the broken peer leaves the replica empty, with the reason.
    let broken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let broken_addr = broken.local_addr().expect("addr");
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        if let Ok((mut stream, _)) = broken.accept() {
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            let _ = stream.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 1000\r\n\r\nKVATSNAP");
        }
    });
    let mut c = start(ServerConfig {
        peers: vec![format!("http://{broken_addr}")],
        ..ServerConfig::default()
    })
    .await;
    let outcome = c.server.bootstrap().await.expect("a bootstrap ran");
    let Bootstrap::Empty { failures } = &outcome else {
        panic!("expected an empty start, got {outcome:?}");
    };
    assert_eq!(failures.len(), 1, "{failures:?}");
    assert!(
        failures[0].contains(&broken_addr.to_string()),
        "{failures:?}"
    );
    let c_report = c.server.shutdown().await;
    assert!(
        c_report.indexes.iter().all(|i| i.memberships == 0),
        "{c_report:?}"
    );
}

/// A peer on a loopback port that answers its first `busy` requests 429 and 503 in turn (busy,
/// then still starting), then the next with
/// `whole` as its snapshot (once `gate`, if any, lets it); returns its URL and the count of
/// requests it read.
fn busy_peer(
    busy: usize,
    whole: Vec<u8>,
    gate: Option<std::sync::mpsc::Receiver<()>>,
) -> (String, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&asked);
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        for answer in 0..=busy {
            let Ok((mut stream, _)) = listener.accept() else {
                return;
            };
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            if answer < busy {
                let _ = stream.write_all(if answer % 2 == 0 {
                    b"HTTP/1.1 429 Too Many Requests\r\ncontent-length: 4\r\nconnection: close\r\n\r\nbusy"
                } else {
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 4\r\nconnection: close\r\n\r\nwait"
                });
            } else {
                if let Some(gate) = &gate {
                    let _ = gate.recv();
                }
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    whole.len()
                );
                let _ = stream.write_all(&whole);
            }
        }
    });
    (url, asked)
}

/// A peer serving its limit of whole-state reads answers 429, and one still starting 503: the
/// replica asks again (the replicas of a fleet started or replaced together bootstrap from each
/// other) and bootstraps. (A 503 failed the peer at once, and the replica started empty.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_peer_is_asked_again() {
    let workers = [Worker::new(1, 0), Worker::new(2, 0)];
    let batches = script(26, MODEL, &workers, 300, BLOCK);
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    let mut a = start(ServerConfig::default()).await;
    publish_script(&mut a.client, &batches).await;
    let whole = fetched_snapshot(&a).await;

    // A peer that is busy, then not ready, then serves the snapshot.
    let (peer, asked) = busy_peer(2, whole, None);
    let b_digest = bootstrapped_replica(
        ServerConfig {
            peers: vec![peer.clone()],
            ..ServerConfig::default()
        },
        &peer,
        &reference,
        11,
        "the replica, after the peer was busy twice",
    )
    .await;
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 3);
    let a_report = a.server.shutdown().await;
    assert_eq!(a_report.indexes[0].digest, b_digest);
}

/// A peer shutting down answers 503 for good: the replica does not wait for it, as it waits for
/// one still bootstrapping, but tries the next peer at once (here none: it starts empty).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_shutting_down_is_not_waited_for() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let peer = format!("http://{}", listener.local_addr().expect("addr"));
    let asked = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&asked);
    std::thread::spawn(move || {
        use std::io::{Read, Write};
        let body = "the server is shutting down";
        while let Ok((mut stream, _)) = listener.accept() {
            let mut request = [0u8; 1024];
            let _ = stream.read(&mut request);
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let _ = write!(
                stream,
                "HTTP/1.1 503 Service Unavailable\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    let mut replica = start(ServerConfig {
        peers: vec![peer],
        ..ServerConfig::default()
    })
    .await;
    let outcome = replica.server.bootstrap().await.expect("a bootstrap ran");
    let Bootstrap::Empty { failures } = &outcome else {
        panic!("no snapshot from a peer shutting down: {outcome:?}");
    };
    assert!(failures[0].contains("shutting down"), "{failures:?}");
    assert_eq!(asked.load(std::sync::atomic::Ordering::SeqCst), 1);
    replica.server.shutdown().await;
}

/// A peer behind TLS and authentication (as any peer listening beyond loopback is): a replica
/// with the peer's CA and an every-tenant token bootstraps from it over https; without a token,
/// or with a token of one tenant, the peer refuses and the replica says why and starts empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_bootstraps_from_a_tls_peer_with_a_token() {
    let dir = temp_dir("tls-peer");
    let workers = [Worker::new(1, 0), Worker::new(2, 0)];
    let batches = script(31, MODEL, &workers, 300, BLOCK);
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    // The peer's state, put in its data directory by a plain run.
    let mut loader = start(persistent(&dir.join("data"), None)).await;
    publish_script(&mut loader.client, &batches).await;
    loader.server.shutdown().await;

    self_signed_certificate(&dir);
    std::fs::write(
        dir.join("tokens"),
        "admin-0123456789abcdef name=admin\nteam-0123456789abcdef tenants=a name=team\n",
    )
    .expect("write");
    std::fs::write(dir.join("admin"), "admin-0123456789abcdef\n").expect("write");
    std::fs::write(dir.join("team"), "team-0123456789abcdef\n").expect("write");
    let peer = kvatlas_server::RunningServer::start(ServerConfig {
        tls: Some(kvatlas_server::TlsFiles {
            cert: dir.join("cert.pem"),
            key: dir.join("key.pem"),
        }),
        auth_tokens: Some(dir.join("tokens")),
        ..persistent(&dir.join("data"), None)
    })
    .await
    .expect("the TLS peer starts");
    assert!(matches!(peer.restored(), Restored::DataDir { .. }));
    let url = format!("https://{}", peer.http_addr());

    for (token, expected) in [(None, "401"), (Some("team"), "403")] {
        let mut refused = start(ServerConfig {
            peers: vec![url.clone()],
            peer_token_file: token.map(|t| dir.join(t)),
            peer_ca_cert: Some(dir.join("cert.pem")),
            ..ServerConfig::default()
        })
        .await;
        let outcome = refused.server.bootstrap().await.expect("a bootstrap ran");
        let Bootstrap::Empty { failures } = &outcome else {
            panic!("token {token:?}: expected an empty start, got {outcome:?}");
        };
        assert!(
            failures[0].contains(expected) && failures[0].contains("--peer-token-file"),
            "{failures:?}"
        );
        refused.server.shutdown().await;
    }
    // Without the peer's CA, the system's roots do not know the self-signed certificate.
    let mut untrusting = start(ServerConfig {
        peers: vec![url.clone()],
        peer_token_file: Some(dir.join("admin")),
        ..ServerConfig::default()
    })
    .await;
    let outcome = untrusting
        .server
        .bootstrap()
        .await
        .expect("a bootstrap ran");
    assert!(
        matches!(&outcome, Bootstrap::Empty { failures } if failures[0].contains("TLS")),
        "{outcome:?}"
    );
    untrusting.server.shutdown().await;

    bootstrapped_replica(
        ServerConfig {
            peers: vec![url.clone()],
            peer_token_file: Some(dir.join("admin")),
            peer_ca_cert: Some(dir.join("cert.pem")),
            ..ServerConfig::default()
        },
        &url,
        &reference,
        5,
        "the replica of a TLS peer",
    )
    .await;
    peer.shutdown().await;
}

/// While a replica restores a peer's snapshot, writes are refused with UNAVAILABLE / 503 (to
/// retry): applied then, the restore would overwrite them, and a listener registered then would
/// have moved past what it applied. Once restored, the replica holds the peer's state exactly
/// and takes writes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_during_a_peer_bootstrap_are_refused_and_the_restore_is_exact() {
    let workers = [Worker::new(1, 0), Worker::new(2, 0)];
    let batches = script(27, MODEL, &workers, 200, BLOCK);
    let mut reference = ReferenceIndex::new();
    apply_script(&mut reference, &batches);
    let mut a = start(ServerConfig::default()).await;
    publish_script(&mut a.client, &batches).await;
    let whole = fetched_snapshot(&a).await;

    // A peer that is busy once, then serves the snapshot when the test says so.
    let (go, go_ahead) = std::sync::mpsc::channel::<()>();
    let (peer, _) = busy_peer(1, whole, Some(go_ahead));
    let mut b = start(ServerConfig {
        peers: vec![peer.clone()],
        ..ServerConfig::default()
    })
    .await;
    // A batch of a third worker, a registration and an unregistration, over gRPC and HTTP.
    let extra = script(28, MODEL, &[Worker::new(3, 0)], 5, BLOCK);
    let published = b
        .client
        .publish_events(tokio_stream::iter(
            extra.iter().map(|b| b.message.clone()).collect::<Vec<_>>(),
        ))
        .await;
    let refused = published.expect_err("publishing is refused while bootstrapping");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("retry"), "{refused:?}");
    let registered = b
        .client
        .register_worker(v1::RegisterWorkerRequest {
            index: selector(MODEL, ""),
            instance_id: 4,
            block_size: BLOCK,
            endpoint: "tcp://127.0.0.1:9".into(),
            ..v1::RegisterWorkerRequest::default()
        })
        .await
        .expect_err("registering is refused while bootstrapping");
    assert_eq!(registered.code(), tonic::Code::Unavailable);
    let unregistered = b
        .client
        .unregister_worker(v1::UnregisterWorkerRequest {
            index: selector(MODEL, ""),
            instance_id: 1,
            ..v1::UnregisterWorkerRequest::default()
        })
        .await
        .expect_err("unregistering is refused while bootstrapping");
    assert_eq!(unregistered.code(), tonic::Code::Unavailable);
    let http = b.server.http_addr();
    let (status, body) = tokio::task::spawn_blocking(move || {
        http_post_json(
            http,
            "/register",
            &format!(
                r#"{{"instance_id": 5, "endpoint": "tcp://127.0.0.1:9", "model_name": "{MODEL}", "block_size": {BLOCK}}}"#
            ),
        )
    })
    .await
    .expect("posted");
    assert_eq!(status, 503, "{body}");

    go.send(()).expect("the peer waits");
    let outcome = b.server.bootstrap().await.expect("a bootstrap ran");
    assert!(
        matches!(&outcome, Bootstrap::Snapshot { peer: used, .. } if *used == peer),
        "{outcome:?}"
    );
    assert_answers(&mut b, &reference, 12, "the replica after refused writes").await;
    // Ready: writes are taken again.
    publish_script(&mut b.client, &extra).await;
    apply_script(&mut reference, &extra);
    assert_answers(&mut b, &reference, 13, "the replica after a write").await;
    let report = b.server.shutdown().await;
    assert_eq!(report.indexes[0].digest, reference.snapshot().digest());
    a.server.shutdown().await;
}

/// A shutdown while the bootstrap from a peer is under way writes no final snapshot to the
/// data directory: written, its half-built state would be taken for the server's own at the
/// next start, which would then never bootstrap again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_during_a_peer_bootstrap_writes_no_snapshot() {
    let dir = temp_dir("bootstrap-shutdown");
    // A peer that takes the request and never answers (until the test ends).
    let (never, gate) = std::sync::mpsc::channel::<()>();
    let (peer, asked) = busy_peer(0, Vec::new(), Some(gate));
    let h = start(ServerConfig {
        peers: vec![peer],
        ..persistent(&dir, None)
    })
    .await;
    wait_until("the peer to be asked", || {
        let asked = std::sync::Arc::clone(&asked);
        async move { asked.load(std::sync::atomic::Ordering::SeqCst) > 0 }
    })
    .await;
    let report = h.server.shutdown().await;
    assert!(report.snapshot.is_none(), "no final snapshot was written");
    assert!(
        snapshot_files(&dir).is_empty(),
        "{:?}",
        snapshot_files(&dir)
    );
    drop(never);
    let _ = std::fs::remove_dir_all(&dir);
}
