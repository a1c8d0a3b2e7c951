//! Command-line flags (each also an environment variable), validated at start.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::backend::ep_settings::{EpMode, EP_LL_MAX_TOKENS};
use crate::flags::{duration, off_or_duration, size_in, Every, OnOff};
use crate::telemetry::LogFormat;

#[derive(Parser, Debug)]
#[command(
    name = "epserve",
    version,
    about = "Expert-parallel serving of MoE layers over gRPC"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run one rank of an EP group (rank 0 is the leader and serves gRPC).
    Serve(ServeArgs),
    /// Spawn N local ranks of one group and supervise them.
    // Launch gives each rank its seat itself: those flags are not its to take.
    #[command(mut_arg("rank", |a| a.hide(true)), mut_arg("world_size", |a| a.hide(true)))]
    Launch(LaunchArgs),
    /// Time the GPU step and its phases with CUDA events (needs `--features cuda` and GPUs).
    Bench(BenchArgs),
    /// The metrics this binary exports (`--list`): README's table, or JSON lines for tools.
    Metrics(MetricsArgs),
}

#[derive(Args, Debug, Clone)]
pub struct MetricsArgs {
    /// Print the table of every metric (the only thing this command does).
    #[arg(help_heading = "Output", long, required = true)]
    pub list: bool,
    /// `markdown` (README's table) or `json` (one object a line: name, type, unit, labels,
    /// gpu_only, help).
    #[arg(help_heading = "Output", long, value_enum, default_value_t = MetricsFormat::Markdown)]
    pub format: MetricsFormat,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum MetricsFormat {
    Markdown,
    Json,
}

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Named configs, comma-separated: decode, decode-shared, decode-512, prefill,
    /// prefill-shared, decode-rank, prefill-rank (one EP4 rank's experts on one GPU), small.
    #[arg(
        long,
        env = "EPSERVE_BENCH_CONFIGS",
        value_delimiter = ',',
        default_value = "decode,small,prefill"
    )]
    pub configs: Vec<String>,
    /// GPU backends to compare in the same run, comma-separated: nccl, nccl-ep.
    #[arg(
        long,
        env = "EPSERVE_BENCH_BACKENDS",
        value_delimiter = ',',
        default_value = "nccl"
    )]
    pub backends: Vec<String>,
    /// Experts' dtypes to time each config in, comma-separated: bf16, fp8 (`--expert-dtype`'s
    /// meaning; random weights either way).
    #[arg(long, value_delimiter = ',', default_value = "bf16")]
    pub expert_dtype: Vec<ExpertDtypeArg>,
    /// `nccl-ep` variants, comma-separated: ht, ll (each over every config), each with zero-copy
    /// on and off as `--zero-copy` lists.
    #[arg(long, value_delimiter = ',', default_value = "ht,ll")]
    pub ep_modes: Vec<EpMode>,
    /// `nccl-ep` receive buffers to time, comma-separated: on (NCCL symmetric windows), off
    /// (the library's staging); `--zero-copy`'s meaning.
    #[arg(long, value_delimiter = ',', default_value = "on")]
    pub zero_copy: Vec<OnOff>,
    /// The FP8 shared expert under the exchange, comma-separated: off, on (`--overlap`'s
    /// meaning); each backend runs once per setting.
    #[arg(long, value_delimiter = ',', default_value = "off")]
    pub overlap: Vec<OnOff>,
    /// Two-batch overlap, comma-separated: off, on (steps of at least 512 tokens a rank run
    /// as two micro-batches, one's rows moving while the other's experts compute); each
    /// backend runs once per setting.
    #[arg(long, value_delimiter = ',', default_value = "off")]
    pub two_batch: Vec<OnOff>,
    /// LL only for configs of at most this many tokens per rank (LL's buffers grow with the
    /// tokens times the experts: prefill's would not fit).
    #[arg(long, default_value_t = 1024)]
    pub ep_ll_max_tokens: usize,
    /// GPUs (one rank each); default: every visible GPU.
    #[arg(long)]
    pub ranks: Option<usize>,
    /// Timed iterations of each measurement (the median is reported).
    #[arg(long, default_value_t = 100)]
    pub iters: usize,
    /// Untimed iterations first.
    #[arg(long, default_value_t = 10)]
    pub warmup: usize,
    /// Host idle before each timed step, in µs, and no all-gather to line the ranks up: steps
    /// after the GPU has idled, as serving runs them. The JSON then keeps every step's time, its
    /// launch and host enqueue time and its phases, and the summary the group's slow steps (each
    /// step's least time over the ranks). At most 1 s.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub gap_us: Option<u64>,
    /// With --gap-us: each rank idles a further draw of its own, 0 to this many µs (uniform,
    /// fresh each step), so the ranks start their steps apart, as serving's do (the leader's
    /// step reaches the other ranks later). At most 1 s.
    #[arg(long, requires = "gap_us", default_value_t = 0,
        value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub gap_spread_us: u64,
    /// With --gap-us: each timed step also moves its rows and small values as a serving rank
    /// does: rows in from page-locked host memory before it, its count (and a client's routing)
    /// in and its counts out inside its time, its rows out after it.
    #[arg(long, requires = "gap_us")]
    pub gap_copies: bool,
    /// With --gap-us: the host waits for each timed step as a serving rank does, polling its
    /// end event in a spin and then between naps (default: in cuStreamSynchronize).
    #[arg(long, requires = "gap_us")]
    pub gap_poll: bool,
    /// Each rank in a process of its own, as `epserve launch` runs them (default: a thread of
    /// this process each).
    #[arg(long)]
    pub rank_processes: bool,
    /// Set by --rank-processes on each process it starts: RUN:RANK:ID:CLOCK:FILE (the run's
    /// index, the rank, the NCCL id in hex, the launch clock's zero in µs since the Unix
    /// epoch, where its result goes).
    #[arg(long, hide = true)]
    pub bench_child: Option<String>,
    /// Skewed routing, comma-separated Zipf exponents (0: balanced): each token's experts are
    /// drawn on the host, the most popular in rank 0's block as contiguous placement has them,
    /// and each config runs once per exponent. Default: the router's top-k over random rows.
    #[arg(long, value_delimiter = ',')]
    pub skew: Vec<f64>,
    /// With --skew, comma-separated: off (contiguous blocks), on (--redundant-experts slots
    /// placed by DeepSeek's EPLB from the drawn routing's counts, read through the slot table).
    #[arg(long, value_delimiter = ',', default_value = "off")]
    pub eplb: Vec<OnOff>,
    /// Redundant slots for --eplb on (default: one per rank).
    #[arg(long)]
    pub redundant_experts: Option<usize>,
    /// Also write the results here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Log lines as text (`rank=R node=H` first on a rank's) or as JSON objects (with `rank`
    /// and `node` keys).
    #[arg(long, env = "EPSERVE_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

