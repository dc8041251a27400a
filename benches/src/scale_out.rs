//! Scale-out over NATS JetStream, measured (`cargo xtask bench scale-out`): the end-to-end
//! benchmark's fleet and probes (`crate::e2e`) against `kvatlas serve` alone and against
//! `kvatlas serve --publish-to --publish-only` (the ingest role: it decodes, re-hashes,
//! sequences and publishes; `scale-out-bench --indexing-ingest` lets it keep an index too) → a
//! real nats-server → `kvatlas serve --consume-from` replicas, in the same run, on the same
//! stream:
//!
//! - **Lag**: the e2e probe's publish-to-visible lag, asked of the first replica, at Workload A's
//!   pace (an upper bound: it includes one query's round trip).
//! - **Event rate**: the whole stream published as fast as the fleet can, until the marker is
//!   visible on the first replica (alone: on the server), events per second.
//! - **Bootstrap**: once the Workload A state is built and a replica has written its snapshot,
//!   a new replica process is started; the time from its spawn to `/ready` answering 200.
//! - **Wire bytes**: the bytes of the records the stream stored (subject, `Nats-Msg-Id` header,
//!   payload) per vLLM event the engines published.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvatlas_fleet::nats::NatsServer;
use serde::Serialize;

use crate::e2e::{ServiceKind, Summary};
use crate::http::{self, Connection};
use crate::service::Server;

/// An ingest, a nats-server and replicas, each a process.
pub(crate) struct Replicated {
    nats: NatsServer,
    kvatlas: PathBuf,
    /// Extra arguments of every kvatlas process (see `Settings::kvatlas_args`).
    extra: Vec<String>,
    /// The ingest (workers are registered with it).
    pub(crate) ingest: Server,
    /// The replicas (queries go to the first).
    pub(crate) replicas: Vec<Server>,
}

/// What the event log measured in one run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct LogFigures {
    /// From a new replica's spawn to `/ready` 200 on the built state, ms.
    pub bootstrap_ms: f64,
    /// Bytes of the stored records per vLLM event published.
    pub wire_bytes_per_event: f64,
    /// Records the ingest published.
    pub records: u64,
    /// The first replica's `kvatlas_log_lag_seconds` (stream stored → replica applied): the
    /// bucket bounds holding its 50th and 99th percentiles, ms.
    pub replica_lag_p50_ms: f64,
    /// The 99th percentile's bucket bound.
    pub replica_lag_p99_ms: f64,
    /// The ingest's `kvatlas_log_publish_seconds` (queued → acknowledged by the stream), p99
    /// bucket bound, ms.
    pub publish_p99_ms: f64,
    /// The first replica's `kvatlas_log_stored_age_seconds` (a batch's engine stamp → the
    /// stream storing its record: the engine, the ingest and NATS), p50 bucket bound, ms.
    pub stored_age_p50_ms: f64,
    /// Its 99th percentile's bucket bound.
    pub stored_age_p99_ms: f64,
    /// Of the records the first replica applied, the share applied off the live path (before
    /// the stream delivered them), %.
    pub live_applied_pct: f64,
    /// The first replica's live-path divergences (0 with one ingest).
    pub live_divergences: u64,
    /// The first replica's `kvatlas_log_live_age_seconds` (a batch's engine stamp → its live
    /// record reaching the replica), p50 and p99 bucket bounds, ms.
    pub live_age_p50_ms: f64,
    /// Its 99th percentile's bucket bound.
    pub live_age_p99_ms: f64,
    /// The ingest's `kvatlas_log_sent_age_seconds` (a batch's engine stamp → the publisher
    /// taking its record), p50 and p99 bucket bounds, ms.
    pub sent_age_p50_ms: f64,
    /// Its 99th percentile's bucket bound.
    pub sent_age_p99_ms: f64,
    /// The first replica's `kvatlas_ingest_delay_seconds` (a record's receipt at the replica →
    /// its events visible), p99 bucket bound, ms: the replica's own share of the event age.
    pub replica_delay_p99_ms: f64,
}

/// Seconds between a replica's snapshots in the benchmark (the default is 30; shorter so a
/// snapshot covers most of the state a new replica bootstraps on).
const SNAPSHOT_INTERVAL_SECS: &str = "5";

/// A kvatlas process's arguments: `extra` (the settings under test), then its role's.
fn with_role(extra: &[String], role: &[&str]) -> Vec<String> {
    let mut args = extra.to_vec();
    args.extend(role.iter().map(|&arg| arg.to_owned()));
    args
}

