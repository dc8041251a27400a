//! The command line of `kvatlas-bench`: one subcommand per preset, each taking only the flags it
//! uses (groups shared by several presets are flattened in), resolved into a [`Plan`] (`--quick`
//! defaults applied, values checked) that [`harness::run`] runs.
//!
//! Presets (the workloads of `docs/benchmarks.md`, those Dynamo's kv-router was measured on):
//! - `conversation` (Workload A): the Mooncake conversation trace through deterministic mock
//!   engines (one LRU prefix cache per worker, leaf-first and head-first eviction, random or
//!   KV-aware routing — by default random in both eviction modes plus KV-aware leaf-first), replayed
//!   (a) interleaved, every query checked against the engines' oracle, and (b) open loop against
//!   the concurrent write front, once or as a sweep of offered loads (threshold throughput);
//! - `synthetic` (Workload B): 1024 sequences × 1024 blocks, hit / partial / miss lookups and
//!   remove + store cycles, checked against the construction; twice: with engine hashes unique
//!   per sequence, and chained as engines make them (a worker's sequences of one group share
//!   their prefix blocks: the peer harness's shared-prefix cycle);
//! - `concurrent` (Workload C): one writer and one reader, alone and at once;
//! - `clear` (Workload D): replay the events, then one `Cleared` per worker, 3 rounds;
//! - `suite` (the default, also when no subcommand is named): all four, the open loop as a sweep.
//!
//! `--trace-length-factor` and `--duplication-factor` transform the trace (after `--requests`)
//! before the mock engines, as Dynamo's `mooncake_bench` does.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::concurrent::ConcurrentConfig;
use crate::engine::{DEFAULT_LOAD_BOUND_PERCENT, EngineConfig, Eviction, LocalHashing, Routing};
use crate::harness::{self, BasePlan, ConversationPlan, Plan, TracePlan};
use crate::openloop::{FrontKind, OpenLoopConfig, sweep_windows};
use crate::replay::{backend_names, default_backends};
use crate::synthetic::SyntheticConfig;
use crate::trace::{TRACE_BLOCK_TOKENS, default_trace_path};

/// Benchmarks kvatlas index backends on the workloads Dynamo's kv-router was measured on.
///
/// Without a subcommand, runs the suite: the options below are the suite's.
#[derive(Debug, Parser)]
#[command(name = "kvatlas-bench", args_conflicts_with_subcommands = true)]
pub struct Cli {
    #[command(subcommand)]
    preset: Option<Preset>,
    #[command(flatten)]
    suite: SuiteArgs,
}

/// Which workloads to run.
#[derive(Debug, Subcommand)]
pub enum Preset {
    /// Conversation + synthetic + concurrent + clear (the open loop as a sweep); the default.
    Suite(SuiteArgs),
    /// Workload A: the Mooncake conversation trace through mock engines.
    Conversation(ConversationPreset),
    /// Workload B: 1024 × 1024 synthetic sequences.
    Synthetic(SyntheticPreset),
    /// Workload C: one writer and one reader at once.
    Concurrent(ConcurrentPreset),
    /// Workload D: replay the events, then one `Cleared` per worker (3 rounds).
    Clear(ClearPreset),
}

/// How the conversation preset replays its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Mode {
    /// Exact: each query checked against the oracle, then its events applied (one thread).
    Interleaved,
    /// Deadline-driven open loop through the concurrent write front.
    OpenLoop,
    /// Both.
    All,
}

