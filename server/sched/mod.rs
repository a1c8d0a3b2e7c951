//! The request path, scheduling requests into steps: an actor owning the queue packs requests
//! of one layer into steps of at most `max_tokens_per_step` tokens (splitting large ones,
//! `batcher`; under `--ingress all` the `coordinator` forms steps from every rank's offers), and
//! one pipeline (`pipeline`) packs each step's rows into the ring, runs it and answers from it:
//! the leader's `executor` for every rank's rows, a worker's `own_rows` for its own clients'.
//! The leader's `balancer` moves expert slots from the routed load (`--eplb-interval`).

mod balancer;
mod batcher;
mod coordinator;
mod executor;
mod job;
mod own_rows;
mod pace;
mod pipeline;
mod redo;
pub(crate) mod rows;

pub use balancer::spawn as spawn_balancer;
pub use batcher::{run_batcher, BatchConfig};
pub use coordinator::{run_coordinator, CoordConfig, Offer};
pub use executor::{Control, Executor, ExecutorError, PeerEvents, RosterView};
pub use job::{Job, Segment, Step, Timings};
pub use own_rows::{lock, Offered, OwnRows, PackOrder, RowsError};
pub use pace::Pace;
pub use redo::Redo;
