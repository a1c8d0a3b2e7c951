//! Test harness: rank groups started the way a user starts them (`epserve launch` / `epserve serve`
//! on free ports), a gRPC client, and an independent f64 reference of the MoE layer.
#![allow(dead_code)]

pub mod checkpoint;
#[cfg(feature = "cuda")]
pub mod gpu;
pub mod kserve;
pub mod loss;
pub mod prom;
pub mod reference;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use epserve::proto::moe_service_client::MoeServiceClient;
use epserve::proto::{DType, ForwardRequest, Tensor};
use tonic::transport::Channel;

/// The binary under test: `EPSERVE_BIN` (a copy carried to a GPU machine), else cargo's build.
pub fn bin() -> String {
    std::env::var("EPSERVE_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_epserve").to_string())
}

/// A scratch directory for shm segments and checkpoints, removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(tag: &str) -> Self {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("epserve-test-{}-{tag}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A running process whose stderr is collected line by line.
pub struct Proc {
    pub child: Child,
    pub log: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    pub fn spawn(args: &[String]) -> Self {
        Self::spawn_env(args, &[])
    }

    pub fn spawn_env(args: &[String], env: &[(&str, &str)]) -> Self {
        let mut cmd = Command::new(bin());
        cmd.args(args).envs(env.iter().copied());
        Self::spawn_command(cmd)
    }

    /// The binary with `args` under a limit of `nofile` open files (soft and hard), set by the
    /// shell that then becomes it (same pid).
    pub fn spawn_limited(args: &[String], nofile: u64) -> Self {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg(format!("ulimit -n {nofile} && exec \"$0\" \"$@\""))
            .arg(bin())
            .args(args);
        Self::spawn_command(cmd)
    }

    fn spawn_command(mut cmd: Command) -> Self {
        // Info logs unless the test asked for others.
        if !cmd.get_envs().any(|(k, _)| k == "RUST_LOG") {
            cmd.env("RUST_LOG", "info");
        }
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn epserve");
        let log = Arc::new(Mutex::new(Vec::new()));
        // stdout carries rank 0's rendezvous address; stderr the logs. Both go to one log.
        let out: Box<dyn std::io::Read + Send> = Box::new(child.stdout.take().unwrap());
        let err: Box<dyn std::io::Read + Send> = Box::new(child.stderr.take().unwrap());
        for stream in [out, err] {
            let l = log.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    l.lock().unwrap().push(line);
                }
            });
        }
        Self { child, log }
    }

    pub fn log_text(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// Waits for a log line containing `needle`; returns the text after it.
    pub fn wait_for(&mut self, needle: &str, timeout: Duration) -> Result<String, String> {
        let end = Instant::now() + timeout;
        loop {
            if let Some(l) = self.log.lock().unwrap().iter().find(|l| l.contains(needle)) {
                return Ok(l[l.find(needle).unwrap() + needle.len()..]
                    .trim()
                    .to_string());
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(100));
                return Err(format!(
                    "exited ({st}) before '{needle}':\n{}",
                    self.log_text()
                ));
            }
            if Instant::now() > end {
                return Err(format!(
                    "no '{needle}' within {timeout:?}:\n{}",
                    self.log_text()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for exit; None if still running at the timeout.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let end = Instant::now() + timeout;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(50));
                return Some(st);
            }
            if Instant::now() > end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn signal(&self, sig: &str) {
        Command::new("kill")
            .args(["-s", sig, &self.child.id().to_string()])
            .status()
            .unwrap();
    }

    /// The REST address (HOST:PORT) rank 0 logs once it serves KServe REST.
    pub fn rest_addr(&mut self) -> String {
        self.wait_for(" KServe REST on http://", Duration::from_secs(30))
            .unwrap()
            .trim_end_matches("/v2")
            .to_string()
    }

    /// The child running `--rank r` (a rank of a launcher).
    pub fn rank_pid(&self, r: usize) -> u32 {
        *self
            .children()
            .iter()
            .find(|&&pid| {
                let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let args: Vec<&[u8]> = cmd.split(|&b| b == 0).collect();
                args.windows(2)
                    .any(|w| w[0] == b"--rank" && w[1] == r.to_string().as_bytes())
            })
            .unwrap_or_else(|| panic!("no rank {r} among {:?}", self.children()))
    }

    /// Child processes (the ranks of a launcher).
    pub fn children(&self) -> Vec<u32> {
        let pid = self.child.id();
        let mut out = Vec::new();
        if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
            for t in tasks.flatten() {
                let c = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
                out.extend(c.split_whitespace().filter_map(|x| x.parse::<u32>().ok()));
            }
        }
        out.sort();
        out
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.signal("TERM");
            if self.wait_exit(Duration::from_secs(10)).is_none() {
                let _ = self.child.kill();
                let _ = self.child.wait();
            }
        }
    }
}

