//! Every metric the service exports, in one table: name, kind, unit, labels, where it is
//! exported (any backend, or GPU ranks only) and its help. Code names a metric by its constant
//! here, never by a string; `metrics::install` describes each from the table; README's table is
//! `epserve metrics --list` (a test holds the two equal, and another that no source file spells
//! a metric's name); the serving test and `deploy/check.py` read the table, not the source.
//! A new metric is a row here.

/// What a metric is to Prometheus.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

impl Kind {
    pub fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One row of the table.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    pub name: &'static str,
    pub kind: Kind,
    pub unit: &'static str,
    pub labels: &'static [&'static str],
    /// Exported by GPU ranks only (a cpu group never has the series).
    pub gpu_only: bool,
    pub help: &'static str,
}

macro_rules! table {
    ($($id:ident: $kind:ident $name:literal, $unit:literal, [$($label:literal),*], $on:ident, $help:literal;)*) => {
        $(#[doc = $help] pub const $id: &str = $name;)*
        /// Every metric, in README's order.
        pub const TABLE: &[Metric] = &[$(Metric {
            name: $name,
            kind: Kind::$kind,
            unit: $unit,
            labels: &[$($label),*],
            gpu_only: table!(@gpu $on),
            help: $help,
        }),*];
    };
    (@gpu gpu) => { true };
    (@gpu any) => { false };
}

table! {
    REQUESTS_TOTAL: Counter "epserve_requests_total", "requests", ["method", "status"], any,
        "requests answered, by method and gRPC status";
    REQUEST_DURATION_SECONDS: Histogram "epserve_request_duration_seconds", "seconds", ["method"], any,
        "request latency at the front";
    REQUEST_QUEUE_SECONDS: Histogram "epserve_request_queue_seconds", "seconds", [], any,
        "admission to the request's first step";
    REQUEST_IN_STEP_SECONDS: Histogram "epserve_request_in_step_seconds", "seconds", [], any,
        "first step to the answer";
    REQUEST_TOKENS_TOTAL: Counter "epserve_request_tokens_total", "tokens", [], any,
        "tokens of requests answered OK";
    REQUESTS_RUNNING: Gauge "epserve_requests_running", "requests", [], any,
        "requests with rows in a step, not yet answered";
    INGRESS_BYTES_TOTAL: Counter "epserve_ingress_bytes_total", "bytes", [], any,
        "hidden-state bytes of requests queued, in their wire dtype";
    EGRESS_BYTES_TOTAL: Counter "epserve_egress_bytes_total", "bytes", [], any,
        "output bytes of requests answered, in their wire dtype";
    REJECTIONS_TOTAL: Counter "epserve_rejections_total", "requests", ["reason"], any,
        "requests refused, by every reason in `server/rejections.rs`";
    ADMITTED_REQUESTS: Gauge "epserve_admitted_requests", "requests", [], any,
        "admitted and not yet finished (running or queued)";
    ADMITTED_TOKENS: Gauge "epserve_admitted_tokens", "tokens", [], any,
        "tokens of the admitted requests";
    LIMIT_MAX_CONCURRENT_REQUESTS: Gauge "epserve_limit_max_concurrent_requests", "requests", [], any,
        "`--max-concurrent-requests`, for ratios";
    LIMIT_MAX_QUEUED_TOKENS: Gauge "epserve_limit_max_queued_tokens", "tokens", [], any,
        "`--max-queued-tokens`, for ratios";
    QUEUE_REQUESTS: Gauge "epserve_queue_requests", "requests", [], any,
        "requests waiting for a step";
    QUEUE_TOKENS: Gauge "epserve_queue_tokens", "tokens", [], any,
        "tokens waiting for a step";
    UPLOAD_BYTES: Gauge "epserve_upload_bytes", "bytes", [], any,
        "bytes charged to `--upload-budget` by messages being read";
    ANSWER_BYTES: Gauge "epserve_answer_bytes", "bytes", [], any,
        "bytes charged to `--answer-budget` by answers made and not yet written";
    SHM_TENSORS_TOTAL: Counter "epserve_shm_tensors_total", "tensors", ["direction"], any,
        "KServe tensors read from (in) or written to (out) clients' shared-memory regions";
    SHM_BYTES_TOTAL: Counter "epserve_shm_bytes_total", "bytes", ["direction"], any,
        "bytes through clients' shared-memory regions";
    STEPS_IN_FLIGHT: Gauge "epserve_steps_in_flight", "steps", [], any,
        "leader: steps formed and not yet answered (at most `--ring-cells`)";
    OFFERS_PENDING: Gauge "epserve_offers_pending", "offers", [], any,
        "`--ingress all`: this rank's packed offers not yet in a step";
    STEPS_TOTAL: Counter "epserve_steps_total", "steps", ["kind"], any,
        "steps run on this rank: work or heartbeat";
    STEP_TOKENS: Histogram "epserve_step_tokens", "tokens", [], any,
        "tokens per step, all ranks together";
    STEP_TOKENS_TOTAL: Counter "epserve_step_tokens_total", "tokens", ["layer"], any,
        "tokens through steps";
    STEP_PADDING_TOKENS_TOTAL: Counter "epserve_step_padding_tokens_total", "tokens", [], any,
        "padding added to steps (graph buckets)";
    STEP_DURATION_SECONDS: Histogram "epserve_step_duration_seconds", "seconds", [], any,
        "a step on this rank, from its start (or the end of the step it queued behind): the sum is the rank's busy time";
    STEP_PHASE_SECONDS: Histogram "epserve_step_phase_seconds", "seconds", ["phase"], any,
        "gating, prepare, dispatch, experts, combine (CPU backend; GPU backends with `--step-phase-times on`, from events inside each step's graph; else `epserve bench` times them)";
    STEP_PACK_SECONDS: Histogram "epserve_step_pack_seconds", "seconds", [], any,
        "a step's rows copied from its requests into the ring";
    STEP_DELIVER_SECONDS: Histogram "epserve_step_deliver_seconds", "seconds", [], any,
        "a step's rows copied from the ring to its requests";
    STEPS_SUBMITTED_AHEAD_TOTAL: Counter "epserve_steps_submitted_ahead_total", "steps", [], any,
        "steps started while the one before still ran (`--steps-ahead`)";
    PARTIAL_STEPS_BEHIND_TOTAL: Counter "epserve_partial_steps_behind_total", "steps", [], any,
        "leader: partial steps formed while another was in the pipeline";
    OUTPUT_BUFFERS_REUSED_TOTAL: Counter "epserve_output_buffers_reused_total", "answers", [], any,
        "answers of 1 MiB or more written into a kept buffer";
    REQUEST_BUFFERS_REUSED_TOTAL: Counter "epserve_request_buffers_reused_total", "requests", [], any,
        "unary requests of 1 MiB or more read into a kept buffer";
    RANK_RECEIVED_TOKENS: Histogram "epserve_rank_received_tokens", "tokens", [], any,
        "token rows this rank received per step";
    EXPERT_BALANCE_RATIO: Gauge "epserve_expert_balance_ratio", "ratio", ["layer"], any,
        "last step: mean/max tokens per rank (1 = balanced)";
    EXPERT_SKEW_RATIO: Gauge "epserve_expert_skew_ratio", "ratio", ["layer"], any,
        "last step: max/mean tokens per expert (1 = balanced)";
    EXPERT_TOKENS_TOTAL: Counter "epserve_expert_tokens_total", "tokens", ["layer", "expert"], any,
        "token rows per local expert slot, labelled by its logical expert (`--metrics-per-expert`, on the owning rank)";
    RANK_LOAD_RATIO: Gauge "epserve_rank_load_ratio", "ratio", ["layer"], any,
        "leader, over the EPLB window: max/mean routed rows per rank (1 = balanced)";
    EXPERT_REPLICAS: Gauge "epserve_expert_replicas", "slots", ["layer"], any,
        "leader: slots of the most replicated expert in the current placement";
    EPLB_REBALANCES_TOTAL: Counter "epserve_eplb_rebalances_total", "placements", [], any,
        "leader: placements applied by the EPLB balancer";
    EPLB_MOVED_BYTES_TOTAL: Counter "epserve_eplb_moved_bytes_total", "bytes", [], any,
        "leader: expert weight bytes every rank loaded into rewritten slots";
    EPLB_REBALANCE_SECONDS: Histogram "epserve_eplb_rebalance_seconds", "seconds", [], any,
        "leader: a placement's proposal to its first step";
    GROUP_RANKS: Gauge "epserve_group_ranks", "ranks", ["state"], any,
        "leader: ranks of the group by state, live or lost (--on-rank-loss continue)";
    GROUP_EPOCH: Gauge "epserve_group_epoch", "epoch", [], any,
        "leader: the group's epoch, one more at every halt for a lost rank or failed step";
    RANK_LOSSES_TOTAL: Counter "epserve_rank_losses_total", "ranks", [], any,
        "leader: ranks the group went on without";
    RECOVERY_SECONDS: Histogram "epserve_recovery_seconds", "seconds", [], any,
        "leader: a halt for a lost rank to steps running again";
    STARTUP_STAGE: Gauge "epserve_startup_stage", "0/1", ["stage"], any,
        "1 for the startup stage this rank is in: load, rendezvous, bringup, warmup, ready";
    STARTUP_SECONDS: Gauge "epserve_startup_seconds", "seconds", ["stage"], any,
        "how long each finished startup stage took";
    GROUP_INFO: Gauge "epserve_group_info", "1", ["backend", "world_size", "rank", "ranks_joined"], any,
        "the EP group this rank belongs to";
    TWO_BATCH_STEPS_TOTAL: Counter "epserve_two_batch_steps_total", "steps", [], gpu,
        "GPU ranks: steps run as two micro-batches (--two-batch on)";
    CROSS_NODE_BYTES_TOTAL: Counter "epserve_cross_node_bytes_total", "bytes", ["rank"], any,
        "bytes this rank sent to ranks of other nodes (rows, exchange writes, flags; absent on one node)";
    BUILD_INFO: Gauge "epserve_build_info", "1", ["version"], any,
        "the build of this binary";
    DEVICE_ALLOCATIONS_TOTAL: Counter "epserve_device_allocations_total", "allocations", [], gpu,
        "GPU ranks: device allocations (all made at startup)";
    DEVICE_MEMORY_USED_BYTES: Gauge "epserve_device_memory_used_bytes", "bytes", [], gpu,
        "GPU ranks: memory in use on the rank's GPU, read after a step at most once a second";
    EP_STEPS_TOTAL: Counter "epserve_ep_steps_total", "steps", ["mode"], gpu,
        "nccl-ep: steps by mode (ll, ht; a two-batch step counts once per micro-batch)";
    EP_RECV_ROWS: Gauge "epserve_ep_recv_rows", "rows", ["mode"], gpu,
        "nccl-ep: rows this rank's experts received in the last step";
    EP_RECV_OVERFLOW_TOTAL: Counter "epserve_ep_recv_overflow_total", "steps", ["mode"], gpu,
        "nccl-ep: steps that received past the capacity (never, by construction)";
    EP_RECV_MISMATCH_TOTAL: Counter "epserve_ep_recv_mismatch_total", "steps", ["mode"], gpu,
        "nccl-ep: steps whose received rows differ from what the routing sent";
}

/// README's table: a header and one row per metric.
pub fn markdown() -> String {
    let mut s = String::from("| name | type | unit | labels | meaning |\n|---|---|---|---|---|\n");
    for m in TABLE {
        // README's spelling: an empty cell is "| |".
        let labels = match m.labels {
            [] => String::new(),
            l => format!(" {}", l.join(", ")),
        };
        s += &format!(
            "| `{}` | {} | {} |{labels} | {} |\n",
            m.name,
            m.kind.name(),
            m.unit,
            m.help
        );
    }
    s
}

/// The table as JSON lines, for tools (`deploy/check.py`).
pub fn json_lines() -> String {
    TABLE
        .iter()
        .map(|m| {
            serde_json::json!({
                "name": m.name,
                "type": m.kind.name(),
                "unit": m.unit,
                "labels": m.labels,
                "gpu_only": m.gpu_only,
                "help": m.help,
            })
            .to_string()
                + "\n"
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    /// Strings that look like a metric's name and are not one.
    const NOT_METRICS: &[&str] = &[
        // tonic's descriptor set of proto/epserve.proto (server/lib.rs).
        "epserve_descriptor",
    ];

    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                sources(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }

    /// Every Rust source of the server and the load generator but this table.
    fn code() -> Vec<(PathBuf, String)> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let mut files = Vec::new();
        sources(&root.join("server"), &mut files);
        sources(&root.join("loadtest/src"), &mut files);
        files
            .into_iter()
            .filter(|p| !p.ends_with("server/metric_names.rs"))
            .map(|p| {
                let s = std::fs::read_to_string(&p).unwrap();
                (p, s)
            })
            .collect()
    }

    #[test]
    fn no_source_spells_a_metric_name() {
        let mut found = Vec::new();
        for (p, s) in code() {
            for (i, line) in s.lines().enumerate() {
                for part in line.split('"').skip(1).step_by(2) {
                    if part.starts_with("epserve_") && !NOT_METRICS.contains(&part) {
                        found.push(format!("{}:{}: \"{part}\"", p.display(), i + 1));
                    }
                }
            }
        }
        assert!(
            found.is_empty(),
            "metric names outside the table: {found:#?}"
        );
    }

    #[test]
    fn every_metric_is_used_and_named_by_its_kind() {
        let code: String = code().into_iter().map(|(_, s)| s).collect();
        let mut seen = std::collections::HashSet::new();
        for m in TABLE {
            assert!(seen.insert(m.name), "{} twice", m.name);
            let id = m.name.strip_prefix("epserve_").unwrap().to_uppercase();
            assert!(
                code.contains(&format!("metric_names::{id}")),
                "{} is in the table but nothing exports it",
                m.name
            );
            match m.kind {
                Kind::Counter => assert!(m.name.ends_with("_total"), "{}", m.name),
                _ => assert!(!m.name.ends_with("_total"), "{}", m.name),
            }
        }
    }

    #[test]
    fn readme_table_is_the_table() {
        let readme =
            std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
        let at = readme
            .find("| name | type | unit | labels | meaning |")
            .expect("README has the metrics table");
        let block: String = readme[at..]
            .lines()
            .take_while(|l| l.starts_with('|'))
            .map(|l| format!("{l}\n"))
            .collect();
        assert_eq!(
            block,
            markdown(),
            "README's metrics table differs: paste `epserve metrics --list` there"
        );
    }
}