/// The flags of every preset.
#[derive(Debug, Clone, Args)]
pub struct CommonArgs {
    /// Smoke run (≈ 10-20 s, CI): 2,000 requests and 16 workers, a 3-step sweep, a smaller
    /// synthetic index, 0.3 s concurrent phases (each unless overridden).
    #[arg(long)]
    quick: bool,
    /// Backends to run, comma-separated (default: every registered backend except `reference`,
    /// which suits only tiny runs).
    #[arg(long, visible_alias = "compare", value_delimiter = ',')]
    backends: Vec<String>,
    /// Seed of the request-to-worker assignment and the synthetic workload.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Write the results as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// The trace and the mock engines that turn it into a stream (conversation, concurrent, clear).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Trace and mock engines")]
pub struct StreamArgs {
    /// JSONL trace (default: the Mooncake conversation trace in data/traces/).
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Replay only the first N trace requests, before the length and duplication factors
    /// (default: all; 2,000 with --quick).
    #[arg(long)]
    requests: Option<usize>,
    /// Split every trace hash id into k ids (h → h*k … h*k+k-1): k times the blocks per request.
    #[arg(long, default_value_t = 1)]
    trace_length_factor: u64,
    /// Replay d disjoint copies of the trace (ids offset by (max id + 1) × copy), interleaved by
    /// timestamp.
    #[arg(long, visible_alias = "trace-duplication-factor", default_value_t = 1)]
    duplication_factor: u64,
    /// Workers (default 128; 16 with --quick).
    #[arg(long)]
    workers: Option<u32>,
    /// Blocks each worker's cache holds.
    #[arg(long, default_value_t = 512)]
    capacity: usize,
    /// How a trace block's local hash is made: `tokens` (deterministic tokens hashed with
    /// kvatlas-hash, as a router does) or `splitmix` (Dynamo's harness's id mapping).
    #[arg(long, value_enum, default_value_t = LocalHashing::Tokens)]
    local_hashing: LocalHashing,
}

/// The conversation preset's own flags (also the suite's).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Conversation (Workload A)")]
pub struct ConversationArgs {
    /// Replay mode of the conversation preset.
    #[arg(long, value_enum, default_value = "all")]
    mode: Mode,
    /// Eviction order of the mock engines (default: both, one table each).
    #[arg(long, value_enum)]
    eviction: Option<Eviction>,
    /// Request routing of the conversation preset (default: random with each eviction order,
    /// plus kv-aware with leaf-first eviction).
    #[arg(long, value_enum)]
    routing: Option<Routing>,
    /// KV-aware routing: a worker takes a request only if its request count then stays within
    /// this percentage of the mean (rounded up); 0 = unbounded (then the trace's shared first
    /// block sends every request to one worker).
    #[arg(long, default_value_t = DEFAULT_LOAD_BOUND_PERCENT)]
    load_bound_percent: u32,
    /// Events-only passes per backend in the interleaved mode (median reported).
    #[arg(long, default_value_t = 5)]
    passes: usize,
    /// Open loop: event issuer threads (workers split between them).
    #[arg(long, default_value_t = 1)]
    issuers: usize,
    /// Open loop: spin (instead of sleeping) this long before each deadline (µs).
    #[arg(long, default_value_t = 200)]
    spin_us: u64,
    /// Write plots (SVG and PNG) of the open-loop runs into this directory.
    #[arg(long)]
    plot_dir: Option<PathBuf>,
}

/// The concurrent write front (the conversation's open loop and the concurrent preset).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Concurrent write front")]
pub struct FrontArgs {
    /// Writer threads of the concurrent front (open loop and concurrent presets).
    #[arg(long, default_value_t = 1)]
    pool_threads: usize,
    /// Capacity of each writer lane (mutations).
    #[arg(long, default_value_t = 1024)]
    queue_capacity: usize,
    /// How the concurrent front shares the index with readers.
    #[arg(long, value_enum, default_value_t = FrontKind::LeftRight)]
    front: FrontKind,
}

/// The open-loop sweep's range (the suite always sweeps; the conversation preset with --sweep).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Open-loop sweep")]
pub struct SweepArgs {
    /// Fastest sweep window (ms).
    #[arg(long)]
    sweep_min_ms: Option<f64>,
    /// Slowest sweep window (ms).
    #[arg(long)]
    sweep_max_ms: Option<f64>,
    /// Sweep steps.
    #[arg(long)]
    sweep_steps: Option<usize>,
}

/// The synthetic preset's flags.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Synthetic (Workload B)")]
pub struct SyntheticArgs {
    /// Synthetic preset: sequences (default 1024; 256 with --quick).
    #[arg(long)]
    sequences: Option<usize>,
    /// Synthetic preset: blocks per sequence (default 1024; 512 with --quick).
    #[arg(long)]
    depth: Option<usize>,
    /// Synthetic preset: lookups per kind and remove + store cycles (default 1000; 200 with
    /// --quick).
    #[arg(long)]
    iterations: Option<usize>,
}

/// The concurrent preset's flags.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Concurrent (Workload C)")]
pub struct ConcurrentArgs {
    /// Concurrent preset: length of each phase (ms; default 3000, 300 with --quick).
    #[arg(long)]
    phase_ms: Option<u64>,
}

/// The clear preset's flags.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Clear (Workload D)")]
pub struct ClearArgs {
    /// Clear preset: rounds of (replay, clear all) on one index.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
}

/// `suite`: every workload, the open loop as a sweep.
#[derive(Debug, Clone, Args)]
pub struct SuiteArgs {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    conversation: ConversationArgs,
    #[command(flatten)]
    sweep: SweepArgs,
    #[command(flatten)]
    front: FrontArgs,
    #[command(flatten)]
    synthetic: SyntheticArgs,
    #[command(flatten)]
    concurrent: ConcurrentArgs,
    #[command(flatten)]
    clear: ClearArgs,
}

/// `conversation`: Workload A, the open loop as one run or (with --sweep) a sweep.
#[derive(Debug, Clone, Args)]
#[command(
    mut_arg("sweep_min_ms", |a| a.requires("sweep")),
    mut_arg("sweep_max_ms", |a| a.requires("sweep")),
    mut_arg("sweep_steps", |a| a.requires("sweep")),
)]
pub struct ConversationPreset {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    conversation: ConversationArgs,
    /// Open loop: the window the trace is rescaled to, in ms (single run, without --sweep).
    #[arg(long, default_value_t = 1000.0, conflicts_with = "sweep")]
    window_ms: f64,
    /// Open loop: sweep log-spaced windows from --sweep-max-ms (slow) to --sweep-min-ms (fast).
    #[arg(long, help_heading = "Open-loop sweep")]
    sweep: bool,
    #[command(flatten)]
    sweep_range: SweepArgs,
    #[command(flatten)]
    front: FrontArgs,
}

