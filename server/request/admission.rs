//! Admission control: bounds on requests and tokens held by the leader, checked before a request
//! is queued. Past a bound a request is refused at once with RESOURCE_EXHAUSTED.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::sync::Notify;

use super::failure::Failure;

use crate::metric_names;

pub struct Admission {
    max_requests: usize,
    max_tokens: usize,
    requests: AtomicUsize,
    tokens: AtomicUsize,
    /// Woken whenever a permit is released (drain waits on it).
    released: Notify,
}

/// Held by an admitted request until it is answered and out of every step; releases on drop.
pub struct Permit {
    adm: Arc<Admission>,
    tokens: usize,
    /// Admitted (not a refused attempt's): counted in the admitted gauges.
    admitted: bool,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Permit({} tokens)", self.tokens)
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if self.admitted {
            metrics::gauge!(metric_names::ADMITTED_REQUESTS).decrement(1.0);
            metrics::gauge!(metric_names::ADMITTED_TOKENS).decrement(self.tokens as f64);
        }
        self.adm.tokens.fetch_sub(self.tokens, Ordering::AcqRel);
        self.adm.requests.fetch_sub(1, Ordering::AcqRel);
        self.adm.released.notify_waiters();
    }
}

impl Admission {
    pub fn new(max_requests: usize, max_tokens: usize) -> Arc<Self> {
        metrics::gauge!(metric_names::LIMIT_MAX_CONCURRENT_REQUESTS).set(max_requests as f64);
        metrics::gauge!(metric_names::LIMIT_MAX_QUEUED_TOKENS).set(max_tokens as f64);
        Arc::new(Self {
            max_requests,
            max_tokens,
            requests: AtomicUsize::new(0),
            tokens: AtomicUsize::new(0),
            released: Notify::new(),
        })
    }

    /// Requests and tokens admitted and not yet finished.
    pub fn held(&self) -> (usize, usize) {
        (
            self.requests.load(Ordering::Acquire),
            self.tokens.load(Ordering::Acquire),
        )
    }

    /// Takes room for one request of `tokens`; the error says which bound was hit.
    pub fn try_admit(self: &Arc<Self>, tokens: usize) -> Result<Permit, Failure> {
        if tokens > self.max_tokens {
            return Err(Failure::Exhausted {
                reason: "request_too_large",
                message: format!(
                    "a request of {tokens} tokens exceeds --max-queued-tokens ({})",
                    self.max_tokens
                ),
            });
        }
        let r = self.requests.fetch_add(1, Ordering::AcqRel);
        let t = self.tokens.fetch_add(tokens, Ordering::AcqRel);
        let mut permit = Permit {
            adm: self.clone(),
            tokens,
            admitted: false,
        };
        if r >= self.max_requests {
            return Err(Failure::Exhausted {
                reason: "max_concurrent_requests",
                message: format!(
                    "too many requests in flight (--max-concurrent-requests {})",
                    self.max_requests
                ),
            });
        }
        if t + tokens > self.max_tokens {
            return Err(Failure::Exhausted {
                reason: "max_queued_tokens",
                message: format!(
                    "the queue holds {t} tokens; {tokens} more exceed --max-queued-tokens ({})",
                    self.max_tokens
                ),
            });
        }
        permit.admitted = true;
        metrics::gauge!(metric_names::ADMITTED_REQUESTS).increment(1.0);
        metrics::gauge!(metric_names::ADMITTED_TOKENS).increment(tokens as f64);
        Ok(permit)
    }

    /// Waits until nothing admitted is left.
    pub async fn drained(&self) {
        loop {
            let notified = self.released.notified();
            if self.held().0 == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounds_hold_and_permits_release() {
        let a = Admission::new(2, 10);
        let p1 = a.try_admit(6).unwrap();
        assert_eq!(a.try_admit(5).unwrap_err().reason(), "max_queued_tokens");
        assert_eq!(a.try_admit(11).unwrap_err().reason(), "request_too_large");
        let p2 = a.try_admit(4).unwrap();
        assert_eq!(
            a.try_admit(0).unwrap_err().reason(),
            "max_concurrent_requests"
        );
        assert_eq!(a.held(), (2, 10));
        drop((p1, p2));
        assert_eq!(a.held(), (0, 0));
    }
}
