//! `kvatlas`: the KV-cache index service and its client commands.
//!
//! A thin binary: it parses the command line, sets up logging and hands each subcommand to
//! `kvatlas_server::cli`, where everything it does lives.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
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
}

fn main() -> ExitCode {
    let args = Cli::parse();
    if let Err(error) = cli::init_logging(args.log_format, &args.log) {
        eprintln!("kvatlas: {error}");
        return ExitCode::from(error.exit_code());
    }
    let result = match &args.command {
        Command::Serve(serve) => cli::serve(serve).map(|()| String::new()),
        Command::Query(query) => cli::query(query),
        Command::Workers(list) => cli::workers(list),
        Command::Indexes(list) => cli::indexes(list),
        Command::Register(register) => cli::register(register),
        Command::Unregister(unregister) => cli::unregister(unregister),
    };
    match result {
        Ok(output) => {
            print!("{output}");
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("kvatlas: {error}");
            ExitCode::from(error.exit_code())
        }
    }
}