/// `synthetic`: Workload B.
#[derive(Debug, Clone, Args)]
pub struct SyntheticPreset {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    synthetic: SyntheticArgs,
}

/// `concurrent`: Workload C.
#[derive(Debug, Clone, Args)]
pub struct ConcurrentPreset {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    front: FrontArgs,
    #[command(flatten)]
    concurrent: ConcurrentArgs,
}

/// `clear`: Workload D.
#[derive(Debug, Clone, Args)]
pub struct ClearPreset {
    #[command(flatten)]
    common: CommonArgs,
    #[command(flatten)]
    stream: StreamArgs,
    #[command(flatten)]
    clear: ClearArgs,
}

/// Resolves `cli` into its plan and runs it ([`harness::run`]); returns the failed correctness
/// checks (empty if all passed).
pub fn run(cli: Cli) -> Result<Vec<String>> {
    harness::run(&cli.plan()?)
}

impl Cli {
    /// The plan of the chosen preset (the suite when none is named): `--quick` defaults applied,
    /// values checked.
    pub fn plan(self) -> Result<Plan> {
        match self.preset.unwrap_or(Preset::Suite(self.suite)) {
            Preset::Suite(args) => args.plan(),
            Preset::Conversation(args) => args.plan(),
            Preset::Synthetic(args) => args.plan(),
            Preset::Concurrent(args) => args.plan(),
            Preset::Clear(args) => args.plan(),
        }
    }
}

impl SuiteArgs {
    fn plan(self) -> Result<Plan> {
        let (quick, seed) = (self.common.quick, self.common.seed);
        let backends = self.common.backends()?;
        let workers = self.stream.workers(quick)?;
        let conversation = self.conversation.plan(
            &self.stream,
            &self.front,
            workers,
            seed,
            true,
            self.sweep.windows(quick),
        )?;
        let synthetic = self.synthetic.config(quick, seed)?;
        let engine = self.stream.engine(
            workers,
            Eviction::LeafFirst,
            Routing::Random,
            self.conversation.load_bound_percent,
            seed,
        );
        Ok(Plan {
            quick,
            backends,
            trace: self.stream.trace(quick),
            conversation: Some(conversation),
            synthetic: Some(synthetic),
            base: Some(BasePlan {
                engine,
                concurrent: Some(self.concurrent.config(quick, &self.front)),
                clear_rounds: Some(self.clear.rounds),
            }),
            json: self.common.json,
        })
    }
}

