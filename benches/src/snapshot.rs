//! The recovery benchmark behind `cargo xtask bench snapshot`: kvatlas's native snapshots and
//! peer bootstrap, end to end through `kvatlas serve` processes (release binary, loopback).
//!
//! Per state and run:
//!
//! 1. **load**: server A (`--data-dir`, snapshots every second) is loaded over `PublishEvents`
//!    and checked to hold exactly the state's memberships;
//! 2. **write**: A's next periodic snapshot of the loaded state — image of the live index,
//!    encoding, fsync, rename — as A itself times it (`kvatlas_snapshot_last_duration_seconds`),
//!    and its size in bytes per (rank, block, tier) membership;
//! 3. **stream**: the `Snapshot` RPC from A, drained by a client: time and bytes;
//! 4. **restore**: A stops; server C starts on A's data directory; from spawn until C holds every
//!    membership and has answered a query (process start, reading and checking the file,
//!    rebuilding the index);
//! 5. **bootstrap**: server B starts with `--peers` = C and no data directory; from spawn until B
//!    holds every membership and has answered a query (fetching C's snapshot over HTTP,
//!    restoring it, releasing its listeners).
//!
//! States: **Workload A** (the Mooncake conversation trace through 128 mock engines of 512 blocks,
//! leaf-first eviction: the service benchmark's state) and **synthetic** fleets of a given size:
//! `W` workers each holding `K` chains of 64 blocks drawn from a pool of chains, so each chain is
//! held by 8 workers on average (a shared prefix per chain, as system prompts and conversations
//! give). The bytes per membership depend on that sharing (the format stores each distinct block
//! once per index): the report gives memberships and distinct blocks side by side.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use kvatlas_hash::LocalBlockHash;
use kvatlas_index::{ExternalBlockHash, Mutation, StoredBlock, Tier, Worker};
use kvatlas_proto::v1::{self, indexer_client::IndexerClient, query_request};
use serde::Serialize;
use tonic::transport::Channel;

use crate::engine::{self, EngineConfig, Eviction, SplitMix64};
use crate::service::{self, BLOCK_TOKENS, MODEL, Server};
use crate::trace;

/// Blocks per synthetic chain.
const CHAIN_BLOCKS: usize = 64;
/// Average workers holding each synthetic chain.
const HOLDERS_PER_CHAIN: u64 = 8;
/// Bound on each wait for a server.
const WAIT: Duration = Duration::from_secs(300);

/// A state to snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateKind {
    /// The service benchmark's Workload A state.
    WorkloadA,
    /// A synthetic fleet of about this many memberships.
    Synthetic(u64),
}

/// What to run.
#[derive(Debug, Clone)]
pub struct Settings {
    /// The `kvatlas` binary to start.
    pub kvatlas: PathBuf,
    /// Runs per state (medians reported).
    pub runs: usize,
    /// The states.
    pub states: Vec<StateKind>,
    /// Where the data directories go (removed afterwards).
    pub scratch: PathBuf,
}

/// One run's figures.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct RunFigures {
    /// Seconds loading A over `PublishEvents`.
    pub load_s: f64,
    /// The periodic snapshot's duration as A timed it.
    pub write_s: f64,
    /// Its size.
    pub file_bytes: u64,
    /// Seconds draining the `Snapshot` RPC.
    pub stream_s: f64,
    /// Bytes the RPC streamed.
    pub stream_bytes: u64,
    /// Seconds from C's spawn until it held the state and answered a query.
    pub restore_s: f64,
    /// Seconds from B's spawn until it held the state and answered a query.
    pub bootstrap_s: f64,
    /// C's resident memory after its restore, MiB.
    pub restored_rss_mib: f64,
}

