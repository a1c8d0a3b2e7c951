//! Expert slots and load balancing (EPLB). Gating picks logical experts; each layer's slot table
//! (`SlotMap`) says which physical slot, on which rank, computes a row of an expert, spreading an
//! expert's rows over its replicas. The leader sums the routed rows over a window (`balance`),
//! DeepSeek's EPLB policy (`policy`) turns them into a new placement, and the ranks stage the
//! rewritten slots' weights off the step path before every rank switches at one step; a slot
//! whose expert a slot of its rank holds is copied from it instead (`sources`). `skew` draws
//! the skewed load the balancer is tested and measured under.

pub mod balance;
pub mod copy_order;
pub mod parts;
pub mod policy;
pub mod skew;
pub mod sources;
pub mod stage;
mod table;

pub use balance::{Balance, EplbConfig};
pub use table::{pick, LayerSlots, PlacementFile, SlotMap};