impl ConversationPreset {
    fn plan(self) -> Result<Plan> {
        let (quick, seed) = (self.common.quick, self.common.seed);
        let backends = self.common.backends()?;
        let workers = self.stream.workers(quick)?;
        let windows = if self.sweep {
            self.sweep_range.windows(quick)
        } else {
            vec![Duration::from_secs_f64(self.window_ms.max(0.0) / 1e3)]
        };
        let conversation = self.conversation.plan(
            &self.stream,
            &self.front,
            workers,
            seed,
            self.sweep,
            windows,
        )?;
        Ok(Plan {
            quick,
            backends,
            trace: self.stream.trace(quick),
            conversation: Some(conversation),
            synthetic: None,
            base: None,
            json: self.common.json,
        })
    }
}

impl SyntheticPreset {
    fn plan(self) -> Result<Plan> {
        let (quick, seed) = (self.common.quick, self.common.seed);
        let backends = self.common.backends()?;
        let synthetic = self.synthetic.config(quick, seed)?;
        Ok(Plan {
            quick,
            backends,
            // Not loaded: named in the header and the report only.
            trace: TracePlan {
                path: default_trace_path(),
                requests: None,
                length_factor: 1,
                duplication_factor: 1,
            },
            conversation: None,
            synthetic: Some(synthetic),
            base: None,
            json: self.common.json,
        })
    }
}

impl ConcurrentPreset {
    fn plan(self) -> Result<Plan> {
        let concurrent = self.concurrent.config(self.common.quick, &self.front);
        leaf_first_plan(&self.common, &self.stream, Some(concurrent), None)
    }
}

impl ClearPreset {
    fn plan(self) -> Result<Plan> {
        leaf_first_plan(&self.common, &self.stream, None, Some(self.clear.rounds))
    }
}

/// The plan of a preset that replays the leaf-first, randomly routed stream (Workloads C and D).
fn leaf_first_plan(
    common: &CommonArgs,
    stream: &StreamArgs,
    concurrent: Option<ConcurrentConfig>,
    clear_rounds: Option<usize>,
) -> Result<Plan> {
    let quick = common.quick;
    let engine = stream.engine(
        stream.workers(quick)?,
        Eviction::LeafFirst,
        Routing::Random,
        DEFAULT_LOAD_BOUND_PERCENT,
        common.seed,
    );
    Ok(Plan {
        quick,
        backends: common.backends()?,
        trace: stream.trace(quick),
        conversation: None,
        synthetic: None,
        base: Some(BasePlan {
            engine,
            concurrent,
            clear_rounds,
        }),
        json: common.json.clone(),
    })
}

impl CommonArgs {
    /// The chosen backends (default: every registered one but `reference`), each checked.
    fn backends(&self) -> Result<Vec<String>> {
        let backends: Vec<String> = if self.backends.is_empty() {
            default_backends().into_iter().map(String::from).collect()
        } else {
            self.backends.clone()
        };
        for name in &backends {
            if !backend_names().contains(&name.as_str()) {
                bail!(
                    "unknown backend `{name}` (available: {})",
                    backend_names().join(", ")
                );
            }
        }
        Ok(backends)
    }
}

impl StreamArgs {
    /// The workers (default 128; 16 with --quick), checked positive with the capacity.
    fn workers(&self, quick: bool) -> Result<u32> {
        let workers = self.workers.unwrap_or(if quick { 16 } else { 128 });
        if workers == 0 || self.capacity == 0 {
            bail!("--workers and --capacity must be positive");
        }
        Ok(workers)
    }