/// A lone rank's gRPC address and its metrics base URL (without `/metrics`), once it serves.
pub fn ports(p: &mut Proc) -> (String, String) {
    let addr = p
        .wait_for("serving gRPC on", Duration::from_secs(60))
        .unwrap();
    let metrics = p
        .wait_for("metrics on http://", Duration::from_secs(10))
        .unwrap();
    (addr, metrics.trim_end_matches("/metrics").to_string())
}

/// The grpc-status and grpc-message of a raw HTTP/2 gRPC answer (headers, else trailers), once
/// its body is over; -1 when it carries none.
pub async fn grpc_outcome<B>(resp: http::Response<B>) -> (i32, String)
where
    B: http_body::Body,
{
    use http_body_util::BodyExt;
    let (parts, body) = resp.into_parts();
    let trailers = match body.collect().await {
        Ok(b) => b.trailers().cloned().unwrap_or_default(),
        Err(_) => Default::default(),
    };
    // tonic reads grpc-status and the percent-encoded grpc-message as any client does.
    match tonic::Status::from_header_map(&parts.headers)
        .or_else(|| tonic::Status::from_header_map(&trailers))
    {
        Some(s) => (s.code() as i32, s.message().to_string()),
        None => (-1, String::new()),
    }
}

/// `epserve serve` as rank `rank` of `world`, on free ports, with `extra` flags.
pub fn serve(rank: usize, world: usize, rendezvous: &str, shm: &TempDir, extra: &[&str]) -> Proc {
    let mut args = serve_args(shm, extra);
    args.extend(
        [
            "--rank",
            &rank.to_string(),
            "--world-size",
            &world.to_string(),
            "--rendezvous",
            rendezvous,
        ]
        .map(String::from),
    );
    Proc::spawn(&args)
}

