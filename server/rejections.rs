//! Why a request was refused, as the `reason` label of `epserve_rejections_total`: one list for
//! every layer that refuses (the transport, admission, the queue), so none imports another to
//! count.

use crate::metric_names;

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
    // Answers not being read: no room left, a connection closed for a waiting request, or
    // answers dropped with their connection at --write-timeout.
    "answer_budget",
    "answer_evicted",
    "write_timeout",
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
    metrics::counter!(metric_names::REJECTIONS_TOTAL, "reason" => reason).increment(1);
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