/// A replica's arguments: `extra`, then its role.
fn replica_args(url: &str, extra: &[String]) -> Vec<String> {
    with_role(
        extra,
        &[
            "--consume-from",
            url,
            "--nats-snapshot-interval-secs",
            SNAPSHOT_INTERVAL_SECS,
        ],
    )
}

impl Replicated {
    /// Starts nats-server, the ingest and `replicas` replicas (at least 1), each kvatlas
    /// process with `extra` arguments before its role's (and the ingest `ingest_extra` after
    /// them).
    pub(crate) fn start(
        kvatlas: &Path,
        replicas: usize,
        extra: &[String],
        ingest_extra: &[String],
    ) -> Result<Self> {
        let nats = NatsServer::start()?;
        let url = nats.url();
        let mut ingest_args = with_role(extra, &["--publish-to", &url]);
        ingest_args.extend_from_slice(ingest_extra);
        let ingest = Server::start(kvatlas, &ingest_args).context("starting the ingest")?;
        let replicas = (0..replicas.max(1))
            .map(|_| {
                Server::start(kvatlas, &replica_args(&url, extra)).context("starting a replica")
            })
            .collect::<Result<Vec<_>>>()?;
        for replica in &replicas {
            wait_ready(replica, Duration::from_secs(30))?;
        }
        Ok(Self {
            nats,
            kvatlas: kvatlas.to_owned(),
            extra: extra.to_vec(),
            ingest,
            replicas,
        })
    }

    /// Every process, named: the ingest, nats-server, the replicas.
    pub(crate) fn processes(&self) -> Vec<(String, u32)> {
        let mut processes = vec![("ingest".to_owned(), self.ingest.pid())];
        processes.extend(self.nats.pid().map(|pid| ("nats-server".to_owned(), pid)));
        processes.extend(
            (1..)
                .zip(&self.replicas)
                .map(|(i, replica)| (format!("replica {i}"), replica.pid())),
        );
        processes
    }

    /// Bootstraps a new replica on the state built so far (after the running replicas wrote
    /// a snapshot of it) and reads the ingest's wire bytes; `events` were published.
    pub(crate) fn figures(&self, events: u64) -> Result<LogFigures> {
        // The replicas snapshot every 5 s, in turn, once caught up: let one cover the state.
        std::thread::sleep(Duration::from_millis(5_500));
        let started = Instant::now();
        let replica = Server::start(&self.kvatlas, &replica_args(&self.nats.url(), &self.extra))
            .context("starting the new replica")?;
        wait_ready(&replica, Duration::from_secs(60))?;
        let bootstrap_ms = started.elapsed().as_secs_f64() * 1e3;
        let consumed = metric(&replica.http, "kvatlas_log_consumed_total")?;
        replica.stop();
        let records = metric(&self.ingest.http, "kvatlas_log_published_total")?;
        if consumed * 2 > records {
            bail!(
                "the new replica read {consumed} of {records} records: it did not start from a \
                 snapshot"
            );
        }
        let bytes = metric(&self.ingest.http, "kvatlas_log_published_bytes_total")?;
        let lag = http::histogram_buckets(&self.replicas[0].http, "kvatlas_log_lag_seconds")?;
        let publish = http::histogram_buckets(&self.ingest.http, "kvatlas_log_publish_seconds")?;
        let stored_age =
            http::histogram_buckets(&self.replicas[0].http, "kvatlas_log_stored_age_seconds")?;
        let first = &self.replicas[0].http;
        let applied = metric(first, "kvatlas_log_applied_total")?;
        let live_applied = metric(first, "kvatlas_log_live_applied_total")?;
        let delay = http::histogram_buckets(first, "kvatlas_ingest_delay_seconds")?;
        let live_age = http::histogram_buckets(first, "kvatlas_log_live_age_seconds")?;
        let sent_age = http::histogram_buckets(&self.ingest.http, "kvatlas_log_sent_age_seconds")?;
        Ok(LogFigures {
            sent_age_p50_ms: http::quantile_bound(&sent_age, 0.5) * 1e3,
            sent_age_p99_ms: http::quantile_bound(&sent_age, 0.99) * 1e3,
            live_age_p50_ms: http::quantile_bound(&live_age, 0.5) * 1e3,
            live_age_p99_ms: http::quantile_bound(&live_age, 0.99) * 1e3,
            replica_delay_p99_ms: http::quantile_bound(&delay, 0.99) * 1e3,
            live_applied_pct: live_applied as f64 * 100.0 / applied.max(1) as f64,
            live_divergences: metric(first, "kvatlas_log_live_divergences_total")?,
            bootstrap_ms,
            wire_bytes_per_event: bytes as f64 / events.max(1) as f64,
            records,
            replica_lag_p50_ms: http::quantile_bound(&lag, 0.5) * 1e3,
            replica_lag_p99_ms: http::quantile_bound(&lag, 0.99) * 1e3,
            publish_p99_ms: http::quantile_bound(&publish, 0.99) * 1e3,
            stored_age_p50_ms: http::quantile_bound(&stored_age, 0.5) * 1e3,
            stored_age_p99_ms: http::quantile_bound(&stored_age, 0.99) * 1e3,
        })
    }

