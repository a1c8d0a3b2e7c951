//! The request vocabulary: what a protocol hands the service (a validated input, its rows, a
//! client's memory), what it gets back (a reply or a `Failure`), and the admission permit it
//! holds meanwhile. A leaf: the protocols (`api/`) name these and `infer::Infer`, never the
//! scheduler or a backend, as TGI's router keeps its protocols to `Infer` and `validation`.

mod admission;
mod failure;
mod memory;
mod rows;

pub use admission::{Admission, Permit};
pub use failure::Failure;
pub use memory::{ClientMemory, ClientSpan, OpenDevice};
pub use rows::{Data, JobInput, Reply, Rows};
