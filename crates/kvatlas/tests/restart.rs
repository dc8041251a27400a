//! Restarts with mock vLLM engines publishing on ZMQ (with replay), every server a `kvatlas
//! serve` process with a data directory:
//!
//! - stopped gracefully (SIGTERM) while the engines keep publishing, and started again on the
//!   same directory while they still publish: nothing is lost and nothing applied twice — the
//!   final snapshot holds every rank's watermark, each listener catches up through the engine's
//!   replay, and the index ends equal to the engines' caches with no resync;
//! - restarted after the engines published more than their replay rings hold: the hole cannot be
//!   filled, so the ranks concerned are resynced, and that shows in `ListWorkers`, `/workers` and
//!   the metrics; the index then never credits a worker with a block its engine does not hold.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::Served;
use common::fleet::{
    CONVERGE, Fleet, converges, http_get, metric, metric_sum, runtime, signal, state_memberships,
};
use kvatlas_fleet::vllm::BLOCK_TOKENS;
use kvatlas_proto::v1::{self, indexer_client::IndexerClient};

const MODEL: &str = "m";

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvatlas-restart-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// `kvatlas serve` for the fleet's engines with a data directory (snapshots only at shutdown).
fn serve_args(fleet: &Fleet, dir: &Path) -> Vec<String> {
    [
        "--data-dir",
        &dir.display().to_string(),
        "--snapshot-interval-secs",
        "0",
        "--model",
        MODEL,
        "--block-size",
        &BLOCK_TOKENS.to_string(),
        "--workers",
        &fleet.workers_arg(),
    ]
    .map(str::to_owned)
    .to_vec()
}

