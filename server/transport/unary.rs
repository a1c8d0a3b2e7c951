//! Unary calls that carry one large tensor each way (Forward, ModelInfer), framed here rather
//! than by tonic's codec, which copies every message twice: into a fresh buffer as it arrives,
//! and into another as it leaves, and at megabytes both fault in page by page (on 1x H200 at
//! 2048-token requests, memcpy was 22% and page faults 12% of the leader's CPU). Here a request
//! is read into a kept buffer (`bufs`), its tensors stay slices of it, and an answer's tensor
//! bytes go to the transport as they are, behind the rest of the message: a decoder merges a
//! second occurrence of a message field into the first and appends one of a repeated field, so
//! every protobuf decoder reads the message it would have read from tonic.
//!
//! What tonic's server did is kept: its limits and their messages, its refusals of compressed
//! requests, the status of a failed call as trailers only, and the call's metadata. On a
//! connection with an answer account (`answer`), a request comes in only when its connection's
//! unwritten answers leave room, and its `Hold` (its admission permit) is let go once its answer
//! is made, the answer charged to the account until the transport has taken it whole; without
//! one (tests), the `Hold` is kept until then.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::future::{poll_fn, Future};
use std::pin::{pin, Pin};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body::{Body as HttpBody, Frame};
use prost::encoding::{encode_key, encode_varint, encoded_len_varint, key_len, WireType};
use prost::Message;
use tonic::body::Body;
use tonic::metadata::MetadataMap;
use tonic::server::NamedService;
use tonic::Status;

use super::answer::ConnAnswers;
use super::bufs::Bufs;
use super::upload::{Charge, Share};

/// Bytes below this are copied in behind the message's head (one frame) rather than sent apart.
const SPLICE_MIN: usize = 64 << 10;

/// A response whose large bytes fields can travel apart from the rest of it.
pub trait Spliced: Message {
    /// Takes the large bytes out, each with its field path (outermost field first), in the
    /// order they are appended.
    fn take_large(&mut self) -> Vec<(&'static [u32], Bytes)>;
}

/// One unary method served here instead of by the tonic service it belongs to.
pub trait Unary: Clone + Send + Sync + 'static {
    type Req: Message + Default + Send + 'static;
    type Resp: Spliced + Send + 'static;
    /// Held until the answer is made (an admission permit).
    type Hold: Send + 'static;
    /// `/package.Service/Method`.
    const PATH: &'static str;
    /// Its `method` label in the request metrics.
    const METHOD: &'static str;
    fn call(
        self,
        req: tonic::Request<Self::Req>,
    ) -> impl Future<Output = Result<(Self::Resp, Self::Hold), Status>> + Send;
    /// Counts a call that ended here, before `call` (its message never arrived whole, or could
    /// not be read), as the protocol counts its calls.
    fn refused(status: &Status, since: std::time::Instant);
}

/// The limits a tonic service would have been given, and where requests are read into.
#[derive(Clone)]
pub struct Limits {
    /// Largest request message (tonic's `max_decoding_message_size`).
    pub max_request: usize,
    /// Largest response message (tonic's `max_encoding_message_size`).
    pub max_response: usize,
    /// Longest the request may take to arrive when the call sets no grpc-timeout.
    pub read_timeout: Duration,
    pub bufs: Arc<Bufs>,
}

/// Frames `U`'s method in front of the tonic service that owns it: the layer gives every other
/// path to that service.
#[derive(Clone)]
pub struct UnaryLayer<U> {
    unary: U,
    limits: Limits,
}

impl<U> UnaryLayer<U> {
    pub fn new(unary: U, limits: Limits) -> Self {
        Self { unary, limits }
    }
}

impl<S, U: Clone> tower::Layer<S> for UnaryLayer<U> {
    type Service = WithUnary<S, U>;

    fn layer(&self, inner: S) -> WithUnary<S, U> {
        WithUnary::new(inner, self.unary.clone(), self.limits.clone())
    }
}

/// The tonic service `S` with its method `U::PATH` served by `U` here.
#[derive(Clone)]
pub struct WithUnary<S, U> {
    inner: S,
    unary: U,
    limits: Limits,
}