    /// The trace and its transformation.
    fn trace(&self, quick: bool) -> TracePlan {
        TracePlan {
            path: self.trace.clone().unwrap_or_else(default_trace_path),
            requests: self.requests.or(if quick { Some(2_000) } else { None }),
            length_factor: self.trace_length_factor,
            duplication_factor: self.duplication_factor,
        }
    }

    /// The mock engines of one configuration.
    fn engine(
        &self,
        workers: u32,
        eviction: Eviction,
        routing: Routing,
        load_bound_percent: u32,
        seed: u64,
    ) -> EngineConfig {
        EngineConfig {
            load_bound_percent,
            local_hashing: self.local_hashing,
            block_tokens: (TRACE_BLOCK_TOKENS as u64 / self.trace_length_factor.max(1)).max(1)
                as u32,
            ..EngineConfig::new(workers, self.capacity, eviction, seed).with_routing(routing)
        }
    }
}

impl ConversationArgs {
    /// Workload A's plan: its configurations and how each stream is replayed.
    fn plan(
        &self,
        stream: &StreamArgs,
        front: &FrontArgs,
        workers: u32,
        seed: u64,
        sweep: bool,
        windows: Vec<Duration>,
    ) -> Result<ConversationPlan> {
        if self.load_bound_percent != 0 && self.load_bound_percent < 100 {
            bail!("--load-bound-percent must be 0 (unbounded) or at least 100");
        }
        let evictions: Vec<Eviction> = self.eviction.map_or(Eviction::ALL.to_vec(), |e| vec![e]);
        let engine = |eviction, routing| {
            stream.engine(workers, eviction, routing, self.load_bound_percent, seed)
        };
        // Conversation configurations: the chosen routing with each eviction order; by default
        // random routing with each, plus KV-aware routing with the first (leaf-first unless
        // chosen).
        let mut configs: Vec<EngineConfig> = evictions
            .iter()
            .map(|&e| engine(e, self.routing.unwrap_or(Routing::Random)))
            .collect();
        if self.routing.is_none() {
            configs.push(engine(evictions[0], Routing::KvAware));
        }
        Ok(ConversationPlan {
            configs,
            interleaved: self.mode != Mode::OpenLoop,
            open_loop: self.mode != Mode::Interleaved,
            sweep,
            open_loop_config: OpenLoopConfig {
                window: windows[0],
                pool_threads: front.pool_threads,
                queue_capacity: front.queue_capacity,
                front: front.front,
                issuers: self.issuers,
                spin: Duration::from_micros(self.spin_us),
            },
            windows,
            passes: self.passes,
            plot_dir: self.plot_dir.clone(),
        })
    }
}

impl SweepArgs {
    /// The sweep's log-spaced windows (default 20–4000 ms in 8 steps; 20–500 ms in 3 with
    /// --quick).
    fn windows(&self, quick: bool) -> Vec<Duration> {
        let (min, max, steps) = if quick {
            (20.0, 500.0, 3)
        } else {
            (20.0, 4000.0, 8)
        };
        sweep_windows(
            Duration::from_secs_f64(self.sweep_min_ms.unwrap_or(min) / 1e3),
            Duration::from_secs_f64(self.sweep_max_ms.unwrap_or(max) / 1e3),
            self.sweep_steps.unwrap_or(steps),
        )
    }
}

impl SyntheticArgs {
    /// Workload B's shape (engine hashes: the default, replaced by each run).
    fn config(&self, quick: bool, seed: u64) -> Result<SyntheticConfig> {
        let iterations = self.iterations.unwrap_or(if quick { 200 } else { 1000 });
        let config = SyntheticConfig {
            sequences: self.sequences.unwrap_or(if quick { 256 } else { 1024 }),
            depth: self.depth.unwrap_or(if quick { 512 } else { 1024 }),
            iterations,
            cycles: iterations,
            seed,
            ..SyntheticConfig::default()
        };
        if config.shared > config.depth {
            bail!("--depth must be at least {}", config.shared);
        }
        Ok(config)
    }
}

