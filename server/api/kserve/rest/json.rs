//! JSON as KServe's and Triton's REST API write it: the protocol's messages from their
//! descriptors (proto field names, 64-bit integers as numbers, every field printed, as Triton
//! prints a model configuration), parameters as plain JSON values, and tensor data as a flat or
//! nested array of numbers read straight into the tensor's little-endian bytes.

use std::collections::HashMap;
use std::fmt;
use std::sync::OnceLock;

use prost_reflect::{DescriptorPool, DynamicMessage, SerializeOptions};
use serde::de::{DeserializeSeed, Deserializer, SeqAccess, Visitor};
use serde_json::{Map, Value};

use crate::infer::quote::quote;
use crate::infer::tensor::Dtype;
use crate::inference::infer_parameter::ParameterChoice;
use crate::inference::InferParameter;
use crate::request::Failure;

fn pool() -> &'static DescriptorPool {
    static POOL: OnceLock<DescriptorPool> = OnceLock::new();
    POOL.get_or_init(|| {
        DescriptorPool::decode(crate::inference::FILE_DESCRIPTOR_SET)
            .expect("the build's own descriptor set decodes")
    })
}

/// `m` (the message `inference.<name>`) as Triton's JSON.
pub fn message<M: prost::Message>(m: &M, name: &str) -> Value {
    let desc = pool()
        .get_message_by_name(&format!("inference.{name}"))
        .unwrap_or_else(|| panic!("inference.{name} is in the descriptor set"));
    let dynamic = DynamicMessage::decode(desc, m.encode_to_vec().as_slice())
        .expect("a message decodes as its own descriptor");
    let options = SerializeOptions::new()
        .stringify_64_bit_integers(false)
        .use_proto_field_name(true)
        .skip_default_fields(false);
    dynamic
        .serialize_with_options(serde_json::value::Serializer, &options)
        .expect("a message serializes to JSON")
}

/// A parameter's value as JSON.
pub fn parameter(p: &InferParameter) -> Value {
    match &p.parameter_choice {
        Some(ParameterChoice::BoolParam(b)) => Value::from(*b),
        Some(ParameterChoice::Int64Param(n)) => Value::from(*n),
        Some(ParameterChoice::Uint64Param(n)) => Value::from(*n),
        Some(ParameterChoice::DoubleParam(d)) => Value::from(*d),
        Some(ParameterChoice::StringParam(s)) => Value::from(s.as_str()),
        None => Value::Null,
    }
}

pub fn parameters(p: &HashMap<String, InferParameter>) -> Map<String, Value> {
    p.iter().map(|(k, v)| (k.clone(), parameter(v))).collect()
}

/// JSON parameters as the protocol's: a bool, an integer (int64, else uint64), a number or a
/// string each; anything else is refused by name.
pub fn from_parameters(
    what: &str,
    p: Map<String, Value>,
) -> Result<HashMap<String, InferParameter>, Failure> {
    p.into_iter()
        .map(|(k, v)| {
            let choice = match &v {
                Value::Bool(b) => ParameterChoice::BoolParam(*b),
                Value::String(s) => ParameterChoice::StringParam(s.clone()),
                Value::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
                    (Some(i), _, _) => ParameterChoice::Int64Param(i),
                    (None, Some(u), _) => ParameterChoice::Uint64Param(u),
                    (None, None, Some(d)) => ParameterChoice::DoubleParam(d),
                    _ => unreachable!("a JSON number is an i64, a u64 or an f64"),
                },
                Value::Null | Value::Array(_) | Value::Object(_) => {
                    return Err(Failure::invalid(format!(
                        "{what}parameter {}: a parameter is a bool, a number or a string",
                        quote(&k)
                    )))
                }
            };
            Ok((
                k,
                InferParameter {
                    parameter_choice: Some(choice),
                },
            ))
        })
        .collect()
}

/// Reads a tensor's `data` (numbers, flat or nested in arrays) as `dtype`'s little-endian
/// bytes, at most `count` values of them. Floats are read as doubles (exactly, so a float32
/// written with enough digits comes back bit for bit) and rounded to the dtype; integers must
/// be integers in the dtype's range.
pub struct Data<'a> {
    pub what: &'a str,
    pub dtype: Dtype,
    pub count: usize,
    pub out: Vec<u8>,
}

