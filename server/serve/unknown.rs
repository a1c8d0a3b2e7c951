//! A method nobody here serves gets UNIMPLEMENTED naming it and what is served, instead of the
//! bare status tonic's router and generated services give (an empty message that leaves a
//! Triton or grpcurl user guessing which call was missing). A request that is not gRPC at all
//! (HTTP/1.1, or no `application/grpc` content type: a load balancer's GET probe, a browser, a
//! REST client at the wrong port) gets an HTTP error, never a `200` it would read as healthy.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use tonic::body::Body;
use tonic::Status;

#[derive(Clone)]
pub struct NameUnknown<S> {
    inner: S,
    /// The services served, for the message.
    services: Arc<str>,
}

impl<S> NameUnknown<S> {
    pub fn new(inner: S, services: &[&str]) -> Self {
        Self {
            inner,
            services: services.join(", ").into(),
        }
    }
}

/// The HTTP answer to a request that is not gRPC: 505 for HTTP/1, 415 for another content type.
fn not_grpc<B>(req: &http::Request<B>) -> Option<http::Response<Body>> {
    use http::StatusCode;
    let grpc = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .is_some_and(|t| t.as_bytes().starts_with(b"application/grpc"));
    let code = if req.version() != http::Version::HTTP_2 {
        StatusCode::HTTP_VERSION_NOT_SUPPORTED
    } else if !grpc {
        StatusCode::UNSUPPORTED_MEDIA_TYPE
    } else {
        return None;
    };
    tracing::debug!(path = req.uri().path(), %code, "not a gRPC request");
    let text = "this port serves gRPC (HTTP/2, application/grpc); KServe v2 REST is on the \
                --http-listen port\n";
    let mut r = http::Response::new(Body::new(http_body_util::Full::new(
        bytes::Bytes::from_static(text.as_bytes()),
    )));
    *r.status_mut() = code;
    r.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    Some(r)
}

/// True for an UNIMPLEMENTED answer that says nothing.
fn bare_unimplemented(r: &http::Response<Body>) -> bool {
    r.headers().get("grpc-status").is_some_and(|s| s == "12")
        && r.headers().get("grpc-message").is_none_or(|m| m.is_empty())
}

impl<S> tonic::codegen::Service<http::Request<Body>> for NameUnknown<S>
where
    S: tonic::codegen::Service<
        http::Request<Body>,
        Response = http::Response<Body>,
        Error = Infallible,
    >,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if let Some(refusal) = not_grpc(&req) {
            return Box::pin(std::future::ready(Ok(refusal)));
        }
        let path = req.uri().path().to_string();
        let services = self.services.clone();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let answer = answer.await?;
            if !bare_unimplemented(&answer) {
                return Ok(answer);
            }
            tracing::debug!(path, "unknown gRPC method");
            let s = Status::unimplemented(format!(
                "method {path} is not served here (services: {services})"
            ));
            Ok(s.into_http())
        })
    }
}