#[derive(Args, Debug, Clone)]
pub struct LaunchArgs {
    /// Ranks of the group (one process each; with --node-index, only that node's run here).
    #[arg(long, env = "EPSERVE_RANKS", default_value_t = 2)]
    pub ranks: usize,
    /// Nodes the ranks are split over (evenly, in rank order). Without --node-index they are
    /// simulated here, each its own node id and `--shm-dir` subdirectory, so the group's
    /// cross-node paths run on one host.
    #[arg(
        help_heading = "Group",
        long,
        env = "EPSERVE_NODES",
        default_value_t = 1
    )]
    pub nodes: usize,
    /// Run only this node's ranks (0-based, < --nodes), as one pod of a LeaderWorkerSet does
    /// (its worker index): node id and --shm-dir as given, ports numbered from this node's
    /// first rank, the rendezvous from --rendezvous, MASTER_ADDR or LWS_LEADER_ADDRESS.
    #[arg(help_heading = "Group", long, env = "EPSERVE_NODE_INDEX")]
    pub node_index: Option<usize>,
    /// A rank the group went on without is started again (it rejoins), at most this many times
    /// a rank; 0: never. One node only (`--nodes 1`).
    #[arg(
        help_heading = "Group",
        long,
        env = "EPSERVE_RANK_RESTARTS",
        default_value_t = 3
    )]
    pub rank_restarts: u32,
    #[command(flatten)]
    pub serve: ServeArgs,
}

/// `--overlap`: communication under computation.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Overlap {
    Auto,
    On,
    Off,
}

impl Overlap {
    /// The largest step (home tokens a rank) that overlaps; 0: none. `auto`: decode's, where
    /// the bench measured a gain.
    pub fn resolve(self) -> usize {
        match self {
            Overlap::On => usize::MAX,
            Overlap::Off => 0,
            Overlap::Auto => AUTO_OVERLAP_TOKENS,
        }
    }
}

/// The steps `--overlap auto` overlaps: decode's. On 2x H100 (docs/benchmarks.md "Overlap",
/// three rounds, the DeepSeek-V3 layer with its shared expert, FP8) 128 tokens a rank gained
/// 23-45 µs a step on every exchange (1.1-1.8%); 4096 lost 89-115 µs on `nccl` (not profiled:
/// likely the shared expert's GEMMs taking SMs from the exchange's kernels) and gained on HT.
const AUTO_OVERLAP_TOKENS: usize = 128;

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// Ranks exchanging through shared memory within a node (TCP between nodes), f32 math.
    Cpu,
    /// One GPU per rank: bf16 experts, NCCL all-gather + send/recv, CUDA graphs.
    Nccl,
    /// As `nccl`, with NVIDIA NCCL EP (HT and LL kernels, see --ep-mode) for the exchange;
    /// needs NCCL >= 2.30.4, libnccl_ep and nvcc.
    NcclEp,
    /// `nccl-ep` where its gates pass, else `nccl` where GPUs and NCCL are found, else `cpu`.
    Auto,
}

impl BackendKind {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Nccl => "nccl",
            BackendKind::NcclEp => "nccl-ep",
            BackendKind::Auto => "auto",
        }
    }
}

/// `--expert-dtype`: how experts are held and computed (`model::ExpertDtype`), or auto.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExpertDtypeArg {
    /// FP8 checkpoints as they ship (fp8, where the recipe applies), everything else bf16.
    Auto,
    /// DeepSeek-V3's FP8 recipe; other checkpoints and synthetic models quantized at load.
    Fp8,
    /// Weights as values (FP8 checkpoints dequantized at load).
    Bf16,
}

impl ExpertDtypeArg {
    /// The dtype asked for; None for auto.
    pub fn asked(self) -> Option<crate::model::ExpertDtype> {
        match self {
            ExpertDtypeArg::Auto => None,
            ExpertDtypeArg::Fp8 => Some(crate::model::ExpertDtype::Fp8),
            ExpertDtypeArg::Bf16 => Some(crate::model::ExpertDtype::Bf16),
        }
    }
}

