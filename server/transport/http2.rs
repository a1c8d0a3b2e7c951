//! HTTP/2 settings of the gRPC port. The service takes them as flags, and the loadtest's echo
//! service and client take the same flags, so a service/echo ratio compares like with like.
//! hyper's defaults (1 MiB windows, 16 KiB frames) cap a connection well below what MB-sized
//! tensors need; the defaults here are sized for them and cost small requests nothing.

use std::time::Duration;

use clap::Args;

use crate::flags::{size_in, OnOff};

fn duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("'{s}': {e} (write e.g. 30s, 0s)"))
}

/// A `grpc-timeout` value as the gRPC spec writes it: 1 to 8 digits and a unit (H, M, S, m, u,
/// n); None for anything else.
pub fn grpc_timeout(v: &str) -> Option<Duration> {
    if !v.is_ascii() {
        return None;
    }
    let (num, unit) = v.split_at(v.len().checked_sub(1)?);
    if num.is_empty() || num.len() > 8 || !num.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = num.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// A request's `grpc-timeout` header, if it has a well-formed one (a malformed one is the
/// handler's to refuse; to the transport it is no deadline).
pub fn header_timeout(headers: &http::HeaderMap) -> Option<Duration> {
    headers
        .get("grpc-timeout")
        .and_then(|v| v.to_str().ok())
        .and_then(grpc_timeout)
}

/// The flow-control and framing settings both ends of a connection apply.
#[derive(Args, Debug, Clone)]
pub struct Http2 {
    /// Receive window of each stream, in bytes (how much of one message may be in flight
    /// unacknowledged).
    #[arg(long, env = "EPSERVE_HTTP2_STREAM_WINDOW", default_value = "8MiB",
          value_parser = |s: &str| size_in::<u32>(s, 65_535, 2_147_483_647))]
    pub http2_stream_window: u32,
    /// Receive window of each connection, in bytes (all its streams together).
    #[arg(long, env = "EPSERVE_HTTP2_CONNECTION_WINDOW", default_value = "64MiB",
          value_parser = |s: &str| size_in::<u32>(s, 65_535, 2_147_483_647))]
    pub http2_connection_window: u32,
    /// Size the windows from the measured bandwidth-delay product instead (replaces the two
    /// above).
    #[arg(
        long,
        env = "EPSERVE_HTTP2_ADAPTIVE_WINDOW",
        value_enum,
        default_value = "off"
    )]
    pub http2_adaptive_window: OnOff,
    /// Largest frame this end accepts, in bytes (16 KiB to 16 MiB - 1).
    #[arg(long, env = "EPSERVE_HTTP2_MAX_FRAME_SIZE", default_value = "1MiB",
          value_parser = |s: &str| size_in::<u32>(s, 16_384, 16_777_215))]
    pub http2_max_frame_size: u32,
    /// Largest header list (a call's metadata) this end accepts, in bytes. Past it a call is
    /// refused on its own; below h2's own ceiling on a header block's frames (which closes the
    /// whole connection, every other call on it too), so that ceiling is not what a client meets.
    #[arg(long, env = "EPSERVE_HTTP2_MAX_HEADER_LIST_SIZE", default_value = "1MiB",
          value_parser = |s: &str| size_in::<u32>(s, 16_384, 16_777_216))]
    pub http2_max_header_list_size: u32,
    /// PING a connection this often, to find a dead peer behind a silent network; 0s: never.
    #[arg(long, env = "EPSERVE_HTTP2_KEEPALIVE_INTERVAL", default_value = "30s", value_parser = duration)]
    pub http2_keepalive_interval: Duration,
    /// Close a connection whose PING is not answered within this.
    #[arg(long, env = "EPSERVE_HTTP2_KEEPALIVE_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub http2_keepalive_timeout: Duration,
}

impl Default for Http2 {
    /// The flags' defaults (and any EPSERVE_HTTP2_* variables set).
    fn default() -> Self {
        #[derive(clap::Parser)]
        struct Flags {
            #[command(flatten)]
            http2: Http2,
        }
        <Flags as clap::Parser>::parse_from(["epserve"]).http2
    }
}

impl Http2 {
    fn adaptive(&self) -> bool {
        self.http2_adaptive_window == OnOff::On
    }

    fn keepalive(&self) -> Option<Duration> {
        (!self.http2_keepalive_interval.is_zero()).then_some(self.http2_keepalive_interval)
    }

    /// The service's own accept loop (hyper).
    pub fn serve<E>(&self, b: &mut hyper_util::server::conn::auto::Builder<E>) {
        let mut h2 = b.http2();
        h2.initial_stream_window_size(self.http2_stream_window)
            .initial_connection_window_size(self.http2_connection_window)
            .adaptive_window(self.adaptive())
            .max_frame_size(self.http2_max_frame_size)
            .max_header_list_size(self.http2_max_header_list_size)
            .keep_alive_interval(self.keepalive())
            .keep_alive_timeout(self.http2_keepalive_timeout)
            .timer(hyper_util::rt::TokioTimer::new());
    }

    /// A tonic server (the loadtest's echo).
    pub fn tonic_server(&self, b: tonic::transport::Server) -> tonic::transport::Server {
        b.initial_stream_window_size(self.http2_stream_window)
            .initial_connection_window_size(self.http2_connection_window)
            .http2_adaptive_window(Some(self.adaptive()))
            .max_frame_size(self.http2_max_frame_size)
            .http2_max_header_list_size(self.http2_max_header_list_size)
            .http2_keepalive_interval(self.keepalive())
            .http2_keepalive_timeout(Some(self.http2_keepalive_timeout))
            .tcp_nodelay(true)
    }

    /// A client connection (the loadtest).
    pub fn endpoint(&self, e: tonic::transport::Endpoint) -> tonic::transport::Endpoint {
        let e = e
            .initial_stream_window_size(self.http2_stream_window)
            .initial_connection_window_size(self.http2_connection_window)
            .http2_adaptive_window(self.adaptive())
            .max_frame_size(self.http2_max_frame_size)
            .keep_alive_timeout(self.http2_keepalive_timeout)
            .tcp_nodelay(true);
        match self.keepalive() {
            Some(d) => e.http2_keep_alive_interval(d),
            None => e,
        }
    }
}
