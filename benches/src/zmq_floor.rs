//! This machine's floor under the end-to-end freshness figures: the fleet's schedule, at the same
//! pace, into a bare subscriber process that takes each batch off a ZMQ socket, reads the `ts`
//! the fleet stamped into it and does nothing else.
//!
//! Every service's event age (`kvatlas_event_age_seconds`) runs from the same stamp to the
//! batch visible to queries; the floor runs from the stamp to the batch read by a process that
//! neither decodes, hashes nor indexes it. What a service adds is the difference. The receiver
//! is as cheap as ZMQ allows: one SUB socket connected to every engine (ZMQ's own fair queue,
//! one blocking receive per batch), in a process of its own on the same cores, as a server's
//! would be. The fleet is the one the services are measured with: one thread publishing every
//! engine's batches through one ZMQ I/O thread.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use hdrhistogram::Histogram;
use serde::Serialize;

use crate::fleet::{self, FleetStream};
use kvatlas_fleet::publish::Publishers;
use kvatlas_fleet::vllm;

/// The first argument that makes a benchmark binary the floor's receiver (see [`run_if_receiver`]).
pub const RECEIVER_ARG: &str = "zmq-floor-receiver";

/// How long the receiver waits for the next batch before it reports what it has.
const IDLE: Duration = Duration::from_secs(10);

/// Every batch's age on arrival at the bare subscriber, over one publishing pass.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Floor {
    /// Batches the fleet published.
    pub published: u64,
    /// Batches the receiver took (all of them, unless ZMQ dropped some at a full queue).
    pub received: u64,
    /// Age on arrival, µs: the fleet's wall-clock stamp as it sent the batch to the
    /// receiver's wall clock as the receive returned.
    pub p50_us: f64,
    /// 99th percentile.
    pub p99_us: f64,
    /// The largest.
    pub max_us: f64,
    /// The fraction of batches that arrived within 1 ms of their stamp.
    pub within_1ms: f64,
    /// The receiver's CPU seconds (user + system) over the pass.
    pub cpu_seconds: f64,
    /// Through the log (`crate::log_floor`): the stamp to the stream storing the batch, p50
    /// and p99, µs (`None` for the ZMQ floor).
    pub stored_p50_us: Option<f64>,
    /// Its 99th percentile.
    pub stored_p99_us: Option<f64>,
    /// Through the log, the same batches published at once on core NATS (the live path's
    /// floor): the stamp to received, p50 and p99, µs (`None` for the ZMQ floor).
    pub live_p50_us: Option<f64>,
    /// Its 99th percentile.
    pub live_p99_us: Option<f64>,
}

impl Floor {
    /// One line for the progress output, after `what` ("the floor").
    pub(crate) fn progress_line(&self, what: &str) -> String {
        format!(
            "{what}: {} of {} batches, age on arrival p50 {:.0} µs, p99 {:.0} µs, {:.1} % \
             within 1 ms",
            self.received,
            self.published,
            self.p50_us,
            self.p99_us,
            self.within_1ms * 100.0
        )
    }
}

/// Publishes `stream`'s schedule at its pace into a bare subscriber started as `exe
/// zmq-floor-receiver …` (the running `e2e-bench`), and returns what it measured.
///
/// # Errors
/// If the fleet cannot bind or send, or the receiver cannot be started or reports nothing.
pub fn measure(stream: &FleetStream, exe: &Path) -> Result<Floor> {
    let fleet = Publishers::bind(stream.workers)?;
    let endpoints: Vec<&str> = fleet.endpoints().iter().map(|e| e.live.as_str()).collect();
    let published = stream.schedule.len() as u64;
    let mut child = Command::new(exe)
        .arg(RECEIVER_ARG)
        .arg(published.to_string())
        .args(&endpoints)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {} {RECEIVER_ARG}", exe.display()))?;
    let result = (|| -> Result<Floor> {
        fleet.wait_subscribed(1, Duration::from_secs(30))?;
        fleet::publish_schedule(stream, &fleet, |_, _| {})?;
        let stdout = child.stdout.take().context("the receiver's stdout")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("reading the receiver's report")?;
        parse_report(published, &line)
    })();
    if result.is_err() {
        let _ = child.kill();
    }
    let status = child.wait()?;
    let floor = result?;
    if !status.success() {
        bail!("the floor's receiver exited with {status}");
    }
    fleet.stop()?;
    Ok(floor)
}

/// Runs the floor's receiver if this process was started as one ([`measure`] starts the
/// running benchmark binary again with [`RECEIVER_ARG`] first), or the log floor's relay or
/// consumer (first argument [`crate::log_floor::RELAY_ARG`] or
/// [`crate::log_floor::CONSUMER_ARG`]); `None` otherwise. A benchmark
/// binary that measures the floors calls it first thing in `main`.
pub fn run_if_receiver() -> Option<Result<()>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (first, rest) = args.split_first()?;
    if first == RECEIVER_ARG {
        return Some(receiver_main(rest));
    }
    crate::log_floor::run_if_started_as(first, rest)
}

