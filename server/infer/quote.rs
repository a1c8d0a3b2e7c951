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

/// A parser's message (serde_json's quotes the client's text in backticks or double quotes:
/// an unknown field's name, a string where a number goes) with each quoted run cut to its first
/// `MAX_CHARS` characters and its length.
pub fn parser_error(e: &dyn std::fmt::Display) -> String {
    let msg = e.to_string();
    let mut out = String::with_capacity(msg.len().min(1024));
    let mut rest = msg.as_str();
    while let Some(open) = rest.find(['`', '"']) {
        let delim = rest[open..].chars().next().expect("found");
        out.push_str(&rest[..=open]);
        let inner = &rest[open + 1..];
        let close = inner.find(delim).unwrap_or(inner.len());
        let quoted = &inner[..close];
        match quoted.char_indices().nth(MAX_CHARS) {
            None => out.push_str(quoted),
            Some((cut, _)) => {
                out.push_str(&quoted[..cut]);
                out.push('…');
            }
        }
        if close < inner.len() {
            out.push(delim);
            if quoted.chars().nth(MAX_CHARS).is_some() {
                out.push_str(&format!(" ({} bytes)", quoted.len()));
            }
            rest = &inner[close + 1..];
        } else {
            rest = "";
        }
    }
    out.push_str(rest);
    out
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

    #[test]
    fn a_parsers_quotes_are_cut_and_the_rest_kept() {
        let long = "x".repeat(60_000);
        let e = serde_json::from_str::<std::collections::HashMap<String, f32>>(&format!(
            r#"{{"a": "{long}"}}"#
        ))
        .unwrap_err();
        let m = parser_error(&e);
        assert!(m.len() < 300, "{m}");
        assert!(
            m.starts_with(&format!(
                "invalid type: string \"{}…\" (60000 bytes)",
                "x".repeat(128)
            )),
            "{m}"
        );
        assert!(m.ends_with("expected f32 at line 1 column 60008"), "{m}");
        assert_eq!(parser_error(&"unknown field `id`"), "unknown field `id`");
        assert_eq!(parser_error(&"a lone ` quote"), "a lone ` quote");
    }
}
