//! A rank out of file descriptors: connections flood the gRPC and metrics ports of a rank held
//! to 96 open files, so each accept fails while they wait in the backlog. The rank must not spin
//! (under 20% of a core), must not flood its log (a few warnings), must keep serving a client
//! already connected (p99 under 20 ms), and must take new connections again once the flood ends.

mod common;

use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;

const NOFILE: u64 = 96;

/// CPU seconds (user + system) of a process so far.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command name, which sits in parentheses and may hold spaces.
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

fn accept_warnings(p: &Proc) -> usize {
    p.log
        .lock()
        .unwrap()
        .iter()
        .filter(|l| l.contains("WARN") && l.contains("accept"))
        .count()
}

/// Forward round trips on `client`'s connection, in milliseconds, sorted.
async fn round_trips(
    client: &mut epserve::proto::moe_service_client::MoeServiceClient<tonic::transport::Channel>,
    n: usize,
) -> Vec<f64> {
    let mut ms = Vec::with_capacity(n);
    for i in 0..n {
        let x = vec![0.25f32; 2 * 64];
        let t0 = Instant::now();
        client
            .forward(request(&format!("r{i}"), 0, f32_tensor(&x, [2, 64])))
            .await
            .expect("forward while descriptors are exhausted");
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ms.sort_by(f64::total_cmp);
    ms
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_descriptors_neither_spin_nor_flood_nor_stall_a_connected_client() {
    let shm = TempDir::new("shm");
    let args = serve_args(&shm, &["--rendezvous", "127.0.0.1:0"]);
    let mut p = Proc::spawn_limited(&args, NOFILE);
    let (addr, metrics) = ports(&mut p);
    assert!(
        p.log_text()
            .contains(&format!("before={NOFILE} now={NOFILE}")),
        "the rank logs its open files limit:\n{}",
        p.log_text()
    );
    let pid = p.child.id();
    let mut client =
        epserve::proto::moe_service_client::MoeServiceClient::connect(format!("http://{addr}"))
            .await
            .unwrap();
    round_trips(&mut client, 5).await;

    // More connections than the rank has descriptors, on both ports; the kernel completes them
    // into the backlogs, where the rank cannot take them.
    let flood: Vec<TcpStream> = (0..2 * NOFILE)
        .flat_map(|i| {
            let to = if i % 4 == 0 { &metrics } else { &addr };
            TcpStream::connect(to.as_str()).ok()
        })
        .collect();
    assert!(flood.len() as u64 > NOFILE, "{} connections", flood.len());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (cpu0, warn0, t0) = (cpu_seconds(pid), accept_warnings(&p), Instant::now());
    let ms = round_trips(&mut client, 100).await;
    tokio::time::sleep(Duration::from_secs(2).saturating_sub(t0.elapsed())).await;
    let secs = t0.elapsed().as_secs_f64();
    let cpu = (cpu_seconds(pid) - cpu0) / secs;
    let warnings = accept_warnings(&p) - warn0;
    let p99 = ms[98];
    eprintln!(
        "{} connections held: rank CPU {cpu:.3} of a core over {secs:.1}s (100 round trips \
         among them), {warnings} accept warnings, round trip p50 {:.2} ms p99 {p99:.2} ms",
        flood.len(),
        ms[49]
    );
    assert!(
        accept_warnings(&p) >= 1,
        "the flood exhausted no descriptor:\n{}",
        p.log_text()
    );
    assert!(cpu < 0.2, "the rank used {cpu:.3} of a core");
    assert!(
        warnings as f64 <= 2.0 * secs,
        "{warnings} accept warnings in {secs:.1}s"
    );
    assert!(
        p99 < 20.0,
        "p99 {p99:.2} ms while descriptors are exhausted"
    );

    // The flood ends: both ports take new connections again.
    drop(flood);
    let t0 = Instant::now();
    let mut fresh = loop {
        let c =
            epserve::proto::moe_service_client::MoeServiceClient::connect(format!("http://{addr}"))
                .await;
        match c {
            Ok(c) => break c,
            Err(_) if t0.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("no new gRPC connection after the flood: {e}"),
        }
    };
    round_trips(&mut fresh, 3).await;
    let samples = common::prom::scrape(&metrics);
    assert!(
        common::prom::sum(&samples, "epserve_build_info", &[]) >= 1.0,
        "no metrics after the flood"
    );
}
