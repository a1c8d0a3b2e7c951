//! Tensor checks shared by every protocol: a protocol hands over a view of what the client sent
//! and gets the checked hidden rows (still its bytes), routing as ids and f32 weights, or a
//! message naming the problem.

use bytes::Bytes;

use super::quote::dims;
use crate::request::{Data, Failure, Rows};

pub use crate::dtype::{encode, Dtype, FLOATS, IDS};

/// How the client's protocol spells a dtype, so messages use the names the client sent.
pub type Names = fn(Dtype) -> &'static str;

/// One tensor as a client sent it: row-major, little-endian, its bytes shared, not copied
/// (or left in the client's device memory).
#[derive(Clone, Debug)]
pub struct View<'a> {
    pub dtype: Dtype,
    pub shape: &'a [i64],
    pub data: Data,
}

impl View<'_> {
    /// The bytes, for a tensor read on the host (only the hidden states may stay on a device).
    fn host(&self, what: &str) -> Result<&Bytes, Failure> {
        self.data.host().ok_or_else(|| {
            bad(format!(
                "{what}: CUDA shared memory holds hidden_states only; send {what} in the \
                 request or a system region"
            ))
        })
    }
}

fn bad(msg: String) -> Failure {
    Failure::Invalid(msg)
}

/// Checks `t` is `[rows, cols]` (rows = None: any positive count), of an accepted dtype, with
/// the byte length that implies; returns the row count.
fn check_2d(
    t: &View,
    what: &str,
    rows: Option<usize>,
    cols: usize,
    accepted: &[Dtype],
    names: Names,
) -> Result<usize, Failure> {
    if !accepted.contains(&t.dtype) {
        return Err(not_accepted(what, names(t.dtype), accepted, names));
    }
    let shape_ok = t.shape.len() == 2 && t.shape.iter().all(|&x| x >= 0);
    let n = if shape_ok { t.shape[0] as usize } else { 0 };
    let expected = format!(
        "[{}, {cols}]",
        rows.map_or("n".to_string(), |r| r.to_string())
    );
    if !shape_ok || t.shape[1] as usize != cols || rows.is_some_and(|r| r != n) {
        return Err(bad(format!(
            "{what}: shape {} must be {expected}",
            dims(t.shape)
        )));
    }
    if n == 0 {
        return Err(bad(format!("{what}: no tokens (shape {})", dims(t.shape))));
    }
    let want = n
        .checked_mul(cols)
        .and_then(|x| x.checked_mul(t.dtype.bytes()));
    if want != Some(t.data.len()) {
        return Err(bad(format!(
            "{what}: {} bytes of data for shape {} of {} (expected {})",
            t.data.len(),
            dims(t.shape),
            names(t.dtype),
            want.map_or("an overflowing size".into(), |w| w.to_string())
        )));
    }
    Ok(n)
}

/// "`what`: dtype X not accepted here (accepted: ...)", for any name the protocol knows.
pub fn not_accepted(what: &str, name: &str, accepted: &[Dtype], names: Names) -> Failure {
    let list: Vec<&str> = accepted.iter().map(|d| names(*d)).collect();
    bad(format!(
        "{what}: dtype {name} not accepted here (accepted: {})",
        list.join(", ")
    ))
}

/// A float tensor `[rows, cols]` as f32, rejecting non-finite values; returns (values, rows).
pub fn floats(
    t: &View,
    what: &str,
    rows: Option<usize>,
    cols: usize,
    names: Names,
) -> Result<(Vec<f32>, usize), Failure> {
    let n = check_2d(t, what, rows, cols, FLOATS, names)?;
    let mut v = vec![0f32; n * cols];
    crate::dtype::to_f32(t.dtype, t.host(what)?, &mut v);
    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
        return Err(bad(format!(
            "{what}: non-finite value at row {}, column {}",
            i / cols,
            i % cols
        )));
    }
    Ok((v, n))
}

/// A float tensor `[n, cols]` kept as the client's bytes, rejecting non-finite values; returns
/// (rows, n). Nothing is converted: the ranks widen it once, where they compute.
pub fn rows(t: View, what: &str, cols: usize, names: Names) -> Result<(Rows, usize), Failure> {
    let n = check_2d(&t, what, None, cols, FLOATS, names)?;
    let first = match &t.data {
        Data::Host(b) => crate::dtype::first_non_finite(t.dtype, b),
        // A GPU's memory: checked where the bytes are, before admission, like a host tensor's.
        Data::Client(d) if d.device_address().is_some() => d
            .mem
            .first_non_finite(d.offset, d.len, t.dtype)
            .map_err(|e| bad(format!("{what}: checking the client's device memory: {e}")))?,
        // A POSIX object's: checked as the rows are read into the ring (`sched::rows::pack`),
        // so that they are read once.
        Data::Client(_) => None,
    };
    if let Some(i) = first {
        return Err(bad(format!(
            "{what}: non-finite value at row {}, column {}",
            i / cols,
            i % cols
        )));
    }
    Ok((
        Rows {
            dtype: t.dtype,
            data: t.data,
        },
        n,
    ))
}

