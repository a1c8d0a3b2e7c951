//! The request path (scheduling requests into steps; "router" names the rank-0 process and the
//! MoE gate, not this): admission bounds what is held, an actor owning the queue packs
//! requests of one layer into steps of at most `max_tokens_per_step` tokens (splitting large ones),
//! and the executor thread runs each step across the group and answers finished requests.

mod batcher;
mod coordinator;
mod executor;
mod job;
mod pace;
pub(crate) mod rows;

pub use batcher::{run_batcher, BatchConfig};
pub use coordinator::{run_coordinator, CoordConfig, Offer};
pub use executor::{Control, Executor, ExecutorError, PeerEvents};
pub use job::{Job, Segment, Step, Timings};
pub use pace::Pace;