/// Which ranks take clients' requests.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ingress {
    /// Rank 0 (the leader) serves gRPC and packs every step. `router`, its earlier name, is
    /// still accepted.
    #[value(alias = "router")]
    Leader,
    /// Every rank serves gRPC on its own --listen; its requests are its home tokens.
    All,
}

impl Ingress {
    pub fn name(self) -> &'static str {
        match self {
            Ingress::Leader => "leader",
            Ingress::All => "all",
        }
    }
}

/// What the group does when a rank is lost (`--on-rank-loss`).
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnRankLoss {
    /// `continue` where the group can carry on without any one rank, else `exit`.
    Auto,
    /// The ranks left go on: the lost rank's experts move to their redundant slots and its
    /// steps run again.
    Continue,
    /// Every rank exits non-zero, for the orchestrator to restart the group.
    Exit,
}

/// A listener that can be turned off (--http-listen, --metrics-listen): an address, or none
/// (`off`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Listen(pub Option<SocketAddr>);

fn listen_or_off(s: &str) -> Result<Listen, String> {
    if crate::flags::is_off(s) {
        return Ok(Listen(None));
    }
    s.parse()
        .map(|a| Listen(Some(a)))
        .map_err(|e| format!("{s:?}: {e} (an address HOST:PORT, or off)"))
}

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// `synthetic:NAME` (tiny, tiny-qwen3, tiny-deepseek, small-deepseek, qwen3-30b-a3b,
    /// mixtral-8x7b, deepseek-v3)
    /// or a Hugging Face checkpoint directory.
    #[arg(
        help_heading = "Model",
        long,
        env = "EPSERVE_MODEL",
        default_value = "synthetic:tiny"
    )]
    pub model: String,
    /// Serve only the first N MoE layers.
    #[arg(help_heading = "Model", long, env = "EPSERVE_LAYERS")]
    pub layers: Option<usize>,
    /// Expert slots per MoE layer beyond one per expert, spread over the ranks (experts + N
    /// must divide by the ranks): the EPLB balancer replicates hot experts into them. 0 with no
    /// --placement: experts in contiguous blocks.
    #[arg(
        help_heading = "Load balance",
        long,
        env = "EPSERVE_REDUNDANT_EXPERTS",
        default_value_t = 0
    )]
    pub redundant_experts: usize,
    /// Start from this placement: JSON `{"phy2log": [[expert of each slot], ...]}`, one list per
    /// MoE layer (DeepSeek EPLB's phy2log), slots in rank order.
    #[arg(help_heading = "Load balance", long, env = "EPSERVE_PLACEMENT")]
    pub placement: Option<std::path::PathBuf>,
    /// Look at the routed load this often and move slots where a layer is out of balance
    /// (e.g. 60s; off: never).
    #[arg(help_heading = "Load balance", long, env = "EPSERVE_EPLB_INTERVAL", default_value = "off", value_parser = off_or_duration)]
    pub eplb_interval: Every,
    /// Steps (all layers) the balancer sums the load over.
    #[arg(
        help_heading = "Load balance",
        long,
        env = "EPSERVE_EPLB_WINDOW",
        default_value_t = 1000
    )]
    pub eplb_window: usize,
    /// A layer whose busiest rank gets at most this times the mean rows is left as it is.
    #[arg(
        help_heading = "Load balance",
        long,
        env = "EPSERVE_EPLB_THRESHOLD",
        default_value_t = 1.05
    )]
    pub eplb_threshold: f64,
    /// How much of a new placement's weight copies a GPU rank starts beside one step: a size
    /// (a layer in parts of about that much a rank, one a step, each after the step before it
    /// has ended, each with the table's rows for what has landed) or layer (a whole layer's).
    #[arg(
        help_heading = "Load balance",
        long,
        env = "EPSERVE_EPLB_STEP_COPIES",
        default_value = "32MiB",
        value_parser = crate::eplb::copy_order::step_copies
    )]
    pub eplb_step_copies: crate::eplb::copy_order::StepCopies,
    /// Seed of synthetic weights.
    #[arg(
        help_heading = "Model",
        long,
        env = "EPSERVE_SEED",
        default_value_t = 0
    )]
    pub seed: u64,
    /// Experts' weights and math: fp8 is DeepSeek-V3's recipe (E4M3 weights in 128x128 blocks
    /// with f32 scales, activations quantized per token per 128 channels; hidden and
    /// intermediate sizes multiples of 128), bf16 holds them as values; auto keeps an FP8
    /// checkpoint's FP8 and runs everything else bf16.
    #[arg(
        help_heading = "Model",
        long,
        env = "EPSERVE_EXPERT_DTYPE",
        value_enum,
        default_value = "auto"
    )]
    pub expert_dtype: ExpertDtypeArg,
    /// Where the experts compute and how ranks exchange tokens.
    #[arg(
        help_heading = "Backend and GPU",
        long,
        env = "EPSERVE_BACKEND",
        value_enum,
        default_value = "cpu"
    )]
    pub backend: BackendKind,
    /// GPU of this rank (else LOCAL_RANK, else the rank modulo the visible GPUs).
    #[arg(help_heading = "Backend and GPU", long, env = "EPSERVE_DEVICE")]
    pub device: Option<usize>,
    /// GPU backends: home tokens per rank of each captured step size, ascending; a step runs in
    /// the smallest that holds its largest home slice. Default: 8, 16, 32, ... up to the largest
    /// home slice (--max-tokens-per-step / ranks), which is always added.
    #[arg(
        help_heading = "Backend and GPU",
        long,
        env = "EPSERVE_GRAPH_BUCKETS",
        value_delimiter = ','
    )]
    pub graph_buckets: Vec<usize>,
    /// GPU backends: replay each step as a CUDA graph captured at startup, or run it eagerly.
    #[arg(
        help_heading = "Backend and GPU",
        long,
        env = "EPSERVE_CUDA_GRAPHS",
        value_enum,
        default_value = "on"
    )]
    pub cuda_graphs: OnOff,
    /// GPU backends with graphs: each step's graph also records events between its phases
    /// (gating, prepare, dispatch, experts, combine), for `epserve_step_phase_seconds` and the
    /// step trace. Off by default: it cost 13-16 µs a step (1.5% of a 2,048-token step, 2x
    /// H200; docs/benchmarks.md "Load balance", session 55).
    #[arg(
        help_heading = "Backend and GPU",
        long,
        env = "EPSERVE_STEP_PHASE_TIMES",
        value_enum,
        default_value = "off"
    )]
    pub step_phase_times: OnOff,
    /// nccl-ep: high-throughput or low-latency kernels, or per bucket (auto).
    #[arg(
        help_heading = "Backend and GPU",
        long,
        env = "EPSERVE_EP_MODE",
        value_enum,
        default_value = "auto"
    )]
    pub ep_mode: EpMode,
    /// nccl-ep, auto mode: buckets up to this many home tokens per rank run low-latency.
    #[arg(help_heading = "Backend and GPU", long, env = "EPSERVE_EP_LL_MAX_TOKENS", default_value_t = EP_LL_MAX_TOKENS)]
    pub ep_ll_max_tokens: usize,
    /// nccl-ep: receive rows in NCCL symmetric windows (ncclMemAlloc, registered once at
    /// startup), or plain device memory through the library's staging.
    #[arg(
        help_heading = "Backend and GPU",
        long,
        env = "EPSERVE_ZERO_COPY",
        value_enum,
        default_value = "on"
    )]
    pub zero_copy: OnOff,
    /// Communication under computation: `on` runs the FP8 shared expert on a stream of its own
    /// from the gate on, under the exchange; `auto` does where the bench measured a gain
    /// (docs/benchmarks.md "Overlap").
    #[arg(
        help_heading = "Backend and GPU",
        long,
        env = "EPSERVE_OVERLAP",
        value_enum,
        default_value = "auto"
    )]
    pub overlap: Overlap,
    /// Two-batch overlap: `on` runs each step of at least 512 tokens a rank as two
    /// micro-batches, one's rows moving (on a stream of their own) while the other's experts
    /// compute; NCCL EP's groups are made twice. Slower on 2 and 4 GPUs of one host (each
    /// micro-batch reads every local expert's weights; docs/benchmarks.md "Two-batch
    /// overlap"): for wider groups and groups over nodes, where the exchange outweighs that.
    #[arg(
        help_heading = "Backend and GPU",
        long,
        env = "EPSERVE_TWO_BATCH",
        value_enum,
        default_value = "off"
    )]
    pub two_batch: OnOff,
    /// This rank (else RANK, then LWS_WORKER_INDEX, else 0).
    #[arg(help_heading = "Group", long)]
    pub rank: Option<usize>,
    /// Ranks in the group (else WORLD_SIZE, then LWS_GROUP_SIZE, else 1).
    #[arg(help_heading = "Group", long)]
    pub world_size: Option<usize>,
    /// The node this rank runs on (default: the host name): ranks of one node id share its
    /// shared memory (`--shm-dir`) and must run on one host; ranks of different ones exchange
    /// over TCP (cpu) or NCCL's network transports.
    #[arg(help_heading = "Group", long, env = "EPSERVE_NODE_ID")]
    pub node_id: Option<String>,
    /// Address this rank's data listener binds, for peers on other nodes (rows, exchange
    /// writes); port 0 picks any. Peers reach it at the address this rank reaches the leader
    /// from, which it binds by default (any port); 0.0.0.0:0 only if asked.
    #[arg(help_heading = "Group", long, env = "EPSERVE_DATA_LISTEN")]
    pub data_listen: Option<SocketAddr>,
    /// Leader's rendezvous address HOST:PORT (else MASTER_ADDR:MASTER_PORT, then
    /// LWS_LEADER_ADDRESS:MASTER_PORT, else 127.0.0.1:29500).
    #[arg(help_heading = "Group", long, env = "EPSERVE_RENDEZVOUS")]
    pub rendezvous: Option<String>,
    /// gRPC address of the leader (with --ingress all, of this rank; launch gives rank r this
    /// port + r; port 0 picks any).
    #[arg(
        help_heading = "Serving",
        long,
        env = "EPSERVE_LISTEN",
        default_value = "127.0.0.1:50051"
    )]
    pub listen: SocketAddr,
    /// KServe v2 REST (HTTP/1.1 and h2c; `/metrics` there too) beside gRPC, on the same ranks;
    /// launch gives rank r this port + r; port 0 picks any; `off`: none.
    #[arg(help_heading = "Serving", long, env = "EPSERVE_HTTP_LISTEN", default_value = "127.0.0.1:8000", value_parser = listen_or_off)]
    pub http_listen: Listen,
    /// Who serves gRPC: the leader alone, or every rank for its own clients (ingress bandwidth
    /// grows with the ranks).
    #[arg(
        help_heading = "Group",
        long,
        env = "EPSERVE_INGRESS",
        value_enum,
        default_value = "leader"
    )]
    pub ingress: Ingress,
    /// A lost rank (gone, or stopped past --step-timeout): the others go on without it
    /// (`continue`: its experts move into their redundant slots, see --redundant-experts) or
    /// the group exits (`exit`). `auto`: continue where the group can; the leader logs which.
    #[arg(
        help_heading = "Group",
        long,
        env = "EPSERVE_ON_RANK_LOSS",
        value_enum,
        default_value = "auto"
    )]
    pub on_rank_loss: OnRankLoss,
    /// Most tokens in one step, all ranks together; sizes every exchange buffer.
    #[arg(
        help_heading = "Serving",
        long,
        env = "EPSERVE_MAX_TOKENS_PER_STEP",
        default_value_t = 256
    )]
    pub max_tokens_per_step: usize,
    /// Longest a step waits to fill, in microseconds.
    #[arg(
        help_heading = "Serving",
        long,
        env = "EPSERVE_MAX_BATCH_WAIT_US",
        default_value_t = 200
    )]
    pub max_batch_wait_us: u64,
    /// Requests admitted and not yet answered; beyond it requests are refused at once with
    /// RESOURCE_EXHAUSTED.
    #[arg(
        help_heading = "Limits",
        long,
        env = "EPSERVE_MAX_CONCURRENT_REQUESTS",
        default_value_t = 1024
    )]
    pub max_concurrent_requests: usize,
    /// Tokens admitted and not yet answered (bounds the memory queued requests hold); beyond it
    /// requests are refused at once with RESOURCE_EXHAUSTED.
    #[arg(
        help_heading = "Limits",
        long,
        env = "EPSERVE_MAX_QUEUED_TOKENS",
        default_value_t = 65536
    )]
    pub max_queued_tokens: usize,
    /// Largest accepted gRPC message.
    #[arg(help_heading = "Limits", long, env = "EPSERVE_MAX_REQUEST_BYTES", default_value = "64MiB",
          value_parser = |s: &str| size_in::<usize>(s, 1, u32::MAX as u64))]
    pub max_request_bytes: usize,
    #[command(flatten, next_help_heading = "HTTP/2 and connections")]
    pub http2: crate::transport::Http2,
    #[command(flatten, next_help_heading = "Limits")]
    pub upload: crate::transport::upload::UploadArgs,
    #[command(flatten, next_help_heading = "Limits")]
    pub answer: crate::transport::answer::AnswerArgs,
    #[command(flatten, next_help_heading = "HTTP/2 and connections")]
    pub conn: crate::transport::conn::ConnArgs,
    #[command(flatten, next_help_heading = "Serving")]
    pub regions: crate::api::kserve::regions::RegionArgs,
    /// Requests of one ForwardStream in progress or answered but not yet taken by the client;
    /// past it the stream is not read (HTTP/2 flow control holds the client's sends).
    #[arg(
        help_heading = "Limits",
        long,
        env = "EPSERVE_MAX_STREAM_IN_FLIGHT",
        default_value_t = 64
    )]
    pub max_stream_in_flight: usize,
    /// Address the leader's rendezvous listener binds (default: the rendezvous host's own
    /// address as it resolves; e.g. 0.0.0.0:29500 to accept on every interface).
    #[arg(help_heading = "Group", long, env = "EPSERVE_RENDEZVOUS_BIND")]
    pub rendezvous_bind: Option<SocketAddr>,
    /// Shared secret every rank must present when it joins (e.g. from a Kubernetes Secret);
    /// without it any process that reaches the rendezvous port may join.
    #[arg(
        help_heading = "Group",
        long,
        env = "EPSERVE_GROUP_TOKEN",
        hide_env_values = true
    )]
    pub group_token: Option<String>,
    /// Bound on every startup wait (joining, creating and mapping buffers).
    #[arg(help_heading = "Group", long, env = "EPSERVE_RENDEZVOUS_TIMEOUT", default_value = "120s", value_parser = duration)]
    pub rendezvous_timeout: Duration,
    /// Bound on every wait inside a step; past it the group is broken.
    #[arg(help_heading = "Serving", long, env = "EPSERVE_STEP_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub step_timeout: Duration,
    /// On SIGTERM/SIGINT: longest wait for admitted requests to finish before giving up.
    #[arg(help_heading = "Serving", long, env = "EPSERVE_DRAIN_TIMEOUT", default_value = "30s", value_parser = duration)]
    pub drain_timeout: Duration,
    /// After draining or breaking, keep refusing with UNAVAILABLE this long before the gRPC port
    /// closes (counted inside --drain-timeout's budget by operators: set terminationGracePeriod
    /// above drain timeout + grace).
    #[arg(help_heading = "Serving", long, env = "EPSERVE_SHUTDOWN_GRACE", default_value = "1s", value_parser = duration)]
    pub shutdown_grace: Duration,
    /// An idle leader runs an empty step through every rank this often, so a lost or stopped rank
    /// is found without traffic.
    #[arg(help_heading = "Group", long, env = "EPSERVE_HEARTBEAT_INTERVAL", default_value = "1s", value_parser = duration)]
    pub heartbeat_interval: Duration,
    /// The `liveness` health service turns NOT_SERVING when one step runs longer than this.
    #[arg(help_heading = "Serving", long, env = "EPSERVE_LIVENESS_TIMEOUT", default_value = "3s", value_parser = duration)]
    pub liveness_timeout: Duration,
    /// Prometheus `/metrics` address (launch gives rank r this port + r; port 0 picks any);
    /// `off`: none.
    #[arg(
        help_heading = "Telemetry",
        long,
        env = "EPSERVE_METRICS_LISTEN",
        default_value = "127.0.0.1:9400",
        value_parser = listen_or_off
    )]
    pub metrics_listen: Listen,
    /// Export a token counter per expert and layer (one series each): on/off (true/false).
    #[arg(help_heading = "Telemetry", long, env = "EPSERVE_METRICS_PER_EXPERT",
          default_value_t = false, num_args = 0..=1, default_missing_value = "on",
          action = clap::ArgAction::Set, value_parser = clap::builder::BoolishValueParser::new())]
    pub metrics_per_expert: bool,
    /// Directory for the shared-memory segments (a tmpfs).
    #[arg(
        help_heading = "Group",
        long,
        env = "EPSERVE_SHM_DIR",
        default_value = "/dev/shm"
    )]
    pub shm_dir: PathBuf,
    /// Threads each rank of the cpu backend runs its expert math on (up to 256, each with its
    /// own scratch); 0: the host's cores shared by the group's ranks (as if every rank ran on
    /// this host, as simulated nodes do), at most 8.
    #[arg(help_heading = "Backend and GPU", long, env = "EPSERVE_CPU_THREADS", default_value_t = 0,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=256))]
    pub cpu_threads: usize,
    /// Threads a rank loads its weights on at startup (checkpoint ranges read and converted,
    /// FP8 quantized, synthetic weights made; each expert on one); 0: the host's cores shared by
    /// the ranks on it (LOCAL_WORLD_SIZE, which launch and torchrun set; else the group's ranks).
    #[arg(help_heading = "Backend and GPU", long, env = "EPSERVE_LOAD_THREADS", default_value_t = 0,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1024))]
    pub load_threads: usize,
    /// Steps a rank holds queued behind the one running: 1 lets a GPU rank copy in and launch
    /// step N+1 while step N runs, and copy N's output out while N+1 runs; 0 runs one step at a
    /// time. Default: 1 on the GPU backends; 0 on cpu, whose ranks compute a step whole on the
    /// host (there a step queued behind another only delays the other's answers).
    #[arg(help_heading = "Group", long, env = "EPSERVE_STEPS_AHEAD",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(0..=1))]
    pub steps_ahead: Option<usize>,
    /// Cells of the step ring, the steps the leader holds at once (packed, running or being
    /// answered); each holds a whole step's rows in and out, in f32. Two let one step be packed
    /// or answered while another runs; more let the next be packed while one is answered and
    /// another runs, at that much more shared memory each. Three measured no faster than two on
    /// 4x H200 with one step in flight, nor three and four on one H200 with two
    /// (docs/benchmarks.md).
    #[arg(help_heading = "Group", long, alias = "ring-slots", env = "EPSERVE_RING_CELLS", default_value_t = 2,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(2..=4))]
    pub ring_cells: usize,
    /// Log lines as text (`rank=R node=H` first on a rank's) or as JSON objects (with `rank`
    /// and `node` keys).
    #[arg(
        help_heading = "Telemetry",
        long,
        env = "EPSERVE_LOG_FORMAT",
        value_enum,
        default_value = "text"
    )]
    pub log_format: LogFormat,
    /// Log a `stats` line this often (requests, tokens/s, steps, step time, busy share, queue);
    /// 0s: never.
    #[arg(help_heading = "Telemetry", long, env = "EPSERVE_LOG_STATS_INTERVAL", default_value = "60s", value_parser = duration)]
    pub log_stats_interval: Duration,
    /// Export traces over OTLP/gRPC to this collector (e.g. http://otel-collector:4317).
    #[arg(help_heading = "Telemetry", long, env = "EPSERVE_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
}