/// `launch` of `ranks` ranks of `model` on free ports with their segments in `shm`, then
/// `extra` flags.
pub fn launch_args(ranks: usize, model: &str, shm: &TempDir, extra: &[&str]) -> Vec<String> {
    let mut args = serve_args(shm, &["--ranks", &ranks.to_string(), "--model", model]);
    args[0] = "launch".into();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// `serve` on free ports (gRPC, metrics) with its segments in `shm`, then `extra` flags.
pub fn serve_args(shm: &TempDir, extra: &[&str]) -> Vec<String> {
    let shm = shm.0.display().to_string();
    let mut args: Vec<String> = [
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--shm-dir",
        &shm,
    ]
    .map(String::from)
    .to_vec();
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// Flags for lifecycle tests: a stopped rank shows within half a second.
pub const FAST_LIVENESS: &[&str] = &[
    "--heartbeat-interval",
    "200ms",
    "--liveness-timeout",
    "500ms",
    "--rendezvous-timeout",
    "60s",
];

/// A group started with `epserve launch`, serving on a free port.
pub struct Group {
    pub proc: Proc,
    pub addr: String,
    pub shm: TempDir,
}

impl Group {
    /// The `/metrics` address of each of the `n` ranks, by rank, from their startup lines.
    pub fn metrics_addrs(&self, n: usize) -> Vec<String> {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let mut addrs = vec![String::new(); n];
            for l in self.proc.log.lock().unwrap().iter() {
                let Some((head, tail)) = l.split_once(" metrics on http://") else {
                    continue;
                };
                let rank: usize = head.rsplit(' ').next().unwrap().parse().unwrap();
                addrs[rank] = tail
                    .split_whitespace()
                    .next()
                    .unwrap()
                    .trim_end_matches("/metrics")
                    .to_string();
            }
            if addrs.iter().all(|a| !a.is_empty()) {
                return addrs;
            }
            assert!(Instant::now() < end, "{}", self.proc.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The KServe REST address (`host:port`), from rank 0's startup line.
    pub fn http_addr(&self) -> String {
        let end = Instant::now() + Duration::from_secs(30);
        loop {
            let found = self.proc.log.lock().unwrap().iter().find_map(|l| {
                let (_, tail) = l.split_once(" KServe REST on http://")?;
                Some(tail.trim_end().trim_end_matches("/v2").to_string())
            });
            if let Some(a) = found {
                return a;
            }
            assert!(Instant::now() < end, "{}", self.proc.log_text());
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn launch(ranks: usize, model: &str, extra: &[&str]) -> Self {
        Self::launch_env(ranks, model, extra, &[])
    }

    pub fn launch_env(ranks: usize, model: &str, extra: &[&str], env: &[(&str, &str)]) -> Self {
        let shm = TempDir::new("shm");
        let args = launch_args(ranks, model, &shm, extra);
        let mut proc = Proc::spawn_env(&args, env);
        let addr = proc
            .wait_for("serving gRPC on", Duration::from_secs(300))
            .unwrap();
        Self { proc, addr, shm }
    }

    pub async fn client(&self) -> MoeServiceClient<Channel> {
        MoeServiceClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
            .max_decoding_message_size(256 << 20)
            .max_encoding_message_size(256 << 20)
    }
}

/// An address where nothing listens (port 1 is privileged and unused).
pub const NOBODY: &str = "127.0.0.1:1";

pub fn kill(pid: u32, sig: &str) {
    Command::new("kill")
        .args(["-s", sig, &pid.to_string()])
        .status()
        .unwrap();
}

/// `[rows, cols]` of `dtype` from its little-endian bytes.
fn tensor(dtype: DType, shape: [usize; 2], data: Vec<u8>) -> Tensor {
    Tensor {
        dtype: dtype as i32,
        shape: shape.iter().map(|&x| x as i64).collect(),
        data: data.into(),
    }
}

pub fn f32_tensor(v: &[f32], shape: [usize; 2]) -> Tensor {
    tensor(
        DType::F32,
        shape,
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

pub fn bf16_tensor(v: &[f32], shape: [usize; 2]) -> Tensor {
    let data = v
        .iter()
        .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes());
    tensor(DType::Bf16, shape, data.collect())
}

pub fn f16_tensor(v: &[f32], shape: [usize; 2]) -> Tensor {
    let data = v.iter().flat_map(|&x| half::f16::from_f32(x).to_le_bytes());
    tensor(DType::F16, shape, data.collect())
}

pub fn i32_tensor(v: &[i32], shape: [usize; 2]) -> Tensor {
    tensor(
        DType::I32,
        shape,
        v.iter().flat_map(|x| x.to_le_bytes()).collect(),
    )
}

/// Decodes an F32, BF16 or F16 tensor.
pub fn decode(t: &Tensor) -> Vec<f32> {
    match DType::try_from(t.dtype).unwrap() {
        DType::F32 => t
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect(),
        DType::Bf16 => t
            .data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        DType::F16 => t
            .data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        d => panic!("unexpected output dtype {d:?}"),
    }
}

/// `x` (`[n, hidden]`, f32) through `layer` with the server's gating; the output as f32.
pub async fn forward_f32(
    c: &mut MoeServiceClient<Channel>,
    id: &str,
    layer: u32,
    x: &[f32],
    hidden: usize,
) -> Vec<f32> {
    let n = x.len() / hidden;
    let out = c
        .forward(request(id, layer, f32_tensor(x, [n, hidden])))
        .await
        .unwrap_or_else(|e| panic!("{id}: {e:?}"))
        .into_inner();
    decode(out.output.as_ref().unwrap())
}

pub fn request(id: &str, layer: u32, hidden: Tensor) -> ForwardRequest {
    ForwardRequest {
        id: id.into(),
        layer,
        hidden_states: Some(hidden),
        topk_ids: None,
        topk_weights: None,
        output_dtype: 0,
    }
}

/// Client routing for `n` tokens: `k` distinct experts of `e` and a weight in [0.05, 1) per
/// token, set on `req`; returned (weights as f64) for the reference.
pub fn client_routing(
    req: &mut ForwardRequest,
    rng: &mut impl rand::Rng,
    n: usize,
    k: usize,
    e: usize,
) -> (Vec<usize>, Vec<f64>) {
    let ids = random_ids(rng, n, k, e);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(0.05f32..1.0)).collect();
    set_routing(req, ids, &w, k)
}

/// `k` distinct experts of `e` for each of `n` tokens, `[n, k]`.
pub fn random_ids(rng: &mut impl rand::Rng, n: usize, k: usize, e: usize) -> Vec<usize> {
    let mut ids = Vec::with_capacity(n * k);
    for _ in 0..n {
        let mut row: Vec<usize> = Vec::new();
        while row.len() < k {
            let c = rng.random_range(0..e);
            if !row.contains(&c) {
                row.push(c);
            }
        }
        ids.extend(row);
    }
    ids
}

/// Client routing `ids` and `w` (`[n, k]`) set on `req`; returned (weights as f64) for the
/// reference.
pub fn set_routing(
    req: &mut ForwardRequest,
    ids: Vec<usize>,
    w: &[f32],
    k: usize,
) -> (Vec<usize>, Vec<f64>) {
    let n = ids.len() / k;
    let ids_i32: Vec<i32> = ids.iter().map(|&i| i as i32).collect();
    req.topk_ids = Some(i32_tensor(&ids_i32, [n, k]));
    req.topk_weights = Some(f32_tensor(w, [n, k]));
    (ids, w.iter().map(|&v| f64::from(v)).collect())
}

/// One unary call over plain HTTP/2 with `headers` and `framed` as its body (gRPC framing is
/// the caller's); the server's grpc-status and grpc-message.
pub async fn raw_unary(
    addr: &str,
    path: &str,
    headers: &[(&str, &str)],
    framed: Vec<u8>,
) -> (i32, String) {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(tcp),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let mut request = http::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let request = request
        .body(http_body_util::Full::new(bytes::Bytes::from(framed)))
        .unwrap();
    let resp = sender.send_request(request).await.unwrap();
    grpc_outcome(resp).await
}

/// Both reflection protocols have the same messages under their own package.
macro_rules! reflected {
    ($v:ident, $channel:expr) => {{
        use tokio_stream::StreamExt;
        use tonic_reflection::pb::$v::server_reflection_client::ServerReflectionClient;
        use tonic_reflection::pb::$v::server_reflection_request::MessageRequest;
        use tonic_reflection::pb::$v::server_reflection_response::MessageResponse;
        use tonic_reflection::pb::$v::ServerReflectionRequest;
        let channel = $channel;
        let req = ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        };
        let mut resp = ServerReflectionClient::new(channel)
            .server_reflection_info(tokio_stream::iter(vec![req]))
            .await
            .unwrap()
            .into_inner();
        let Some(MessageResponse::ListServicesResponse(list)) =
            resp.next().await.unwrap().unwrap().message_response
        else {
            panic!("no service list");
        };
        list.service
            .into_iter()
            .map(|s| s.name)
            .collect::<Vec<String>>()
    }};
}

/// The services a server lists through gRPC reflection v1 (`v1alpha`: the older protocol).
pub async fn reflected_services(channel: Channel) -> Vec<String> {
    reflected!(v1, channel)
}

pub async fn reflected_services_v1alpha(channel: Channel) -> Vec<String> {
    reflected!(v1alpha, channel)
}

/// One HTTP/1.1 request on a new connection: its status, headers and body.
pub async fn http(
    addr: &str,
    method: &str,
    path: &str,
    headers: &[(&str, String)],
    body: Vec<u8>,
) -> (u16, http::HeaderMap, bytes::Bytes) {
    use http_body_util::BodyExt;
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = http::Request::builder()
        .method(method)
        .uri(path)
        .header("host", addr);
    for (k, v) in headers {
        req = req.header(*k, v);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from(body)))
        .unwrap();
    let r = send.send_request(req).await.unwrap();
    let (parts, body) = r.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    (parts.status.as_u16(), parts.headers, body)
}

/// Max |a - b| / max |b| of one token's row.
pub fn row_error(a: &[f32], b: &[f32]) -> f64 {
    let scale = b.iter().fold(0f64, |m, &v| m.max(f64::from(v).abs()));
    let err = a.iter().zip(b).fold(0f64, |m, (&x, &y)| {
        m.max((f64::from(x) - f64::from(y)).abs())
    });
    if scale > 0.0 {
        err / scale
    } else {
        err
    }
}

/// Resident memory of a process, in bytes.
pub fn rss(pid: u32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: usize = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

/// The largest resident memory of a process, sampled every 10 ms from `start` to `stop`.
pub struct PeakRss {
    on: Arc<std::sync::atomic::AtomicBool>,
    task: tokio::task::JoinHandle<usize>,
}

impl PeakRss {
    pub fn start(pid: u32) -> Self {
        let on = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let sampling = on.clone();
        let task = tokio::spawn(async move {
            let mut peak = 0;
            while sampling.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss(pid));
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            peak
        });
        Self { on, task }
    }

    pub async fn stop(self) -> usize {
        self.on.store(false, std::sync::atomic::Ordering::Relaxed);
        self.task.await.unwrap()
    }
}

/// A well-behaved client's Forward latencies (ms, sorted) over `for_`, 2 tokens a call on
/// `synthetic:tiny`; every call must succeed.
pub async fn polite(addr: &str, for_: Duration) -> Vec<f64> {
    let mut client = MoeServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let x = vec![0.25f32; 2 * kserve::H];
    let end = Instant::now() + for_;
    let mut ms = Vec::new();
    while Instant::now() < end {
        let t = Instant::now();
        client
            .forward(request("polite", 0, f32_tensor(&x, [2, kserve::H])))
            .await
            .expect("a well-behaved call beside the probe");
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    ms.sort_by(f64::total_cmp);
    ms
}

/// The 99th percentile of sorted latencies.
pub fn p99(ms: &[f64]) -> f64 {
    ms[ms.len() * 99 / 100]
}
