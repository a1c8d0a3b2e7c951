//! Listening sockets when descriptors run out. Every connection holds a descriptor; at the
//! process's limit `accept` fails (EMFILE) for as long as connections wait in the backlog, so a
//! loop that retries at once burns a core and one that logs each failure floods the log (seen at
//! RLIMIT_NOFILE 256: 110% of a core on the metrics port, 90 warnings a second on gRPC). Here a
//! failed accept waits, doubling from 10 ms to 1 s, and warns at most once every 5 s with the
//! count since; and each rank raises its soft limit to the hard one at startup.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use tokio::net::{TcpListener, TcpStream};
use tracing::warn;

const FIRST_WAIT: Duration = Duration::from_millis(10);
const LONGEST_WAIT: Duration = Duration::from_secs(1);
const WARN_EVERY: Duration = Duration::from_secs(5);

/// A listener whose `accept` backs off on errors.
pub struct Acceptor {
    listener: TcpListener,
    /// The port's name in warnings.
    what: &'static str,
    wait: Duration,
    failures: u64,
    warned: Option<Instant>,
}

impl Acceptor {
    pub fn new(listener: TcpListener, what: &'static str) -> Self {
        Self {
            listener,
            what,
            wait: FIRST_WAIT,
            failures: 0,
            warned: None,
        }
    }

    /// The next connection. Cancel-safe: a call dropped while it waits loses no connection.
    pub async fn accept(&mut self) -> (TcpStream, SocketAddr) {
        loop {
            match self.listener.accept().await {
                Ok(c) => {
                    self.wait = FIRST_WAIT;
                    return c;
                }
                Err(e) => {
                    self.failures += 1;
                    if self.warned.is_none_or(|t| t.elapsed() >= WARN_EVERY) {
                        warn!(
                            failures = self.failures,
                            retry_seconds = self.wait.as_secs_f64(),
                            "{} accept: {e}; retrying, then less often",
                            self.what,
                        );
                        self.warned = Some(Instant::now());
                        self.failures = 0;
                    }
                    tokio::time::sleep(self.wait).await;
                    self.wait = (self.wait * 2).min(LONGEST_WAIT);
                }
            }
        }
    }
}

/// Raises the soft limit on open files to the hard limit; returns (soft before, soft now).
pub fn raise_open_files() -> std::io::Result<(u64, u64)> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if soft < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    Ok((soft, soft.max(hard)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_limit_rises_to_the_hard_one() {
        let (before, now) = raise_open_files().unwrap();
        let (soft, hard) =
            nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE).unwrap();
        assert!(
            now >= before && soft == now && soft == hard,
            "{before} {now} {soft} {hard}"
        );
    }
}
