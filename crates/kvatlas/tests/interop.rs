//! `kill -9` of the `kvatlas serve` process, mid-stream and mid-snapshot-write, while real vLLM
//! publishers keep publishing: each restart restores the data directory's newest
//! complete snapshot, catches up through the engines' replay endpoints, and in the end the index
//! equals the reference model of everything the engines published.
//!
//! Needs the engines' wheels: run by `cargo xtask interop` (`KVATLAS_INTEROP_DIR`).

mod common;
#[path = "../../../xtask/interop/driver.rs"]
mod driver;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{BIN, Served};
use driver::{BLOCK, Fleet, WAIT};
use kvatlas_events::EngineKind;
use kvatlas_index::KvIndex as _;
use serde_json::Value;

const MODEL: &str = "m";
/// How many times the test tries to kill the server while a snapshot's temporary file exists.
const MID_WRITE_ATTEMPTS: usize = 20;

fn serve_args(fleet: &Fleet, dir: &Path) -> Vec<String> {
    let workers: Vec<String> = fleet
        .members
        .iter()
        .map(|m| {
            format!(
                "{}={},replay={}",
                m.instance_id,
                m.endpoint(),
                m.replay_endpoint()
            )
        })
        .collect();
    [
        "--data-dir",
        &dir.display().to_string(),
        "--snapshot-interval-secs",
        "1",
        "--workers",
        &workers.join(","),
        "--block-size",
        &BLOCK.to_string(),
        "--model",
        MODEL,
    ]
    .map(str::to_owned)
    .to_vec()
}

fn start(args: &[String]) -> Served {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Served::start(&args)
}

/// `kvatlas workers --json` against a running server.
fn workers(served: &Served) -> Vec<Value> {
    let out = Command::new(BIN)
        .args(["workers", "--server", &served.grpc, "--json"])
        .output()
        .expect("kvatlas workers");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    match serde_json::from_slice(&out.stdout).expect("JSON") {
        Value::Array(workers) => workers,
        other => panic!("not a list: {other}"),
    }
}

/// Nudges the fleet until the server applied every member's last batch.
fn settle(fleet: &mut Fleet, served: &Served) {
    let start = Instant::now();
    loop {
        let listed = workers(served);
        let behind = fleet.members.iter().any(|m| {
            let seq = listed
                .iter()
                .find(|w| w["instance_id"] == m.instance_id)
                .and_then(|w| w["last_seq"].as_u64());
            seq != m.last_seq()
        });
        if !behind {
            return;
        }
        assert!(
            start.elapsed() < WAIT,
            "the server never caught up: {listed:?}"
        );
        std::thread::sleep(Duration::from_millis(300));
        fleet.nudge();
    }
}

fn names(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(Result::ok)
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

fn has_temp_file(dir: &Path) -> bool {
    names(dir).iter().any(|n| n.starts_with(".tmp-snapshot-"))
}

fn has_snapshot(dir: &Path) -> bool {
    names(dir).iter().any(|n| n.ends_with(".kvs"))
}

#[test]
#[ignore = "needs the engines' wheels: run `cargo xtask interop`"]
fn kill_9_mid_stream_and_mid_snapshot_write_then_restart_equals_the_reference() {
    let dir: PathBuf = std::env::temp_dir().join(format!("kvatlas-kill9-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut fleet = Fleet::spawn("vllm", "0.33.0", &[31, 32, 33]);
    let args = serve_args(&fleet, &dir);

    // 1. Serve, let the engines publish, wait for a periodic snapshot, then SIGKILL mid-stream:
    //    the engines keep publishing while the server is down and while it restarts.
    let served = start(&args);
    fleet.round(30, false);
    settle(&mut fleet, &served);
    let deadline = Instant::now() + WAIT;
    while !has_snapshot(&dir) {
        assert!(Instant::now() < deadline, "no periodic snapshot in {dir:?}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let stop = Arc::new(AtomicBool::new(false));
    let publishing = fleet.publish_in_background(5, false, Duration::from_millis(10), stop.clone());
    std::thread::sleep(Duration::from_millis(700));
    served.kill_9();

    // 2. Restart; kill -9 again while a snapshot's temporary file exists (the write is caught
    //    between create and rename), until a kill lands inside a write.
    let mut caught_mid_write = false;
    for attempt in 1..=MID_WRITE_ATTEMPTS {
        let served = start(&args);
        let restored = served.restored_memberships();
        eprintln!("restart {attempt}: {restored} memberships restored");
        assert!(restored > 0);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && !has_temp_file(&dir) {
            std::hint::spin_loop();
        }
        served.kill_9();
        if has_temp_file(&dir) {
            caught_mid_write = true;
            break;
        }
    }
    assert!(
        caught_mid_write,
        "no kill in {MID_WRITE_ATTEMPTS} attempts landed while a snapshot was being written"
    );

    // 3. Restart once more: the temporary file is removed, the newest complete snapshot is
    //    restored, the listeners catch up through replay; the engines stop, the server settles.
    let served = start(&args);
    let restored = served.restored_memberships();
    eprintln!("final restart: {restored} memberships restored");
    assert!(restored > 0);
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Release);
    let mut fleet = publishing.join().expect("the publishing thread");
    settle(&mut fleet, &served);
    assert!(!has_temp_file(&dir), "{:?}", names(&dir));
    for worker in workers(&served) {
        let counters = &worker["counters"];
        eprintln!("worker {}: {counters}", worker["instance_id"]);
        assert_eq!(counters["resyncs"], 0, "nothing lost: {worker}");
        assert!(
            counters["catch_ups"].as_u64().unwrap_or(0) > 0,
            "the restart caught up through replay: {worker}"
        );
    }

    // 4. SIGTERM: the index equals the reference model of every published batch.
    let reference = fleet.reference(EngineKind::Vllm);
    let digest = format!("digest {:#018x}", reference.snapshot().digest());
    let (status, stdout) = served.terminate();
    assert!(status.success(), "{status:?}");
    assert!(stdout.contains(&digest), "{stdout}\nwanted {digest}");
    fleet.quit();
    let _ = std::fs::remove_dir_all(&dir);
}