impl Data<'_> {
    fn push(&mut self, v: Number) -> Result<(), String> {
        if self.out.len() / self.dtype.bytes() >= self.count {
            return Err(format!(
                "{}: more values than its shape's {}",
                self.what, self.count
            ));
        }
        let bad = |v: &dyn fmt::Display| {
            format!(
                "{}: {v} is not a {} value",
                self.what,
                crate::api::kserve::models::name(self.dtype)
            )
        };
        match self.dtype {
            Dtype::F32 | Dtype::F16 | Dtype::Bf16 => {
                let x = match v {
                    Number::I(i) => i as f64,
                    Number::U(u) => u as f64,
                    Number::F(f) => f,
                };
                let x = [x as f32];
                let mut b = [0u8; 4];
                let n = self.dtype.bytes();
                crate::dtype::from_f32(self.dtype, &x, &mut b[..n]);
                self.out.extend_from_slice(&b[..n]);
            }
            Dtype::I32 => {
                let i = match v {
                    Number::I(i) => i32::try_from(i).map_err(|_| bad(&i))?,
                    Number::U(u) => i32::try_from(u).map_err(|_| bad(&u))?,
                    Number::F(f) => return Err(bad(&f)),
                };
                self.out.extend_from_slice(&i.to_le_bytes());
            }
            Dtype::I64 => {
                let i = match v {
                    Number::I(i) => i,
                    Number::U(u) => i64::try_from(u).map_err(|_| bad(&u))?,
                    Number::F(f) => return Err(bad(&f)),
                };
                self.out.extend_from_slice(&i.to_le_bytes());
            }
        }
        Ok(())
    }
}

#[derive(Clone, Copy)]
enum Number {
    I(i64),
    U(u64),
    F(f64),
}

impl<'de> DeserializeSeed<'de> for &mut Data<'_> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for &mut Data<'_> {
    type Value = ();

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        write!(f, "numbers, or arrays of them")
    }

    fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<(), E> {
        self.push(Number::I(v)).map_err(E::custom)
    }

    fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<(), E> {
        self.push(Number::U(v)).map_err(E::custom)
    }

    fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<(), E> {
        self.push(Number::F(v)).map_err(E::custom)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(&mut *self)?.is_some() {}
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str, dtype: Dtype, count: usize) -> Result<Vec<u8>, String> {
        let mut d = Data {
            what: "x",
            dtype,
            count,
            out: Vec::new(),
        };
        let mut de = serde_json::Deserializer::from_str(json);
        (&mut d).deserialize(&mut de).map_err(|e| e.to_string())?;
        Ok(d.out)
    }

    /// Flat and nested arrays give the same bytes; a float32 printed with enough digits comes
    /// back bit for bit; integers are range-checked; a value past the shape is refused.
    #[test]
    fn data_reads_numbers_exactly_and_refuses_the_rest() {
        let x = [0.1f32, f32::MIN, f32::MIN_POSITIVE, 7.0];
        let flat = format!("[{}]", x.map(|v| format!("{}", v as f64)).join(","));
        let want: Vec<u8> = x.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(read(&flat, Dtype::F32, 4).unwrap(), want);
        let nested = format!(
            "[[{}, {}], [{}, {}]]",
            x[0] as f64, x[1] as f64, x[2] as f64, x[3] as f64
        );
        assert_eq!(read(&nested, Dtype::F32, 4).unwrap(), want);
        let bf: Vec<u8> = half::bf16::from_f32(0.1).to_le_bytes().to_vec();
        assert_eq!(read("[0.1]", Dtype::Bf16, 1).unwrap(), bf);
        assert_eq!(
            read("[-2, 5]", Dtype::I32, 2).unwrap(),
            [(-2i32).to_le_bytes(), 5i32.to_le_bytes()].concat()
        );
        let e = read("[1, 2, 3]", Dtype::F32, 2).unwrap_err();
        assert!(e.contains("more values than its shape's 2"), "{e}");
        let e = read("[2147483648]", Dtype::I32, 1).unwrap_err();
        assert!(e.contains("not a INT32 value"), "{e}");
        let e = read("[1.5]", Dtype::I64, 1).unwrap_err();
        assert!(e.contains("1.5 is not a INT64 value"), "{e}");
        assert!(read("[true]", Dtype::F32, 1).is_err());
        assert!(read("[\"1\"]", Dtype::F32, 1).is_err());
    }

    /// Messages print with proto field names, 64-bit integers as numbers and default fields
    /// (a message field left unset is left out, as protobuf's JSON does).
    #[test]
    fn messages_print_as_triton_prints_them() {
        use crate::inference::{InferStatistics, ModelStatistics, StatisticDuration};
        let m = ModelStatistics {
            name: "layer-0".into(),
            version: "1".into(),
            inference_count: 3,
            inference_stats: Some(InferStatistics {
                success: Some(StatisticDuration { count: 3, ns: 12 }),
                fail: Some(StatisticDuration::default()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let v = message(&m, "ModelStatistics");
        assert_eq!(v["inference_count"], 3);
        assert_eq!(v["execution_count"], 0);
        assert_eq!(v["inference_stats"]["success"]["ns"], 12);
        assert_eq!(v["inference_stats"]["fail"]["count"], 0);
        assert!(v["inference_stats"].get("queue").is_none(), "{v}");
    }
}