/// Home-token buckets of a group: the given ones (validated), else powers of two from 8, ending
/// at the largest home slice.
pub fn graph_buckets(given: &[usize], max_home: usize) -> Result<Vec<usize>, String> {
    if given.contains(&0) || given.windows(2).any(|w| w[0] >= w[1]) {
        return Err(format!(
            "--graph-buckets {given:?} must be positive and strictly ascending"
        ));
    }
    let mut out: Vec<usize> = if given.is_empty() {
        std::iter::successors(Some(8usize), |b| Some(b * 2))
            .take_while(|&b| b < max_home)
            .collect()
    } else {
        given.iter().copied().filter(|&b| b < max_home).collect()
    };
    out.push(max_home);
    Ok(out)
}

/// Where this rank sits in its group, as its flags say.
#[derive(Clone, Debug)]
pub struct Member {
    pub place: crate::place::Place,
    pub rendezvous: String,
    /// `--node-id`, else the host name.
    pub node: String,
}

fn env_usize(keys: &[&str]) -> Result<Option<usize>, String> {
    for k in keys {
        if let Ok(v) = std::env::var(k) {
            return v
                .trim()
                .parse()
                .map(Some)
                .map_err(|_| format!("{k}={v} is not a number"));
        }
    }
    Ok(None)
}