impl<S, U> WithUnary<S, U> {
    pub fn new(inner: S, unary: U, limits: Limits) -> Self {
        Self {
            inner,
            unary,
            limits,
        }
    }
}

impl<S: NamedService, U> NamedService for WithUnary<S, U> {
    const NAME: &'static str = S::NAME;
}

type Answer = http::Response<Body>;

impl<S, U> tonic::codegen::Service<http::Request<Body>> for WithUnary<S, U>
where
    S: tonic::codegen::Service<http::Request<Body>, Response = Answer, Error = Infallible>,
    S::Future: Send + 'static,
    U: Unary,
{
    type Response = Answer;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Answer, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        if req.uri().path() != U::PATH {
            return Box::pin(self.inner.call(req));
        }
        let (unary, limits) = (self.unary.clone(), self.limits.clone());
        Box::pin(async move {
            Ok(serve(unary, &limits, req)
                .await
                .unwrap_or_else(|s| s.into_http()))
        })
    }
}

async fn serve<U: Unary, B>(
    unary: U,
    limits: &Limits,
    req: http::Request<B>,
) -> Result<Answer, Status>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<tonic::codegen::StdError>,
{
    let (parts, body) = req.into_parts();
    let encoding = Encoding::of(&parts.headers)?;
    let t0 = std::time::Instant::now();
    let answers = parts.extensions.get::<Arc<ConnAnswers>>().cloned();
    let share = parts.extensions.get::<Arc<Share>>().cloned();
    let msg = read_request::<U, B>(body, share.as_ref(), &parts.headers, encoding, limits)
        .await
        .inspect_err(|s| U::refused(s, t0))?;
    if let Some(a) = &answers {
        a.room().await.inspect_err(|s| U::refused(s, t0))?;
    }
    let req = tonic::Request::from_parts(
        MetadataMap::from_headers(parts.headers),
        parts.extensions,
        msg,
    );
    let (resp, hold) = unary.call(req).await?;
    match answers {
        Some(a) => respond(resp, limits.max_response, move |len| {
            drop(hold);
            a.charge(len)
        }),
        None => respond(resp, limits.max_response, |_| hold),
    }
}

/// The call's request, read whole by its deadline (the call's grpc-timeout, else
/// --upload-timeout) and decoded; a call that ends here is counted in the request metrics.
async fn read_request<U: Unary, B>(
    body: B,
    share: Option<&Arc<Share>>,
    headers: &http::HeaderMap,
    encoding: Option<Encoding>,
    limits: &Limits,
) -> Result<U::Req, Status>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<tonic::codegen::StdError>,
{
    // The whole request must be in by the call's deadline, else --upload-timeout.
    let (limit, by) = match super::header_timeout(headers) {
        Some(d) => (d, "the call's grpc-timeout".to_string()),
        None => (
            limits.read_timeout,
            format!("--upload-timeout ({:?})", limits.read_timeout),
        ),
    };
    let read = read_message(body, limits.max_request, encoding, &limits.bufs, share);
    let Ok(msg) = tokio::time::timeout(limit, read).await else {
        crate::rejections::count_rejection("upload_deadline");
        tracing::debug!(
            reason = "upload_deadline",
            "request refused: not in within {by}"
        );
        return Err(Status::deadline_exceeded(format!(
            "the request message did not arrive within {by}"
        )));
    };
    let msg = msg?;
    U::Req::decode(msg).map_err(|e| Status::internal(e.to_string()))
}

/// How the call's messages are compressed (`grpc-encoding`); None: not at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Gzip,
    /// zlib, as gRPC names it.
    Deflate,
}

impl Encoding {
    /// The call's encoding; one not served is UNIMPLEMENTED, saying which are (as tonic says it).
    fn of(headers: &http::HeaderMap) -> Result<Option<Self>, Status> {
        match headers.get("grpc-encoding").map(|e| e.as_bytes()) {
            None | Some(b"identity") => Ok(None),
            Some(b"gzip") => Ok(Some(Self::Gzip)),
            Some(b"deflate") => Ok(Some(Self::Deflate)),
            Some(e) => {
                let e = String::from_utf8_lossy(e);
                let mut s = Status::unimplemented(format!(
                    "Content is compressed with `{e}` which isn't supported"
                ));
                s.metadata_mut().insert(
                    "grpc-accept-encoding",
                    tonic::metadata::MetadataValue::from_static("gzip,deflate"),
                );
                Err(s)
            }
        }
    }