/// Expert ids `[rows, k]` (I32 or I64): each in `0..experts` and distinct within its row.
pub fn expert_ids(
    t: &View,
    rows: usize,
    k: usize,
    experts: usize,
    names: Names,
) -> Result<Vec<i32>, Failure> {
    let what = "topk_ids";
    check_2d(t, what, Some(rows), k, IDS, names)?;
    let data = t.host(what)?;
    let raw: Vec<i64> = match t.dtype {
        Dtype::I32 => data
            .chunks_exact(4)
            .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        _ => data
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
    };
    for (r, row) in raw.chunks_exact(k).enumerate() {
        for (j, &id) in row.iter().enumerate() {
            // The ids are not quoted: they may be a client's shared memory, which an error
            // must not read back (#56).
            if id < 0 || id >= experts as i64 {
                return Err(bad(format!(
                    "{what}: the expert id at row {r}, column {j} is out of range 0..{experts}"
                )));
            }
            if let Some(i) = row[..j].iter().position(|&x| x == id) {
                return Err(bad(format!(
                    "{what}: row {r} names one expert twice (columns {i} and {j})"
                )));
            }
        }
    }
    Ok(raw.into_iter().map(|x| x as i32).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(d: Dtype) -> &'static str {
        match d {
            Dtype::Bf16 => "BF16",
            Dtype::F16 => "F16",
            Dtype::F32 => "F32",
            Dtype::I32 => "I32",
            Dtype::I64 => "I64",
        }
    }

    fn v<'a>(dtype: Dtype, shape: &'a [i64], data: &[u8]) -> View<'a> {
        View {
            dtype,
            shape,
            data: Data::Host(Bytes::copy_from_slice(data)),
        }
    }

    #[test]
    fn round_trips_and_names_each_problem() {
        let vals = [1.0f32, -2.5, 0.25, 3.0];
        for d in FLOATS {
            let enc = encode(&vals, *d);
            let (back, n) = floats(&v(*d, &[2, 2], &enc), "x", None, 2, name).unwrap();
            assert_eq!((back, n), (vals.to_vec(), 2));
        }
        let err = |r: Result<(Vec<f32>, usize), Failure>| r.unwrap_err().to_string();
        let z = [0u8; 24];
        assert!(
            err(floats(&v(Dtype::F32, &[2, 3], &z), "x", None, 2, name)).contains("must be [n, 2]")
        );
        assert!(err(floats(
            &v(Dtype::F32, &[2, 2], &z[..15]),
            "x",
            None,
            2,
            name
        ))
        .contains("15 bytes"));
        assert!(err(floats(
            &v(Dtype::I32, &[2, 2], &z[..16]),
            "x",
            None,
            2,
            name
        ))
        .contains("dtype I32 not accepted here (accepted: BF16, F16, F32)"));
        assert!(
            err(floats(&v(Dtype::F32, &[0, 2], &[]), "x", None, 2, name)).contains("no tokens")
        );
        let nan = encode(&[1.0, f32::NAN], Dtype::F32);
        assert!(
            err(floats(&v(Dtype::F32, &[1, 2], &nan), "x", None, 2, name))
                .contains("row 0, column 1")
        );
        // Hidden rows keep the client's bytes, and their checks name the same problems.
        for d in FLOATS {
            let enc = encode(&[1.0, 2.0, 3.0, f32::INFINITY, 5.0, 6.0], *d);
            let e = rows(v(*d, &[3, 2], &enc), "h", 2, name).unwrap_err();
            assert!(e.to_string().contains("row 1, column 1"), "{e}");
            let ok = encode(&vals, *d);
            let (r, n) = rows(v(*d, &[2, 2], &ok), "h", 2, name).unwrap();
            let data = r.data.host().expect("host rows");
            assert_eq!((r.dtype, &data[..], n), (*d, &ok[..], 2));
        }
        assert!(rows(v(Dtype::Bf16, &[2, 2], &z[..6]), "h", 2, name)
            .unwrap_err()
            .to_string()
            .contains("6 bytes"));
        let ids = |x: &[i64]| x.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        let ok = ids(&[3, 1]);
        assert_eq!(
            expert_ids(&v(Dtype::I64, &[1, 2], &ok), 1, 2, 8, name).unwrap(),
            vec![3, 1]
        );
        let out = ids(&[3, 8]);
        assert!(expert_ids(&v(Dtype::I64, &[1, 2], &out), 1, 2, 8, name)
            .unwrap_err()
            .to_string()
            .contains("out of range"));
        let twice = ids(&[3, 3]);
        assert!(expert_ids(&v(Dtype::I64, &[1, 2], &twice), 1, 2, 8, name)
            .unwrap_err()
            .to_string()
            .contains("names one expert twice"));
    }
}
