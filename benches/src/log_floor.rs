//! This machine's floor under the scale-out lag: the fleet's schedule, at the same pace,
//! through a bare relay into NATS JetStream and out to bare consumers, with nothing of
//! kvatlas's work on the way.
//!
//! A replica's event age (`kvatlas_event_age_seconds`) runs from the engine's stamp, through
//! the ingest (decode, re-hash, sequence, encode, one message in flight per source), the stream
//! and the replica (decode, sequence, apply), to the batch visible to queries. The log's floor
//! runs from the same stamp through the same parts of the path that are not kvatlas's:
//! - the **relay** (a process of its own, as the ingest is) takes each batch off one SUB
//!   socket connected to every engine on a thread of its own (the ingest's poller), hands it
//!   to a one-worker tokio runtime (the ingest's runtime) that publishes it unchanged to a
//!   JetStream stream on file storage with a message id (the ingest's stream and header),
//!   every publish in flight at once, and publishes it on core NATS too (the ingest's live
//!   path);
//! - **consumers** (as many as the replicas, each a process of its own) read the stream with
//!   an ordered pull consumer (the replica's) and subscribe to the core subjects (the replica's
//!   live path), and take the stamp of each message on arrival.
//!
//! The first consumer's ages are the floor: what the fleet, ZMQ, the relay's hand-off,
//! nats-server and the consumer's client cost on these cores. What kvatlas adds is the
//! difference.

use std::io::{BufRead as _, BufReader, Write as _};
use std::path::Path;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use async_nats::jetstream;
use hdrhistogram::Histogram;
use tokio_stream::StreamExt as _;

use crate::fleet::{self, FleetStream};
use crate::zmq_floor::{Floor, age_us};
use kvatlas_fleet::nats::NatsServer;
use kvatlas_fleet::publish::Publishers;
use kvatlas_fleet::vllm;

/// The first argument that makes a benchmark binary the log floor's relay.
pub const RELAY_ARG: &str = "log-floor-relay";
/// The first argument that makes a benchmark binary one of the log floor's consumers.
pub const CONSUMER_ARG: &str = "log-floor-consumer";

/// The floor's stream and its subjects (one per engine, as the ingest has one per source).
const STREAM: &str = "KVATLAS_FLOOR";
const SUBJECT_PREFIX: &str = "kvatlas-floor";
/// The core subjects (outside the stream's, as the ingest's live path).
const LIVE_PREFIX: &str = "kvatlas-floor-live";

/// How long a relay or consumer waits for the next batch before it reports what it has.
const IDLE: Duration = Duration::from_secs(10);

/// Publishes `stream`'s schedule at its pace through a relay (`exe log-floor-relay …`),
/// JetStream on a nats-server of its own, and `consumers` consumers (`exe
/// log-floor-consumer …`, at least one), and returns what the first consumer measured.
///
/// # Errors
/// If nats-server, the fleet, the relay or a consumer cannot start, or a consumer reports
/// nothing.
pub fn measure(stream: &FleetStream, exe: &Path, consumers: usize) -> Result<Floor> {
    let nats = NatsServer::start()?;
    let url = nats.url();
    let published = stream.schedule.len() as u64;
    let mut children: Vec<Child> = Vec::new();
    let result = (|| -> Result<Floor> {
        let mut reports: Vec<BufReader<ChildStdout>> = Vec::new();
        // The consumers first: each says "ready" once it reads the stream, so that no batch
        // is older than its consumer.
        let expected = published.to_string();
        for _ in 0..consumers.max(1) {
            let (child, stdout) =
                start_ready(exe, &[CONSUMER_ARG, url.as_str(), expected.as_str()])?;
            children.push(child);
            reports.push(stdout);
        }
        let fleet = Publishers::bind(stream.workers)?;
        let mut relay_args = vec![RELAY_ARG, url.as_str(), expected.as_str()];
        relay_args.extend(fleet.endpoints().iter().map(|e| e.live.as_str()));
        let (relay, mut relay_out) = start_ready(exe, &relay_args)?;
        children.push(relay);
        fleet.wait_subscribed(1, Duration::from_secs(30))?;
        fleet::publish_schedule(stream, &fleet, |_, _| {})?;
        let mut line = String::new();
        relay_out
            .read_line(&mut line)
            .context("reading the relay's report")?;
        let acknowledged: u64 = line
            .trim()
            .parse()
            .with_context(|| format!("the relay's report {line:?}"))?;
        if acknowledged < published {
            bail!("the stream acknowledged {acknowledged} of {published} batches");
        }
        let mut floors = Vec::new();
        for report in &mut reports {
            let mut line = String::new();
            report
                .read_line(&mut line)
                .context("reading a consumer's report")?;
            floors.push(crate::zmq_floor::parse_report(published, &line)?);
        }
        fleet.stop()?;
        floors.into_iter().next().context("no consumer reported")
    })();
    for mut child in children {
        if result.is_err() {
            let _ = child.kill();
        }
        let _ = child.wait();
    }
    drop(nats);
    result
}

