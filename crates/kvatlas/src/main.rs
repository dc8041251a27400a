//! `kvatlas`: the KV-cache index service and its client commands.
//!
//! A thin binary: it parses the command line, sets up logging and hands each subcommand to
//! `kvatlas_server::cli` (or `kvatlas demo` to `kvatlas_fleet::demo`), where everything it does
//! lives.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};
use kvatlas_fleet::demo;
use kvatlas_server::cli;

/// kvatlas: the global, real-time index of which worker holds which KV-cache block.
#[derive(Debug, Parser)]
#[command(name = "kvatlas", version, about)]
struct Cli {
    /// Log format.
    #[arg(
        long,
        global = true,
        env = "KVATLAS_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    log_format: cli::LogFormat,
    /// Log filter (`info`, `debug`, `kvatlas_server=debug,info`, ...).
    #[arg(long, global = true, env = "KVATLAS_LOG", default_value = "info")]
    log: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the index service (gRPC and HTTP).
    Serve(Box<cli::ServeArgs>),
    /// Ask which workers hold how much of a prompt.
    Query(cli::QueryArgs),
    /// List registered workers with their listener state and counters.
    Workers(cli::ListArgs),
    /// List indexes with their block size, size and freshness.
    Indexes(cli::ListArgs),
    /// Register an engine rank's ZMQ publisher.
    Register(cli::RegisterArgs),
    /// Unregister a worker and remove its blocks.
    Unregister(cli::UnregisterArgs),
    /// See it work: a simulated fleet of engines, a router and `kvatlas serve`, random against
    /// KV-aware routing (no setup).
    Demo(demo::DemoArgs),
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let mut args = Cli::from_arg_matches(&matches)
        .map_err(|error| error.format(&mut Cli::command()))
        .unwrap_or_else(|error| error.exit());
    if let (Command::Serve(serve), Some(("serve", serve_matches))) =
        (&mut args.command, matches.subcommand())
    {
        // (A port from the environment must not change an address from the command line.)
        serve.note_sources(serve_matches);
    }
    if let Err(error) = cli::init_logging(args.log_format, &args.log) {
        eprintln!("kvatlas: {error}");
        return ExitCode::from(error.exit_code());
    }
    let failed = |e: cli::CliError| (e.to_string(), e.exit_code());
    let result = match &args.command {
        Command::Serve(serve) => cli::serve(serve).map(|()| String::new()).map_err(failed),
        Command::Query(query) => cli::query(query).map_err(failed),
        Command::Workers(list) => cli::workers(list).map_err(failed),
        Command::Indexes(list) => cli::indexes(list).map_err(failed),
        Command::Register(register) => cli::register(register).map_err(failed),
        Command::Unregister(unregister) => cli::unregister(unregister).map_err(failed),
        Command::Demo(args) => demo::run(args).map_err(|e| (e.to_string(), 1)),
    };
    match result {
        Ok(output) => {
            // A reader gone (`kvatlas workers | head -1`) is not a failure: the output was
            // wanted no further. (`print!` panicked on it.)
            use std::io::Write as _;
            match std::io::stdout().lock().write_all(output.as_bytes()) {
                Err(error) if error.kind() != std::io::ErrorKind::BrokenPipe => {
                    eprintln!("kvatlas: cannot write the output: {error}");
                    ExitCode::FAILURE
                }
                _ => ExitCode::SUCCESS,
            }
        }
        Err((message, code)) => {
            eprintln!("kvatlas: {message}");
            ExitCode::from(code)
        }
    }
}
