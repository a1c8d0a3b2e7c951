//! epserve-loadtest: closed- and open-loop gRPC load against epserve (or a bare echo service),
//! with latency histograms, a rate sweep, and the transport's ceiling measured in the same run.

pub mod config;
pub mod echo;
pub mod load;
pub mod record;
pub mod report;
pub mod shm;
pub mod sweep;
pub mod workload;
