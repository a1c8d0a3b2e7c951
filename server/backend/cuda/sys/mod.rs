//! Every raw call into the CUDA driver, cuBLAS, NCCL and NCCL EP, each behind a safe type that
//! owns its handle (cudarc's sys -> result -> safe, one floor up): the rest of the GPU floor has no
//! `unsafe` but its kernel launches.
//! - `nccl`: the communicator; `nccl_ep`: NCCL EP's groups, handles and tensors;
//! - `blas`: cuBLAS GEMMs on the rank's stream;
//! - `memory`: page-locked staging, the step ring registered with the driver, and the async
//!   copies between them and device memory (a client's too);
//! - `ipc`: a client's CUDA memory opened from its IPC handle;
//! - `graph`: a captured step; `device`: device attributes and context settings.

pub mod blas;
pub mod device;
pub mod graph;
pub mod ipc;
pub mod memory;
pub mod nccl;
pub mod nccl_ep;
