//! Why a request got no output, in the service's own terms. Each protocol maps these to its own
//! status codes (`api::status` for gRPC), so the request path never names a wire protocol.

/// Every `reason` label of `epserve_rejections_total`: the series are exported at 0 from start,
/// so an alert sees them before the first rejection (a test keeps the list complete).
pub const REJECTION_REASONS: &[&str] = &[
    // The request is wrong.
    "invalid_argument",
    "not_found",
    // Deadlines: passed before admission, while queued, or while the message was read.
    "deadline_on_arrival",
    "deadline_in_queue",
    "upload_deadline",
    // Overload: admission bounds, the queue, the upload budget.
    "request_too_large",
    "max_concurrent_requests",
    "max_queued_tokens",
    "queue_full",
    "upload_budget",
    // Not serving.
    "starting",
    "draining",
    "broken",
];

/// Counts one rejection under `reason` (one of `REJECTION_REASONS`).
pub fn count_rejection(reason: &'static str) {
    debug_assert!(
        REJECTION_REASONS.contains(&reason),
        "rejection reason {reason:?} is not in REJECTION_REASONS"
    );
    metrics::counter!("epserve_rejections_total", "reason" => reason).increment(1);
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Failure {
    /// The request itself is wrong.
    #[error("{0}")]
    Invalid(String),
    /// The model or version it names does not exist.
    #[error("{0}")]
    NotFound(String),
    /// A bound on what the service holds was hit; `reason` labels the rejection metric.
    #[error("{message}")]
    Exhausted {
        reason: &'static str,
        message: String,
    },
    /// Not serving now (starting, draining, the group broke, the request was dropped).
    #[error("{message}")]
    Unavailable {
        reason: &'static str,
        message: String,
    },
    /// The client's deadline passed.
    #[error("{0}")]
    Deadline(String),
    /// A step holding the request computed a wrong result.
    #[error("{0}")]
    Wrong(String),
}

impl Failure {
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::Invalid(message.into())
    }

    pub fn unavailable(reason: &'static str, message: impl Into<String>) -> Self {
        Self::Unavailable {
            reason,
            message: message.into(),
        }
    }

    /// The label of `epserve_rejections_total` for a request refused before it was queued.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::Invalid(_) => "invalid_argument",
            Self::NotFound(_) => "not_found",
            Self::Exhausted { reason, .. } | Self::Unavailable { reason, .. } => reason,
            Self::Deadline(_) => "deadline",
            Self::Wrong(_) => "wrong_result",
        }
    }
}

#[cfg(test)]
mod tests {
    /// Every reason the source counts or gives a `Failure` is in `REJECTION_REASONS`.
    #[test]
    fn every_rejection_reason_is_listed() {
        let pattern = regex::Regex::new(
            r#"(?:count_rejection|rejected)\("([a-z_]+)"|reason: "([a-z_]+)"|Failure::unavailable\(\s*"([a-z_]+)""#,
        )
        .unwrap();
        let mut found = 0;
        let mut stack = vec![std::path::PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/server"
        ))];
        while let Some(dir) = stack.pop() {
            for e in std::fs::read_dir(&dir).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    let text = std::fs::read_to_string(&p).unwrap();
                    for c in pattern.captures_iter(&text) {
                        let r = c.iter().skip(1).flatten().next().unwrap().as_str();
                        // A queued request's failure when the group stops: not a refusal.
                        if r == "dropped" {
                            continue;
                        }
                        found += 1;
                        assert!(
                            super::REJECTION_REASONS.contains(&r),
                            "{}: reason {r:?} is not in REJECTION_REASONS",
                            p.display()
                        );
                    }
                }
            }
        }
        assert!(found >= 10, "only {found} reasons found in the source");
    }
}