    /// `data` inflated, refused past `max` bytes, off the runtime's threads (a 69 KB body can
    /// inflate to 64 MiB): in steps of `INFLATE_STEP`, each charged to `charge` in its share of
    /// the upload budget (the bytes made so far and the step) before it is made.
    pub(crate) async fn inflate(
        self,
        data: Bytes,
        max: usize,
        mut charge: Option<(&Arc<Share>, &mut Option<Charge>)>,
    ) -> Result<Bytes, Status> {
        use std::io::Read;
        let reader = bytes::Buf::reader(data);
        let mut dec: Box<dyn Read + Send> = match self {
            Self::Gzip => Box::new(flate2::read::GzDecoder::new(reader)),
            Self::Deflate => Box::new(flate2::read::ZlibDecoder::new(reader)),
        };
        let mut out = Vec::new();
        loop {
            let want = (out.len() + INFLATE_STEP).min(max + 1);
            if let Some((share, held)) = charge.as_mut() {
                // At most a whole message's room: the byte past it only tells it is too large.
                share.grow(held, want.min(max)).await?;
            }
            let step = move || {
                let before = out.len();
                let read = (&mut dec)
                    .take((want - before) as u64)
                    .read_to_end(&mut out);
                (dec, out, read.map(|n| n < want - before))
            };
            let (d, o, ended) = tokio::task::spawn_blocking(step)
                .await
                .map_err(|e| Status::internal(format!("decompressing the request: {e}")))?;
            (dec, out) = (d, o);
            let ended = ended.map_err(|e| {
                Status::internal(format!("Error decompressing: {e}, while sending request"))
            })?;
            if out.len() > max {
                return Err(Status::resource_exhausted(format!(
                    "Error decompressing: size limit, of {max} bytes, exceeded while decompressing message"
                )));
            }
            if ended {
                return Ok(Bytes::from(out));
            }
        }
    }
}

/// What one step of inflating makes at most before its room is asked again.
const INFLATE_STEP: usize = 1 << 20;

/// The one message of a unary call's body, read into a kept buffer when large; a compressed one
/// (under `encoding`) is inflated, both its wire and its inflated size held to `max`, the
/// inflated bytes charged to `share` as they are made.
pub async fn read_message<B>(
    body: B,
    max: usize,
    encoding: Option<Encoding>,
    bufs: &Arc<Bufs>,
    share: Option<&Arc<Share>>,
) -> Result<Bytes, Status>
where
    B: HttpBody<Data = Bytes>,
    B::Error: Into<tonic::codegen::StdError>,
{
    let mut body = pin!(body);
    let mut head = [0u8; 5];
    let mut have = 0;
    // The message, once its length is known, and how much of it has arrived.
    let mut msg: Option<(Vec<u8>, usize)> = None;
    let mut compressed = false;
    while let Some(frame) = poll_fn(|cx| body.as_mut().poll_frame(cx)).await {
        let frame = frame.map_err(|e| Status::from_error(e.into()))?;
        // A request's trailers carry nothing a unary call uses.
        let Ok(mut data) = frame.into_data() else {
            continue;
        };
        while data.has_remaining() {
            match &mut msg {
                None => {
                    let n = (5 - have).min(data.len());
                    head[have..have + n].copy_from_slice(&data[..n]);
                    data.advance(n);
                    have += n;
                    if have == 5 {
                        let len = message_len(&head, max, encoding.is_some())?;
                        compressed = head[0] == 1;
                        msg = Some((bufs.take(len), 0));
                    }
                }
                Some((buf, filled)) if *filled < buf.len() => {
                    let n = (buf.len() - *filled).min(data.len());
                    buf[*filled..*filled + n].copy_from_slice(&data[..n]);
                    data.advance(n);
                    *filled += n;
                }
                Some(_) => {
                    return Err(Status::invalid_argument(
                        "a unary call carries one message; this one carried more",
                    ))
                }
            }
        }
    }
    match (msg, encoding) {
        (Some((buf, filled)), Some(e)) if filled == buf.len() && compressed => {
            let mut charge = None;
            e.inflate(bufs.freeze(buf), max, share.map(|s| (s, &mut charge)))
                .await
        }
        (Some((buf, filled)), _) if filled == buf.len() => Ok(bufs.freeze(buf)),
        (None, _) if have == 0 => Err(Status::internal("Missing request message.")),
        _ => Err(Status::internal("Unexpected EOF decoding stream.")),
    }
}