    /// Stops every process.
    pub(crate) fn stop(self) {
        for replica in self.replicas {
            replica.stop();
        }
        self.ingest.stop();
        drop(self.nats);
    }
}

/// Waits until `server`'s `GET /ready` answers 200.
fn wait_ready(server: &Server, timeout: Duration) -> Result<()> {
    let addr = &server.http;
    let deadline = Instant::now() + timeout;
    loop {
        let answer = Connection::connect(addr).and_then(|mut c| c.send(&http::get("/ready")));
        if let Ok((200, _)) = answer {
            return Ok(());
        }
        if Instant::now() > deadline {
            let answer = answer.map_or_else(
                |e| format!("no answer: {e}"),
                |(status, body)| format!("{status} {}", String::from_utf8_lossy(&body)),
            );
            bail!(
                "{addr} was not ready within {timeout:?} (GET /ready: {answer}); its log:\n{}",
                server.log_tail().join("\n")
            );
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A metric's value from `/metrics`.
fn metric(addr: &str, name: &str) -> Result<u64> {
    let mut c = Connection::connect(addr)?;
    let (status, body) = c.send(&http::get("/metrics"))?;
    if status != 200 {
        bail!("GET /metrics on {addr}: {status}");
    }
    let body = String::from_utf8_lossy(&body);
    body.lines()
        .find_map(|line| {
            line.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map(|v| v as u64)
        .with_context(|| format!("{name} is not in {addr}'s /metrics"))
}

fn median(values: Vec<f64>) -> f64 {
    let mut values = values;
    crate::service::median(&mut values)
}

/// How the ingest ran, for the report: `--publish-only` or not, and `extra` arguments.
pub fn ingest_description(publish_only: bool, extra: &[String]) -> String {
    let role = if publish_only {
        "publishes only (`--publish-only`: no index of its own; the replicas answer)"
    } else {
        "keeps an index of its own as well (`--publish-to` without `--publish-only`)"
    };
    if extra.is_empty() {
        format!("the ingest {role}")
    } else {
        format!(
            "the ingest {role}; its extra arguments: {}",
            extra.join(" ")
        )
    }
}

/// The figures of the paced run (lag, bootstrap, bytes) and the unpaced one (event rates),
/// medians over their runs, against the bars; `ingest` says how the ingest ran
/// ([`ingest_description`]).
pub fn markdown(paced: &Summary, unpaced: &Summary, ingest: &str) -> String {
    use std::fmt::Write as _;
    let runs = |summary: &Summary, kind: ServiceKind| -> Vec<crate::e2e::ServiceRun> {
        summary
            .runs
            .iter()
            .flat_map(|r| r.iter().filter(|s| s.service == kind).cloned())
            .collect()
    };
    let leaf = |run: &crate::e2e::ServiceRun| {
        run.ingest
            .iter()
            .find(|i| i.eviction == "leaf-first")
            .cloned()
    };
    let rate = |summary: &Summary, kind| {
        median(
            runs(summary, kind)
                .iter()
                .filter_map(leaf)
                .map(|i| i.events as f64 / (i.publish_seconds + i.quiesce_ms / 1e3))
                .collect(),
        )
    };
    let lag = |kind, f: fn(&crate::e2e::Freshness) -> f64| {
        median(
            runs(paced, kind)
                .iter()
                .filter_map(leaf)
                .map(|i| f(&i.freshness))
                .collect(),
        )
    };
    let log = |f: fn(&LogFigures) -> f64| {
        median(
            runs(paced, ServiceKind::KvatlasNats)
                .iter()
                .filter_map(|r| r.scale_out.as_ref().map(f))
                .collect(),
        )
    };
    let (alone, nats) = (
        rate(unpaced, ServiceKind::Kvatlas),
        rate(unpaced, ServiceKind::KvatlasNats),
    );
    let mut out = format!(
        "Load (paced): {}\n\nLoad (unpaced): {}\n\nThrough NATS: {ingest}.\n\n",
        paced.load, unpaced.load
    );
    let _ = writeln!(
        out,
        "| figure (leaf-first, medians of {} runs) | kvatlas alone | through NATS (replica) | bar |",
        paced.runs.len()
    );
    let _ = writeln!(out, "|---|---|---|---|");
    let _ = writeln!(
        out,
        "| event rate, unpaced (events/s to visible) | {alone:.0} | {nats:.0} ({:.0} %) | ≥ 50 % of alone: {} |",
        nats / alone.max(1e-9) * 100.0,
        if nats >= alone / 2.0 {
            "met"
        } else {
            "not met"
        }
    );
    for (label, f) in [
        (
            "lag p50 (upper bound), paced",
            (|x: &crate::e2e::Freshness| x.p50_us) as fn(&crate::e2e::Freshness) -> f64,
        ),
        ("lag p99 (upper bound), paced", |x| x.p99_us),
        ("lag p99 (lower bound), paced", |x| x.lower_p99_us),
    ] {
        let (a, n) = (
            lag(ServiceKind::Kvatlas, f),
            lag(ServiceKind::KvatlasNats, f),
        );
        let bar = if label.starts_with("lag p99 (upper") {
            if n <= 5_000.0 {
                "≤ 5 ms: met"
            } else {
                "≤ 5 ms: not met"
            }
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "| {label} | {:.2} ms | {:.2} ms | {bar} |",
            a / 1e3,
            n / 1e3
        );
    }
    // Every batch's age at the server queried (alone) or the first replica: the engine's stamp
    // to visible, `kvatlas_event_age_seconds` (bucket bounds).
    let age = |kind, f: fn(&crate::e2e::ServerDelay) -> f64| {
        median(
            runs(paced, kind)
                .iter()
                .filter_map(leaf)
                .filter_map(|i| i.freshness.event_age.as_ref().map(f))
                .collect(),
        )
    };
    let p50: fn(&crate::e2e::ServerDelay) -> f64 = |d| d.p50_le_us;
    let p99: fn(&crate::e2e::ServerDelay) -> f64 = |d| d.p99_le_us;
    let _ = writeln!(
        out,
        "| event age, every batch (the engine's stamp → visible; bucket bounds), p50 / p99, paced | ≤ {:.2} / ≤ {:.2} ms | ≤ {:.2} / ≤ {:.2} ms | |",
        age(ServiceKind::Kvatlas, p50) / 1e3,
        age(ServiceKind::Kvatlas, p99) / 1e3,
        age(ServiceKind::KvatlasNats, p50) / 1e3,
        age(ServiceKind::KvatlasNats, p99) / 1e3,
    );
    // The same paced schedule into a bare ZMQ subscriber: what the machine costs before any
    // ingest does its work (leaf-first, medians over the runs).
    let floor = |f: fn(&crate::zmq_floor::Floor) -> f64| leaf_first_median(&paced.floors, f);
    if !paced.floors.is_empty() {
        let _ = writeln!(
            out,
            "| the machine's floor: the same schedule into a bare ZMQ subscriber process (the stamp → received), p50 / p99, paced | {:.2} / {:.2} ms (no index) | — | |",
            floor(|f| f.p50_us) / 1e3,
            floor(|f| f.p99_us) / 1e3,
        );
    }
    // The same schedule through a bare relay, JetStream and bare consumers: the floor under
    // the replica's event age (leaf-first, medians over the runs).
    let log_floor =
        |f: fn(&crate::zmq_floor::Floor) -> f64| leaf_first_median(&paced.log_floors, f);
    if !paced.log_floors.is_empty() {
        let _ = writeln!(
            out,
            "| the log's floor: the same schedule through a bare relay, JetStream and bare consumers; the stamp → stored, p50 / p99; the stamp → received, p50 / p99, paced | — | {:.2} / {:.2} ms; {:.2} / {:.2} ms (no ingest work, no index) | |",
            log_floor(|f| f.stored_p50_us.unwrap_or(f64::NAN)) / 1e3,
            log_floor(|f| f.stored_p99_us.unwrap_or(f64::NAN)) / 1e3,
            log_floor(|f| f.p50_us) / 1e3,
            log_floor(|f| f.p99_us) / 1e3,
        );
        let _ = writeln!(
            out,
            "| the live path's floor: the same batches published by the bare relay on core NATS too, the stamp → received by a bare consumer, p50 / p99, paced | — | {:.2} / {:.2} ms (no ingest work, no index) | |",
            log_floor(|f| f.live_p50_us.unwrap_or(f64::NAN)) / 1e3,
            log_floor(|f| f.live_p99_us.unwrap_or(f64::NAN)) / 1e3,
        );
    }
    let bootstrap = log(|f| f.bootstrap_ms);
    let _ = writeln!(
        out,
        "| new replica: spawn to ready on the Workload A state | — | {bootstrap:.0} ms | ≤ 2 s: {} |",
        if bootstrap <= 2_000.0 {
            "met"
        } else {
            "not met"
        }
    );
    let _ = writeln!(
        out,
        "| of the lag: ingest queued → stream acknowledged, p99 (bucket bound), paced | — | ≤ {:.2} ms | — |",
        log(|f| f.publish_p99_ms)
    );
    // A row of two bucket bounds of the replicated setup, p50 and p99, ms.
    let mut bounds_row = |what: &str, p50: f64, p99: f64| {
        let _ = writeln!(
            out,
            "| {what}, p50 / p99 (bucket bounds), paced | — | ≤ {p50:.2} / ≤ {p99:.2} ms | — |"
        );
    };
    bounds_row(
        "of the event age: the engine's stamp → the stream storing the record",
        log(|f| f.stored_age_p50_ms),
        log(|f| f.stored_age_p99_ms),
    );
    bounds_row(
        "of the lag: stream stored → replica applied",
        log(|f| f.replica_lag_p50_ms),
        log(|f| f.replica_lag_p99_ms),
    );
    bounds_row(
        "of the event age: the engine's stamp → the ingest's publisher taking the record",
        log(|f| f.sent_age_p50_ms),
        log(|f| f.sent_age_p99_ms),
    );
    bounds_row(
        "of the event age: the engine's stamp → the live record reaching the replica",
        log(|f| f.live_age_p50_ms),
        log(|f| f.live_age_p99_ms),
    );
    let _ = writeln!(
        out,
        "| of the event age: a record's receipt at the replica → visible, p99 (bucket bound), paced | — | ≤ {:.2} ms | — |",
        log(|f| f.replica_delay_p99_ms)
    );
    let _ = writeln!(
        out,
        "| of the records a replica applied: off the live path (before the stream delivered them); live-path divergences | — | {:.1} %; {:.0} | — |",
        log(|f| f.live_applied_pct),
        log(|f| f.live_divergences as f64)
    );
    let _ = writeln!(
        out,
        "| bytes on the wire per vLLM event (stored records) | — | {:.1} B | — |",
        log(|f| f.wire_bytes_per_event)
    );
    let cpu = |summary: &Summary, kind| {
        median(
            runs(summary, kind)
                .iter()
                .filter_map(leaf)
                .map(|i| i.cpu_seconds_per_million_events)
                .collect(),
        )
    };
    let _ = writeln!(
        out,
        "| CPU s per million events, paced (alone: the server; through NATS: ingest + nats-server + replicas) | {:.1} | {:.1} | — |",
        cpu(paced, ServiceKind::Kvatlas),
        cpu(paced, ServiceKind::KvatlasNats)
    );
    // Through NATS, by process: the median over runs of each process's share.
    let by_process: Vec<Vec<(String, f64)>> = runs(paced, ServiceKind::KvatlasNats)
        .iter()
        .filter_map(leaf)
        .map(|i| {
            let events = i.events.max(1) as f64;
            i.cpu_seconds_by_process
                .iter()
                .map(|(name, seconds)| (name.clone(), seconds / events * 1e6))
                .collect()
        })
        .collect();
    if let Some(first) = by_process.first() {
        let shares: Vec<String> = first
            .iter()
            .enumerate()
            .map(|(k, (name, _))| {
                let values = by_process
                    .iter()
                    .filter_map(|run| run.get(k).map(|(_, v)| *v))
                    .collect();
                format!("{name} {:.1}", median(values))
            })
            .collect();
        let _ = writeln!(
            out,
            "| of which, by process (CPU s per million events, paced) | — | {} | — |",
            shares.join(", ")
        );
    }
    out
}

/// The median over the runs of `f` of each run's leaf-first floor (the first of the run's).
fn leaf_first_median(
    floors: &[Vec<crate::zmq_floor::Floor>],
    f: fn(&crate::zmq_floor::Floor) -> f64,
) -> f64 {
    median(floors.iter().filter_map(|run| run.first()).map(f).collect())
}
