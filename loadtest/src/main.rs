use std::process::ExitCode;

use clap::Parser;
use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::GetModelInfoRequest;
use epserve_loadtest::config::{Api, Args};
use epserve_loadtest::echo::{self, Echo};
use epserve_loadtest::load::{self, Mode, Plan};
use epserve_loadtest::report::{Comparison, Report};
use epserve_loadtest::sweep::{self, Sweep};
use epserve_loadtest::workload::{Shape, Skewed, Workload};

/// The model's shape, from the first of the target's addresses.
async fn shape_of(addr: &str, args: &Args) -> anyhow::Result<Shape> {
    let first = addr.split(',').next().unwrap_or(addr);
    let mut c = MoeServiceClient::connect(format!("http://{first}")).await?;
    let info = c.get_model_info(GetModelInfoRequest {}).await?.into_inner();
    Shape::from_info(&info, args.layer).map_err(anyhow::Error::msg)
}

async fn run_once(addr: &str, args: &Args, mode: Mode, shape: &Shape) -> anyhow::Result<Report> {
    run_api(addr, args, args.api, mode, shape).await
}

async fn run_api(
    addr: &str,
    args: &Args,
    api: Api,
    mode: Mode,
    shape: &Shape,
) -> anyhow::Result<Report> {
    let plan = Plan {
        http2: args.http2.clone(),
        mode,
        api,
        warmup: args.warmup,
        duration: args.duration,
        timeout: args.timeout,
        connections: args.connections,
        max_in_flight: args.max_in_flight,
    };
    let skew = args
        .skew
        .map(|s| Skewed::load(s, args.skew_model.as_deref(), args.skew_model_seed, shape))
        .transpose()?;
    let w = Workload::new(
        shape.clone(),
        args.tokens,
        args.dtype,
        args.client_routing,
        skew,
        args.seed,
    );
    load::run(addr, &plan, w, args.seed).await
}

fn write_json(args: &Args, value: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(value)?)?;
    }
    Ok(())
}

async fn main_async(args: Args) -> anyhow::Result<()> {
    if let Some(addr) = args.serve_echo {
        let bound = echo::spawn(
            addr,
            Echo {
                hidden: args.echo_hidden,
                delay: args.echo_delay,
            },
            &args.http2,
        )
        .await?;
        eprintln!(
            "echo service on {bound} (hidden {}, delay {:?}); Ctrl-C stops it",
            args.echo_hidden, args.echo_delay
        );
        tokio::signal::ctrl_c().await?;
        return Ok(());
    }
    // The echo target: given, or started here with the target's hidden size.
    let echo_addr = match (&args.echo_target, args.echo) {
        (Some(t), _) => Some(t.clone()),
        (None, true) => {
            let hidden = match &args.target {
                Some(t) => shape_of(t, &args).await?.hidden as u32,
                None => args.echo_hidden,
            };
            let echo = Echo {
                hidden,
                delay: args.echo_delay,
            };
            Some(
                echo::spawn("127.0.0.1:0".parse()?, echo, &args.http2)
                    .await?
                    .to_string(),
            )
        }
        (None, false) => None,
    };
    let target = args
        .target
        .clone()
        .or(echo_addr.clone())
        .expect("validated");
    let shape = shape_of(&target, &args).await?;
    if args.sweep {
        let mut points = Vec::new();
        let mut rate = args.sweep_start;
        let mut stopped = format!("reached --sweep-max-steps {}", args.sweep_max_steps);
        for _ in 0..args.sweep_max_steps {
            let r = run_once(&target, &args, Mode::Open(rate), &shape).await?;
            println!("{}", r.table());
            let sat = sweep::saturated(&r);
            points.push(r);
            if let Some(why) = sat {
                stopped = why;
                break;
            }
            rate *= args.sweep_factor;
        }
        let sweep = Sweep { points, stopped };
        println!("sweep stopped: {}", sweep.stopped);
        let title = format!(
            "{target}: {:?}, tokens {:?}, {:?}",
            args.api, args.tokens, args.dtype
        );
        sweep::draw(&sweep, &title, &args.svg)?;
        println!("wrote {}", args.svg.display());
        return write_json(&args, &sweep);
    }
    let mode = match (args.concurrency, args.rate) {
        (Some(n), _) => Mode::Closed(n),
        (_, Some(r)) => Mode::Open(r),
        _ => unreachable!("validated"),
    };
    let report = run_once(&target, &args, mode, &shape).await?;
    if let Some(other) = args.compare_api {
        let base = run_api(&target, &args, other, mode, &shape).await?;
        let cmp = Comparison::versus(report, base, format!("{other:?}"));
        print!("{}", cmp.table());
        return write_json(&args, &cmp);
    }
    match echo_addr
        .filter(|e| Some(e) != args.target.as_ref())
        .filter(|_| args.target.is_some())
    {
        Some(e) => {
            let echo_report = run_once(&e, &args, mode, &shape).await?;
            let cmp = Comparison::new(report, echo_report);
            print!("{}", cmp.table());
            write_json(&args, &cmp)
        }
        None => {
            print!("{}", report.table());
            write_json(&args, &report)
        }
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    if let Err(e) = args.validate() {
        eprintln!("epserve-loadtest: {e}");
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("epserve-loadtest: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(main_async(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("epserve-loadtest: {e:#}");
            ExitCode::FAILURE
        }
    }
}
