//! Why a request got no output, in the service's own terms. Each protocol maps these to its own
//! status codes (`api::status` for gRPC), so the request path never names a wire protocol.

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