/// One state's runs and medians.
#[derive(Debug, Clone, Serialize)]
pub struct StateReport {
    /// The state.
    pub name: String,
    /// How it was made.
    pub description: String,
    /// Its (rank, block, tier) memberships.
    pub memberships: u64,
    /// Its distinct blocks.
    pub distinct_blocks: u64,
    /// The runs.
    pub runs: Vec<RunFigures>,
    /// Per-figure medians.
    pub median: RunFigures,
}

/// A state's events and counts.
struct State {
    name: String,
    description: String,
    events: Vec<Mutation>,
    memberships: u64,
    distinct_blocks: u64,
}

fn workload_a() -> Result<State> {
    let trace = trace::load_trace(&trace::default_trace_path())?;
    let config = EngineConfig {
        block_tokens: BLOCK_TOKENS,
        ..EngineConfig::new(128, 512, Eviction::LeafFirst, 42)
    };
    let stream = engine::generate(&trace, &config);
    let distinct: std::collections::HashSet<u64> = stream
        .final_caches
        .iter()
        .flatten()
        .map(|h| h.get())
        .collect();
    Ok(State {
        name: "Workload A".into(),
        description: format!(
            "the Mooncake conversation trace ({} requests) through 128 mock engines of 512 blocks, \
             leaf-first eviction ({} events)",
            trace.len(),
            stream.events.len()
        ),
        memberships: stream.stats.final_memberships,
        distinct_blocks: distinct.len() as u64,
        events: stream.events,
    })
}

/// `W` workers holding `K` distinct chains each from a pool of `W·K/8` chains of 64 blocks.
fn synthetic(target: u64) -> State {
    let workers: u64 = if target <= 2_000_000 { 256 } else { 1024 };
    let per_worker = (target / (workers * CHAIN_BLOCKS as u64)).max(1);
    let pool = (workers * per_worker / HOLDERS_PER_CHAIN).max(per_worker);
    let block = |chain: u64, position: usize| {
        let id = chain * CHAIN_BLOCKS as u64 + position as u64;
        StoredBlock {
            external: ExternalBlockHash::new(id.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1),
            local: LocalBlockHash::new(id.wrapping_mul(0xC2B2_AE3D_27D4_EB4F) ^ 0x5EED),
        }
    };
    let mut rng = SplitMix64::new(7);
    let mut events = Vec::with_capacity((workers * per_worker) as usize);
    let mut used = std::collections::HashSet::new();
    for worker_id in 0..workers {
        used.clear();
        while (used.len() as u64) < per_worker {
            let chain = rng.next_u64() % pool;
            if !used.insert(chain) {
                continue;
            }
            events.push(Mutation::Stored {
                worker: Worker::new(worker_id, 0),
                tier: Tier::Device,
                parent: None,
                blocks: (0..CHAIN_BLOCKS).map(|p| block(chain, p)).collect(),
            });
        }
    }
    let memberships = workers * per_worker * CHAIN_BLOCKS as u64;
    State {
        name: format!("synthetic {}", millions(memberships)),
        description: format!(
            "{workers} workers × {per_worker} chains of {CHAIN_BLOCKS} blocks from a pool of \
             {pool} chains (each held by {HOLDERS_PER_CHAIN} workers on average)"
        ),
        memberships,
        distinct_blocks: pool.min(workers * per_worker) * CHAIN_BLOCKS as u64,
        events,
    }
}

fn millions(n: u64) -> String {
    if n >= 1_000_000 {
        format!("{:.1}M", n as f64 / 1e6)
    } else {
        format!("{:.0}k", n as f64 / 1e3)
    }
}

/// `GET path` over plain HTTP/1.1: the body.
fn http_get(addr: &str, path: &str) -> Result<String> {
    let mut stream = std::net::TcpStream::connect(addr)?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nhost: bench\r\nconnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (_, body) = response.split_once("\r\n\r\n").context("no HTTP body")?;
    Ok(body.to_owned())
}

fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// Memberships the server's index holds (0 while it has none).
async fn memberships(client: &mut IndexerClient<Channel>) -> Result<u64> {
    let listed = client
        .list_indexes(v1::ListIndexesRequest::default())
        .await?
        .into_inner();
    Ok(listed.indexes.iter().map(|i| i.memberships).sum())
}

/// Waits until the server at `url` holds `expected` memberships and answers `probe` with at least
/// one worker.
async fn until_serving(url: &str, expected: u64, probe: &v1::QueryRequest) -> Result<()> {
    let deadline = Instant::now() + WAIT;
    let mut client = loop {
        match service::connect(url).await {
            Ok(client) => break client,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            Err(e) => return Err(e),
        }
    };
    loop {
        if memberships(&mut client).await.unwrap_or(0) == expected
            && let Ok(answer) = client.query(probe.clone()).await
            && !answer.into_inner().matches.is_empty()
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{url} did not hold {expected} memberships within {WAIT:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn probe(events: &[Mutation]) -> Result<v1::QueryRequest> {
    let hashes = events
        .iter()
        .rev()
        .find_map(|m| match m {
            Mutation::Stored {
                parent: None,
                blocks,
                ..
            } => Some(blocks.iter().map(|b| b.local.get()).collect::<Vec<_>>()),
            _ => None,
        })
        .context("no root run in the state")?;
    Ok(v1::QueryRequest {
        index: Some(v1::IndexSelector {
            model: MODEL.into(),
            tenant: String::new(),
        }),
        input: Some(query_request::Input::LocalHashes(v1::LocalHashes {
            hashes,
        })),
        ..v1::QueryRequest::default()
    })
}

fn run_once(
    settings: &Settings,
    state: &State,
    messages: &[v1::PublishEventsRequest],
    probe: &v1::QueryRequest,
    run: usize,
) -> Result<RunFigures> {
    let dir = settings.scratch.join(format!("run-{run}"));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir)?;
    let data_dir = |extra: &[&str]| -> Vec<String> {
        [&["--data-dir", &dir.display().to_string()], extra]
            .concat()
            .into_iter()
            .map(str::to_owned)
            .collect()
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut figures = RunFigures::default();

    // 1–3: load A, its periodic snapshot, the Snapshot RPC.
    let a = Server::start(
        &settings.kvatlas,
        &data_dir(&["--snapshot-interval-secs", "1"]),
    )?;
    runtime.block_on(async {
        let mut client = service::connect(&a.url).await?;
        let started = Instant::now();
        client
            .publish_events(tokio_stream::iter(messages.to_vec()))
            .await?;
        figures.load_s = started.elapsed().as_secs_f64();
        let held = memberships(&mut client).await?;
        if held != state.memberships {
            bail!(
                "A holds {held} memberships, the state {}",
                state.memberships
            );
        }
        let deadline = Instant::now() + WAIT;
        loop {
            let text = http_get(&a.http, "/metrics")?;
            let written = metric(&text, "kvatlas_snapshot_last_memberships");
            if written == Some(state.memberships as f64) {
                figures.write_s = metric(&text, "kvatlas_snapshot_last_duration_seconds")
                    .context("no snapshot duration metric")?;
                figures.file_bytes = metric(&text, "kvatlas_snapshot_last_bytes")
                    .context("no snapshot size metric")?
                    as u64;
                break;
            }
            if Instant::now() > deadline {
                bail!("A wrote no snapshot of the loaded state within {WAIT:?}");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let started = Instant::now();
        let mut chunks = client
            .snapshot(v1::SnapshotRequest::default())
            .await?
            .into_inner();
        while let Some(chunk) = chunks.message().await? {
            figures.stream_bytes += chunk.data.len() as u64;
        }
        figures.stream_s = started.elapsed().as_secs_f64();
        Ok::<_, anyhow::Error>(())
    })?;
    a.stop();

    // 4: C restores A's data directory.
    let started = Instant::now();
    let c = Server::start(
        &settings.kvatlas,
        &data_dir(&["--snapshot-interval-secs", "0"]),
    )?;
    runtime.block_on(until_serving(&c.url, state.memberships, probe))?;
    figures.restore_s = started.elapsed().as_secs_f64();
    figures.restored_rss_mib = service::memory(&c).0;

    // 5: B bootstraps from C.
    let started = Instant::now();
    let peer = format!("http://{}", c.http);
    let b = Server::start(&settings.kvatlas, &["--peers".to_owned(), peer])?;
    runtime.block_on(until_serving(&b.url, state.memberships, probe))?;
    figures.bootstrap_s = started.elapsed().as_secs_f64();
    b.stop();
    c.stop();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(figures)
}

fn median_figures(runs: &[RunFigures]) -> RunFigures {
    let m = |f: fn(&RunFigures) -> f64| {
        let mut values: Vec<f64> = runs.iter().map(f).collect();
        service::median(&mut values)
    };
    RunFigures {
        load_s: m(|r| r.load_s),
        write_s: m(|r| r.write_s),
        file_bytes: m(|r| r.file_bytes as f64) as u64,
        stream_s: m(|r| r.stream_s),
        stream_bytes: m(|r| r.stream_bytes as f64) as u64,
        restore_s: m(|r| r.restore_s),
        bootstrap_s: m(|r| r.bootstrap_s),
        restored_rss_mib: m(|r| r.restored_rss_mib),
    }
}

/// Runs the benchmark (see the module docs).
///
/// # Errors
/// A server that does not start, load, snapshot, restore or bootstrap.
pub fn run(settings: &Settings, mut progress: impl FnMut(&str)) -> Result<Vec<StateReport>> {
    if settings.runs == 0 {
        bail!("--runs must be at least 1");
    }
    let mut reports = Vec::new();
    for kind in &settings.states {
        let state = match kind {
            StateKind::WorkloadA => workload_a()?,
            StateKind::Synthetic(target) => synthetic(*target),
        };
        let messages = service::messages(&state.events);
        let probe = probe(&state.events)?;
        let mut runs = Vec::new();
        for run in 0..settings.runs {
            progress(&format!(
                "{}: run {} of {}",
                state.name,
                run + 1,
                settings.runs
            ));
            runs.push(run_once(settings, &state, &messages, &probe, run)?);
        }
        reports.push(StateReport {
            name: state.name,
            description: state.description,
            memberships: state.memberships,
            distinct_blocks: state.distinct_blocks,
            median: median_figures(&runs),
            runs,
        });
    }
    Ok(reports)
}

/// The reports as a Markdown table.
pub fn markdown(reports: &[StateReport]) -> String {
    use std::fmt::Write as _;
    let mut out = String::from(
        "| state | memberships | distinct blocks | bytes / membership | write | stream | restore (spawn → first answer) | bootstrap from a peer (spawn → first answer) | RSS after restore |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for r in reports {
        let m = &r.median;
        let _ = writeln!(
            out,
            "| {} | {} | {} | {:.2} | {:.3} s | {:.3} s ({:.0} MB/s) | {:.3} s | {:.3} s | {:.0} MiB |",
            r.name,
            r.memberships,
            r.distinct_blocks,
            m.file_bytes as f64 / r.memberships.max(1) as f64,
            m.write_s,
            m.stream_s,
            m.stream_bytes as f64 / 1e6 / m.stream_s.max(1e-9),
            m.restore_s,
            m.bootstrap_s,
            m.restored_rss_mib,
        );
    }
    out.push('\n');
    for r in reports {
        let _ = writeln!(
            out,
            "- {}: {}; medians of {} runs (load over PublishEvents {:.2} s)",
            r.name,
            r.description,
            r.runs.len(),
            r.median.load_s
        );
    }
    out
}

/// A scratch directory under `target/`.
pub fn default_scratch() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/snapshot-bench")
}
