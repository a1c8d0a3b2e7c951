//! How bytes reach the service and leave it, below the protocols: the gRPC port's accept loop
//! (`accept`) and HTTP/2 settings (`http2`), each connection's limits (`conn`) and shares of the
//! upload budget (`upload`) and the answer budget (`answer`), the unary calls' own framing
//! (`unary`, a tower layer over tonic's services), the plain-HTTP ports (`http`), buffers kept
//! for reuse (`bufs`), accepting when descriptors run out (`listen`), and the length-prefixed
//! frames between ranks (`frame`).
//! Nothing here names a protocol's messages: `api/` and `group/` do.

pub mod accept;
pub mod answer;
pub mod bufs;
pub mod conn;
pub mod frame;
pub mod http;
pub mod http2;
pub mod listen;
pub mod unary;
pub mod upload;

pub use http2::{grpc_timeout, header_timeout, Http2};
