//! A validated request and its rows, as the protocols hand it to the scheduler.

use std::time::Instant;

use bytes::Bytes;

use super::failure::Failure;
use super::memory::ClientSpan;
use crate::dtype::Dtype;

/// The output rows `[tokens, hidden]` in the request's output dtype, or why there are none.
pub type Reply = Result<Bytes, Failure>;

/// Rows of floats as the client sent them: `[tokens, hidden]`, little-endian `dtype`.
#[derive(Clone, Debug)]
pub struct Rows {
    pub dtype: Dtype,
    pub data: Data,
}

/// Where a tensor's bytes are.
#[derive(Clone, Debug)]
pub enum Data {
    /// In this process: off the wire, or read from a system shared-memory region.
    Host(Bytes),
    /// In a client's device memory (CUDA shared memory), left there until a step reads it.
    Client(ClientSpan),
}

impl Data {
    pub fn len(&self) -> usize {
        match self {
            Data::Host(b) => b.len(),
            Data::Client(d) => d.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, if they are in this process.
    pub fn host(&self) -> Option<&Bytes> {
        match self {
            Data::Host(b) => Some(b),
            Data::Client(_) => None,
        }
    }
}

/// A validated request: its hidden states still the client's bytes.
pub struct JobInput {
    pub id: String,
    /// Index into `MoeSpec::moe_layers`.
    pub layer: usize,
    pub tokens: usize,
    /// `[tokens, hidden]`.
    pub hidden: Rows,
    /// The dtype its output rows leave in.
    pub output: Dtype,
    /// Client routing: ids and weights, `[tokens, top_k]` each.
    pub routing: Option<(Vec<i32>, Vec<f32>)>,
    /// The client's deadline (grpc-timeout): past it, a queued request never enters a step.
    pub deadline: Option<Instant>,
    /// Where the output rows go when the client named its device memory for them; the answer
    /// then carries no bytes.
    pub output_to: Option<ClientSpan>,
}
