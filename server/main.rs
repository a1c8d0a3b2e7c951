use std::process::ExitCode;

use clap::Parser;
use epserve::config::{Cli, Command};

fn main() -> ExitCode {
    let cli = Cli::parse();
    let (serve, role) = match &cli.command {
        Command::Serve(a) => (a, "rank"),
        Command::Launch(a) => (&a.serve, "launcher"),
    };
    let telemetry =
        match epserve::telemetry::init(serve.log_format, serve.otlp_endpoint.as_deref(), role) {
            Ok(t) => t,
            Err(e) => {
                eprintln!("epserve: cannot set up logging: {e:#}");
                return ExitCode::FAILURE;
            }
        };
    let result = match cli.command {
        Command::Serve(args) => epserve::rank::serve(args),
        Command::Launch(args) => epserve::launch::launch(args),
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
