//! epserve: Mixture-of-Experts layers served over gRPC with expert parallelism.

pub mod api;
pub mod backend;
pub mod bench;
pub mod config;
pub mod dtype;
pub mod eplb;
pub mod flags;
pub mod group;
pub mod infer;
pub mod launch;
pub mod lifecycle;
pub mod metric_names;
pub mod metrics;
pub mod model;
pub mod nodes;
pub mod place;
pub mod rejections;
pub mod request;
pub mod sched;
pub mod serve;
pub mod startup;
pub mod stats_log;
pub mod step;
pub mod sys;
pub mod telemetry;
pub mod transport;
pub mod watchdog;

pub mod proto {
    tonic::include_proto!("epserve.v1");
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("epserve_descriptor");
}

/// KServe v2 / Open Inference Protocol messages (`proto/inference.proto`).
pub mod inference {
    tonic::include_proto!("inference");
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("inference_descriptor");
}