impl ServeArgs {
    /// `--steps-ahead`, or its default for the backend the group runs.
    pub fn steps_ahead(&self, backend: BackendKind) -> usize {
        self.steps_ahead.unwrap_or(match backend {
            BackendKind::Nccl | BackendKind::NcclEp => 1,
            _ => 0,
        })
    }

    /// Resolves rank, world size and rendezvous from flags, then torchrun's and LeaderWorkerSet's
    /// variables, and checks the flags that must be positive.
    pub fn member(&self) -> Result<Member, String> {
        let rank = match self.rank {
            Some(r) => r,
            None => env_usize(&["RANK", "LWS_WORKER_INDEX"])?.unwrap_or(0),
        };
        let world = match self.world_size {
            Some(w) => w,
            None => env_usize(&["WORLD_SIZE", "LWS_GROUP_SIZE"])?.unwrap_or(1),
        };
        if world == 0 || rank >= world {
            return Err(format!("rank {rank} is not in a world of size {world}"));
        }
        let port = std::env::var("MASTER_PORT").unwrap_or_else(|_| "29500".into());
        let rendezvous = self
            .rendezvous
            .clone()
            .or_else(|| {
                std::env::var("MASTER_ADDR")
                    .ok()
                    .map(|a| format!("{a}:{port}"))
            })
            .or_else(|| {
                std::env::var("LWS_LEADER_ADDRESS")
                    .ok()
                    .map(|a| format!("{a}:{port}"))
            })
            .unwrap_or_else(|| format!("127.0.0.1:{port}"));
        if self.max_tokens_per_step == 0 {
            return Err("--max-tokens-per-step must be at least 1".into());
        }
        if self.max_concurrent_requests == 0
            || self.max_queued_tokens == 0
            || self.max_stream_in_flight == 0
        {
            return Err(
                "--max-concurrent-requests, --max-queued-tokens and --max-stream-in-flight must be at least 1"
                    .into(),
            );
        }
        if self.eplb_window == 0 || !self.eplb_threshold.is_finite() || self.eplb_threshold < 1.0 {
            return Err(
                "--eplb-window must be at least 1 and --eplb-threshold at least 1.0".into(),
            );
        }
        if self.eplb_interval.0.is_some_and(|d| d.is_zero()) {
            return Err("--eplb-interval must be positive, or off".into());
        }
        if self.heartbeat_interval.is_zero() || self.step_timeout.is_zero() {
            return Err("--heartbeat-interval and --step-timeout must be positive".into());
        }
        self.upload.sizes(self.max_request_bytes)?;
        crate::transport::answer::Answers::new(
            &self.answer,
            self.max_request_bytes,
            self.upload.upload_wait,
        )?;
        let node = self
            .node_id
            .clone()
            .unwrap_or_else(crate::telemetry::node_name);
        if node.is_empty() || node.len() > 253 || node.chars().any(char::is_control) {
            return Err(format!(
                "--node-id {node:?} must be 1 to 253 characters without control characters"
            ));
        }
        Ok(Member {
            place: crate::place::Place { rank, world },
            rendezvous,
            node,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::graph_buckets;

    /// Every on/off setting of `serve` takes on/off/true/false (a flag's value and its env var
    /// go through one parser), and every listener that can be off takes `off` (#58:
    /// EPSERVE_METRICS_PER_EXPERT=off failed the start; --metrics-listen off was refused).
    #[test]
    fn on_off_settings_take_on_off_true_false() {
        use clap::CommandFactory;
        use clap::Parser;
        let cli = super::Cli::command();
        let serve = cli.find_subcommand("serve").unwrap();
        let mut switches = Vec::new();
        for a in serve.get_arguments() {
            let id = a.get_id().as_str();
            let values: Vec<String> = a
                .get_possible_values()
                .iter()
                .map(|v| v.get_name().to_string())
                .collect();
            let boolish = matches!(a.get_action(), clap::ArgAction::SetTrue)
                || a.get_value_parser().type_id() == clap::builder::ValueParser::bool().type_id()
                || values == ["on", "off"];
            if boolish && !matches!(id, "help" | "version") {
                let long = a.get_long().unwrap().to_string();
                assert!(
                    !matches!(a.get_action(), clap::ArgAction::SetTrue),
                    "--{long} is a bare switch: it cannot be set off (or on) from its env var"
                );
                switches.push(long);
            }
        }
        switches.sort();
        assert_eq!(
            switches,
            [
                "allow-client-shm",
                "cuda-graphs",
                "http2-adaptive-window",
                "metrics-per-expert",
                "step-phase-times",
                "two-batch",
                "zero-copy"
            ],
            "the on/off settings this test knows"
        );
        for v in ["on", "off", "true", "false"] {
            for s in &switches {
                let argv = ["epserve", "serve", &format!("--{s}"), v];
                super::Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("--{s} {v}: {e}"));
            }
        }
        for listener in ["--http-listen", "--metrics-listen"] {
            for v in ["off", "false"] {
                let argv = ["epserve", "serve", listener, v];
                super::Cli::try_parse_from(argv).unwrap_or_else(|e| panic!("{listener} {v}: {e}"));
            }
        }
    }

    /// `--help` describes every flag it lists, and `serve`/`launch` group theirs by heading.
    #[test]
    fn every_flag_is_described_and_grouped() {
        use clap::CommandFactory;
        let cli = super::Cli::command();
        let mut bare = Vec::new();
        for sub in cli.get_subcommands() {
            for a in sub.get_arguments().filter(|a| !a.is_hide_set()) {
                let id = a.get_id().as_str();
                if matches!(id, "help" | "version") {
                    continue;
                }
                if a.get_help().is_none() && a.get_long_help().is_none() {
                    bare.push(format!("{} --{id}: no description", sub.get_name()));
                }
                let grouped = sub.get_name() == "bench" || id == "ranks";
                if !grouped && a.get_help_heading().is_none() {
                    bare.push(format!("{} --{id}: no heading", sub.get_name()));
                }
            }
        }
        assert!(bare.is_empty(), "{bare:#?}");
        // launch seats its ranks itself: its help lists neither seat flag (launch.rs refuses them).
        let launch = cli.find_subcommand("launch").unwrap();
        let listed: Vec<&str> = launch
            .get_arguments()
            .filter(|a| !a.is_hide_set())
            .map(|a| a.get_id().as_str())
            .collect();
        assert!(!listed.contains(&"rank") && !listed.contains(&"world_size"));
    }

    #[test]
    fn byte_flags_take_sizes_and_launch_lists_only_what_it_takes() {
        use super::{Cli, Command};
        use clap::{CommandFactory, Parser};
        let parse = |flags: &[&str]| {
            let argv = ["epserve", "serve"].iter().chain(flags).copied();
            Cli::try_parse_from(argv).map(|c| match c.command {
                Command::Serve(a) => a,
                _ => unreachable!(),
            })
        };
        let a = parse(&[
            "--max-request-bytes",
            "64MiB",
            "--http2-stream-window",
            "16MiB",
            "--upload-budget",
            "1GiB",
        ])
        .unwrap();
        assert_eq!(a.max_request_bytes, 64 << 20);
        assert_eq!(a.http2.http2_stream_window, 16 << 20);
        assert_eq!(a.upload.upload_budget, Some(1 << 30));
        assert_eq!(
            parse(&["--max-request-bytes", "1000"])
                .unwrap()
                .max_request_bytes,
            1000
        );
        let defaults = parse(&[]).unwrap();
        assert_eq!(
            (
                defaults.max_request_bytes,
                defaults.http2.http2_max_frame_size
            ),
            (64 << 20, 1 << 20)
        );
        let e = parse(&["--http2-max-frame-size", "32MiB"]).unwrap_err();
        assert!(
            e.to_string().contains("not within 16384 to 16777215"),
            "{e}"
        );
        assert!(parse(&["--max-request-bytes", "64 parsecs"]).is_err());

        let mut cli = Cli::command();
        let launch = cli.find_subcommand_mut("launch").unwrap();
        let help = launch.render_long_help().to_string();
        assert!(help.contains("--ranks"), "{help}");
        for refused in ["--rank ", "--world-size"] {
            assert!(!help.contains(refused), "launch --help lists {refused}");
        }
    }

    #[test]
    fn cpu_threads_are_bounded() {
        use clap::Parser;
        let threads = |v: &str| {
            super::Cli::try_parse_from(["epserve", "serve", "--cpu-threads", v]).map(|c| {
                match c.command {
                    super::Command::Serve(a) => a.cpu_threads,
                    _ => unreachable!("parsed as serve"),
                }
            })
        };
        assert_eq!(threads("0").unwrap(), 0);
        assert_eq!(threads("256").unwrap(), 256);
        let e = threads("257").unwrap_err().to_string();
        assert!(e.contains("not in 0..=256"), "{e}");
    }

    fn serve_args(extra: &[&str]) -> Result<super::ServeArgs, clap::Error> {
        use clap::Parser;
        let argv = ["epserve", "serve"].iter().chain(extra).copied();
        super::Cli::try_parse_from(argv).map(|c| match c.command {
            super::Command::Serve(a) => a,
            _ => unreachable!("parsed as serve"),
        })
    }

    #[test]
    fn steps_ahead_defaults_per_backend_and_is_bounded() {
        use super::BackendKind::{Cpu, Nccl, NcclEp};
        let auto = serve_args(&[]).unwrap();
        let ahead = [Cpu, Nccl, NcclEp].map(|b| auto.steps_ahead(b));
        assert_eq!(ahead, [0, 1, 1]);
        let one = serve_args(&["--steps-ahead", "1"]).unwrap();
        assert_eq!([Cpu, NcclEp].map(|b| one.steps_ahead(b)), [1, 1]);
        let zero = serve_args(&["--steps-ahead", "0"]).unwrap();
        assert_eq!([Nccl, NcclEp].map(|b| zero.steps_ahead(b)), [0, 0]);
        let e = serve_args(&["--steps-ahead", "2"]).unwrap_err().to_string();
        assert!(e.contains("not in 0..=1"), "{e}");
    }

    #[test]
    fn ring_cells_default_to_two_and_are_bounded() {
        assert_eq!(serve_args(&[]).unwrap().ring_cells, 2);
        assert_eq!(serve_args(&["--ring-cells", "4"]).unwrap().ring_cells, 4);
        // Its earlier name.
        assert_eq!(serve_args(&["--ring-slots", "3"]).unwrap().ring_cells, 3);
        for bad in ["1", "5"] {
            let e = serve_args(&["--ring-cells", bad]).unwrap_err().to_string();
            assert!(e.contains("not in 2..=4"), "{e}");
        }
    }

    #[test]
    fn buckets_default_to_powers_of_two_ending_at_the_largest_home_slice() {
        assert_eq!(graph_buckets(&[], 64).unwrap(), vec![8, 16, 32, 64]);
        assert_eq!(graph_buckets(&[], 100).unwrap(), vec![8, 16, 32, 64, 100]);
        assert_eq!(graph_buckets(&[], 5).unwrap(), vec![5]);
        assert_eq!(graph_buckets(&[4, 48, 512], 100).unwrap(), vec![4, 48, 100]);
        assert!(graph_buckets(&[16, 8], 100).is_err());
        assert!(graph_buckets(&[0, 8], 100).is_err());
    }
}
