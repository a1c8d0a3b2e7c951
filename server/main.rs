use std::io::IsTerminal;
use std::process::ExitCode;

use clap::Parser;
use epserve::config::{Cli, Command, LogFormat};

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => {
            init_tracing(args.log_format);
            epserve::rank::serve(args)
        }
        Command::Launch(args) => {
            init_tracing(args.serve.log_format);
            epserve::launch::launch(args)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One line, where it is handled: the whole chain of causes.
            tracing::error!("{e:#}");
            ExitCode::FAILURE
        }
    }
}
