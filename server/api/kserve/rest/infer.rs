//! `POST .../infer` bodies: KServe v2's JSON and Triton's binary-tensor extension, to and from
//! the gRPC `ModelInferRequest`/`ModelInferResponse` that the request entry takes, so REST
//! requests are checked, admitted and computed exactly as gRPC's.
//!
//! With the extension the body is a JSON header (`Inference-Header-Content-Length` bytes) and
//! then each binary input's bytes in input order, each input naming its length in its
//! `binary_data_size` parameter. An output is answered in binary when it asks
//! (`binary_data: true`) or the request does (`binary_data_output: true`) and it does not say
//! otherwise; the answer is then its own JSON header and the outputs' bytes.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Frame, SizeHint};
use serde::de::DeserializeSeed;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use super::json;
use crate::infer::quote::{parser_error, quote};
use crate::inference::model_infer_request::{InferInputTensor, InferRequestedOutputTensor};
use crate::inference::{ModelInferRequest, ModelInferResponse};
use crate::request::Failure;

/// The header that splits a body into its JSON and its binary tensors.
pub const HEADER_LENGTH: &str = "inference-header-content-length";

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Body<'a> {
    #[serde(default)]
    id: String,
    #[serde(default)]
    parameters: Map<String, Value>,
    #[serde(borrow)]
    inputs: Vec<Input<'a>>,
    #[serde(default)]
    outputs: Vec<Output>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Input<'a> {
    name: String,
    shape: Vec<i64>,
    datatype: String,
    #[serde(default)]
    parameters: Map<String, Value>,
    #[serde(borrow)]
    data: Option<&'a RawValue>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Output {
    name: String,
    #[serde(default)]
    parameters: Map<String, Value>,
}

/// Which outputs, by name, are answered in binary.
pub struct Binary {
    all: bool,
    /// (output, binary) as each output asked; an output not named follows `all`.
    each: Vec<(String, bool)>,
}

impl Binary {
    fn wants(&self, output: &str) -> bool {
        self.each
            .iter()
            .find(|(n, _)| n == output)
            .map_or(self.all, |(_, b)| *b)
    }
}

/// Takes a bool parameter out of `p`.
fn take_bool(p: &mut Map<String, Value>, key: &str, what: &str) -> Result<Option<bool>, Failure> {
    match p.remove(key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(b)),
        Some(v) => Err(Failure::invalid(format!(
            "{what}parameter {key}: {v} is not a bool"
        ))),
    }
}

/// The request a body asks, for `model` at `version`: `header` is the JSON's length when the
/// body carries binary tensors after it. `max` bounds what one input's JSON data may hold.
pub fn request(
    body: &Bytes,
    header: Option<usize>,
    model: String,
    version: String,
    max: usize,
) -> Result<(ModelInferRequest, Binary), Failure> {
    let split = header.unwrap_or(body.len());
    if split > body.len() {
        return Err(Failure::invalid(format!(
            "Inference-Header-Content-Length {split} is past the body's {} bytes (the JSON \
             before the binary tensor data)",
            body.len()
        )));
    }
    let text = std::str::from_utf8(&body[..split])
        .map_err(|e| Failure::invalid(format!("the request's JSON is not UTF-8: {e}")))?;
    let b: Body = serde_json::from_str(text)
        .map_err(|e| Failure::invalid(format!("the request's JSON: {}", parser_error(&e))))?;
    let mut tail = body.slice(split..);
    let mut parameters = b.parameters;
    let all = take_bool(&mut parameters, "binary_data_output", "")?.unwrap_or(false);
    let mut r = ModelInferRequest {
        model_name: model,
        model_version: version,
        id: b.id,
        parameters: json::from_parameters("", parameters)?,
        ..Default::default()
    };
    for i in b.inputs {
        let what = format!("input {}: ", quote(&i.name));
        let mut p = i.parameters;
        let binary = match p.remove("binary_data_size") {
            None => None,
            Some(v) => Some(v.as_u64().ok_or_else(|| {
                Failure::invalid(format!(
                    "{what}parameter binary_data_size: {v} is not a byte count"
                ))
            })?),
        };
        let shm = p.contains_key("shared_memory_region");
        let data = match (binary, i.data, shm) {
            (Some(_), Some(_), _) => {
                return Err(Failure::invalid(format!(
                    "{what}data given both in binary_data_size and in data"
                )))
            }
            (Some(n), None, _) => {
                if n > tail.len() as u64 {
                    return Err(Failure::invalid(format!(
                        "{what}binary_data_size {n} is past the end of the binary tensor data \
                         ({} bytes left)",
                        tail.len()
                    )));
                }
                Some(tail.split_to(n as usize))
            }
            (None, Some(data), _) => Some(data_bytes(&i.name, &i.datatype, &i.shape, data, max)?),
            (None, None, true) => None,
            (None, None, false) => {
                return Err(Failure::invalid(format!(
                    "{what}no data (neither data, binary_data_size nor shared_memory_region)"
                )))
            }
        };
        r.inputs.push(InferInputTensor {
            name: i.name,
            datatype: i.datatype,
            shape: i.shape,
            parameters: json::from_parameters(&what, p)?,
            contents: None,
        });
        // A region's input takes no raw entry: the entries go in order to the inputs that
        // carry neither a region nor contents, as Triton's gRPC clients send them.
        if let Some(d) = data {
            r.raw_input_contents.push(d);
        }
    }
    if !tail.is_empty() {
        return Err(Failure::invalid(format!(
            "{} bytes of binary tensor data after the last binary input (the inputs' \
             binary_data_size parameters name fewer)",
            tail.len()
        )));
    }
    let mut each = Vec::new();
    for o in b.outputs {
        let what = format!("output {}: ", quote(&o.name));
        let mut p = o.parameters;
        if let Some(b) = take_bool(&mut p, "binary_data", &what)? {
            each.push((o.name.clone(), b));
        }
        r.outputs.push(InferRequestedOutputTensor {
            name: o.name,
            parameters: json::from_parameters(&what, p)?,
        });
    }
    Ok((r, Binary { all, each }))
}