impl ConcurrentArgs {
    /// Workload C's settings.
    fn config(&self, quick: bool, front: &FrontArgs) -> ConcurrentConfig {
        ConcurrentConfig {
            phase_ms: self.phase_ms.unwrap_or(if quick { 300 } else { 3000 }),
            pool_threads: front.pool_threads,
            queue_capacity: front.queue_capacity,
            front: front.front,
            ..ConcurrentConfig::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn parse(args: &str) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("kvatlas-bench").chain(args.split_whitespace()))
    }

    fn plan(args: &str) -> Plan {
        parse(args).expect("parses").plan().expect("a valid plan")
    }

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn no_subcommand_is_the_suite() {
        let quick = plan("--quick --backends atlas");
        let named = plan("suite --quick --backends atlas");
        assert_eq!(format!("{quick:?}"), format!("{named:?}"));
        let conversation = quick.conversation.expect("Workload A");
        assert!(conversation.sweep && conversation.interleaved && conversation.open_loop);
        assert_eq!(conversation.windows.len(), 3);
        assert_eq!(conversation.configs.len(), 3);
        assert_eq!(quick.trace.requests, Some(2_000));
        let base = quick.base.expect("Workloads C and D");
        assert_eq!(base.engine.workers, 16);
        assert_eq!(base.concurrent.map(|c| c.phase_ms), Some(300));
        assert_eq!(base.clear_rounds, Some(3));
        assert_eq!(quick.synthetic.map(|s| s.sequences), Some(256));
    }

    #[test]
    fn each_preset_runs_only_its_workload() {
        let conversation = plan("conversation --mode open-loop --window-ms 500");
        let workload = conversation.conversation.expect("Workload A");
        assert!(!workload.sweep && !workload.interleaved && workload.open_loop);
        assert_eq!(workload.windows, vec![Duration::from_millis(500)]);
        assert!(conversation.synthetic.is_none() && conversation.base.is_none());

        let synthetic = plan("synthetic --depth 512");
        assert!(synthetic.conversation.is_none() && synthetic.base.is_none());
        assert_eq!(synthetic.synthetic.map(|s| s.depth), Some(512));

        let concurrent = plan("concurrent --front locked");
        let base = concurrent.base.expect("Workload C");
        assert!(base.clear_rounds.is_none());
        assert_eq!(base.concurrent.map(|c| c.front), Some(FrontKind::Locked));

        let clear = plan("clear --rounds 2 --workers 16 --capacity 4096");
        let base = clear.base.expect("Workload D");
        assert!(base.concurrent.is_none() && clear.synthetic.is_none());
        assert_eq!(base.clear_rounds, Some(2));
        assert_eq!((base.engine.workers, base.engine.capacity), (16, 4096));
    }

    #[test]
    fn a_preset_rejects_the_flags_it_would_ignore() {
        for args in [
            "synthetic --window-ms 5",
            "synthetic --workers 16",
            "synthetic --trace x.jsonl",
            "concurrent --rounds 2",
            "concurrent --mode interleaved",
            "clear --front locked",
            "clear --plot-dir plots",
            "conversation --phase-ms 10",
            "conversation --sweep-min-ms 50",
            "conversation --sweep --window-ms 500",
            "--sweep",
            "suite --window-ms 500",
            "--quick synthetic",
            "--preset synthetic",
        ] {
            assert!(parse(args).is_err(), "`{args}` parsed");
        }
        for args in [
            "conversation --sweep --sweep-min-ms 50 --sweep-max-ms 2000 --sweep-steps 6 --compare atlas,radix",
            "conversation --routing kv-aware --eviction leaf-first",
            "conversation --mode interleaved --trace-length-factor 4 --trace-duplication-factor 2",
            "--quick --json r.json --plot-dir plots --rounds 2 --phase-ms 10 --depth 512",
        ] {
            assert!(parse(args).is_ok(), "`{args}` rejected");
        }
    }

    #[test]
    fn bad_values_are_refused() {
        for args in [
            "synthetic --backends nonesuch",
            "clear --workers 0",
            "conversation --load-bound-percent 50",
            "synthetic --depth 1",
        ] {
            assert!(
                parse(args).expect("parses").plan().is_err(),
                "`{args}` planned"
            );
        }
    }
}
