//! Tensor decoding and encoding at the gRPC edge, with every check a client can fail named.

use tonic::Status;

use crate::proto::{DType, Tensor};

fn bad(msg: String) -> Status {
    Status::invalid_argument(msg)
}

/// The dtype field as an enum; unknown numbers are rejected by name.
pub fn dtype(raw: i32, what: &str) -> Result<DType, Status> {
    DType::try_from(raw).map_err(|_| bad(format!("{what}: unknown dtype {raw}")))
}

fn elem_bytes(d: DType) -> usize {
    match d {
        DType::Bf16 | DType::F16 => 2,
        DType::F32 | DType::I32 => 4,
        DType::I64 => 8,
        DType::DtypeUnspecified => 0,
    }
}

/// Checks `t` is `[rows, cols]` (rows = None: any positive count) and its byte length; returns
/// (dtype, rows).
fn check_2d(
    t: &Tensor,
    what: &str,
    rows: Option<usize>,
    cols: usize,
    accepted: &[DType],
) -> Result<(DType, usize), Status> {
    let d = dtype(t.dtype, what)?;
    if !accepted.contains(&d) {
        let names: Vec<&str> = accepted.iter().map(|d| d.as_str_name()).collect();
        return Err(bad(format!(
            "{what}: dtype {} not accepted here (accepted: {})",
            d.as_str_name(),
            names.join(", ")
        )));
    }
    let shape_ok = t.shape.len() == 2 && t.shape.iter().all(|&x| x >= 0);
    let n = if shape_ok { t.shape[0] as usize } else { 0 };
    let expected = format!(
        "[{}, {cols}]",
        rows.map_or("n".to_string(), |r| r.to_string())
    );
    if !shape_ok || t.shape[1] as usize != cols || rows.is_some_and(|r| r != n) {
        return Err(bad(format!(
            "{what}: shape {:?} must be {expected}",
            t.shape
        )));
    }
    if n == 0 {
        return Err(bad(format!("{what}: no tokens (shape {:?})", t.shape)));
    }
    let want = n
        .checked_mul(cols)
        .and_then(|x| x.checked_mul(elem_bytes(d)));
    if want != Some(t.data.len()) {
        return Err(bad(format!(
            "{what}: {} bytes of data for shape {:?} of {} (expected {})",
            t.data.len(),
            t.shape,
            d.as_str_name(),
            want.map_or("an overflowing size".into(), |w| w.to_string())
        )));
    }
    Ok((d, n))
}

pub const FLOATS: &[DType] = &[DType::Bf16, DType::F16, DType::F32];

/// A float tensor `[rows, cols]` as f32, rejecting non-finite values; returns (values, rows, dtype).
pub fn floats(
    t: &Tensor,
    what: &str,
    rows: Option<usize>,
    cols: usize,
) -> Result<(Vec<f32>, usize, DType), Status> {
    let (d, n) = check_2d(t, what, rows, cols, FLOATS)?;
    let v: Vec<f32> = match d {
        DType::F32 => t
            .data
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        DType::Bf16 => t
            .data
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => t
            .data
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
    };
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!(
            "{what}: non-finite value at row {}, column {}",
            i / cols,
            i % cols
        )));
    }
    Ok((v, n, d))
}

/// Expert ids `[rows, k]` (I32 or I64): each in `0..experts` and distinct within its row.
pub fn expert_ids(t: &Tensor, rows: usize, k: usize, experts: usize) -> Result<Vec<i32>, Status> {
    let what = "topk_ids";
    let (d, _) = check_2d(t, what, Some(rows), k, &[DType::I32, DType::I64])?;
    let raw: Vec<i64> = match d {
        DType::I32 => t
            .data
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        _ => t
            .data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
    };
    for (r, row) in raw.chunks_exact(k).enumerate() {
        for (j, &id) in row.iter().enumerate() {
            if id < 0 || id >= experts as i64 {
                return Err(bad(format!(
                    "{what}: expert {id} at row {r} is out of range 0..{experts}"
                )));
            }
            if row[..j].contains(&id) {
                return Err(bad(format!("{what}: expert {id} repeated in row {r}")));
            }
        }
    }
    Ok(raw.into_iter().map(|x| x as i32).collect())
}

/// `[rows, cols]` f32 values as a tensor of `d` (a float dtype).
pub fn encode(values: &[f32], rows: usize, cols: usize, d: DType) -> Tensor {
    let data: Vec<u8> = match d {
        DType::Bf16 => values
            .iter()
            .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
            .collect(),
        DType::F16 => values
            .iter()
            .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
            .collect(),
        _ => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
    };
    Tensor {
        dtype: d as i32,
        shape: vec![rows as i64, cols as i64],
        data,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(d: DType, shape: &[i64], data: Vec<u8>) -> Tensor {
        Tensor {
            dtype: d as i32,
            shape: shape.to_vec(),
            data,
        }
    }

    #[test]
    fn round_trips_and_names_each_problem() {
        let vals = [1.0f32, -2.5, 0.25, 3.0];
        for d in FLOATS {
            let enc = encode(&vals, 2, 2, *d);
            let (back, n, got) = floats(&enc, "x", None, 2).unwrap();
            assert_eq!((back, n, got), (vals.to_vec(), 2, *d));
        }
        let err =
            |r: Result<(Vec<f32>, usize, DType), Status>| r.unwrap_err().message().to_string();
        assert!(
            err(floats(&t(DType::F32, &[2, 3], vec![0; 24]), "x", None, 2))
                .contains("must be [n, 2]")
        );
        assert!(
            err(floats(&t(DType::F32, &[2, 2], vec![0; 15]), "x", None, 2)).contains("15 bytes")
        );
        assert!(
            err(floats(&t(DType::I32, &[2, 2], vec![0; 16]), "x", None, 2))
                .contains("not accepted")
        );
        assert!(err(floats(
            &Tensor {
                dtype: 42,
                shape: vec![1, 2],
                data: vec![0; 8]
            },
            "x",
            None,
            2
        ))
        .contains("unknown dtype 42"));
        assert!(err(floats(&t(DType::F32, &[0, 2], vec![]), "x", None, 2)).contains("no tokens"));
        let nan = encode(&[1.0, f32::NAN], 1, 2, DType::F32);
        assert!(err(floats(&nan, "x", None, 2)).contains("row 0, column 1"));
        let ids = |v: &[i64]| {
            t(
                DType::I64,
                &[1, v.len() as i64],
                v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            )
        };
        assert_eq!(expert_ids(&ids(&[3, 1]), 1, 2, 8).unwrap(), vec![3, 1]);
        assert!(expert_ids(&ids(&[3, 8]), 1, 2, 8)
            .unwrap_err()
            .message()
            .contains("out of range"));
        assert!(expert_ids(&ids(&[3, 3]), 1, 2, 8)
            .unwrap_err()
            .message()
            .contains("repeated"));
    }
}