/// An input's JSON data as its dtype's bytes; a dtype the data cannot be read as is left to the
/// entry to refuse by name.
fn data_bytes(
    name: &str,
    datatype: &str,
    shape: &[i64],
    data: &RawValue,
    max: usize,
) -> Result<Bytes, Failure> {
    use crate::infer::tensor::Dtype;
    let dtype = match datatype {
        "FP32" => Dtype::F32,
        "FP16" => Dtype::F16,
        "BF16" => Dtype::Bf16,
        "INT32" => Dtype::I32,
        "INT64" => Dtype::I64,
        _ => return Ok(Bytes::new()),
    };
    let count = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
        .filter(|n| n.saturating_mul(dtype.bytes()) <= max)
        .ok_or_else(|| {
            Failure::invalid(format!(
                "input {}: shape {shape:?} is negative or holds more than --max-request-bytes \
                 ({max})",
                quote(name)
            ))
        })?;
    let what = format!("input {}", quote(name));
    let mut d = json::Data {
        what: &what,
        dtype,
        count,
        out: Vec::with_capacity(count * dtype.bytes()),
    };
    let mut de = serde_json::Deserializer::from_str(data.get());
    (&mut d).deserialize(&mut de).map_err(|e| {
        Failure::invalid(format!("{what}: data does not fit: {}", parser_error(&e)))
    })?;
    let got = d.out.len() / dtype.bytes();
    if got != count {
        return Err(Failure::invalid(format!(
            "{what}: data does not fit: {got} values for shape {shape:?} ({count})"
        )));
    }
    Ok(Bytes::from(d.out))
}

/// A response body of a JSON header and binary parts, its length known.
pub struct Parts(VecDeque<Bytes>);

impl http_body::Body for Parts {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.iter().map(|b| b.len() as u64).sum())
    }
}

/// The answer as JSON with binary parts, and the JSON's length when there are any.
pub fn response(r: ModelInferResponse, binary: &Binary) -> Result<(Parts, Option<usize>), Failure> {
    let mut outputs = Vec::new();
    let mut parts = VecDeque::new();
    for (o, raw) in r.outputs.into_iter().zip(r.raw_output_contents) {
        let mut params = json::parameters(&o.parameters);
        let mut out = serde_json::json!({
            "name": o.name,
            "datatype": o.datatype,
            "shape": o.shape,
        });
        // An output written to shared memory has no data here: zero binary bytes (Triton's C++
        // client reads `binary_data_size` wherever an output has parameters).
        if o.parameters.contains_key("shared_memory_region") {
            params.insert("binary_data_size".into(), 0.into());
        } else {
            if binary.wants(&o.name) {
                params.insert("binary_data_size".into(), raw.len().into());
                parts.push_back(raw);
            } else {
                out["data"] = numbers(&o.name, &o.datatype, &raw)?;
            }
        }
        if !params.is_empty() {
            out["parameters"] = Value::Object(params);
        }
        outputs.push(out);
    }
    let mut head = serde_json::json!({
        "model_name": r.model_name,
        "model_version": r.model_version,
        "outputs": outputs,
    });
    if !r.id.is_empty() {
        head["id"] = r.id.into();
    }
    if !r.parameters.is_empty() {
        head["parameters"] = Value::Object(json::parameters(&r.parameters));
    }
    let head = Bytes::from(serde_json::to_vec(&head).expect("JSON values serialize"));
    let len = (!parts.is_empty()).then_some(head.len());
    parts.push_front(head);
    Ok((Parts(parts), len))
}

