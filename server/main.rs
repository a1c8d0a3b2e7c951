use std::process::ExitCode;

use clap::Parser;
use epserve::config::{Cli, Command, MetricsFormat};

fn main() -> ExitCode {
    // The ring's cells were its slots: the old variable still sets them when the new one is unset.
    if let (Ok(v), Err(_)) = (
        std::env::var("EPSERVE_RING_SLOTS"),
        std::env::var("EPSERVE_RING_CELLS"),
    ) {
        // Before any other thread exists (first thing in main).
        std::env::set_var("EPSERVE_RING_CELLS", v);
    }
    let cli = Cli::parse();
    let (format, otlp, role, member) = match &cli.command {
        Command::Serve(a) => (
            a.log_format,
            a.otlp_endpoint.as_deref(),
            "rank",
            a.member().ok(),
        ),
        Command::Launch(a) => (
            a.serve.log_format,
            a.serve.otlp_endpoint.as_deref(),
            "launcher",
            None,
        ),
        Command::Bench(a) => (a.log_format, None, "bench", None),
        Command::Metrics(a) => {
            // Prints the table and nothing else: no logging to set up.
            print!(
                "{}",
                match a.format {
                    MetricsFormat::Markdown => epserve::metric_names::markdown(),
                    MetricsFormat::Json => epserve::metric_names::json_lines(),
                }
            );
            return ExitCode::SUCCESS;
        }
    };
    let (rank, node) = member.map(|m| (m.place.rank, m.node)).unzip();
    let telemetry = match epserve::telemetry::init(format, otlp, role, rank, node) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("epserve: cannot set up logging: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    let result = match cli.command {
        Command::Serve(args) => epserve::serve::serve(args),
        Command::Launch(args) => epserve::launch::launch(args),
        Command::Bench(args) => epserve::bench::run(args),
        Command::Metrics(_) => unreachable!("answered above"),
    };
    let code = match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, where it is handled: the whole chain of causes.
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    };
    drop(telemetry);
    code
}