/// The length in a message's 5-byte prefix, refused (in tonic's words) if too long, or
/// compressed in a call that named no encoding.
fn message_len(head: &[u8; 5], max: usize, encoded: bool) -> Result<usize, Status> {
    match head[0] {
        0 => {}
        1 if encoded => {}
        1 => {
            return Err(Status::internal(
                "protocol error: received message with compressed-flag but no grpc-encoding was specified",
            ))
        }
        f => {
            return Err(Status::internal(format!(
                "protocol error: received message with invalid compression flag: {f} (valid flags are 0 and 1), while sending request"
            )))
        }
    }
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > max {
        return Err(Status::out_of_range(format!(
            "Error, decoded message length too large: found {len} bytes, the limit is: {max} bytes"
        )));
    }
    Ok(len)
}

/// The bytes a field path adds around `len` bytes: each level's key and length.
fn splice_len(path: &[u32], len: usize) -> usize {
    path.iter().rev().fold(len, |inner, &f| {
        key_len(f) + encoded_len_varint(inner as u64) + inner
    })
}

/// Writes the keys and lengths that put `len` bytes at `path`.
fn put_splice_head(buf: &mut BytesMut, path: &[u32], len: usize) {
    for (i, &f) in path.iter().enumerate() {
        encode_key(f, WireType::LengthDelimited, buf);
        encode_varint(splice_len(&path[i + 1..], len) as u64, buf);
    }
}

/// The answer's gRPC frame: its head (the message without its large bytes, and the keys and
/// lengths that splice them back), the large bytes as they are, then `grpc-status: 0`; the body
/// keeps what `keep` makes of its length until it is dropped.
fn respond<M: Spliced, H: Send + 'static>(
    mut m: M,
    max: usize,
    keep: impl FnOnce(usize) -> H,
) -> Result<Answer, Status> {
    let large = m.take_large();
    let head_len = m.encoded_len();
    let len = head_len
        + large
            .iter()
            .map(|(p, b)| splice_len(p, b.len()))
            .sum::<usize>();
    if len > max || u32::try_from(len).is_err() {
        return Err(Status::out_of_range(format!(
            "Error, encoded message length too large: found {len} bytes, the limit is: {max} bytes"
        )));
    }
    let mut head = BytesMut::with_capacity(5 + head_len + 16 * large.len());
    head.put_u8(0);
    head.put_u32(len as u32);
    m.encode(&mut head).expect("a BytesMut grows");
    let mut chunks = VecDeque::new();
    for (path, bytes) in large {
        put_splice_head(&mut head, path, bytes.len());
        if bytes.len() < SPLICE_MIN {
            head.put_slice(&bytes);
        } else {
            chunks.push_back(head.split().freeze());
            chunks.push_back(bytes);
        }
    }
    if !head.is_empty() {
        chunks.push_back(head.freeze());
    }
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let body = Frames {
        chunks,
        trailers: Some(trailers),
        _hold: Box::new(keep(5 + len)),
    };
    let mut answer = http::Response::new(Body::new(body));
    answer.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    Ok(answer)
}

/// A response body of ready chunks and trailers, holding `_hold` until it is dropped. Its size
/// hint stays unknown, as tonic's does, so hyper adds no content-length to a gRPC response.
struct Frames {
    chunks: VecDeque<Bytes>,
    trailers: Option<http::HeaderMap>,
    _hold: Box<dyn Send>,
}