/// A float output's values as JSON numbers (each the shortest text that reads back to the same
/// float32). JSON has no NaN or infinity: such an output must be asked in binary.
fn numbers(name: &str, datatype: &str, raw: &[u8]) -> Result<Value, Failure> {
    use crate::infer::tensor::Dtype;
    let dtype = match datatype {
        "FP32" => Dtype::F32,
        "FP16" => Dtype::F16,
        "BF16" => Dtype::Bf16,
        d => {
            return Err(Failure::Wrong(format!(
                "output {name}: datatype {d} in JSON"
            )))
        }
    };
    let mut v = vec![0f32; raw.len() / dtype.bytes()];
    crate::dtype::to_f32(dtype, raw, &mut v);
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(Failure::invalid(format!(
            "output {name}: value {i} is {}, which JSON cannot carry: ask for it in binary \
             (the output's binary_data parameter)",
            v[i]
        )));
    }
    Ok(Value::Array(v.into_iter().map(Value::from).collect()))
}

/// A bool request parameter's value, for tests of what was forwarded.
#[cfg(test)]
fn bool_of(r: &ModelInferRequest, k: &str) -> Option<bool> {
    use crate::inference::infer_parameter::ParameterChoice;
    match r.parameters.get(k)?.parameter_choice {
        Some(ParameterChoice::BoolParam(b)) => Some(b),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: &str, bin: &[u8]) -> (Bytes, Option<usize>) {
        let mut b = json.as_bytes().to_vec();
        b.extend_from_slice(bin);
        (Bytes::from(b), (!bin.is_empty()).then_some(json.len()))
    }

    /// Binary inputs take their bytes in order, JSON ones are converted, the REST-only
    /// parameters are taken out and the rest forwarded.
    #[test]
    fn a_body_becomes_the_grpc_request() {
        let json = r#"{"id":"a","parameters":{"binary_data_output":true,"timeout":5},
            "inputs":[{"name":"hidden_states","shape":[1,2],"datatype":"BF16","parameters":{"binary_data_size":4}},
                      {"name":"topk_ids","shape":[1,2],"datatype":"INT32","data":[[3,4]]}],
            "outputs":[{"name":"output","parameters":{"binary_data":false}}]}"#;
        let (b, h) = body(json, &[1, 2, 3, 4]);
        let (r, bin) = request(&b, h, "layer-0".into(), String::new(), 1 << 20).unwrap();
        assert_eq!(r.id, "a");
        assert_eq!(bool_of(&r, "binary_data_output"), None);
        assert!(r.parameters.contains_key("timeout"));
        assert_eq!(r.raw_input_contents[0].as_ref(), &[1, 2, 3, 4]);
        assert_eq!(
            r.raw_input_contents[1].as_ref(),
            [3i32.to_le_bytes(), 4i32.to_le_bytes()].concat()
        );
        assert!(r.inputs[0].parameters.is_empty());
        assert!(r.outputs[0].parameters.is_empty());
        assert!(!bin.wants("output"));
        assert!(bin.all);
    }

    #[test]
    fn bad_bodies_are_refused_by_what_is_wrong() {
        let bad = |json: &str, bin: &[u8], want: &str| {
            let (b, h) = body(json, bin);
            let e = request(&b, h, "m".into(), String::new(), 1 << 20)
                .err()
                .unwrap_or_else(|| panic!("{json} was taken"));
            assert!(e.to_string().contains(want), "{json}: {e}");
        };
        let input = |extra: &str| {
            format!(r#"{{"inputs":[{{"name":"x","shape":[1,2],"datatype":"FP32"{extra}}}]}}"#)
        };
        bad(
            &input(r#","parameters":{"binary_data_size":8}"#),
            &[0; 4],
            "(4 bytes left)",
        );
        bad(
            &input(r#","parameters":{"binary_data_size":4}"#),
            &[0; 8],
            "4 bytes of binary tensor data after",
        );
        bad(
            &input(r#","data":[1]"#),
            &[],
            "1 values for shape [1, 2] (2)",
        );
        bad(
            &input(r#","data":[1,2],"parameters":{"binary_data_size":0}"#),
            &[],
            "both",
        );
        bad(&input(r#","extra":1"#), &[], "unknown field `extra`");
        bad(
            &input(r#","data":[1,2],"parameters":{"p":[1]}"#),
            &[],
            "parameter \"p\"",
        );
        bad(
            r#"{"inputs":[],"parameters":{"binary_data_output":1}}"#,
            &[],
            "not a bool",
        );
        bad("{", &[], "the request's JSON");
        bad(
            r#"{"inputs":[{"name":"x","shape":[1099511627776,1099511627776],"datatype":"FP32","data":[]}]}"#,
            &[],
            "more than --max-request-bytes",
        );
    }
}