/// Starts `exe ARGS…` (a relay or a consumer: `ARGS[0]` says which) with its stdout piped,
/// and waits for the "ready" line it prints (killing it if another line or none comes).
fn start_ready(exe: &Path, args: &[&str]) -> Result<(Child, BufReader<ChildStdout>)> {
    let role = args.first().copied().unwrap_or_default();
    let mut child = Command::new(exe)
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {} {role}", exe.display()))?;
    let ready = (|| -> Result<BufReader<ChildStdout>> {
        let mut out = BufReader::new(child.stdout.take().context("its stdout")?);
        let mut line = String::new();
        out.read_line(&mut line)
            .with_context(|| format!("waiting for the {role}"))?;
        if line.trim() != "ready" {
            bail!("the {role} did not start (it said {line:?})");
        }
        Ok(out)
    })();
    match ready {
        Ok(out) => Ok((child, out)),
        Err(error) => {
            let _ = child.kill();
            let _ = child.wait();
            Err(error)
        }
    }
}

/// Runs the relay or a consumer if this process's first argument `first` says it is one
/// ([`measure`] starts the running benchmark binary again with [`RELAY_ARG`] or
/// [`CONSUMER_ARG`] first), with the arguments `rest`; `None` otherwise.
/// `zmq_floor::run_if_receiver`, which benchmark binaries call first thing in `main`,
/// dispatches here.
pub(crate) fn run_if_started_as(first: &str, rest: &[String]) -> Option<Result<()>> {
    if first == RELAY_ARG {
        Some(relay_main(rest))
    } else if first == CONSUMER_ARG {
        Some(consumer_main(rest))
    } else {
        None
    }
}

/// A one-worker runtime, as `kvatlas serve` runs on two cores.
fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?)
}

/// Connects and creates the floor's stream (file storage and a duplicate window, as the
/// event log's).
async fn floor_stream(url: &str) -> Result<(jetstream::Context, jetstream::stream::Stream)> {
    let client = async_nats::connect(url)
        .await
        .with_context(|| format!("connecting to {url}"))?;
    let js = jetstream::new(client);
    let stream = js
        .get_or_create_stream(jetstream::stream::Config {
            name: STREAM.to_owned(),
            subjects: vec![format!("{SUBJECT_PREFIX}.>")],
            max_age: Duration::from_secs(3600),
            duplicate_window: Duration::from_secs(120),
            storage: jetstream::stream::StorageType::File,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("creating the floor's stream: {e}"))?;
    Ok((js, stream))
}

/// Prints `line` on stdout at once (the parent reads it).
fn say(line: &str) -> Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()?;
    Ok(())
}

/// The relay (`… log-floor-relay URL EXPECTED ENDPOINT…`): takes `EXPECTED` batches (or as
/// many as come before a 10-second silence) off one SUB socket on every endpoint, publishes
/// each to the stream unchanged, and prints how many the stream acknowledged.
fn relay_main(args: &[String]) -> Result<()> {
    let [url, expected, endpoints @ ..] = args else {
        bail!("usage: {RELAY_ARG} URL EXPECTED ENDPOINT…");
    };
    let expected: u64 = expected.parse().context("EXPECTED is a count of batches")?;
    let runtime = runtime()?;
    let (js, _) = runtime.block_on(floor_stream(url))?;
    // The stream's connection, as the ingest's live path.
    let core = js.client();
    let context = zmq::Context::new();
    let sub = crate::zmq_floor::subscribe_all(&context, endpoints)?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u8>>();
    let receiver = std::thread::spawn(move || -> Result<()> {
        for _ in 0..expected {
            let mut frames = match sub.recv_multipart(0) {
                Ok(frames) => frames,
                Err(zmq::Error::EAGAIN) => break,
                Err(error) => return Err(error.into()),
            };
            let Some(payload) = frames.pop() else {
                continue;
            };
            if tx.send(payload).is_err() {
                break;
            }
        }
        Ok(())
    });
    say("ready")?;
    let acknowledged = runtime.block_on(async move {
        let mut acks = tokio::task::JoinSet::new();
        let mut sent = 0u64;
        let mut acknowledged = 0u64;
        loop {
            tokio::select! {
                Some(done) = acks.join_next(), if !acks.is_empty() => {
                    if matches!(done, Ok(true)) {
                        acknowledged += 1;
                    }
                }
                payload = rx.recv() => {
                    let Some(payload) = payload else { break };
                    sent += 1;
                    let subject = format!("{SUBJECT_PREFIX}.{}", sent % 128);
                    let payload = bytes::Bytes::from(payload);
                    let live = format!("{LIVE_PREFIX}.{}", sent % 128);
                    if let Err(error) = core.publish(live, payload.clone()).await {
                        eprintln!("{RELAY_ARG}: publishing on core NATS failed: {error}");
                    }
                    let publish = jetstream::message::PublishMessage::build()
                        .payload(payload)
                        .message_id(sent.to_string());
                    match js.send_publish(subject, publish).await {
                        Ok(ack) => {
                            acks.spawn(async move { ack.await.is_ok() });
                        }
                        Err(error) => eprintln!("{RELAY_ARG}: publishing failed: {error}"),
                    }
                }
            }
        }
        while let Some(done) = acks.join_next().await {
            if matches!(done, Ok(true)) {
                acknowledged += 1;
            }
        }
        if let Err(error) = core.flush().await {
            eprintln!("{RELAY_ARG}: flushing core NATS failed: {error}");
        }
        acknowledged
    });
    receiver
        .join()
        .map_err(|_| anyhow::anyhow!("the relay's receiving thread panicked"))??;
    say(&acknowledged.to_string())
}

