//! The gRPC protocols over the one request entry (`crate::infer`): `epserve.v1.MoeService`
//! (`moe`) and KServe v2 / the Open Inference Protocol (`kserve`). What they share lives here:
//! deadlines from `grpc-timeout`, the status of each `Failure`, and request metrics.

mod call;
pub mod catalogue;
pub mod kserve;
pub mod moe;
mod stream;

pub use call::{grpc_timeout, status, METHODS, STATUSES};
pub use moe::{MoeApi, RosterView};