impl HttpBody for Frames {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let frame = match self.chunks.pop_front() {
            Some(mut c) => {
                let piece = super::answer::piece(&mut c);
                if !c.is_empty() {
                    self.chunks.push_front(c);
                }
                Some(Frame::data(piece))
            }
            None => self.trailers.take().map(Frame::trailers),
        };
        Poll::Ready(frame.map(Ok))
    }

    fn is_end_stream(&self) -> bool {
        self.chunks.is_empty() && self.trailers.is_none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inference::model_infer_response::InferOutputTensor;
    use crate::inference::ModelInferResponse;
    use crate::metric_names;
    use crate::proto::ForwardResponse;
    use crate::proto::{Error, Tensor};
    use crate::transport::answer::PIECE;
    use rand::{Rng, SeedableRng};
    use tonic::Code;

    fn bytes(rng: &mut impl Rng, len: usize) -> Bytes {
        (0..len)
            .map(|_| rng.random::<u8>())
            .collect::<Vec<_>>()
            .into()
    }

    /// Lengths either side of every threshold: inline, spliced, varints of 1 to 4 bytes.
    const LENS: &[usize] = &[
        0,
        1,
        127,
        128,
        16_383,
        16_384,
        SPLICE_MIN - 1,
        SPLICE_MIN,
        3 << 20,
    ];

    /// A body of these chunks, as the transport would hand them over.
    fn body(chunks: Vec<Bytes>) -> Frames {
        Frames {
            chunks: chunks.into(),
            trailers: None,
            _hold: Box::new(()),
        }
    }

    /// The answer's data frames, its trailers, and the frames' own buffers.
    async fn drain(a: Answer) -> (Vec<Bytes>, http::HeaderMap) {
        assert_eq!(a.headers()["content-type"], "application/grpc");
        let mut b = pin!(a.into_body());
        let (mut data, mut trailers) = (Vec::new(), None);
        while let Some(f) = poll_fn(|cx| b.as_mut().poll_frame(cx)).await {
            match f.unwrap().into_data() {
                Ok(d) => data.push(d),
                Err(f) => trailers = f.into_trailers().ok(),
            }
        }
        (data, trailers.expect("trailers"))
    }

    /// The message in a gRPC frame, its 5-byte prefix checked.
    fn unframe(chunks: &[Bytes]) -> Bytes {
        let all: Vec<u8> = chunks.iter().flat_map(|c| c.iter().copied()).collect();
        assert_eq!(all[0], 0, "not compressed");
        let len = u32::from_be_bytes(all[1..5].try_into().unwrap()) as usize;
        assert_eq!(len, all.len() - 5);
        Bytes::from(all[5..].to_vec())
    }

    /// Every spliced answer decodes to the message it was, and large bytes leave as the very
    /// buffers they were (no copy): checked for each length class on random messages.
    #[tokio::test]
    async fn spliced_answers_decode_as_the_messages_they_were() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
        for &len in LENS {
            let data = bytes(&mut rng, len);
            let m = ForwardResponse {
                id: "r".repeat(rng.random_range(0..300)),
                output: Some(Tensor {
                    dtype: rng.random_range(0..4),
                    shape: vec![rng.random_range(0..1 << 40), 7168],
                    data: data.clone(),
                }),
                error: rng.random_bool(0.5).then(|| Error {
                    code: 3,
                    message: "m".into(),
                }),
            };
            let (chunks, trailers) = drain(respond(m.clone(), usize::MAX, |_| ()).unwrap()).await;
            assert_eq!(trailers["grpc-status"], "0");
            assert_eq!(
                ForwardResponse::decode(unframe(&chunks)).unwrap(),
                m,
                "{len}"
            );
            // Large bytes leave as pieces of the very buffer they were (no copy).
            let shared = chunks
                .iter()
                .any(|c| c.as_ptr() == data.as_ptr() && c.len() == len.min(PIECE));
            assert_eq!(shared, len >= SPLICE_MIN, "{len}: sent as it was");
            assert!(chunks.iter().all(|c| c.len() <= PIECE), "{len}: in pieces");

            let raw: Vec<Bytes> = (0..rng.random_range(0..4))
                .map(|i| bytes(&mut rng, LENS[(i + len) % LENS.len()]))
                .collect();
            let m = ModelInferResponse {
                model_name: "layer-0".into(),
                model_version: "1".into(),
                id: "k".into(),
                outputs: vec![InferOutputTensor {
                    name: "output".into(),
                    datatype: "BF16".into(),
                    shape: vec![2, 3],
                    ..Default::default()
                }],
                raw_output_contents: raw,
                ..Default::default()
            };
            let (chunks, _) = drain(respond(m.clone(), usize::MAX, |_| ()).unwrap()).await;
            assert_eq!(ModelInferResponse::decode(unframe(&chunks)).unwrap(), m);
        }
        // A message with no output at all goes out as tonic would send it.
        let m = ForwardResponse::default();
        let (chunks, _) = drain(respond(m.clone(), usize::MAX, |_| ()).unwrap()).await;
        assert_eq!(unframe(&chunks), m.encode_to_vec());
    }

    #[tokio::test]
    async fn an_answer_over_the_limit_is_out_of_range() {
        let m = ForwardResponse {
            output: Some(Tensor {
                data: vec![0; 1000].into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        // The head repeats `output`'s key: a few bytes over tonic's encoding, never more.
        let (chunks, _) = drain(respond(m.clone(), usize::MAX, |_| ()).unwrap()).await;
        let fits = unframe(&chunks).len();
        assert!((m.encoded_len()..m.encoded_len() + 8).contains(&fits));
        assert!(respond(m.clone(), fits, |_| ()).is_ok());
        let e = respond(m, fits - 1, |_| ()).unwrap_err();
        assert_eq!(e.code(), Code::OutOfRange);
        assert!(
            e.message().contains("encoded message length too large"),
            "{e:?}"
        );
    }

    /// The admission permit is held while the answer is being handed over, and let go with it.
    #[tokio::test]
    async fn the_hold_lasts_as_long_as_the_answer_body() {
        let hold = Arc::new(());
        let a = respond(ForwardResponse::default(), usize::MAX, |_| hold.clone()).unwrap();
        assert_eq!(Arc::strong_count(&hold), 2);
        drop(drain(a).await);
        assert_eq!(Arc::strong_count(&hold), 1);
    }

    fn framed(msg: &[u8]) -> Vec<u8> {
        let mut f = vec![0];
        f.extend((msg.len() as u32).to_be_bytes());
        f.extend(msg);
        f
    }

    /// Cuts `bytes` at random places, as frames may arrive.
    fn cut(rng: &mut impl Rng, bytes: &[u8]) -> Vec<Bytes> {
        let mut at = 0;
        let mut out = Vec::new();
        while at < bytes.len() {
            let most = 1usize << rng.random_range(0..21);
            let n = rng.random_range(1..=(bytes.len() - at).min(most));
            out.push(Bytes::copy_from_slice(&bytes[at..at + n]));
            at += n;
        }
        out
    }

    #[tokio::test]
    async fn a_message_is_read_whole_across_any_frame_boundaries() {
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let bufs = Bufs::new(64 << 20, metric_names::REQUEST_BUFFERS_REUSED_TOTAL);
        for &len in LENS {
            let msg = bytes(&mut rng, len);
            for _ in 0..3 {
                let chunks = cut(&mut rng, &framed(&msg));
                let got = read_message(body(chunks), len, None, &bufs, None)
                    .await
                    .unwrap();
                assert_eq!(got, msg, "{len}");
            }
        }
        // A large request lands in the buffer the one before it left behind.
        let first = read_message(
            body(vec![framed(&[1; 2 << 20]).into()]),
            4 << 20,
            None,
            &bufs,
            None,
        )
        .await
        .unwrap();
        let at = first.as_ptr();
        drop(first);
        let second = read_message(
            body(vec![framed(&[2; 2 << 20]).into()]),
            4 << 20,
            None,
            &bufs,
            None,
        )
        .await
        .unwrap();
        assert_eq!(second.as_ptr(), at);
        assert!(second.iter().all(|&b| b == 2));
    }

    /// Bad framing gets the status tonic gave it, and nothing is read past it.
    #[tokio::test]
    async fn bad_framing_gets_a_clear_status() {
        let bufs = Bufs::new(0, metric_names::REQUEST_BUFFERS_REUSED_TOTAL);
        let read = |chunks: Vec<Vec<u8>>, max| {
            let bufs = bufs.clone();
            async move {
                let chunks = chunks.into_iter().map(Bytes::from).collect();
                read_message(body(chunks), max, None, &bufs, None)
                    .await
                    .unwrap_err()
            }
        };
        let e = read(vec![framed(&[0; 11])], 10).await;
        assert_eq!(e.code(), Code::OutOfRange);
        assert!(e
            .message()
            .contains("decoded message length too large: found 11 bytes, the limit is: 10"));
        let mut compressed = framed(&[0; 4]);
        compressed[0] = 1;
        let e = read(vec![compressed], 10).await;
        assert_eq!(e.code(), Code::Internal);
        assert!(e.message().contains("compressed-flag"), "{e:?}");
        let e = read(vec![], 10).await;
        assert_eq!(
            (e.code(), e.message()),
            (Code::Internal, "Missing request message.")
        );
        for short in [vec![0, 0, 0], framed(&[5; 8])[..9].to_vec()] {
            let e = read(vec![short], 10).await;
            assert_eq!(
                (e.code(), e.message()),
                (Code::Internal, "Unexpected EOF decoding stream.")
            );
        }
        let e = read(vec![framed(&[1]), framed(&[2])], 10).await;
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.message().contains("one message"), "{e:?}");
    }

    /// gzip and deflate messages come out as they went in; one that inflates past the limit,
    /// or is not what its encoding says, is refused; an unknown encoding is UNIMPLEMENTED.
    #[tokio::test]
    async fn compressed_messages_are_inflated_within_the_limit() {
        use flate2::write::{GzEncoder, ZlibEncoder};
        use std::io::Write;
        let bufs = Bufs::new(0, metric_names::REQUEST_BUFFERS_REUSED_TOTAL);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        for len in [0, 7, 100_000] {
            // Half random, half zeros: it compresses.
            let mut msg = bytes(&mut rng, len / 2).to_vec();
            msg.resize(len, 0);
            let msg = Bytes::from(msg);
            for e in [Encoding::Gzip, Encoding::Deflate] {
                let packed = match e {
                    Encoding::Gzip => {
                        let mut w = GzEncoder::new(Vec::new(), flate2::Compression::fast());
                        w.write_all(&msg).unwrap();
                        w.finish().unwrap()
                    }
                    Encoding::Deflate => {
                        let mut w = ZlibEncoder::new(Vec::new(), flate2::Compression::fast());
                        w.write_all(&msg).unwrap();
                        w.finish().unwrap()
                    }
                };
                let mut f = framed(&packed);
                f[0] = 1;
                let got = read_message(body(vec![f.clone().into()]), 200_000, Some(e), &bufs, None)
                    .await
                    .unwrap();
                assert_eq!(got, msg, "{e:?} {len}");
                // Within the limit on the wire, past it inflated.
                if len > 1000 {
                    assert!(f.len() < len - 1);
                    let e2 = read_message(body(vec![f.into()]), len - 1, Some(e), &bufs, None)
                        .await
                        .unwrap_err();
                    assert_eq!(e2.code(), Code::ResourceExhausted, "{e2:?}");
                }
            }
            // An uncompressed message in a call that names an encoding is taken as it is.
            let got = read_message(
                body(vec![framed(&msg).into()]),
                200_000,
                Some(Encoding::Gzip),
                &bufs,
                None,
            )
            .await
            .unwrap();
            assert_eq!(got, msg);
        }
        let mut junk = framed(&[7; 30]);
        junk[0] = 1;
        let e = read_message(
            body(vec![junk.into()]),
            100,
            Some(Encoding::Gzip),
            &bufs,
            None,
        )
        .await
        .unwrap_err();
        assert_eq!(e.code(), Code::Internal);
        assert!(e.message().contains("decompressing"), "{e:?}");
        let mut h = http::HeaderMap::new();
        h.insert("grpc-encoding", http::HeaderValue::from_static("snappy"));
        let e = Encoding::of(&h).unwrap_err();
        assert_eq!(e.code(), Code::Unimplemented);
        assert!(e.message().contains("snappy"), "{e:?}");
    }
}