/// A consumer (`… log-floor-consumer URL EXPECTED`): reads the stream from its start with an
/// ordered pull consumer and the core subjects with a subscription, takes each message's stamp
/// on arrival, and after `EXPECTED` messages of each (or a 10-second silence) prints the zmq
/// floor's report line of the stream's messages (received, p50, p99, max (µs), within 1 ms, CPU
/// seconds), the p50 and p99 of the stamp to the stream storing the batch, and the p50 and p99
/// of the core messages' ages.
fn consumer_main(args: &[String]) -> Result<()> {
    let [url, expected] = args else {
        bail!("usage: {CONSUMER_ARG} URL EXPECTED");
    };
    let expected: u64 = expected.parse().context("EXPECTED is a count of batches")?;
    let runtime = runtime()?;
    runtime.block_on(async {
        let (js, stream) = floor_stream(url).await?;
        let consumer = stream
            .create_consumer(jetstream::consumer::pull::OrderedConfig {
                filter_subject: format!("{SUBJECT_PREFIX}.>"),
                ..Default::default()
            })
            .await
            .map_err(|e| anyhow::anyhow!("creating the consumer: {e}"))?;
        let mut messages = consumer
            .messages()
            .await
            .map_err(|e| anyhow::anyhow!("reading the stream: {e}"))?;
        // The stream's connection, as the replica's live path.
        let core = js.client();
        let mut live = core
            .subscribe(format!("{LIVE_PREFIX}.>"))
            .await
            .map_err(|e| anyhow::anyhow!("subscribing to the core subjects: {e}"))?;
        core.flush().await?;
        say("ready")?;
        let mut ages = Histogram::<u64>::new(3)?;
        let mut stored_ages = Histogram::<u64>::new(3)?;
        let mut live_ages = Histogram::<u64>::new(3)?;
        let (mut received, mut live_received) = (0u64, 0u64);
        let started = crate::e2e::cpu_seconds(std::process::id())?;
        while received < expected || live_received < expected {
            let next = tokio::time::timeout(IDLE, async {
                tokio::select! {
                    message = messages.next(), if received < expected => Some((message, None)),
                    message = live.next(), if live_received < expected => Some((None, message)),
                }
            });
            let Ok(Some((from_stream, from_live))) = next.await else {
                break;
            };
            let now = vllm::wall_clock_seconds();
            if let Some(message) = from_live {
                live_received += 1;
                if let Some(age) = age_us(&message.payload, now) {
                    live_ages.record(age)?;
                }
                continue;
            }
            let Some(message) = from_stream else {
                break; // the stream's messages ended
            };
            let message = message.map_err(|e| anyhow::anyhow!("reading the stream: {e}"))?;
            received += 1;
            if let Some(age) = age_us(&message.payload, now) {
                ages.record(age)?;
                let stored = message.info().ok().and_then(|info| {
                    age_us(
                        &message.payload,
                        info.published.unix_timestamp_nanos() as f64 / 1e9,
                    )
                });
                if let Some(stored) = stored {
                    stored_ages.record(stored)?;
                }
            }
        }
        let cpu = crate::e2e::cpu_seconds(std::process::id())? - started;
        say(&format!(
            "{} {} {} {} {}",
            crate::zmq_floor::report_line(received, &ages, cpu),
            stored_ages.value_at_quantile(0.5),
            stored_ages.value_at_quantile(0.99),
            live_ages.value_at_quantile(0.5),
            live_ages.value_at_quantile(0.99)
        ))
    })
}