fn serve(args: &[String]) -> Served {
    Served::start(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// SIGTERM, then waits for the graceful stop (the final snapshot written).
fn stop(mut served: Served) {
    signal(&served, "TERM");
    let status = served.child.wait().expect("the server exits");
    assert!(status.success(), "a graceful stop exits 0: {status}");
}

/// Every rank, from `ListWorkers`.
fn workers(served: &Served) -> Vec<v1::WorkerInfo> {
    runtime().block_on(async {
        let mut client = IndexerClient::connect(served.grpc.clone())
            .await
            .expect("connects");
        client
            .list_workers(v1::ListWorkersRequest::default())
            .await
            .expect("ListWorkers")
            .into_inner()
            .workers
    })
}

/// Every rank's counters, from `ListWorkers`.
fn counters(served: &Served) -> Vec<v1::WorkerCounters> {
    workers(served)
        .into_iter()
        .map(|w| w.counters.unwrap_or_default())
        .collect()
}

#[test]
fn a_graceful_stop_and_restart_while_the_engines_publish_loses_nothing() {
    let dir = temp_dir("graceful");
    let mut fleet = Fleet::new();
    let args = serve_args(&fleet, &dir);
    let served = serve(&args);
    fleet.wait_subscribed(1);
    fleet.serve(200);
    converges(&served, &fleet, "before the stop");

    // The engines keep publishing through the stop, the time the server is down, and its start.
    let publishing = Arc::new(AtomicBool::new(true));
    let feeder = {
        let publishing = Arc::clone(&publishing);
        std::thread::spawn(move || {
            while publishing.load(Ordering::Acquire) {
                fleet.serve(4);
                std::thread::sleep(Duration::from_millis(5));
            }
            fleet
        })
    };
    std::thread::sleep(Duration::from_millis(200));
    stop(served);
    std::thread::sleep(Duration::from_millis(300));
    // The same command line, as a supervisor restarts it.
    let served = serve(&args);
    assert!(served.restored_memberships() > 0);
    std::thread::sleep(Duration::from_millis(300));
    publishing.store(false, Ordering::Release);
    let mut fleet = feeder.join().expect("the feeder");
    fleet.serve(20);
    converges(&served, &fleet, "after the restart");

    let counters = counters(&served);
    assert_eq!(counters.len(), fleet.engines.caches().len());
    for c in &counters {
        assert_eq!(c.resyncs, 0, "nothing lost: {c:?}");
        assert_eq!(c.catch_ups, 1, "each listener caught up once: {c:?}");
    }
    assert!(
        counters.iter().map(|c| c.batches_replayed).sum::<u64>() > 0,
        "what the engines published while the server was down came back by replay: \
         {counters:?}"
    );
    stop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// The server again, on the same directory and without `--workers`: its registrations come
/// from the snapshot.
fn serve_again(dir: &Path) -> Served {
    let dir = dir.display().to_string();
    Served::start(&["--data-dir", &dir, "--snapshot-interval-secs", "0"])
}

/// A final snapshot that fails (here the data directory was replaced by a file) makes `serve`
/// exit 1 naming it, after its summary: a supervisor must not take the stop for a clean one
/// (it exited 0).
#[test]
fn a_failed_final_snapshot_fails_the_exit() {
    let dir = temp_dir("unwritable");
    let served = Served::start(&["--data-dir", &dir.display().to_string()]);
    std::fs::remove_dir_all(&dir).expect("the directory removed");
    std::fs::write(&dir, b"not a directory").expect("a file in its place");
    let (status, summary) = served.terminate();
    assert_eq!(status.code(), Some(1), "{summary}");
    assert!(summary.contains("the final snapshot failed"), "{summary}");
    let _ = std::fs::remove_file(&dir);
}

/// A second server on a data directory in use is refused at start, naming the lock: it would
/// have removed the first's snapshot under way as a crash's leftover, pruned its snapshots and
/// written its own among them. The first goes on and stops gracefully.
#[test]
fn a_second_server_on_a_data_directory_in_use_is_refused() {
    let dir = temp_dir("locked");
    let dir_arg = dir.display().to_string();
    let first = Served::start(&["--data-dir", &dir_arg]);
    let (status, log) = common::refused_start(&["--data-dir", &dir_arg]);
    assert!(!status.success(), "{log}");
    assert!(
        log.contains("another kvatlas server uses it") && log.contains(".lock"),
        "{log}"
    );
    stop(first);
    let again = Served::start(&["--data-dir", &dir_arg]);
    stop(again);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hole_the_replay_ring_no_longer_holds_is_resynced_counted_and_shown() {
    const RING: usize = 8;
    let dir = temp_dir("ring");
    let mut fleet = Fleet::with_ring(Some(RING));
    let served = serve(&serve_args(&fleet, &dir));
    fleet.wait_subscribed(1);
    fleet.serve(100);
    converges(&served, &fleet, "before the stop");
    stop(served);
    // Far more batches than an engine's ring holds, while the server is down.
    let before = fleet.batches;
    fleet.serve(400);
    assert!(fleet.batches - before > 2 * RING as u64 * u64::from(common::fleet::WORKERS));

    let served = serve_again(&dir);
    assert!(served.restored_memberships() > 0);
    let started = Instant::now();
    while metric_sum(
        &served,
        "kvatlas_sequence_events_total",
        "kind=\"replay_resync\"",
    ) == 0
    {
        assert!(
            started.elapsed() < CONVERGE,
            "no replay resync counted: {:?}",
            served.log_lines()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Some listeners may not be subscribed yet: the batches their engines publish before that
    // are lost on the live stream, and nothing after them shows the gap; the listeners' probes
    // of the quiet streams (`--quiet-probe-ms`, 2 s) fetch them.
    fleet.serve(50);
    // Visible per rank over gRPC and on Dynamo's /workers, and never an over-credit: every
    // membership the server holds, the engines hold.
    let started = Instant::now();
    loop {
        let counters = counters(&served);
        let resynced = counters.iter().filter(|c| c.replay_resyncs > 0).count();
        let held = state_memberships(&served.grpc).expect("the snapshot reads");
        let engines = fleet.held();
        let over: Vec<_> = held.difference(&engines).collect();
        if resynced > 0 && over.is_empty() {
            assert!(counters.iter().all(|c| c.resyncs >= c.replay_resyncs));
            break;
        }
        assert!(
            started.elapsed() < CONVERGE,
            "resynced ranks {resynced}, memberships the engines do not hold: {over:?}; \
             counters {counters:?}; the server's log: {:#?}",
            served.log_lines()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let workers = http_get(&served, "/workers").expect("GET /workers");
    // The JSON list is the body (axum sends it in one piece).
    let body = &workers[workers.find('[').unwrap_or(0)..workers.rfind(']').map_or(0, |e| e + 1)];
    let listed: serde_json::Value = serde_json::from_str(body).expect("/workers is JSON");
    let shown: u64 = listed
        .as_array()
        .expect("a list")
        .iter()
        .flat_map(|w| w["listeners"].as_object().into_iter().flatten())
        .map(|(_, l)| l["sequence"]["replay_resyncs"].as_u64().unwrap_or(0))
        .sum();
    assert!(shown > 0, "/workers shows the replay resyncs: {listed}");
    stop(served);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A restart whose `--workers` name a rank's engine at another address (here the same engine
/// as `localhost` instead of `127.0.0.1`, as after a pod moved) starts, registers the
/// configured address and continues from the rank's watermark; one whose `--block-size`
/// contradicts the snapshot's index sets the snapshot aside and starts empty. Neither is a
/// crash loop.
#[test]
fn a_restart_with_changed_workers_starts_and_the_configuration_wins() {
    let dir = temp_dir("changed");
    let mut fleet = Fleet::new();
    let args = serve_args(&fleet, &dir);
    let served = serve(&args);
    fleet.wait_subscribed(1);
    fleet.serve(100);
    converges(&served, &fleet, "before the stop");
    stop(served);

    let moved: Vec<String> = args
        .iter()
        .map(|a| a.replace("127.0.0.1", "localhost"))
        .collect();
    assert_ne!(moved, args, "the endpoints changed");
    let served = serve(&moved);
    assert!(served.restored_memberships() > 0, "the snapshot restored");
    fleet.serve(50);
    converges(&served, &fleet, "after the restart at the new addresses");
    let endpoints: Vec<String> = workers(&served).into_iter().map(|w| w.endpoint).collect();
    assert_eq!(endpoints.len(), fleet.engines.caches().len());
    assert!(
        endpoints.iter().all(|e| e.contains("localhost")),
        "the configured addresses: {endpoints:?}"
    );
    for c in counters(&served) {
        assert_eq!(c.resyncs, 0, "continued from the watermark: {c:?}");
    }
    stop(served);

    let mut resized = moved.clone();
    let at = resized
        .iter()
        .position(|a| a == "--block-size")
        .expect("a block size flag");
    resized[at + 1] = (BLOCK_TOKENS * 2).to_string();
    let served = serve(&resized);
    assert!(
        !served
            .startup_log
            .iter()
            .any(|l| l.contains("restored the data directory's snapshot")),
        "the snapshot set aside: {:?}",
        served.startup_log
    );
    assert_eq!(
        metric(&served, "kvatlas_snapshot_files_rejected_total"),
        2,
        "the snapshots of both stops"
    );
    stop(served);
    let _ = std::fs::remove_dir_all(&dir);
}
