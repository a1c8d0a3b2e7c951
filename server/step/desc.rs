//! A step as the leader describes it to every rank, and how a step fails.

use std::ops::Range;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::dtype::Dtype;

/// What the leader tells every rank about a step (sent over the control channel).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepDesc {
    /// Monotonic from 1; doubles as the sequence number of every flag the step sets.
    pub step: u64,
    /// Index into `MoeSpec::moe_layers`.
    pub layer: u32,
    /// Tokens in the whole step (all ranks' home slices together).
    pub tokens: u32,
    /// Step-ring cell holding the input and receiving the output.
    pub cell: u32,
    /// The ring carries the client's top-k ids and weights: gating is skipped.
    pub client_routing: bool,
    /// The dtype of the step's input rows in the ring, as the clients sent them.
    pub input: Dtype,
    /// The dtype the ranks write the output rows in, as the clients asked for them.
    pub output: Dtype,
    /// `--ingress all`: each rank's home rows, its own clients' requests, at `rank * stride` in
    /// the cell. Empty: the leader packed `tokens` rows, split evenly (`home_range`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub homes: Vec<u32>,
    /// The expert placement's epoch this step runs on: a new one is applied by every rank
    /// before the step (it was staged on each already).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub placement: u32,
    /// Ranks out of the group (`--on-rank-loss continue`), ascending: they have no home rows,
    /// nothing is sent to them and nothing awaited from them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub lost: Vec<u32>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// What requests must share to be in one step: the ring carries one layout per step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepKey {
    /// Index into `MoeSpec::moe_layers`.
    pub layer: u32,
    pub client_routing: bool,
    pub input: Dtype,
    pub output: Dtype,
}

impl StepDesc {
    pub fn key(&self) -> StepKey {
        StepKey {
            layer: self.layer,
            client_routing: self.client_routing,
            input: self.input,
            output: self.output,
        }
    }

    /// Leader ingress: the leader packed every rank's rows into the cell (and answers from the
    /// outputs there), so across nodes the rows travel with the ring's flags.
    pub fn leader_packed(&self) -> bool {
        self.homes.is_empty()
    }

    /// `rank`'s rows of the cell; `stride` is the most home rows a rank has (the ring's).
    /// Leader ingress splits the rows over the ranks still in the group.
    pub fn home(&self, world: usize, rank: usize, stride: usize) -> Range<usize> {
        match self.homes.get(rank) {
            Some(&n) => rank * stride..rank * stride + n as usize,
            None if self.is_lost(rank) => 0..0,
            None => {
                let live = world - self.lost.len();
                let nth = rank - self.lost.iter().filter(|&&r| (r as usize) < rank).count();
                home_range(self.tokens as usize, live, nth)
            }
        }
    }

    /// Whether `rank` is out of the group for this step.
    pub fn is_lost(&self, rank: usize) -> bool {
        self.lost.binary_search(&(rank as u32)).is_ok()
    }

    /// The most home rows any rank has in this step: every rank picks its buffers (the GPU's
    /// bucket) from it, so they agree.
    pub fn most_home(&self, world: usize) -> usize {
        match self.homes.iter().max() {
            Some(&n) => n as usize,
            None => max_home_tokens(self.tokens as usize, world - self.lost.len()),
        }
    }
}

/// The step's tokens `[start, end)` that `rank` owns: an even split, the remainder to low ranks.
pub fn home_range(tokens: usize, world: usize, rank: usize) -> Range<usize> {
    let (base, rem) = (tokens / world, tokens % world);
    let start = rank * base + rank.min(rem);
    start..start + base + usize::from(rank < rem)
}

/// Most tokens one rank can own in a step of at most `max_tokens_per_step`.
pub fn max_home_tokens(max_tokens_per_step: usize, world: usize) -> usize {
    max_tokens_per_step.div_ceil(world)
}

#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("step {step}: waiting for {what} from rank {rank}: {source}")]
    Wait {
        step: u64,
        what: &'static str,
        rank: usize,
        source: crate::sys::shm::WaitError,
    },
    #[error("step {step}: {msg}")]
    Invalid { step: u64, msg: String },
    /// The device failed the step; `source` is the backend's own error, kept typed.
    #[error("step {step}: the device failed the step: {source}")]
    Device {
        step: u64,
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A data connection to another node failed (its rank is gone, stopped or unreachable).
    #[error("step {step}: {msg}")]
    DataLink { step: u64, msg: String },
    /// The step did not complete within its bound (a peer is gone or stuck).
    #[error("step {step}: did not finish within {after:?} (a peer is gone or stuck)")]
    Timeout { step: u64, after: Duration },
    /// The step ran but its output cannot be trusted (e.g. NCCL EP received other than the
    /// routing sent): its requests fail INTERNAL and the group breaks.
    #[error("step {step}: {msg}")]
    Corrupt { step: u64, msg: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Leader ingress without a lost rank: the rows split over the ranks left, each once, in
    /// rank order; the lost rank has none, and the most a rank holds follows.
    #[test]
    fn home_rows_split_over_the_ranks_left() {
        let desc = StepDesc {
            step: 1,
            layer: 0,
            tokens: 10,
            cell: 0,
            client_routing: false,
            input: Dtype::F32,
            output: Dtype::F32,
            homes: Vec::new(),
            placement: 0,
            lost: vec![2],
        };
        let homes: Vec<_> = (0..4).map(|r| desc.home(4, r, 8)).collect();
        assert_eq!(homes, vec![0..4, 4..7, 0..0, 7..10]);
        assert_eq!(desc.most_home(4), 4);
        assert!(desc.is_lost(2) && !desc.is_lost(3));
        let whole = StepDesc {
            lost: Vec::new(),
            ..desc
        };
        assert_eq!(whole.home(4, 3, 8), 8..10);
        assert_eq!(whole.most_home(4), 3);
    }
}