/// The receiver's side (`e2e-bench zmq-floor-receiver EXPECTED ENDPOINT…`): subscribes to
/// every endpoint on one SUB socket, takes `EXPECTED` batches (or as many as come before a
/// 10-second silence) and prints one line: received, p50, p99, max (µs), within 1 ms, CPU
/// seconds.
///
/// # Errors
/// If the arguments are not a count and endpoints, or a ZMQ call fails.
fn receiver_main(args: &[String]) -> Result<()> {
    let (expected, endpoints) = args
        .split_first()
        .context("usage: zmq-floor-receiver EXPECTED ENDPOINT…")?;
    let expected: u64 = expected.parse().context("EXPECTED is a count of batches")?;
    let context = zmq::Context::new();
    let sub = subscribe_all(&context, endpoints)?;
    let mut ages = Histogram::<u64>::new(3)?;
    let mut received = 0u64;
    let started = crate::e2e::cpu_seconds(std::process::id())?;
    while received < expected {
        let frames = match sub.recv_multipart(0) {
            Ok(frames) => frames,
            Err(zmq::Error::EAGAIN) => break,
            Err(error) => return Err(error.into()),
        };
        let now = vllm::wall_clock_seconds();
        received += 1;
        if let Some(age) = frames.last().and_then(|payload| age_us(payload, now)) {
            ages.record(age)?;
        }
    }
    let cpu = crate::e2e::cpu_seconds(std::process::id())? - started;
    println!("{}", report_line(received, &ages, cpu));
    Ok(())
}

/// The age in µs, at `at` (seconds since the epoch), of the batch `payload` as the fleet
/// stamped it; `None` for a batch without a stamp.
pub(crate) fn age_us(payload: &[u8], at: f64) -> Option<u64> {
    let stamp = vllm::timestamp(payload).filter(|s| s.is_finite() && *s > 0.0)?;
    Some(((at - stamp).max(0.0) * 1e6) as u64)
}

/// One SUB socket connected to every endpoint, subscribed to everything, whose receive gives
/// up after a 10-second silence: how a floor's process takes the fleet's batches.
pub(crate) fn subscribe_all(context: &zmq::Context, endpoints: &[String]) -> Result<zmq::Socket> {
    let sub = context.socket(zmq::SUB)?;
    sub.set_subscribe(b"")?;
    sub.set_rcvtimeo(i32::try_from(IDLE.as_millis()).unwrap_or(i32::MAX))?;
    for endpoint in endpoints {
        sub.connect(endpoint)?;
    }
    Ok(sub)
}

/// A receiver's report: `received`, the p50, p99 and largest of `ages` (µs), the fraction
/// within 1 ms, and its `cpu` seconds, on one line ([`parse_report`] reads it).
pub(crate) fn report_line(received: u64, ages: &Histogram<u64>, cpu: f64) -> String {
    let within = if ages.is_empty() {
        0.0
    } else {
        ages.count_between(0, 1_000) as f64 / ages.len() as f64
    };
    format!(
        "{received} {} {} {} {within} {cpu}",
        ages.value_at_quantile(0.5),
        ages.value_at_quantile(0.99),
        ages.max()
    )
}

/// A receiver's line as a [`Floor`] of `published` batches.
pub(crate) fn parse_report(published: u64, line: &str) -> Result<Floor> {
    let fields: Vec<f64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .with_context(|| format!("the receiver's report {line:?}"))?;
    let (&[received, p50, p99, max, within, cpu], stored) =
        fields.split_at_checked(6).unwrap_or_default()
    else {
        bail!("the receiver reported {line:?}, not six figures");
    };
    let (stored_p50_us, stored_p99_us, live_p50_us, live_p99_us) = match *stored {
        [] => (None, None, None, None),
        [p50, p99] => (Some(p50), Some(p99), None, None),
        [p50, p99, live_p50, live_p99] => (Some(p50), Some(p99), Some(live_p50), Some(live_p99)),
        _ => bail!(
            "the receiver reported {line:?}: six figures, eight with the stored ages, or ten \
             with the live ages"
        ),
    };
    Ok(Floor {
        published,
        received: received as u64,
        p50_us: p50,
        p99_us: p99,
        max_us: max,
        within_1ms: within,
        cpu_seconds: cpu,
        stored_p50_us,
        stored_p99_us,
        live_p50_us,
        live_p99_us,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_line_parses_and_a_short_one_is_an_error() {
        let floor = parse_report(10, "9 120 900 1500 0.95 0.25\n").expect("six figures");
        let mut ages = Histogram::<u64>::new(3).expect("a histogram");
        for age in [100, 200, 2_000] {
            ages.record(age).expect("in range");
        }
        let written = parse_report(3, &report_line(3, &ages, 0.5)).expect("what it writes parses");
        assert_eq!((written.received, written.cpu_seconds), (3, 0.5));
        assert!((written.within_1ms - 2.0 / 3.0).abs() < 1e-9);
        assert!(written.max_us >= 2_000.0 && written.p50_us < 1_000.0);
        assert_eq!(floor.received, 9);
        assert_eq!(
            (floor.p50_us, floor.p99_us, floor.max_us),
            (120.0, 900.0, 1500.0)
        );
        assert_eq!(floor.stored_p99_us, None);
        let through_log = parse_report(10, "9 120 900 1500 0.95 0.25 80 700").expect("eight");
        assert_eq!(
            (through_log.stored_p50_us, through_log.stored_p99_us),
            (Some(80.0), Some(700.0))
        );
        assert_eq!(through_log.live_p99_us, None);
        let live = parse_report(10, "9 120 900 1500 0.95 0.25 80 700 60 300").expect("ten");
        assert_eq!(
            (live.live_p50_us, live.live_p99_us),
            (Some(60.0), Some(300.0))
        );
        assert!(parse_report(10, "9 120 900 1500 0.95 0.25 80").is_err());
        assert!(parse_report(10, "9 120 900 1500 0.95 0.25 80 700 60").is_err());
        assert!(parse_report(10, "9 120").is_err());
        assert!(parse_report(10, "nine 1 2 3 4 5").is_err());
    }
}
