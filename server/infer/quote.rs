//! Client strings and shapes as a status quotes them: bounded, so that a 100 KB name still gives
//! a status stock clients read (grpcio drops a `grpc-message` over 16 KiB and reports
//! RESOURCE_EXHAUSTED instead), and the rest of the message still says what was wrong.

/// Characters of a client string quoted whole.
const MAX_CHARS: usize = 128;
/// Dimensions of a client shape shown whole.
const MAX_DIMS: usize = 8;

/// `s` quoted as Rust debug-quotes it, its first `MAX_CHARS` characters and its length past that.
pub fn quote(s: &str) -> String {
    match s.char_indices().nth(MAX_CHARS) {
        None => format!("{s:?}"),
        Some((cut, _)) => format!("{:?}… ({} bytes)", &s[..cut], s.len()),
    }
}

/// `shape` as `[a, b]`, its first `MAX_DIMS` dimensions and its rank past that.
pub fn dims(shape: &[i64]) -> String {
    if shape.len() <= MAX_DIMS {
        return format!("{shape:?}");
    }
    let head: Vec<String> = shape[..MAX_DIMS].iter().map(i64::to_string).collect();
    format!("[{}, …] ({} dims)", head.join(", "), shape.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn short_values_read_as_before_and_long_ones_are_cut() {
        assert_eq!(quote("INPUT0"), "\"INPUT0\"");
        assert_eq!(dims(&[3, -1]), "[3, -1]");
        let long = "é".repeat(100_000);
        let q = quote(&long);
        assert!(
            q.starts_with(&format!("\"{}", "é".repeat(128))) && q.ends_with("… (200000 bytes)")
        );
        assert!(q.len() < 400, "{}", q.len());
        let d = dims(&vec![7; 100_000]);
        assert_eq!(d, "[7, 7, 7, 7, 7, 7, 7, 7, …] (100000 dims)");
        assert_eq!(quote(&"a".repeat(128)), format!("{:?}", "a".repeat(128)));
    }
}
